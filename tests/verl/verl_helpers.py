"""What tests/verl put on Ray: a verl trainer worker, verl's rollout test workers, checks.

The rollout side is verl's own ``CheckpointEngineWorkerTest`` with its ``MockServerAdapter``
(which keeps a copy of every tensor it received) in verl's ``MockReplica``, made by verl's
``create_rollout_worker_group``; the test reads what each worker holds through Ray's
``__ray_call__``, so verl's classes stay as they are. The trainer is a verl ``Worker`` that
builds its checkpoint engine and registers ``update_weights`` and
``execute_checkpoint_engine`` as verl's actor workers do, with weights that change every step.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

MODULE = "weightsync.integrations.verl"
BUCKET_MB = 1  # the embedding below is larger: it travels in chunks

# name -> (shape, dtype): a tiny Qwen2-shaped model of about 2.5 MB, several dtypes
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed_tokens.weight": ((640, 1024), torch.bfloat16),  # 1.25 MiB > 1 MiB bucket
    "model.layers.0.self_attn.q_proj.weight": ((256, 256), torch.float32),
    "model.layers.0.self_attn.q_proj.bias": ((256,), torch.float32),
    "model.layers.0.mlp.up_proj.weight": ((512, 300), torch.bfloat16),
    "model.layers.0.input_layernorm.weight": ((1000,), torch.float16),
    "model.norm.weight": ((256,), torch.bfloat16),
    "lm_head.step": ((3,), torch.int64),
}


Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def weights_at(step: int, seed: int = 0, shapes: Shapes | None = None) -> dict[str, torch.Tensor]:
    """The trainer's weights after ``step`` training steps: different every step, the same
    on every trainer rank. ``shapes``: another model than ``SHAPES``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out = {}
    for name, (shape, dtype) in (shapes or SHAPES).items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen).to(dtype)
        else:
            out[name] = torch.full(shape, step, dtype=dtype) + torch.arange(shape[0], dtype=dtype)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and bytes."""
    out = {}
    for name, t in tensors.items():
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def tiny_model_dir(root: Path) -> str:
    """A config-only Hugging Face model directory for verl's HFModelConfig (no weights, no tokenizer)."""
    from transformers import Qwen2Config

    path = root / "tiny-qwen2"
    if not (path / "config.json").exists():
        Qwen2Config(
            vocab_size=640,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            architectures=["Qwen2ForCausalLM"],
        ).save_pretrained(path)
    return str(path)


class TrainerWorker(Worker):
    """A verl actor worker in miniature: its checkpoint engine is built as verl's
    ``ActorRolloutRefWorker`` builds it (``is_master`` on rank 0, ``custom_backend_module``
    imported first), ``update_weights`` sends ``(name, tensor)`` pairs from a generator and
    returns the engine's metrics, ``execute_checkpoint_engine`` is dispatched DP_COMPUTE."""

    def __init__(
        self, checkpoint_engine_config: CheckpointEngineConfig, seed: int = 0, shapes: Shapes | None = None
    ) -> None:
        super().__init__()
        config = checkpoint_engine_config
        backend = config.backend
        bucket_size = config.update_weights_bucket_megabytes << 20
        engine_kwargs = dict(config.engine_kwargs.get(backend, {}))
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(self.rank == 0), bucket_size=bucket_size, **engine_kwargs
        )
        self.seed = seed
        self.shapes = shapes
        self.step = 0
        self.weights = weights_at(0, seed, shapes)
        self.last_update: dict[str, Any] | None = None  # outcome of the last update_weights

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_to(self, step: int) -> dict[str, str]:
        """'Train' to ``step``: new weights; returns their digest."""
        self.step = step
        self.weights = weights_at(step, self.seed, self.shapes)
        return digest(self.weights)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        start = time.monotonic()
        per_tensor_param = ((name, tensor) for name, tensor in self.weights.items())
        try:
            metrics = await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)
        except BaseException as e:
            # "at": CLOCK_MONOTONIC is the machine's, so the test can compare it with its own
            self.last_update = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "seconds": time.monotonic() - start,
                "type": type(e).__name__,
                "ranks": list(getattr(e, "ranks", [])),
                "at": time.monotonic(),
            }
            raise
        self.last_update = {"ok": True, "seconds": time.monotonic() - start}
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


def checkpoint_engine_config(transport: str, **kwargs: Any) -> CheckpointEngineConfig:
    """What a verl user writes: backend weightsync, the module, the bucket, engine_kwargs.weightsync."""
    return CheckpointEngineConfig(
        backend="weightsync",
        update_weights_bucket_megabytes=BUCKET_MB,
        engine_kwargs={"weightsync": {"transport": transport, "timeout_s": 30, **kwargs}},
        custom_backend_module=MODULE,
    )


