"""What every engine's replicas share: the ``Replica`` protocol and its capabilities
(``replica``), the trainer's update call over replicas (``rollout``) and its reports
(``reports``), and the worker side each engine's workers hold (``receiver``, with its
host staging copy, ``staging``, and the slices a worker keeps, ``slices``). Engines plug
in beside it: ``weightsync.integrations.vllm*`` and ``weightsync.integrations.sglang*``;
nothing here imports an engine."""
