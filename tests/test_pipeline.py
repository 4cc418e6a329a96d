"""The pipelined receive of engine replicas (``weightsync.receiver.prefetch`` through
``ReplicaReceiver``), without vLLM: a replica process loads through a plain ``reload``
callable, over a real transport (Gloo). Transfer overlaps loading within the in-flight
bound, landing memory is reused across versions without overwriting tensors still held,
a transfer that fails midway ends the loader's stream cleanly (the replica reports a mix),
and a loader error fails the sync on the sender within the deadline."""

import threading
import time

import pipeline_workers as pw
import pytest
import torch
import workers
from procs import CTX, start, stop

from weightsync import EngineConfig, Sender, SyncError
from weightsync.errors import SyncTimeout
from weightsync.plan import TensorSpec, make_plan
from weightsync.receiver.landing import LANDED_AHEAD, LOOKAHEAD, LandingPool, following_landings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Well above DETECT_S: a failure detected only by waiting out the deadline fails the
# bounds below, which assert detection (measured on 2 loaded cores: 2.1 s for a transfer
# failing midway, most of it the sender's 2 s grace for a peer's EOF in Sender._explain;
# 0.1 s for a loader error).
TIMEOUT_S = 60
DETECT_S = 10
IN_FLIGHT = 2
OVERRIDES = [
    "backend=nccl",
    "update_weights_bucket_megabytes=1",
    f"timeout_s={TIMEOUT_S}",
    f"receive_buckets_in_flight={IN_FLIGHT}",
]
MiB = 1 << 20
# An arena that holds the largest tensor (split over two buckets), the bucket unpacked and
# the one landed ahead: no version needs more unless the loader keeps tensors.
WIDE = 4
WIDE_OVERRIDES = [*OVERRIDES[:-1], f"receive_buckets_in_flight={WIDE}"]


class Replica:
    """A replica process and its command queue (one call at a time)."""

    def __init__(self) -> None:
        self.commands, self.results = CTX.Queue(), CTX.Queue()
        self.proc = start(pw.replica, self.commands, self.results)

    def call(self, method, *args, timeout=90, **opts):
        self.commands.put((method, args, opts))
        return self.results.get(timeout=timeout)

    def close(self) -> None:
        self.commands.put(None)
        stop([self.proc])


def _send_while(replica, sender, source, version, **opts):
    """Start the replica's receive, send, and return (send outcome, replica reply)."""
    replica.commands.put(("weightsync_receive", (version,), opts))
    try:
        outcome = sender.send(source, version=version)
    except SyncError as e:
        outcome = e
    return outcome, replica.results.get(timeout=90)


@pytest.fixture
def session():
    config = EngineConfig.from_overrides(OVERRIDES)
    replica = Replica()
    try:
        with Sender(config, "127.0.0.1:0", num_receivers=1) as sender:
            status, _, _ = replica.call("weightsync_init", sender.address, 0, OVERRIDES)
            assert status["version"] is None
            yield replica, sender
    finally:
        replica.close()


def test_versions_are_exact_landing_memory_is_reused_and_transfer_overlaps_loading(session):
    replica, sender = session
    allocations = []
    for v in (1, 2, 3):
        outcome, (status, loaded, extra) = _send_while(replica, sender, pw.weights(v), v)
        assert not isinstance(outcome, Exception), outcome
        assert status["ok"] and status["version"] == v and loaded == pw.expected(v), status
        allocations.append((extra["allocations"], status["landing_allocated_bytes"]))
    # the first version allocates the landing memory, the next ones reuse it: at most a
    # bucket or two more where the loader and the transfer happened to overlap differently
    assert allocations[1][1] + allocations[2][1] <= IN_FLIGHT * MiB, allocations
    # landing memory: the bucket landed ahead (not the transport's window: nccl posts 8
    # receives ahead), the in-flight bound, what the loader holds and the split tensor;
    # never a second copy of the model
    total = sum(t.nbytes for t in pw.weights(1).values())
    assert status["landing_bytes"] <= (LANDED_AHEAD + IN_FLIGHT + 4) * MiB < total, status

    # A loader that stalls on its first tensor: meanwhile the transfer goes on, up to the bound.
    outcome, (status, loaded, extra) = _send_while(replica, sender, pw.weights(4), 4, sleep_first=2.0)
    assert status["ok"] and loaded == pw.expected(4), status
    largest = max(t.nbytes for t in pw.weights(4).values())
    assert IN_FLIGHT * MiB - largest <= status["queued_peak_bytes"] <= IN_FLIGHT * MiB + largest, status

    # Tensors the loader keeps are never overwritten by a later version's landing.
    outcome, (status, _, _) = _send_while(replica, sender, pw.weights(5), 5, keep=True)
    assert status["ok"], status
    for v in (6, 7):
        outcome, (status, loaded, _) = _send_while(replica, sender, pw.weights(v), v)
        assert status["ok"] and loaded == pw.expected(v), status
    kept, _, _ = replica.call("kept_digests")
    assert kept == pw.expected(5)


