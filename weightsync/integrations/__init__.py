"""Adapters between weightsync and inference engines, each optional and in its own module.

- ``weightsync.integrations.vllm``: vLLM replicas as receivers (``pip install weightsync[vllm]``).
- ``weightsync.integrations.rollout_args``: rollout configuration -> vLLM / SGLang engine
  arguments (no engine import needed).
"""
