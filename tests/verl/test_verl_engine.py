"""The verl adapter without Ray: verl's generated configs, the registry, the topology, and
a few updates in one process (sender and receivers on one event loop)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import verl
from verl.checkpoint_engine import CheckpointEngineRegistry

import weightsync.integrations.verl as adapter
from weightsync import ConfigError, EngineConfig, HandshakeError

GENERATED = sorted((Path(verl.__file__).parent / "trainer" / "config").glob("_generated_*.yaml"))
KB = 1 << 10


@pytest.mark.timeout(120)
def test_verls_generated_trainer_configs_are_accepted():
    names = {p.name for p in GENERATED}
    assert {
        "_generated_ppo_trainer.yaml",
        "_generated_ppo_megatron_trainer.yaml",
        "_generated_ppo_torchtitan_trainer.yaml",
        "_generated_ppo_veomni_trainer.yaml",
    } <= names
    for path in GENERATED:
        c = EngineConfig.from_yaml(path)  # _target_, verl's trainer modes, everything else is verl's
        assert (c.backend, c.update_weights_bucket_megabytes) == ("naive", 2048), path.name
        assert (c.trainer.use_v1, c.trainer.trainer_mode) == (True, "sync"), path.name
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli", "config", "--check", "--yaml", str(GENERATED[0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "config OK" in out.stdout, out.stderr


@pytest.mark.timeout(60)
def test_importing_the_module_registers_the_backend():
    assert CheckpointEngineRegistry.get("weightsync") is adapter.WeightsyncCheckpointEngine
    engine = CheckpointEngineRegistry.new(
        "weightsync",
        bucket_size=4 << 20,
        transport="auto",
        timeout_s=5,
        verify="crc32",
        nccl={"group_name": "ws"},
    )
    assert engine.bucket_mb == 4 and not engine.is_master and set(engine._configs) == {"shm", "nccl"}
    assert (
        engine._configs["nccl"].engine_kwargs.nccl.group_name == "ws"
        and engine._configs["shm"].verify == "crc32"
    )
    with pytest.raises(
        ConfigError,
        match=r"unknown key .*weightsync\.timeout \(did you mean 'timeout_s'\?\); known keys: transport, host, timeout_s",
    ):
        CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, timeout=5)
    with pytest.raises(ConfigError, match="engine_kwargs.disk.path=''"):
        CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, transport="disk")


def meta(i: str, node: str, master: bool = False, held: int | None = None, members=None) -> dict:
    m = {"id": i, "node_id": node, "ip": "10.0.0.1", "pid": 1, "master": master, "held": held}
    if master:
        m.update(
            transport=members.pop("_transport"),
            addresses={"nccl": "h:1", "shm": "h:2"},
            members=members,
            version=None,
        )
    return m


@pytest.mark.timeout(60)
def test_build_topology_keeps_ranks_and_picks_the_transport():
    build = adapter.WeightsyncCheckpointEngine.build_topology
    master = meta("t0", "A", master=True, members={"_transport": "auto", "shm": {}, "nccl": {}})
    actors, rollouts = build(
        2, 3, [master, meta("t1", "A"), meta("a", "A"), meta("b", "A", held=4), meta("c", "A")]
    )
    assert actors["rank"] == [0, -1] and rollouts["rank"] == [0, 1, 2]
    topo = rollouts["topology"][0]
    assert (topo["transport"], topo["address"], topo["held"]) == ("shm", "h:2", 4)

    # "a" left, "d" (on another node) joined: the others keep their ranks, d takes the lowest free one
    master = meta("t0", "A", master=True, members={"_transport": "auto", "nccl": {"a": 0, "b": 1, "c": 2}})
    _, rollouts = build(1, 3, [master, meta("c", "A"), meta("d", "B"), meta("b", "A")])
    assert rollouts["rank"] == [2, 0, 1] and rollouts["topology"][0]["transport"] == "nccl"
    assert rollouts["topology"][0]["members"] == {"c": 2, "d": 0, "b": 1}

    master = meta("t0", "A", master=True, members={"_transport": "shm"})
    with pytest.raises(
        ConfigError, match=r"transport=shm needs every rollout worker on the trainer's node \(A\).*\[1\]"
    ):
        build(1, 2, [master, meta("a", "A"), meta("b", "B")])
    with pytest.raises(ValueError, match="actor rank 0 must be the weightsync sender"):
        build(1, 1, [meta("x", "A"), meta("a", "A")])

    # a sender bound to every interface is advertised at the node IP Ray reports
    assert adapter._advertised("0.0.0.0:4321", "10.1.2.3") == "10.1.2.3:4321"
    assert adapter._advertised("[::]:4321", "10.1.2.3") == "10.1.2.3:4321"
    assert adapter._advertised("127.0.0.1:4321", "10.1.2.3") == "127.0.0.1:4321"


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "embed": torch.randn(300, 1000, generator=g).to(torch.bfloat16),  # larger than the bucket
        "w": torch.randn(64, 64, generator=g),
        "n": torch.arange(5) + step,
    }


async def one_update(engines, step: int | None, trainer_weights, expect_version: int, actors: int = 1):
    """verl's manager's sequence for one update, in one process: ``engines`` are the actor
    ranks' (``actors`` of them, rank 0 first) then the rollout workers'."""
    metadata = [e.prepare() for e in engines]
    actor_kwargs, rollout_kwargs = adapter.WeightsyncCheckpointEngine.build_topology(
        actors, len(engines) - actors, metadata
    )
    for i, e in enumerate(engines[:actors]):
        e.init_process_group(**{k: v[i] for k, v in actor_kwargs.items()})
    for i, e in enumerate(engines[actors:]):
        e.init_process_group(**{k: v[i] for k, v in rollout_kwargs.items()})

    async def receive(engine):
        return {name: t.clone() async for name, t in engine.receive_weights(global_steps=step)}

    async def send(engine):  # verl's actor passes a generator
        return await engine.send_weights(((n, t) for n, t in trainer_weights.items()), global_steps=step)

    results = await asyncio.gather(
        *[send(e) for e in engines[:actors]], *[receive(e) for e in engines[actors:]]
    )
    for e in engines:
        e.finalize()
    metrics, others, got = results[0], results[1:actors], results[actors:]
    assert all(m == {} for m in others)  # only actor rank 0 reports metrics
    for held in got:
        assert held.keys() == trainer_weights.keys()
        assert all(torch.equal(held[n], trainer_weights[n]) for n in held)
    assert metrics["weightsync/version"] == expect_version
    return metrics


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, actors", [("paired", 2), ("sharded", 2), ("disk", 2), ("nccl", 2)])
def test_other_transports_and_several_actor_ranks(transport, actors, tmp_path):
    new = adapter.WeightsyncCheckpointEngine
    extra = {"engine_kwargs": {"disk": {"path": str(tmp_path)}}} if transport == "disk" else {}
    kw = dict(bucket_size=2 << 20, transport=transport, timeout_s=20, **extra)
    engines = [new(is_master=True, host="127.0.0.1", **kw)] + [new(**kw) for _ in range(actors - 1 + 2)]

    async def scenario():
        for step in (1, 2, 3):
            await one_update(engines, step, weights(step), expect_version=step, actors=actors)

    try:
        asyncio.run(scenario())
        roles = [e.describe()["role"] for e in engines]
        assert (
            roles
            == (["sender"] * actors if transport in ("paired", "sharded") else ["sender", "drain"])
            + ["receiver"] * 2
        )
    finally:
        for e in engines:
            e.close()


@pytest.mark.timeout(120)
def test_updates_in_one_process_count_versions_and_roll_back_once_logged(caplog):
    new = adapter.WeightsyncCheckpointEngine
    engines = [new(bucket_size=512 * KB, is_master=True, transport="shm", host="127.0.0.1", timeout_s=20)]
    engines += [new(bucket_size=512 * KB, transport="shm", timeout_s=20) for _ in range(2)]

    async def scenario():
        m = await one_update(engines, None, weights(1), expect_version=1)
        assert m["weightsync/forced"] == 0 and m["weightsync/receivers"] == 2
        await one_update(engines, None, weights(2), expect_version=2)
        await one_update(engines, 7, weights(7), expect_version=7)
        with caplog.at_level(logging.WARNING, logger="weightsync.verl"):
            m = await one_update(engines, 5, weights(5), expect_version=5)
            assert m["weightsync/forced"] == 1 and m["weightsync/rollback_from"] == 7
        warnings = [r for r in caplog.records if "went back to 5" in r.getMessage()]
        assert len(warnings) == 1 and "force=True" in warnings[0].getMessage()
        m = await one_update(engines, None, weights(6), expect_version=6)
        assert m["weightsync/forced"] == 0
        # a receiver expecting another version refuses: weightsync's error, raised in send_weights
        metadata = [e.prepare() for e in engines]
        actors, rollouts = new.build_topology(1, 2, metadata)
        engines[0].init_process_group(**{k: v[0] for k, v in actors.items()})
        for i, r in enumerate(engines[1:]):
            r.init_process_group(**{k: v[i] for k, v in rollouts.items()})

        async def receive(engine, version):
            return [n async for n, _ in engine.receive_weights(global_steps=version)]

        sent, first, _second = await asyncio.gather(
            engines[0].send_weights(iter(weights(9).items()), global_steps=9),
            receive(engines[1], 8),
            receive(engines[2], 9),
            return_exceptions=True,
        )
        assert isinstance(sent, HandshakeError) and sent.ranks == [0], sent
        assert "weightsync (shm): update to version 9 for 2 rollout worker(s) failed" in str(sent)
        assert "receiver rank 0 refused version 9: version: sender sends 9, receiver expects 8" in str(sent)
        assert "[failed: receiver rank 0 = rollout worker 0" in str(sent)
        assert isinstance(first, HandshakeError) and "rollout worker (receiver rank 0" in str(first)
        await one_update(engines, 10, weights(10), expect_version=10)  # the next update recovers

    try:
        asyncio.run(scenario())
    finally:
        for e in engines:
            e.close()