def test_warm_up_with_the_model_reserves_the_first_versions_landing_memory():
    """weightsync_init with warm_up while the sender warms up with the model: the worker
    joins, takes the plan and allocates its landing memory then (the arena of the
    in-flight bound); the first version travels without its plan and finds that memory."""
    replica = Replica()
    try:
        with Sender(EngineConfig.from_overrides(OVERRIDES), "127.0.0.1:0", num_receivers=1) as sender:
            replica.commands.put(("weightsync_init", (sender.address, 0, WIDE_OVERRIDES, True), {}))
            sender.warm_up(pw.weights(1))
            status, _, extra = replica.results.get(timeout=90)
            assert "raised" not in extra, status
            assert status["landing_reserved_bytes"] == WIDE * MiB, status
            for v in (1, 2):
                outcome, (status, loaded, _) = _send_while(replica, sender, pw.weights(v), v)
                assert not isinstance(outcome, Exception), outcome
                assert status["ok"] and loaded == pw.expected(v), status
                assert v > 1 or outcome.plan_sent_to == 0  # the warm-up carried it
                assert status["landing_allocated_bytes"] == 0, status  # without it: the arena, at v1
    finally:
        replica.close()


def test_landing_memory_stays_within_the_in_flight_bound_allocated_once():
    """A loader slower than the transfer: the received tensors it has not let go of stay
    within receive_buckets_in_flight buckets (the transfer waits for it), in one arena
    allocated at the first version and reused by the next; a loader that keeps a whole
    version passes the bound rather than hanging, and keeps its tensors intact."""
    replica = Replica()
    try:
        with Sender(EngineConfig.from_overrides(OVERRIDES), "127.0.0.1:0", num_receivers=1) as sender:
            replica.call("weightsync_init", sender.address, 0, WIDE_OVERRIDES)
            for v in (1, 2, 3):
                outcome, (status, loaded, extra) = _send_while(
                    replica, sender, pw.weights(v), v, sleep_each=0.01
                )
                assert not isinstance(outcome, Exception) and status["ok"] and loaded == pw.expected(v), (
                    status
                )
                assert status["landing_peak_bytes"] <= WIDE * MiB, status
                assert status["landing_wait_s"] > 0, status  # the transfer waited for the loader
                assert status["landing_bytes"] == WIDE * MiB and extra["allocations"] == 1, (status, extra)
            total = sum(t.nbytes for t in pw.weights(4).values())
            outcome, (status, loaded, _) = _send_while(replica, sender, pw.weights(4), 4, keep=True)
            assert status["ok"] and loaded == pw.expected(4), status
            assert status["landing_peak_bytes"] >= total > WIDE * MiB, status
            outcome, (status, loaded, _) = _send_while(replica, sender, pw.weights(5), 5)
            assert status["ok"] and loaded == pw.expected(5), status
            kept, _, _ = replica.call("kept_digests")
            assert kept == pw.expected(4)
    finally:
        replica.close()


def test_transfer_failing_midway_ends_the_stream_cleanly_and_reports_a_mix(session):
    replica, sender = session
    outcome, (status, _, _) = _send_while(replica, sender, pw.weights(1), 1)
    assert status["ok"]
    t0 = time.monotonic()
    outcome, (status, loaded, extra) = _send_while(
        replica, sender, workers.FailingSource(pw.weights(2), after=12), 2
    )
    assert isinstance(outcome, SyncError)
    assert time.monotonic() - t0 < DETECT_S  # the sender's abort reached the receiver, no deadline did
    assert extra["ended"]  # the loader's stream ended without an exception (the engine finalizes)
    assert not status["ok"] and status["applied"] > 0
    assert (status["version"], status["mixed"], status["failed_version"]) == (None, True, 2), status
    # the next version makes the replica whole again
    outcome, (status, loaded, _) = _send_while(replica, sender, pw.weights(3), 3)
    assert status["ok"] and (status["version"], status["mixed"]) == (3, False) and loaded == pw.expected(3), (
        status
    )


