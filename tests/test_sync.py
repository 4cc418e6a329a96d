"""Multi-process syncs over real Gloo (the `nccl` backend on CPU): bit-exactness across
versions, failures that name the peer within the deadline."""

import asyncio
import os
import socket
import threading
import time

import pytest
import torch
import workers
from listeners import listeners_of
from procs import CTX, collect, free_port, start, stop
from proxy import ControlProxy

from weightsync import EngineConfig, HandshakeError, Receiver, Sender, SyncError, SyncTimeout
from weightsync.errors import RemoteFailure
from weightsync.plan import TensorSpec, make_plan
from weightsync.sources import IteratorSource

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

BASE = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=60"]
# The transports the data-path tests run on: collective broadcast (Gloo), shared memory and
# Mooncake Transfer Engine over TCP (a chain of receivers).
TRANSPORTS = ["nccl", "shm", pytest.param("mooncake", marks=workers.needs_mooncake)]


def base(backend):
    return [f"backend={backend}"] + BASE[1:]


@pytest.mark.parametrize("backend", TRANSPORTS)
@pytest.mark.parametrize("num_receivers", [1, 3])
def test_versions_arrive_bit_exact(num_receivers, backend):
    versions = [1, 2, 3]
    specs = [TensorSpec.of(n, t) for n, t in workers.make_weights(1).items()]
    planned = len(make_plan(specs, 1 << 20).buckets)  # 1 MiB buckets, as in BASE
    assert planned >= 2
    q = CTX.Queue()
    overrides = base(backend)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", num_receivers) as sender:
        procs = [
            start(workers.run_receiver, sender.address, r, overrides, versions, q)
            for r in range(num_receivers)
        ]
        try:
            for v in versions:
                stats = sender.send(workers.make_weights(v), version=v)
                assert (stats.tensors, stats.buckets) == (9, planned)
                # The plan travels once; unchanged, only its hash goes with later versions.
                assert stats.plan_sent_to == (num_receivers if v == 1 else 0)
                reports = collect(q, num_receivers)
                expected = workers.expected_digests(v)
                for rank, version, got, held in reports:
                    assert version == v, got
                    assert held == v
                    assert got == expected, f"receiver {rank} differs at version {v}"
            assert workers.expected_digests(1) != workers.expected_digests(2)
        finally:
            stop(procs)


def test_modules_load_in_place_with_tied_weights_and_rebuilt_groups():
    overrides = BASE + ["engine_kwargs.nccl.rebuild_group=true", "engine_kwargs.nccl.group_name=weights"]
    q = CTX.Queue()
    trainer = workers.Small(seed=1)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [
            start(workers.run_module_receiver, sender.address, r, overrides, [1, 2], q) for r in range(2)
        ]
        try:
            for v in (1, 2):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.mul_(1.5).add_(v)
                    trainer.count.fill_(v)
                sender.send(trainer, version=v)
                for rank, version, got, missing in collect(q, 2):
                    assert version == v, got
                    assert got == workers.module_digests(trainer)
                    assert missing == []
        finally:
            stop(procs)


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_owned_tensors_stay_valid_after_the_sync(backend):
    """receive(owned=True): every tensor kept until the end still holds its own bytes
    (large ones landed in new tensors, packed ones copied out of the reused buffers)."""
    q = CTX.Queue()
    overrides = base(backend)
    weights = workers.big_weights(4)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [
            start(workers.run_receiver, sender.address, r, overrides, [4], q, None, True) for r in range(2)
        ]
        try:
            sender.send(weights, version=4)
            for rank, version, got, held in collect(q, 2):
                assert version == 4 and got == {n: workers.digest(t.contiguous()) for n, t in weights.items()}
        finally:
            stop(procs)


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_iterator_source_streams_buckets_without_specs_up_front(backend):
    q = CTX.Queue()
    overrides = base(backend)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_receiver, sender.address, r, overrides, [5], q) for r in range(2)]
        try:
            source = IteratorSource(iter(workers.make_weights(5).items()))
            assert source.specs() is None
            stats = sender.send(source, version=5)
            assert stats.tensors == 9 and stats.plan_sent_to == 0
            for rank, version, got, held in collect(q, 2):
                assert version == 5 and got == workers.expected_digests(5)
        finally:
            stop(procs)


