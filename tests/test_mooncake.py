"""The ``mooncake`` backend over real Mooncake Transfer Engine (TCP on 127.0.0.1): a chain
of receivers, a receiver lost in the middle of the chain, strangers on the signal port. The slot ring's
signals it shares with ``shm`` (never leaking across versions) are tested in
test_ring.py, without the wheel. The data-path tests shared with the
other transports (bit-exact versions to 1 and 3 receivers, iterator sources, owned
tensors, a killed first receiver) run it too, from test_sync.py and test_faults.py."""

import logging
import signal
import socket
import sys
import time

import pytest
import torch
import workers
from procs import CTX, collect, start, stop

from weightsync import EngineConfig, Sender, SyncError
from weightsync.engines.base import EngineUnavailable
from weightsync.engines.registry import get_engine

# Every test here but the registry's needs the wheel: they carry the marker one by one.


def config(timeout=20):
    return ["backend=mooncake", "update_weights_bucket_megabytes=1", f"timeout_s={timeout}"]


def weights(version):
    """make_weights plus 6 MB: about nine 1 MiB buckets, more than the two slots."""
    g = torch.Generator().manual_seed(7000 + version)
    return {
        **workers.make_weights(version),
        **{f"extra.{i}": torch.randn(1 << 18, generator=g) for i in range(6)},
    }


def digests(tensors):
    return {n: workers.digest(t.contiguous()) for n, t in tensors.items()}


# ---------------------------------------------------------------------------- versions
@workers.needs_mooncake
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_many_versions_through_the_chain_are_bit_exact_every_time():
    """More buckets than slots, twelve versions: a completion signal left over from one
    version would let a later one read a slot before its bytes arrived."""
    from weightsync.engines.ring import SLOTS

    versions = list(range(1, 13))
    q = CTX.Queue()
    overrides = config()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_receiver, sender.address, r, overrides, versions, q) for r in range(2)]
        try:
            for v in versions:
                payload = weights(v)
                stats = sender.send(payload, version=v)
                assert stats.buckets > 2 * SLOTS
                expected = digests(payload)
                for rank, version, got, held in collect(q, 2, timeout=60):
                    assert (version, held) == (v, v), got
                    assert got == expected, f"receiver {rank} differs at version {v}"
        finally:
            stop(procs)


def run_recording_receiver(address, rank, overrides, versions, queue, frames):
    """``workers.run_receiver``, logging in order the READY frames it reads from upstream
    ("in") and sends downstream ("out"), reported as ``(rank, log)`` once it is done."""
    from weightsync.engines import ring

    log = []
    send, wait = ring.Signals.send, ring.Signals.wait

    def sending(self, kind, version, seq, nbytes):
        send(self, kind, version, seq, nbytes)
        if kind == ring.READY:
            log.append(("out", seq, nbytes))

    def waiting(self, kind, version, seq):
        nbytes = wait(self, kind, version, seq)
        if kind == ring.READY:
            log.append(("in", seq, nbytes))
        return nbytes

    from weightsync.engines.mooncake import MooncakeEngine

    recv = MooncakeEngine.recv_buckets

    def receiving(self, *args, **kwargs):  # a slow consumer, logging what it holds when
        for bucket, view in recv(self, *args, **kwargs):
            log.append(("held", bucket.index, 0))
            time.sleep(0.2)
            log.append(("released", bucket.index, 0))
            yield bucket, view

    ring.Signals.send, ring.Signals.wait = sending, waiting
    MooncakeEngine.recv_buckets = receiving
    workers.run_receiver(address, rank, overrides, versions, queue)
    frames.put((rank, log))