def test_loader_error_mid_stream_fails_the_sync_on_the_sender_within_the_deadline(session):
    replica, sender = session
    outcome, (status, _, _) = _send_while(replica, sender, pw.weights(1), 1)
    assert status["ok"]
    t0 = time.monotonic()
    outcome, (status, _, _) = _send_while(replica, sender, pw.weights(2), 2, fail_after=3)
    assert time.monotonic() - t0 < DETECT_S
    assert isinstance(outcome, SyncError) and "the loader refused" in str(outcome), outcome
    assert not status["ok"] and "the loader refused" in status["error"]
    assert (status["version"], status["mixed"]) == (None, True), status
    # connections stay usable: the next version goes through
    outcome, (status, loaded, _) = _send_while(replica, sender, pw.weights(3), 3)
    assert not isinstance(outcome, Exception) and status["ok"] and loaded == pw.expected(3), status


def test_landing_pool_reuses_only_released_buffers():
    pool = LandingPool()
    a = pool.acquire(1000)
    b = pool.acquire(1000)
    assert a.data_ptr() != b.data_ptr() and pool.allocations == 2
    view = a[10:20].view(torch.int16)  # a view keeps a's buffer busy
    del a
    pool.next_version()
    c = pool.acquire(1000)
    assert c.data_ptr() not in (view.data_ptr() - 10,) and pool.allocations == 3
    del view, b, c
    pool.next_version()
    d = pool.acquire(900)  # a free buffer of up to twice the size serves
    assert pool.allocations == 3 and d.numel() == 900
    pool.next_version()
    pool.trim()  # the buffers neither of the last two versions used go
    assert pool.bytes == 1000
    pool.close()
    assert pool.bytes == 0
    d.fill_(7)  # d stays valid after close: its memory is still its own
    assert int(d.sum()) == 7 * 900


def test_bounded_pool_lands_in_one_arena_and_reuses_ranges_as_they_are_released():
    pool = LandingPool()
    exceed = [False]
    pool.bound(3 * 4096, lambda: exceed[0], wait_s=0.05)
    a, b = pool.acquire(4096), pool.acquire(4096)
    c = pool.acquire(4000)
    b.fill_(2), c.fill_(3)
    assert pool.allocations == 1 and pool.bytes == 3 * 4096  # one arena
    assert pool.acquire(4096, wait=False) is None  # full: the transport's own buffer serves
    with pytest.raises(SyncTimeout):
        pool.acquire(4096)  # nobody lets go within wait_s
    view = b[100:200]  # a view of a range keeps it busy
    del a, b
    d = pool.acquire(4096)  # the released range
    assert pool.allocations == 1 and d.numel() == 4096 and pool.in_use_bytes() == 3 * 4096 - 96
    d.fill_(1)
    assert bool((view == 2).all()) and bool((c == 3).all())  # ranges in use are not handed out again
    exceed[0] = True  # the loader waits with nothing queued: the bound is passed
    e = pool.acquire(4096)
    assert pool.allocations == 2 and pool.peak_bytes > 3 * 4096
    del c, d, e, view
    pool.next_version()
    assert pool.in_use_bytes() == 0 and pool.peak_bytes == 0
    pool.close()
    assert pool.bytes == 0


