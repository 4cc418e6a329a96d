"""``weightsync demo``: a plain PyTorch model (``plain``) or vLLM replicas (``vllm``) as the
rollout side of a trainer that syncs every step.
"""

from weightsync.demo.plain import (
    DEFAULT_MODEL_CONFIG,
    DemoFailed,
    DemoOptions,
    build_model,
    checksums,
    rollout_main,
    run_demo,
)
from weightsync.demo.vllm import (
    PROMPTS,
    TCMALLOC,
    TINY_MODEL_CONFIG,
    VLLMDemoOptions,
    replica_greedy,
    run_vllm_demo,
    save_tiny_model,
    start_replica,
    train_until_changed,
    trainer_greedy,
    vllm_environment,
)

__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "DemoFailed",
    "DemoOptions",
    "PROMPTS",
    "TCMALLOC",
    "TINY_MODEL_CONFIG",
    "VLLMDemoOptions",
    "build_model",
    "checksums",
    "replica_greedy",
    "rollout_main",
    "run_demo",
    "run_vllm_demo",
    "save_tiny_model",
    "start_replica",
    "train_until_changed",
    "trainer_greedy",
    "vllm_environment",
]
