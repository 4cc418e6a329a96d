"""verl's own trainer worker feeds verl's CheckpointEngineManager through backend weightsync.

The trainer is verl's ``TrainingWorkerTest`` (verl's ``TrainingWorker`` and its FSDP2
engine, from verl's checkpoint-engine tests); the weights generator is verl's
``engine.get_per_tensor_param()``, as in verl's ``ActorRolloutRefWorker.update_weights``
(``verl/workers/engine_workers.py``). verl 0.9.1 has no CPU platform, so every worker of
this module's Ray job gets one through verl's platform plugin point (``cpu_platform.py``,
installed by the job's ``worker_process_setup_hook``); verl's code runs unchanged on it.
"""

from __future__ import annotations

import pytest
import ray
import verl_helpers as H
from safetensors.torch import load_file
from verl.checkpoint_engine import CheckpointEngineManager

import weightsync.integrations.verl  # noqa: F401  (registers backend "weightsync" in the driver too)


@pytest.fixture(scope="module")
def ray_node():
    ray.init(
        num_cpus=16,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": "verl_helpers.cpu_process_setup"},
    )
    yield
    ray.shutdown()


@pytest.fixture
def reaper(ray_node):
    r = H.Reaper()
    yield r
    r.close()


@pytest.mark.timeout(300)
def test_verls_own_fsdp_trainer_worker_feeds_the_manager_bit_exact(tmp_path, reaper):
    """Two FSDP2 trainer ranks over Gloo: each tensor of ``get_per_tensor_param()`` is
    all-gathered from both ranks' shards, so rank 0 sends the generator and rank 1 must walk
    it too. Every rollout worker (verl's MockServerAdapter) holds the checkpoint's bytes,
    under its Hugging Face names, after each update."""
    model_path = H.tiny_model_with_weights(tmp_path)
    config = H.checkpoint_engine_config("nccl")
    trainer = H.make_verl_trainer(config, model_path, reaper.pool([2]))
    reaper.track(trainer.workers)
    _rollout, replicas = H.make_rollout(config, model_path, reaper.pool([2]))
    workers = H.replica_workers(replicas)
    reaper.track(workers)
    manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas))
    want = H.digest(load_file(f"{model_path}/model.safetensors"))
    assert len(want) > 10
    for step in (1, 2):
        H.clear(workers)
        manager.update_weights(global_steps=step)
        assert H.received(workers) == [want, want], f"step {step}"
    states = H.engine_state(workers)
    assert [(s["transport"], s["rank"], s["held"]) for s in states] == [("nccl", 0, 2), ("nccl", 1, 2)], (
        states
    )
    roles = [s["role"] for s in ray.get(trainer.execute_checkpoint_engine(["describe"] * 2))]
    assert roles == ["sender", "drain"]