@workers.needs_mooncake
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_bucket_travels_the_chain_in_pieces_each_forwarded_before_the_bucket_is_whole():
    """16 MiB buckets of a model with a 40 MiB tensor, to 3 receivers: every bucket is
    announced in pieces of ``CHUNK_BYTES`` (growing byte counts, the last the bucket's
    size), each forwarding receiver passes a piece on before the last piece of its
    bucket arrived (store and forward would announce it once, whole), and goes on
    forwarding the next bucket while its (slow) consumer holds one, bit-exact."""
    from weightsync.engines.ring import CHUNK_BYTES

    g = torch.Generator().manual_seed(77)
    payload = {**workers.make_weights(1), "big": torch.randn((40 << 20) // 4, generator=g)}
    q, frames = CTX.Queue(), CTX.Queue()
    overrides = ["backend=mooncake", "update_weights_bucket_megabytes=16", "timeout_s=30"]
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 3) as sender:
        procs = [
            start(run_recording_receiver, sender.address, r, overrides, [1], q, frames) for r in range(3)
        ]
        try:
            sender.send(payload, version=1)
            for rank, version, got, held in collect(q, 3, timeout=90):
                assert (version, held) == (1, 1) and got == digests(payload), f"receiver {rank} differs"
            logs = dict(frames.get(timeout=30) for _ in range(3))
        finally:
            stop(procs)
    for rank in range(3):
        for way in ("in", "out") if rank < 2 else ("in",):
            counts: dict[int, list[int]] = {}
            for w, seq, nbytes in logs[rank]:
                if w == way:
                    counts.setdefault(seq, []).append(nbytes)
            assert counts and all(c == sorted(set(c)) for c in counts.values()), (rank, way, counts)
            sizes = {seq: c[-1] for seq, c in counts.items()}
            assert max(sizes.values()) == 16 << 20
            for seq, c in counts.items():  # pieces of CHUNK_BYTES, the last the rest
                assert [b - a for a, b in zip([0] + c, c)][:-1] == [CHUNK_BYTES] * (len(c) - 1), (
                    rank,
                    way,
                    seq,
                    c,
                )
    for rank in range(2):  # a piece went on before its bucket was whole
        log = logs[rank]
        whole = {seq: i for i, (w, seq, nbytes) in enumerate(log) if w == "in" and nbytes == 16 << 20}
        assert whole, log
        for seq, at in whole.items():
            assert any(w == "out" and s == seq and nbytes < 16 << 20 for w, s, nbytes in log[:at]), (
                rank,
                seq,
                log,
            )
        held = {seq: i for i, (w, seq, _) in enumerate(log) if w == "held"}
        released = {seq: i for i, (w, seq, _) in enumerate(log) if w == "released"}
        for seq in sorted(held)[:-1]:  # the next bucket went on while the consumer held this one
            during = log[held[seq] : released[seq]]
            assert any(w == "out" and s == seq + 1 for w, s, _ in during), (rank, seq, during)


# ---------------------------------------------------------------------------- failures
@workers.needs_mooncake
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_receiver_killed_in_the_middle_of_the_chain_is_named_and_survivors_sync_next():
    """The middle receiver of the chain SIGKILLed in version 2 (version 1 done, so no
    start-up is timed): the sender names it and both neighbours fail far below the 60 s
    deadline, keeping version 1; version 3 to the two survivors is exact."""
    q = CTX.Queue()
    overrides = config(timeout=60)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 3) as sender:
        first = start(workers.run_resilient_receiver, sender.address, 0, overrides, [1, 2, 3], q)
        victim = start(workers.run_resilient_receiver, sender.address, 1, overrides, [1, 2], q, (2, 3))
        last = start(workers.run_resilient_receiver, sender.address, 2, overrides, [1, 2, 3], q)
        try:
            sender.send(workers.big_weights(1), version=1)
            assert sorted(r[1] for r in collect(q, 3, timeout=60)) == [1, 1, 1]
            t0 = time.monotonic()
            with pytest.raises(SyncError, match=r"receiver rank 1 \(pid \d+.*\) disconnected") as failure:
                sender.send(workers.big_weights(2), version=2)
            assert time.monotonic() - t0 < 10
            assert failure.value.ranks == [1]
            victim.join(timeout=10)
            assert victim.exitcode == -signal.SIGKILL
            # Both neighbours fail at once, not at their deadline, keeping version 1.
            for _ in range(2):
                rank, status, message, held, attempted, torn = q.get(timeout=30)
                assert (status, held, attempted) == ("error", 1, 2), message
                assert "version 2" in message
            assert time.monotonic() - t0 < 10
            sender.remove_receiver(1)
            sender.send(workers.big_weights(3), version=3)
            for rank, version, got, held in collect(q, 2, timeout=60):
                assert (version, held) == (3, 3) and got == digests(workers.big_weights(3))
        finally:
            stop([first, victim, last])


