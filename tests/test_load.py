"""Load: one sender, sixteen receiver processes over loopback, twenty versions, each bit-exact,
with no growth in the sender's descriptors, threads or memory after the first versions. And
one address, one sender: a second sender on a bound address fails clearly (receivers never
see a mix of two), while a new sender on the address of one that closed works."""

from __future__ import annotations

import re
import threading

import pytest

from weightsync import EngineConfig, Receiver, Sender, SyncError

import workers
from procs import CTX, collect, start, stop

RECEIVERS = 16
VERSIONS = list(range(1, 21))
WARMUP = 3  # versions before the sender's resources are taken as the baseline
# Growth allowed between the end of the warm-up and the last version: descriptors and
# threads must not grow beyond noise; memory may wobble with the allocator.
FD_SLACK, THREAD_SLACK, RSS_SLACK_MB = 2, 1, 32


@pytest.mark.slow
@pytest.mark.timeout(1200)  # sixteen processes start on two shared cores: generous
@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_one_sender_to_sixteen_receivers_twenty_versions_bit_exact_and_flat(backend):
    # timeout_s covers the start of sixteen processes (each imports torch) on a busy machine.
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=300"]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", RECEIVERS) as sender:
        procs = [start(workers.run_receiver, sender.address, r, overrides, VERSIONS, q) for r in range(RECEIVERS)]
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
                if v in (WARMUP, VERSIONS[-1]):
                    usage[v] = workers.resources()
            first, last = usage[WARMUP], usage[VERSIONS[-1]]
            assert last["fds"] - first["fds"] <= FD_SLACK, (first, last)
            assert last["threads"] - first["threads"] <= THREAD_SLACK, (first, last)
            assert last["rss_mb"] - first["rss_mb"] <= RSS_SLACK_MB, (first, last)
        finally:
            stop(procs)


# ---------------------------------------------------------------------------- one address, one sender
CONFIG = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=60"]


def receive_in_thread(address: str, version: int, box: dict) -> threading.Thread:
    """A receiver (rank 0) in this process that takes one version and records its digests."""

    def run():
        try:
            with Receiver(EngineConfig.from_overrides(CONFIG), address, 0) as receiver:
                box[version] = {n: workers.digest(t) for n, t in receiver.receive(version=version)}
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def sync_one(sender: Sender, version: int) -> None:
    box: dict = {}
    thread = receive_in_thread(sender.address, version, box)
    sender.send(workers.make_weights(version), version=version)
    thread.join(timeout=60)
    assert "error" not in box, box.get("error")
    assert box[version] == workers.expected_digests(version)


def test_a_second_sender_on_a_bound_address_fails_clearly_and_never_shares_it():
    config = EngineConfig.from_overrides(CONFIG)
    with Sender(config, "127.0.0.1:0", 1) as first:
        for _ in range(2):  # the same answer each time, nothing left half-open
            with pytest.raises(SyncError, match=rf"^cannot listen on {re.escape(first.address)}: .*Address already in use"):
                Sender(config, first.address, 1)
        # The first sender alone holds the address: a receiver that connects reaches it.
        sync_one(first, 1)


def test_a_new_sender_listens_on_the_address_of_one_that_closed():
    config = EngineConfig.from_overrides(CONFIG)
    first = Sender(config, "127.0.0.1:0", 1)
    address = first.address
    try:
        sync_one(first, 1)  # connections were open on this port: closing leaves TIME_WAIT behind
    finally:
        first.close()
    with Sender(config, address, 1) as second:
        assert second.address == address
        sync_one(second, 2)
