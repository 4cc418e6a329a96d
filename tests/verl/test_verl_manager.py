"""verl 0.9.1's own CheckpointEngineManager drives backend ``weightsync`` on one Ray node.

Rollout workers are verl's CheckpointEngineWorkerTest (MockServerAdapter) in verl's
MockReplica; the trainer is a verl Worker whose weights change every step. After every
update each rollout worker must hold the trainer's bytes exactly.
"""

from __future__ import annotations

import time

import pytest
import ray
import verl_helpers as H
from verl.checkpoint_engine import CheckpointEngineManager

import weightsync
import weightsync.integrations.verl
from weightsync import SyncError


@pytest.fixture(scope="module")
def ray_node():
    ray.init(num_cpus=16, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return H.tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def reaper(ray_node):
    r = H.Reaper()
    yield r
    r.close()


def kill_mid_update(manager, trainer, workers, victim: int, step: int, transport: str, timeout_s: float):
    """Make rollout worker ``victim`` die in the middle of update ``step``: the trainer's
    send_weights must fail within its deadline with weightsync's error naming that worker."""
    H.crash_after(workers[victim], tensors=2)
    trainer.train_to(step)
    H.reset_last_update(trainer)
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (any error: verl's manager gives up at the first failed worker)
        manager.update_weights(global_steps=step)
    outcome = H.last_update(trainer, within_s=timeout_s + 15)
    assert outcome is not None, "the trainer's send_weights did not end"
    assert time.monotonic() - start < timeout_s + 15
    assert outcome["ok"] is False and outcome["seconds"] < timeout_s, outcome
    assert issubclass(getattr(weightsync, outcome["type"]), SyncError), outcome
    resolved = "shm" if transport == "auto" else transport
    for part in (f"version {step}", f"weightsync ({resolved}", f"rollout worker {victim}"):
        assert part in outcome["error"], outcome["error"]
    return outcome


@pytest.mark.timeout(300)
# auto picks shm on one Ray node (asserted below): it runs the shm case and proves the choice
@pytest.mark.parametrize("transport", ["nccl", "auto"])
def test_manager_updates_bit_exact_as_replicas_join_die_and_leave(transport, model_path, reaper):
    timeout_s = 20
    config = H.checkpoint_engine_config(transport, timeout_s=timeout_s)
    # with nccl, two trainer ranks: rank 0 sends, rank 1 only drains its generator
    trainer = H.make_trainer(config, reaper.pool([2 if transport == "nccl" else 1]))
    reaper.track(trainer.workers)
    _rollout, replicas = H.make_rollout(config, model_path, reaper.pool([3]))
    workers = H.replica_workers(replicas)
    reaper.track(workers)
    assert len(replicas) == 3 and len(workers) == 3
    manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas[:2]))

    for step in (1, 2, 3):  # 2 rollout workers
        metrics = H.update(manager, trainer, step, workers[:2])
        assert metrics["weightsync/forced"] == 0
    expected = "shm" if transport == "auto" else transport  # one Ray node: auto picks shm
    states = H.engine_state(workers[:2])
    assert [s["transport"] for s in states] == [expected] * 2 and [s["rank"] for s in states] == [0, 1]
    trainer_states = ray.get(trainer.execute_checkpoint_engine(["describe"] * len(trainer.workers)))
    assert [s["role"] for s in trainer_states] == ["sender", "drain"][: len(trainer.workers)]
    address = trainer_states[0]["address"]

    manager.add_replicas([replicas[2]])  # a replica joins at the next update
    for step in (4, 5):  # 3 rollout workers
        H.update(manager, trainer, step, workers)
    states = H.engine_state(workers)
    assert [s["rank"] for s in states] == [0, 1, 2] and {s["address"] for s in states} == {address}

    # rollout worker 1 dies mid-update: a clear error on the trainer within the deadline
    outcome = kill_mid_update(manager, trainer, workers, 1, 6, transport, timeout_s)
    assert outcome["ranks"] == [1] and "receiver rank 1" in outcome["error"], outcome
    manager.remove_replicas([replicas[1]])  # the next update goes to the survivors
    survivors = [workers[0], workers[2]]
    for step in (7, 8):
        H.update(manager, trainer, step, survivors)
    assert [s["rank"] for s in H.engine_state(survivors)] == [0, 2]  # ranks stay

    manager.remove_replicas([replicas[0]])  # a replica leaves at the next update
    H.update(manager, trainer, 9, workers[2:])
    assert ray.get(trainer.execute_checkpoint_engine(["describe"] * len(trainer.workers)))[0][
        "receivers"
    ] == [2]
    assert H.received(workers[:1])[0] == trainer.train_to(8)[0], "a removed replica must not be updated"


@pytest.mark.timeout(240)
def test_versions_counted_rolled_back_and_after_a_trainer_restart(model_path, reaper):
    config = H.checkpoint_engine_config("nccl")
    trainer = H.make_trainer(config, reaper.pool([1]))
    reaper.track(trainer.workers)
    _rollout, replicas = H.make_rollout(config, model_path, reaper.pool([2]))
    workers = H.replica_workers(replicas)
    reaper.track(workers)
    manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas))

    # verl's default global_steps=None: the adapter counts
    for count in (1, 2):
        metrics = H.update(manager, trainer, None, workers, version=count, train_to=count)
        assert metrics["weightsync/forced"] == 0
    H.update(manager, trainer, 10, workers)

    # the trainer resumed from an older checkpoint: it is authoritative
    metrics = H.update(manager, trainer, 4, workers)
    assert metrics["weightsync/forced"] == 1 and metrics["weightsync/rollback_from"] == 10
    assert [s["held"] for s in H.engine_state(workers)] == [4, 4]
    metrics = H.update(manager, trainer, None, workers, version=5, train_to=5)
    assert metrics["weightsync/forced"] == 0

    # a new trainer process (nothing remembered) resumes at step 3 while rollout kept version 5
    for w in trainer.workers:
        ray.kill(w, no_restart=True)
    trainer2 = H.make_trainer(config, reaper.pool([1]))
    reaper.track(trainer2.workers)
    manager2 = CheckpointEngineManager(config=config, actor_wg=trainer2, replicas=list(replicas))
    metrics = H.update(manager2, trainer2, 3, workers)
    assert metrics["weightsync/forced"] == 1 and metrics["weightsync/rollback_from"] == 5
    metrics = H.update(manager2, trainer2, None, workers, version=4, train_to=4)
    assert metrics["weightsync/forced"] == 0