@workers.needs_mooncake
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_strangers_on_the_signal_port_are_rejected_and_the_sync_completes(monkeypatch, caplog):
    from weightsync.engines.mooncake import MooncakeEngine
    from weightsync.engines.ring import pack_message

    strangers: list[socket.socket] = []
    prepare = MooncakeEngine.prepare

    def prepare_with_strangers(self, join):
        info = prepare(self, join)
        if not strangers:  # before any receiver: one with a wrong token, one that says nothing
            port = info["signal_port"]
            wrong = socket.create_connection(("127.0.0.1", port))
            wrong.sendall(
                pack_message(
                    {
                        "token": "0" * 32,
                        "generation": info["generation"],
                        "rank": 1,
                        "label": 0,
                        "rpc_port": 1,
                        "ring": 1,
                        "signal_port": 1,
                    }
                )
            )
            strangers.extend([wrong, socket.create_connection(("127.0.0.1", port))])
        return info

    monkeypatch.setattr(MooncakeEngine, "prepare", prepare_with_strangers)
    caplog.set_level(logging.WARNING, logger="weightsync.engines.ring")
    q = CTX.Queue()
    overrides = config(timeout=20)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_receiver, sender.address, r, overrides, [1, 2], q) for r in range(2)]
        try:
            for v in (1, 2):
                sender.send(workers.make_weights(v), version=v)
                for rank, version, got, held in collect(q, 2, timeout=60):
                    assert (version, held) == (v, v) and got == workers.expected_digests(v)
            assert any(
                "rejected a connection from 127.0.0.1 joining mooncake receiver(s): wrong session token"
                in r.getMessage()
                for r in caplog.records
            )
            for s in strangers:  # both were hung up on
                s.settimeout(5)
                assert s.recv(1) == b""
        finally:
            for s in strangers:
                s.close()
            stop(procs)


def test_missing_wheel_is_reported_by_the_registry(monkeypatch):
    from weightsync.config import backends

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "weightsync.engines.mooncake", raising=False)
    monkeypatch.setitem(backends._registry, "mooncake", "weightsync.engines.mooncake:MooncakeEngine")
    monkeypatch.setattr(backends, "_failed", {})
    with pytest.raises(EngineUnavailable, match="backend 'mooncake' cannot be loaded: .*mooncake"):
        get_engine("mooncake")


@workers.needs_mooncake
@pytest.mark.parametrize("slot_bytes", [(1 << 20) + 1, 1 << 50, 0])
def test_a_receiver_refuses_slots_its_buckets_do_not_need_before_allocating_them(slot_bytes):
    """The slot size comes from the sender's handshake, and a receiver allocates (and
    registers with Mooncake) two slots of it: one larger than a bucket, or empty, is
    refused before any Transfer Engine starts or any ring is allocated."""
    from weightsync.engines.base import Join
    from weightsync.engines.mooncake import MooncakeEngine
    from weightsync.engines.ring import PeerError

    engine = MooncakeEngine(EngineConfig.from_overrides(config()), torch.device("cpu"))
    join = Join(
        version=1,
        rank=1,
        world_size=2,
        senders=1,
        capacity=1 << 20,
        name="receiver rank 0",
        receiver_rank=0,
        local_host="127.0.0.1",
        sender_host="127.0.0.1",
    )
    info = {"slot_bytes": slot_bytes, "token": "0" * 32, "generation": 1, "signal_port": 1}
    try:
        with pytest.raises(
            PeerError, match=f"mooncake: the sender asks for slots of {slot_bytes} bytes; buckets are 1048576"
        ):
            engine.connect(join, info)
        assert engine._local is None  # no Transfer Engine, no ring
    finally:
        engine.close()