def make_trainer(
    config: CheckpointEngineConfig, pool: RayResourcePool, seed: int = 0, shapes: Shapes | None = None
) -> RayWorkerGroup:
    """One TrainerWorker per bundle of ``pool`` (rank 0 sends, the others drain)."""
    cls = RayClassWithInitArgs(
        cls=ray.remote(TrainerWorker), checkpoint_engine_config=config, seed=seed, shapes=shapes
    )
    cls.update_options({"num_cpus": 0})
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")


def make_rollout(config: CheckpointEngineConfig, model_path: str, pool: RayResourcePool):
    """verl's create_rollout_worker_group: CheckpointEngineWorkerTest workers, one MockReplica each (TP 1)."""
    # verl's wheel; imported here, in the driver only, so trainer processes skip its imports
    from tests.checkpoint_engine.test_utils import create_rollout_worker_group

    model_config = HFModelConfig(path=model_path, load_tokenizer=False)
    rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config, tensor_model_parallel_size=1)
    return asyncio.run(create_rollout_worker_group(pool, model_config, rollout_config, check_allclose=True))


def cpu_pool(counts: list[int], max_colocate_count: int = 1) -> RayResourcePool:
    return RayResourcePool(process_on_nodes=counts, use_gpu=False, max_colocate_count=max_colocate_count)


def total_bytes(shapes: Shapes | None = None) -> int:
    return sum(t.nbytes for t in weights_at(0, 0, shapes).values())


TOTAL_BYTES = total_bytes()


def update(
    manager,
    trainer: RayWorkerGroup,
    step: int | None,
    workers,
    version: int | None = None,
    train_to=None,
    shapes: Shapes | None = None,
):
    """Train to ``train_to`` (default ``step``), update through verl's manager with
    ``global_steps=step``, and check every worker holds the trainer's bytes (``shapes``:
    the trainer's, when not ``SHAPES``)."""
    want = trainer.train_to(train_to if train_to is not None else step)[0]
    metrics = manager.update_weights(global_steps=step)
    got = received(workers)
    for i, held in enumerate(got):
        assert held == want, f"rollout worker {i} does not hold the trainer's weights after step {step}"
    size, count = total_bytes(shapes), len(shapes or SHAPES)
    assert size <= metrics["weightsync/bytes"] <= size + 64 * count  # bucket alignment
    assert metrics["weightsync/receivers"] == len(workers)
    assert metrics["weightsync/seconds"] > 0 and metrics["weightsync/gbps"] > 0
    if version is not None or step is not None:
        assert metrics["weightsync/version"] == (version if version is not None else step)
    return metrics


# ---------------------------------------------------------------------------- run inside actors
def _received(worker) -> dict[str, str]:
    return digest(worker.server_adapter.received_weights)


def _clear(worker) -> None:
    worker.server_adapter.received_weights.clear()


def _engine_state(worker) -> dict[str, Any]:
    return worker.checkpoint_engine.describe()


def _node(worker) -> str:
    return ray.get_runtime_context().get_node_id()


def _crash_after(worker, tensors: int) -> None:
    """Make this rollout worker's process exit after ``tensors`` tensors of the next update."""
    adapter = worker.server_adapter

    async def crashing(weights, **kwargs):
        n = 0
        async for _name, _tensor in weights:
            n += 1
            if n >= tensors:
                os._exit(17)

    adapter.update_weights = crashing


def received(workers) -> list[dict[str, str]]:
    return ray.get([w.__ray_call__.remote(_received) for w in workers])


def clear(workers) -> None:
    ray.get([w.__ray_call__.remote(_clear) for w in workers])


def engine_state(workers) -> list[dict[str, Any]]:
    return ray.get([w.__ray_call__.remote(_engine_state) for w in workers])


def nodes(workers) -> list[str]:
    return ray.get([w.__ray_call__.remote(_node) for w in workers])


def crash_after(worker, tensors: int) -> None:
    ray.get(worker.__ray_call__.remote(_crash_after, tensors))


def replica_workers(replicas) -> list:
    return [w for r in replicas for w in r.workers]


def _last_update(worker) -> dict[str, Any] | None:
    return worker.last_update


