"""``backend=ipc``: receivers read the trainer's own shared tensors (docs/ipc.md).

Real processes on this host: the trainer is the test process, receivers are children. What
each receiver has mapped is read from its ``/proc/<pid>/maps`` (a region is a memfd named
``weightsync-ipc``), so "the old mapping dropped" is the kernel's word, not ours."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import workers
from procs import CTX, collect, start, stop
from test_hardening import NOBODY, as_another_user

from weightsync import EngineConfig, Sender, SyncError, SyncStats, TensorSpec, make_plan, share_tensors
from weightsync.engines import ring
from weightsync.engines.base import Join
from weightsync.engines.ipc import IpcEngine
from weightsync.engines.shared_tensors import shared_region
from weightsync.plan import direct_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BUCKET = 1 << 20


def overrides(timeout=30, *extra):
    return ["backend=ipc", "update_weights_bucket_megabytes=1", f"timeout_s={timeout}", *extra]


def values(version: int) -> dict[str, torch.Tensor]:
    """Every version's bytes: two large tensors receivers read from the trainer, one larger
    than a bucket; packed small ones; two large ones that cannot be shared (a tensor outside
    shared memory, a transposed view that must be made contiguous for the wire)."""
    g = torch.Generator().manual_seed(version)
    return {
        "lm_head.weight": torch.randn(600, 512, generator=g),  # 1.2 MB: a bucket of its own
        "embed.weight": torch.randn(700, 512, generator=g),  # 1.4 MB > a 1 MiB bucket
        "unshared.weight": torch.randn(600, 512, generator=g),
        "proj.weight": torch.randn(512, 600, generator=g),  # sent transposed
        "norm.weight": torch.randn(512, generator=g).to(torch.bfloat16),
        "step": torch.tensor(version),
    }


class Trainer:
    """The trainer's tensors: shared once, rewritten in place every version (as an
    optimizer step does), the transposed one a view of a shared storage."""

    def __init__(self) -> None:
        v = values(0)
        self.shared = share_tensors({n: t for n, t in v.items() if n != "unshared.weight"})
        self.unshared = v["unshared.weight"]

    def step(self, version: int) -> None:
        for name, t in values(version).items():
            (self.unshared if name == "unshared.weight" else self.shared[name]).copy_(t)

    def source(self) -> dict[str, torch.Tensor]:
        s = self.shared
        return {
            "lm_head.weight": s["lm_head.weight"],
            "embed.weight": s["embed.weight"],
            "unshared.weight": self.unshared,
            "proj.weight": s["proj.weight"].t(),
            "norm.weight": s["norm.weight"],
            "step": s["step"],
        }


def expected(trainer: Trainer) -> dict[str, str]:
    return {n: workers.digest(t.contiguous()) for n, t in trainer.source().items()}


def mapped_regions(pid: int) -> set[tuple[int, int]]:
    """The trainer's shared storages (not the staging ring) that ``pid`` maps, as (inode of
    their memfd, offset in it)."""
    with open(f"/proc/{pid}/maps") as f:
        fields = [line.split() for line in f if "/memfd:weightsync-ipc " in line]
    return {(int(x[4]), int(x[2], 16)) for x in fields}


def region(t: torch.Tensor) -> tuple[int, int]:
    found = shared_region(t)
    assert found is not None
    return os.fstat(found[0].arena.fd).st_ino, found[0].offset


@pytest.mark.timeout(90)
def test_three_receivers_read_the_trainers_memory_bit_exact_and_follow_a_reallocated_parameter():
    """3 receivers, versions bit-exact. The two shareable large tensors (one larger than
    a bucket) are read from the trainer's memory, everything else is staged in the same sync
    (counted apart). Between versions 2 and 3 the trainer re-allocates ``lm_head.weight``:
    receivers map the new storage and drop the old one's mapping (their /proc/pid/maps)."""
    trainer = Trainer()
    q = CTX.Queue()
    config = overrides()
    with Sender(EngineConfig.from_overrides(config), "127.0.0.1:0", 3) as sender:
        # a fourth version keeps them alive while their maps are read after the third
        procs = [start(workers.run_receiver, sender.address, r, config, [1, 2, 3, 4], q) for r in range(3)]
        try:
            for v in (1, 2, 3, 4):
                if v == 3:  # a new storage for one parameter, shared again
                    old = region(trainer.shared["lm_head.weight"])
                    trainer.shared["lm_head.weight"] = torch.empty(600, 512)
                    share_tensors(trainer.shared)
                    assert region(trainer.shared["lm_head.weight"]) != old
                trainer.step(v)
                stats = sender.send(trainer.source(), version=v)
                for rank, version, got, held in collect(q, 3):
                    assert (version, held) == (v, v) and got == expected(trainer), rank
                # read in place: the two shareable large tensors, whole
                shared = trainer.shared["lm_head.weight"].nbytes + trainer.shared["embed.weight"].nbytes
                assert stats.shared_bytes == shared, stats
                assert stats.staged_bytes == stats.wire_bytes - shared >= 2 * 600 * 512 * 4, stats
                regions = {region(trainer.shared[n]) for n in ("lm_head.weight", "embed.weight")}
                for p in procs if v < 4 else ():  # each maps exactly the regions this version used
                    assert mapped_regions(p.pid) == regions, (v, p.pid)
        finally:
            stop(procs)
    assert max(t.nbytes for t in trainer.source().values()) > BUCKET >= direct_bytes(BUCKET)