def test_a_request_told_a_large_one_follows_leaves_it_room_and_only_one_larger_than_the_arena_takes_a_buffer():
    """A layer's last bucket is placed so that the large tensor after it (the lm_head) fits
    in the arena right after it, or, with no room there now, at the arena's end; a request
    as large as the arena lands in it when nothing is held; only a request larger than the
    arena takes a buffer of its own, kept across versions."""
    page = LandingPool.ALIGN
    pool = LandingPool()
    for version in range(3):
        pool.next_version()
        pool.bound(4 * page, lambda: True, wait_s=0.05)
        first = pool.acquire(page)
        held = pool.acquire(page)  # the ring's cursor after 2 of 4 pages
        del first
        last = pool.acquire(page, then=3 * page)  # at the cursor, 3 pages would not fit after it
        del held  # the engine lets go of what came before ...
        large = pool.acquire(3 * page)  # ... and the large tensor lands right after the last bucket
        arena = pool._arena
        assert last.data_ptr() == arena.data_ptr()
        assert large.data_ptr() == last.data_ptr() + page
        del last, large
        held = [pool.acquire(page), pool.acquire(page)]  # pages 0 and 1, the cursor after them
        last = pool.acquire(page, then=3 * page)  # no room after it now: at the arena's end ...
        del held
        large = pool.acquire(3 * page)  # ... so the large one finds the pages let go of before it
        assert (last.data_ptr(), large.data_ptr()) == (arena.data_ptr() + 3 * page, arena.data_ptr())
        del last, large
        mid = pool.acquire(page)
        del mid  # nothing held, the ring's cursor one page in: the whole arena still serves
        assert pool.acquire(4 * page).data_ptr() == arena.data_ptr()
        huge = pool.acquire(5 * page)  # larger than the arena
        assert not arena.data_ptr() <= huge.data_ptr() < arena.data_ptr() + 4 * page
        del huge
        pool.trim()
    assert pool.allocations == 2 and pool.bytes == 9 * page  # the arena and one buffer, once


def test_the_landings_before_a_large_tensor_are_told_its_size():
    """``following_landings``: each of the last LOOKAHEAD landings before the lm_head-like
    tensor carries its size (the whole tensor, though it travels split over buckets)."""
    layer = [TensorSpec(f"l.{i}.w", (1024,), "float32") for i in range(6)]  # 4 KiB each: one bucket each
    big = TensorSpec("lm_head.w", (3000,), "float32")  # 12000 bytes, over three buckets
    plan = make_plan([*layer, big], 4096)
    told = following_landings(plan.tensors, plan.buckets)
    order = [b.index for b in plan.buckets if b.pieces[0].tensor_offset == 0]  # the buckets that take memory
    assert [told[i] for i in order] == [4096, 4096] + [12000] * LOOKAHEAD + [0]


def test_a_request_before_a_large_one_waits_for_room_below_the_arenas_top_while_waiting_can_help():
    """Before a large tensor the last layer's buckets keep clear of the arena's top (the
    large one's room, the engine may still hold them when it arrives): with the loader busy
    such a request waits for room below rather than landing in the top, and the large one
    lands there."""
    page = LandingPool.ALIGN
    pool = LandingPool()
    pool.bound(4 * page, lambda: False, wait_s=5)
    held = pool.acquire(page)  # page 0: the only page below the top 3
    arena = pool._arena
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(page, then=3 * page)))
    waiter.start()
    time.sleep(0.2)
    assert not got and waiter.is_alive()  # pages 1-3 are free, but they are the large one's
    del held
    pool.released()
    waiter.join(5)
    assert got[0].data_ptr() == arena.data_ptr()
    assert pool.acquire(3 * page).data_ptr() == arena.data_ptr() + page  # though got[0] is held


def _sparse_versions(count):
    """Versions that differ from the last in a few elements of each tensor (an RL step)."""
    state = {n: t.clone() for n, t in pw.weights(1).items()}
    out = []
    g = torch.Generator().manual_seed(7)
    for _ in range(count):
        for t in state.values():
            if t.is_floating_point() and t.numel() > 100 and t.element_size() > 1:
                flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
                idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=g)
                flat[idx] = flat[idx] + 1
        out.append({n: t.clone() for n, t in state.items()})
    return out


def test_replica_takes_delta_syncs_through_the_pipeline_bit_exact():
    """delta=on through the vLLM integration's receive path: the replica streams full
    tensors into its loader (keeping a base copy), versions after the first travel as deltas."""
    overrides = OVERRIDES + ["delta=on", "verify=crc32"]
    config = EngineConfig.from_overrides(overrides)
    replica = Replica()
    try:
        with Sender(config, "127.0.0.1:0", num_receivers=1) as sender:
            replica.call("weightsync_init", sender.address, 0, overrides)
            for v, payload in enumerate(_sparse_versions(4), start=1):
                replica.commands.put(("weightsync_receive", (v,), {}))
                stats = sender.send(payload, version=v)
                status, loaded, _ = replica.results.get(timeout=90)
                assert status["ok"] and status["version"] == v, status
                assert loaded == {n: pw.workers.digest(t.contiguous()) for n, t in payload.items()}
                if v > 1:
                    assert stats.delta_base == v - 1 and stats.wire_bytes < 0.2 * stats.bytes, stats
    finally:
        replica.close()