def last_update(trainer: RayWorkerGroup, within_s: float) -> dict[str, Any]:
    """The outcome of actor rank 0's last ``update_weights``, waiting up to ``within_s`` for
    it (verl's manager returns at the first failed worker, the trainer may still be on it)."""
    end = time.monotonic() + within_s
    while True:
        outcome = ray.get(trainer.workers[0].__ray_call__.remote(_last_update))
        if outcome is not None or time.monotonic() > end:
            return outcome
        time.sleep(0.1)


def _reset_last_update(worker) -> None:
    worker.last_update = None


def reset_last_update(trainer: RayWorkerGroup) -> None:
    ray.get([w.__ray_call__.remote(_reset_last_update) for w in trainer.workers])


class Reaper:
    """Kills a test's actors and frees its placement groups, so later tests start clean."""

    def __init__(self) -> None:
        self.workers: list = []
        self.pools: list[RayResourcePool] = []

    def pool(self, counts: list[int], max_colocate_count: int = 1) -> RayResourcePool:
        pool = cpu_pool(counts, max_colocate_count)
        self.pools.append(pool)
        return pool

    def track(self, workers) -> None:
        self.workers.extend(workers)

    def close(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        for pool in self.pools:
            for pg in pool.pgs or []:
                try:
                    ray.util.remove_placement_group(pg)
                except Exception:
                    pass


# ---------------------------------------------------------------------------- verl's own trainer
def tiny_model_with_weights(root: Path) -> str:
    """The tiny Qwen2 of ``tiny_model_dir`` with random fp32 weights (safetensors) that
    verl's FSDP engine loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / "tiny-qwen2-weights"
    if not (path / "model.safetensors").exists():
        torch.manual_seed(5)
        config = AutoConfig.from_pretrained(tiny_model_dir(root))
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def cpu_process_setup() -> None:
    """Ray's ``worker_process_setup_hook`` (every worker of the job): verl's engine on the
    CPU (``cpu_platform``), and ``custom_backend_module`` imported as verl's actor worker
    imports it (verl's ``TrainingWorkerTest`` does not)."""
    import cpu_platform

    cpu_platform.install()
    import_external_libs(MODULE)


def make_verl_trainer(
    config: CheckpointEngineConfig, model_path: str, pool: RayResourcePool
) -> RayWorkerGroup:
    """verl's own trainer worker, as verl's checkpoint-engine tests build it
    (``create_trainer_worker_group``): ``TrainingWorkerTest``, a verl ``TrainingWorker``
    whose ``update_weights`` sends ``self.engine.get_per_tensor_param()`` (verl's FSDP engine
    all-gathering each DTensor shard into the HF-named tensor) through the checkpoint
    engine. FSDP2 over Gloo, fp32, sharded over the pool's ranks; sdpa attention (verl's
    default, flash-attention 2, needs CUDA). The workers' job needs ``cpu_process_setup``
    as its ``worker_process_setup_hook``."""
    from tests.checkpoint_engine.test_utils import TrainingWorkerTest
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine_workers import TrainingWorkerConfig

    class GlooTrainingWorker(TrainingWorkerTest):
        """verl's ``TrainingWorkerTest``, its process group joined over Gloo first: verl's
        ``initialize_global_process_group_ray`` (``verl/utils/distributed.py:89``) would ask
        for ``cpu:gloo,<device>:<backend>``, which torch refuses with device ``cpu`` (a
        duplicate), and skips a group already initialized (``:90``)."""

        def __init__(self, config, checkpoint_engine_config) -> None:
            import torch.distributed as dist

            if (
                not dist.is_initialized()
            ):  # MASTER_ADDR/PORT, RANK, WORLD_SIZE: verl's RayWorkerGroup sets them
                dist.init_process_group(
                    "gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
                )
            super().__init__(config, checkpoint_engine_config)

    model_config = HFModelConfig(
        path=model_path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"}
    )
    # an actor, not forward_only: verl gives a forward-only FSDP2 engine a CPU offload policy
    # whose pinned memory needs an accelerator
    engine_config = FSDPEngineConfig(
        forward_only=False,
        fsdp_size=pool.world_size,
        strategy="fsdp2",
        model_dtype="fp32",
        use_torch_compile=False,
    )
    trainer_config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3),
    )
    cls = RayClassWithInitArgs(
        cls=ray.remote(GlooTrainingWorker), config=trainer_config, checkpoint_engine_config=config
    )
    # verl's RayWorkerGroup sets each actor's runtime_env itself: the CPU platform comes from
    # the job's (ray.init(runtime_env={"worker_process_setup_hook": ...}), test_verl_fsdp.py)
    cls.update_options({"num_cpus": 0})
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    group.reset()  # verl's TrainingWorker builds, loads and shards the model here
    return group