def test_two_trainer_ranks_only_rank_zero_sends():
    q, addr_q, rq = CTX.Queue(), CTX.Queue(), CTX.Queue()
    port = free_port()
    trainers = [start(workers.run_sharded_trainer, r, port, addr_q, BASE, 2, [1, 2], q) for r in range(2)]
    receivers = []
    try:
        address = addr_q.get(timeout=90)
        receivers = [start(workers.run_receiver, address, r, BASE, [1, 2], rq) for r in range(2)]
        for v in (1, 2):
            trainer_reports = sorted(collect(q, 2), key=lambda r: r[0])
            assert [r[1] for r in trainer_reports] == [v, v], trainer_reports
            assert trainer_reports[0][2] > 0 and trainer_reports[1][2] == 0  # rank 1 sent nothing
            assert trainer_reports[1][3] == 9  # ... but drained every tensor
            for rank, version, got, held in collect(rq, 2):
                assert version == v and got == workers.expected_digests(v)
    finally:
        stop(trainers + receivers)


def test_receiver_that_never_connects_times_out_naming_it():
    overrides = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=3"]
    config = EngineConfig.from_overrides(overrides)
    with Sender(config, "127.0.0.1:0", 2) as sender:
        proxy = ControlProxy(sender.address)  # counts rank 0's control connections
        with Receiver(config, proxy.address, 0) as present:
            joiner = threading.Thread(target=present.connect, daemon=True)  # rank 0 joins, rank 1 never does
            joiner.start()
            t0 = time.monotonic()
            with pytest.raises(
                SyncTimeout, match=r"receiver rank 1 never connected .* within 3.0 s \(1 of 2 connected\)"
            ) as info:
                sender.send(workers.make_weights(1), version=1)
            assert info.value.ranks == [1]
            assert time.monotonic() - t0 < 10
            joiner.join(timeout=5)
            # The connected receiver stayed connected: without rank 1, the same connection
            # takes the version.
            sender.remove_receiver(1)
            got = {}
            taker = threading.Thread(
                target=lambda: got.update((n, workers.digest(t)) for n, t in present.receive(version=1))
            )
            taker.start()
            sender.send(workers.make_weights(1), version=1)
            taker.join(timeout=30)
            assert got == workers.expected_digests(1) and present.version == 1
            assert proxy.connections == 1
            proxy.close()


def test_sender_that_never_appears_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        config = EngineConfig.from_overrides(["backend=nccl", "timeout_s=1.5"])
        t0 = time.monotonic()
        with Receiver(config, address, 0) as receiver:
            with pytest.raises(
                SyncTimeout, match=f"receiver rank 0 could not reach the sender at {address} within 1.5 s"
            ):
                list(receiver.receive())
        assert time.monotonic() - t0 < 6


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_receiver_killed_mid_sync_fails_the_sender_naming_it(backend):
    q = CTX.Queue()
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=20"]
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        victim = start(workers.run_receiver, sender.address, 0, overrides, [1], q, 2)
        survivor = start(workers.run_receiver, sender.address, 1, overrides, [1], q)
        try:
            # 64 MB after the first tensors: the victim dies while most buckets are still to come.
            payload = {**workers.make_weights(1), **{f"extra.{i}": torch.randn(1 << 18) for i in range(64)}}
            t0 = time.monotonic()
            with pytest.raises(SyncError, match=r"receiver rank 0 \(pid \d+.*\) disconnected"):
                sender.send(payload, version=1)
            assert time.monotonic() - t0 < 25
            victim.join(timeout=10)
            assert victim.exitcode == 9
            # The survivor does not hang either: a clear error, well before its own deadline
            # (the sender drops the failed group at once), and it holds no version.
            rank, status, message, held = q.get(timeout=30)
            assert time.monotonic() - t0 < 15
            assert (rank, status, held) == (1, "error", None), message
            assert "transfer of version 1" in message
            # Nothing of the failed sync's memory is left: no shared-memory descriptor held.
            assert workers.shared_memory_fds() == []
        finally:
            stop([victim, survivor])


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_warm_up_forms_the_data_plane_that_the_syncs_then_use(backend):
    """``Sender.warm_up`` connects every receiver and forms the data plane before the first
    version; a receiver takes part from ``Receiver.warm_up`` (an engine's init call) or
    while it waits in ``receive``. The syncs then reuse that data plane (no new group,
    ring or chain), bit-exact. Warmed up with the source, the buffers fit its plan."""
    q = CTX.Queue()
    overrides = base(backend)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        # rank 0 warms up explicitly, rank 1 waits in receive()
        procs = [
            start(
                workers.run_receiver,
                sender.address,
                r,
                overrides,
                [1, 2],
                q,
                None,
                False,
                False,
                None,
                None,
                r == 0,
            )
            for r in range(2)
        ]
        try:
            sender.warm_up(workers.make_weights(1))
            assert q.get(timeout=60) == (0, "warm")
            assert sender._transport._generation == 1  # formed by the warm-up
            for v in (1, 2):
                stats = sender.send(workers.make_weights(v), version=v)
                assert stats.plan_sent_to == 0  # the warm-up carried it
                for rank, version, got, held in collect(q, 2):
                    assert (version, held) == (v, v) and got == workers.expected_digests(v), rank
            assert sender._transport._generation == 1  # the syncs joined no new one
        finally:
            stop(procs)