@pytest.mark.timeout(90)
def test_an_engines_loader_reads_the_trainers_tensors_in_place_and_copies_only_the_staged():
    """A loader fed through a landing pool (``receive_into``, as a vLLM worker is) holding
    every tensor until the version ends: the tensors the trainer shares, the one larger than
    a bucket too (its pieces lie one after another in the trainer's memory), reach it as
    the trainer's own memory, no landing copy; the staged ones are copied into the pool. 3
    versions bit-exact, 2 loaders."""
    trainer = Trainer()
    q = CTX.Queue()
    config = overrides()
    with Sender(EngineConfig.from_overrides(config), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_pooled_loader, sender.address, r, config, [1, 2, 3], q) for r in range(2)]
        try:
            for v in (1, 2, 3):
                trainer.step(v)
                stats = sender.send(trainer.source(), version=v)
                for rank, version, got, in_place, lent, copied in collect(q, 2):
                    assert version == v and got == expected(trainer), (rank, version, got)
                    assert in_place == ["embed.weight", "lm_head.weight"], rank
                    assert lent == stats.shared_bytes and copied == stats.staged_bytes, (lent, copied, stats)
        finally:
            stop(procs)
    assert trainer.shared["embed.weight"].nbytes > BUCKET


@pytest.mark.timeout(90)
def test_a_receiver_killed_while_reading_is_named_the_trainers_tensors_stay_and_survivors_sync():
    """A receiver SIGKILLs itself after its first tensor of version 2 (its mappings of the
    trainer's memory open): ``send`` fails within the deadline naming it, the trainer's
    tensors are those it sent, and version 3 reaches the survivors bit-exact."""
    trainer = Trainer()
    q = CTX.Queue()
    config = overrides(60)
    with Sender(EngineConfig.from_overrides(config), "127.0.0.1:0", 3) as sender:
        victim = start(workers.run_resilient_receiver, sender.address, 0, config, [1, 2], q, (2, 1))
        survivors = [
            start(workers.run_resilient_receiver, sender.address, r, config, [1, 2, 3], q) for r in (1, 2)
        ]
        try:
            trainer.step(1)
            sender.send(trainer.source(), version=1)
            assert sorted(r[1] for r in collect(q, 3)) == [1, 1, 1]
            trainer.step(2)
            before = expected(trainer)
            t0 = time.monotonic()
            with pytest.raises(SyncError, match=r"receiver rank 0 .*(disconnected|closed)") as failure:
                sender.send(trainer.source(), version=2)
            assert time.monotonic() - t0 < 10 and failure.value.ranks == [0]
            victim.join(timeout=10)
            assert victim.exitcode == -signal.SIGKILL
            assert expected(trainer) == before  # nothing wrote into the trainer's memory
            for _ in survivors:
                rank, status, message, held, attempted, torn = q.get(timeout=30)
                assert (status, held, attempted) == ("error", 1, 2), message
            sender.remove_receiver(0)
            trainer.step(3)
            sender.send(trainer.source(), version=3)
            for rank, version, got, held in collect(q, 2):
                assert (version, held) == (3, 3) and got == expected(trainer), rank
        finally:
            stop([victim, *survivors])


