"""vLLM replicas as the rollout side: the trainer's update call.

    rollout = VLLMRollout([LLMReplica(llm_a), LLMReplica(llm_b)], ["backend=nccl"])
    report = rollout.update(model, version=step, mode="keep")   # pause, sync, resume
    rollout.stage(model, version=step + 1)   # into host memory while the replicas generate
    rollout.commit(step + 1)                 # pause, load locally, resume

Each replica is a vLLM engine started with
``worker_extension_cls="weightsync.integrations.vllm.WeightsyncWorkerExtension"``
(``EXTENSION``); each of its workers is one weightsync receiver. vLLM replicas
(``LLMReplica``) take every kind of update: streamed, staged, LoRA-only, ``backend=sharded``
with each worker's own slices, and release the KV cache around an update on GPUs. The
update call itself is the engine-neutral ``Rollout``
(``weightsync.integrations.replicas.rollout``, where its behaviour is documented).
"""

from __future__ import annotations

from weightsync.integrations.replicas.rollout import Rollout
from weightsync.integrations.vllm_replicas import EXTENSION, LLMReplica

__all__ = ["EXTENSION", "LLMReplica", "VLLMRollout"]


class VLLMRollout(Rollout):
    """``Rollout`` over vLLM replicas (``LLMReplica``, each started with
    ``worker_extension_cls=EXTENSION``); see ``Rollout`` for its arguments and calls."""
