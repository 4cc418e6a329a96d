"""Adapters between weightsync and inference engines or RL frameworks, each optional and in
its own module.

- ``weightsync.integrations.vllm``: vLLM replicas as receivers (``pip install weightsync[vllm]``).
- ``weightsync.integrations.sglang``: SGLang replicas as receivers, through SGLang's custom
  weight loader (``make install-sglang``; docs/sglang.md).
- ``weightsync.integrations.rollout_args``: rollout configuration -> vLLM / SGLang engine
  arguments (no engine import needed).
- ``weightsync.integrations.verl``: backend ``weightsync`` for verl's checkpoint-engine
  manager (``pip install weightsync[verl]``; docs/verl.md).
"""