# A process that reaches the trainer's socket with the first message it is given and reports
# whether it was answered and how many descriptors it received before the trainer hung up.
STRANGER = r"""
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect("\0" + sys.argv[1])
sock.sendall(bytes.fromhex(sys.argv[2]))
sock.settimeout(30)
fds, answered = 0, False
try:
    while True:
        data, got, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        fds += len(got)
        if not data:
            break
        answered = True
except OSError as e:
    print("error", e, flush=True)
print("answered" if answered else "hung up", fds, flush=True)
"""


@pytest.mark.timeout(90)
def test_strangers_cannot_open_the_trainers_memory(caplog):
    """While the trainer waits for its receiver, a process of this user with a wrong token
    and a process of another user (``nobody``) with the right one both connect: both are
    hung up on without a descriptor; the real receiver joins and reads the trainer's tensor
    from its memory, and ``send_buckets`` returns only once that (slow) reader is done."""
    caplog.set_level("WARNING", logger="weightsync.engines.ring")
    config = EngineConfig.from_overrides(overrides())
    weights = share_tensors({"w": torch.arange(1 << 18, dtype=torch.float32)})
    payload = weights["w"].view(torch.uint8)
    plan = make_plan([TensorSpec("w", (payload.numel(),), "uint8")], BUCKET)
    sender, receiver = IpcEngine(config, torch.device("cpu")), IpcEngine(config, torch.device("cpu"))
    join = Join(version=1, rank=0, world_size=2, senders=1, capacity=BUCKET, name="trainer rank 0")
    info = sender.prepare(join)
    errors: list[BaseException] = []
    accepting = threading.Thread(target=_run, args=(errors, sender.connect, join, info), daemon=True)
    accepting.start()
    first = {"token": info["token"], "generation": info["generation"], "rank": 1, "label": 0}
    wrong = ring.pack_message({**first, "token": "f" * 32}).hex()
    same_user = subprocess.Popen(
        [sys.executable, "-c", STRANGER, info["socket"], wrong], stdout=subprocess.PIPE, text=True
    )
    other_user = as_another_user(STRANGER, info["socket"], ring.pack_message(first).hex())
    try:
        for stranger in (same_user, other_user):
            out, err = stranger.communicate(timeout=60)
            assert out.split() == ["hung", "up", "0"], (out, err)
        messages = [rec.getMessage() for rec in caplog.records]
        assert any("wrong session token" in m for m in messages), messages
        assert any(f"process of uid {NOBODY} is not this user" in m for m in messages), messages
        rjoin = Join(
            version=1,
            rank=1,
            world_size=2,
            senders=1,
            capacity=BUCKET,
            name="receiver rank 0",
            receiver_rank=0,
        )
        receiver.connect(rjoin, info)
        accepting.join(30)
        assert not errors, errors
        got: list[torch.Tensor] = []
        left = list(plan.buckets)
        buckets = receiver.recv_buckets(lambda: left.pop(0) if left else None)
        read_at: list[float] = []

        def read() -> None:  # a slow reader: the trainer must wait for it
            for _, b in buckets:
                time.sleep(0.5)
                got.append(b.clone())
                read_at.append(time.monotonic())

        reading = threading.Thread(target=_run, args=(errors, read))
        reading.start()
        sent = iter([(plan.buckets[0], payload)])
        assert sender.send_buckets(lambda buffer: next(sent, None)) == payload.numel()
        returned_at = time.monotonic()
        reading.join(30)
        assert not errors and torch.equal(got[0], payload)
        assert returned_at >= read_at[-1]  # send_buckets returned only once the reader was done
        stats = SyncStats(1)
        sender.account(stats)
        assert (stats.shared_bytes, stats.staged_bytes) == (payload.numel(), 0)
    finally:
        sender.close()
        receiver.close()
        for stranger in (same_user, other_user):
            if stranger.poll() is None:
                stranger.kill()
                stranger.wait(10)


def _run(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # reported by the test
        errors.append(e)
