"""Load: one sender, sixteen receiver processes over loopback, twenty versions, each bit-exact,
with no growth in the sender's descriptors, threads or memory after the first versions. And
one address, one sender: a second sender on a bound address fails clearly (receivers never
see a mix of two), while a new sender on the address of one that closed works."""

from __future__ import annotations

import re
import threading
import time

import pytest
import workers
from procs import CTX, collect, start, stop

from weightsync import EngineConfig, PeerLost, Receiver, Sender, SyncError

RECEIVERS = 16
VERSIONS = list(range(1, 21))
WARMUP = 3  # versions before the sender's resources are taken as the baseline
# Growth allowed between the end of the warm-up and the last version: descriptors and
# threads must not grow beyond noise; memory may wobble with the allocator, so it is
# bounded by its slope (workers.rss_slope) too, far below a 1 MiB bucket kept per sync.
FD_SLACK, THREAD_SLACK, RSS_SLACK_MB, RSS_SLOPE_MB = 2, 1, 32, 0.1


@pytest.mark.slow
@pytest.mark.timeout(1200)  # sixteen processes start on two shared cores: generous
@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_one_sender_to_sixteen_receivers_twenty_versions_bit_exact_and_flat(backend):
    # timeout_s covers the start of sixteen processes (each imports torch) on a busy machine.
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=300"]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", RECEIVERS) as sender:
        procs = [
            start(workers.run_receiver, sender.address, r, overrides, VERSIONS, q) for r in range(RECEIVERS)
        ]
        try:
            usage = {}
            for v in VERSIONS:
                stats = sender.send(workers.make_weights(v), version=v)
                assert (stats.receivers, stats.tensors) == (RECEIVERS, 9)
                expected = workers.expected_digests(v)
                reports = collect(q, RECEIVERS, timeout=300 if v == 1 else 120)
                assert sorted(r[0] for r in reports) == list(range(RECEIVERS))
                for rank, version, got, held in reports:
                    assert (version, held) == (v, v), got
                    assert got == expected, f"receiver {rank} differs at version {v}"
                # Measured while every receiver is still connected, waiting for the next
                # version: after the last one they leave, and the sockets they close would
                # hide descriptors leaked meanwhile.
                if WARMUP <= v < VERSIONS[-1]:
                    usage[v] = workers.resources()
            first = usage[WARMUP]
            for v, now in usage.items():
                assert now["fds"] - first["fds"] <= FD_SLACK, (v, first, now)
                assert now["threads"] - first["threads"] <= THREAD_SLACK, (v, first, now)
                assert now["rss_mb"] - first["rss_mb"] <= RSS_SLACK_MB, (v, first, now)
            slope = workers.rss_slope(list(usage.values()))
            assert slope <= RSS_SLOPE_MB, (slope, [r["rss_mb"] for r in usage.values()])
        finally:
            stop(procs)


# ---------------------------------------------------------------------------- one address, one sender
CONFIG = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=60"]


def receive_in_thread(
    address: str, version: int, box: dict, hold: threading.Event | None = None
) -> threading.Thread:
    """A receiver (rank 0) in this process that takes one version and records its digests;
    with ``hold``, it keeps its connection open until the event is set."""

    def run():
        try:
            with Receiver(EngineConfig.from_overrides(CONFIG), address, 0) as receiver:
                box[version] = {n: workers.digest(t) for n, t in receiver.receive(version=version)}
                if hold is not None:
                    hold.wait(60)
                    with pytest.raises(PeerLost, match="closed the session"):  # read the goodbye, then close
                        list(receiver.receive())
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def sync_one(sender: Sender, version: int, hold: threading.Event | None = None) -> threading.Thread:
    box: dict = {}
    thread = receive_in_thread(sender.address, version, box, hold)
    sender.send(workers.make_weights(version), version=version)
    for _ in range(600):
        if version in box or "error" in box:
            break
        time.sleep(0.1)
    assert "error" not in box, box.get("error")
    assert box[version] == workers.expected_digests(version)
    return thread


def time_wait_on(port: int) -> int:
    """Connections on local ``port`` in TIME_WAIT (the side that closed first keeps them)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if int(r[1].split(":")[1], 16) == port and r[3] == "06")


def test_a_second_sender_on_a_bound_address_fails_clearly_and_never_shares_it():
    config = EngineConfig.from_overrides(CONFIG)
    with Sender(config, "127.0.0.1:0", 1) as first:
        for _ in range(2):  # the same answer each time, nothing left half-open
            with pytest.raises(
                SyncError, match=rf"^cannot listen on {re.escape(first.address)}: .*Address already in use"
            ):
                Sender(config, first.address, 1)
        # The first sender alone holds the address: a receiver that connects reaches it.
        sync_one(first, 1).join(timeout=60)


def test_a_new_sender_listens_on_the_address_of_one_that_closed():
    config = EngineConfig.from_overrides(CONFIG)
    first = Sender(config, "127.0.0.1:0", 1)
    address, port = first.address, int(first.address.rsplit(":", 1)[1])
    hold = threading.Event()
    try:
        receiver = sync_one(first, 1, hold)  # the receiver stays connected...
    finally:
        first.close()  # ...so the sender closes first and its port keeps a TIME_WAIT connection
    hold.set()
    receiver.join(timeout=60)
    assert time_wait_on(port) >= 1
    with Sender(config, address, 1) as second:
        assert second.address == address
        sync_one(second, 2).join(timeout=60)