def test_a_warm_up_without_the_source_forms_the_group_and_leaves_the_buffers_to_the_first_sync():
    """Without the source the warm-up cannot know the plan: it forms the group but holds
    no bucket-sized buffers (two full buckets, 2 GiB each by default, on every rank); the
    first sync sizes them by its plan and keeps the group."""
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(BASE), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_receiver, sender.address, r, BASE, [1], q) for r in range(2)]
        try:
            sender.warm_up()
            transport = sender._transport
            assert transport._generation == 1 and [b.numel() for b in transport._buffers] == [1, 1]
            sender.send(workers.make_weights(1), version=1)
            for rank, version, got, held in collect(q, 2):
                assert (version, held) == (1, 1) and got == workers.expected_digests(1), rank
            assert transport._generation == 1  # the same group
            assert transport._buffers[0].numel() == 2**20  # sized by the plan (its buckets fill 1 MiB)
        finally:
            stop(procs)


@pytest.mark.parametrize("fault", ["refuses", "dies"])
def test_a_receiver_refusing_or_dying_in_the_warm_up_is_named_and_the_other_takes_the_sync(fault):
    """Receiver 1 refuses the warm-up (another bucket size) or its process dies when the
    warm-up reaches it: the sender's warm-up fails naming it; receiver 0, waiting in
    receive(), takes the next sync once receiver 1 is removed."""
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(BASE), "127.0.0.1:0", 2) as sender:
        other = ["backend=nccl", "update_weights_bucket_megabytes=2", "timeout_s=60"]
        second = (
            start(
                workers.run_receiver, sender.address, 1, other, [1], q, None, False, False, None, None, True
            )
            if fault == "refuses"
            else start(workers.run_dying_in_warm_up, sender.address, 1, BASE)
        )
        procs = [start(workers.run_receiver, sender.address, 0, BASE, [1], q), second]
        try:
            t0 = time.monotonic()
            expected = (
                (
                    HandshakeError,
                    "receiver rank 1 refused the warm-up: bucket size: sender 1048576 bytes, "
                    "receiver 2097152 bytes",
                )
                if fault == "refuses"
                else (SyncError, "receiver rank 1")
            )
            with pytest.raises(expected[0], match=expected[1]) as info:
                sender.warm_up()
            assert info.value.ranks == [1] and time.monotonic() - t0 < 30
            if fault == "refuses":
                rank, status, message, _ = q.get(timeout=30)
                assert (rank, status) == (1, "error") and "bucket size" in message
            sender.remove_receiver(1)
            sender.send(workers.make_weights(1), version=1)
            rank, version, got, held = q.get(timeout=60)
            assert (rank, version, held) == (0, 1, 1) and got == workers.expected_digests(1)
        finally:
            stop(procs)


@pytest.mark.parametrize("backend", TRANSPORTS)
def test_failed_load_keeps_the_old_version_and_the_next_sync_succeeds(backend):
    q = CTX.Queue()
    trainer = workers.Small(seed=1)
    overrides = base(backend)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [
            start(workers.run_module_receiver, sender.address, r, overrides, [1, 2, 3], q) for r in range(2)
        ]
        try:
            sender.send(trainer, version=1)
            assert sorted(r[1] for r in collect(q, 2)) == [1, 1]
            v1 = workers.module_digests(trainer)
            # A streamed source (no specs up front), every tensor different from version 1,
            # one of the wrong shape: the receivers find out mid-sync, drain the rest and
            # report; the sender names them.
            bad = {n: t + 1 for n, t in trainer.state_dict().items()}
            bad["block.0.weight"] = torch.zeros(64, 511)
            v2 = {n: workers.digest(t) for n, t in bad.items()}
            assert all(v2[n] != v1[n] for n in v1)
            with pytest.raises(
                RemoteFailure,
                match=r"receiver rank 0 failed version 2: .*'block.0.weight': shape \(64, 511\) received, model has \(64, 512\)",
            ):
                sender.send(IteratorSource(iter(bad.items())), version=2)
            order = list(bad)  # the stream's order: what came before the bad tensor was loaded
            before = set(order[: order.index("block.0.weight")]) | {"head.weight"}  # tied to embed.weight
            for rank, status, message, held, failed, torn, got in collect(q, 2):
                assert status == "error" and "block.0.weight" in message
                assert (held, failed) == (1, 2)  # still version 1; version 2 failed
                loaded = {n for n in got if got[n] == v2[n]}
                # What came before the bad tensor has version 2's bytes (landed or loaded),
                # every other tensor still version 1's, and ``torn`` says the model is a mix.
                assert loaded == before and torn, (torn, loaded)
                assert all(got[n] == v1[n] for n in got if n not in loaded)
            # Same sender, same receivers, same connections: the next version goes through.
            with torch.no_grad():
                trainer.block[0].weight.add_(1)
            stats = sender.send(trainer, version=3)
            assert stats.plan_sent_to == 0  # the plan agreed at version 1 still holds
            for rank, version, got, missing in collect(q, 2):
                assert version == 3 and got == workers.module_digests(trainer)
        finally:
            stop(procs)


def test_async_send_does_not_block_the_event_loop():
    q = CTX.Queue()

    async def controller(sender):
        ticks = 0
        stop_ticking = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop_ticking.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        payload = {**workers.make_weights(1), **{f"extra.{i}": torch.randn(1 << 18) for i in range(32)}}
        stats = await sender.send_async(payload, version=1)
        stop_ticking.set()
        await task
        return stats, ticks

    with Sender(EngineConfig.from_overrides(BASE), "127.0.0.1:0", 1) as sender:
        procs = [start(workers.run_receiver, sender.address, 0, BASE, [1], q)]
        try:
            stats, ticks = asyncio.run(controller(sender))
            rank, version, got, held = q.get(timeout=60)
            assert version == held == 1 and got["embed.weight"] == workers.expected_digests(1)["embed.weight"]
            # The loop kept running while the sync (receiver start-up included) was under way.
            assert ticks >= 10, ticks
        finally:
            stop(procs)


def test_data_plane_listens_only_on_the_chosen_loopback_interface():
    q = CTX.Queue()
    before = set(listeners_of(os.getpid()))  # what earlier tests left in this process
    with Sender(EngineConfig.from_overrides(BASE), "127.0.0.1:0", 1) as sender:
        procs = [start(workers.run_receiver, sender.address, 0, BASE, [1, 2], q)]
        try:
            sender.send(workers.make_weights(1), version=1)
            q.get(timeout=60)
            ours = sorted(set(listeners_of(os.getpid())) - before) + listeners_of(procs[0].pid)
            # Control socket, rendezvous store and Gloo's sockets: all on loopback, no exception.
            assert len(ours) >= 4 and all(address == "127.0.0.1" for address, _ in ours), ours
            assert ("127.0.0.1", sender._transport._server.port) in ours
            sender.send(workers.make_weights(2), version=2)
            q.get(timeout=60)
        finally:
            stop(procs)


def test_a_bf16_wire_loads_into_a_bf16_model_without_blocking_the_receivers_event_loop():
    """``Sender(wire_dtype=bfloat16)`` end to end: multi-byte floats cross the wire as
    bf16 (half the bytes) and land bit-exact as the trainer's values cast; the integer
    buffer keeps its dtype. The receiver loads with ``load_into_async`` while its event
    loop keeps running."""
    trainer = workers.Small(seed=1)
    workers.bump_small(trainer, 1)
    model = workers.Small(seed=2).to(torch.bfloat16)  # a rollout copy kept in bf16
    config = EngineConfig.from_overrides(BASE)
    with (
        Sender(config, "127.0.0.1:0", 1, wire_dtype=torch.bfloat16) as sender,
        Receiver(config, sender.address, 0) as receiver,
    ):
        sent = workers.Background(sender, trainer, 1)

        async def load():
            ticks = 0
            task = asyncio.create_task(receiver.load_into_async(model, version=1))
            while not task.done():
                ticks += 1
                await asyncio.sleep(0.005)
            return await task, ticks

        stats, ticks = asyncio.run(load())
        sent_stats = sent.join(timeout=60)
    assert ticks >= 2, (
        ticks
    )  # the loop ran during the load (blocked, it ticks once); how often depends on its length
    expected = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in trainer.state_dict().items()
    }
    assert workers.module_digests(model) == {n: workers.digest(t) for n, t in expected.items()}
    assert model.count.dtype == torch.int64
    fp32_bytes = sum(p.numel() * 4 for p in trainer.parameters())
    assert sent_stats.bytes == stats.bytes < 0.51 * fp32_bytes + 64
