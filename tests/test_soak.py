"""Soak: 50 consecutive syncs with changing weights to 3 receivers, all bit-exact, with no
growth in open descriptors, threads, shared-memory descriptors or memory beyond a bound."""

import pytest
import workers
from procs import CTX, start

from weightsync import EngineConfig, Sender

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SYNCS = 50
# Bounds on growth between the first sync and the last (after warm-up): descriptors and
# threads must not grow at all beyond noise; memory may wobble with the allocator, so its
# bound is a slope: the median of the pairwise slopes of resident memory over the syncs
# after WARM_UP (robust to one allocator step), far below a 1 MiB bucket leaked per sync.
FD_SLACK, THREAD_SLACK, RSS_SLACK_MB = 2, 1, 32
WARM_UP, RSS_SLOPE_MB = 10, 0.1


@pytest.mark.parametrize(
    "backend,verify",
    [("nccl", "xxh3"), ("shm", "off"), pytest.param("mooncake", "off", marks=workers.needs_mooncake)],
)
def test_fifty_syncs_to_three_receivers_stay_exact_and_flat(backend, verify):
    overrides = [
        f"backend={backend}",
        "update_weights_bucket_megabytes=1",
        "timeout_s=60",
        f"verify={verify}",
    ]
    versions = list(range(1, SYNCS + 1))
    q = CTX.Queue()
    trainer = workers.Small(seed=3)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 3) as sender:
        procs = [
            start(workers.run_soak_receiver, sender.address, r, overrides, versions, q) for r in range(3)
        ]
        try:
            usage = {}
            for v in versions:
                workers.bump_small(trainer, v)
                sender.send(trainer, version=v)
                expected = workers.module_digests(trainer)
                for _ in range(3):
                    rank, version, got, res = q.get(timeout=60)
                    assert version == v and got == expected, f"receiver {rank} differs at version {v}"
                    usage.setdefault(rank, []).append(res)
                usage.setdefault("sender", []).append(workers.resources())
            for who, samples in usage.items():
                first, last = samples[0], samples[-1]
                assert workers.rss_slope(samples[WARM_UP:]) <= RSS_SLOPE_MB, (
                    who,
                    workers.rss_slope(samples[WARM_UP:]),
                    [r["rss_mb"] for r in samples],
                )
                assert last["fds"] - first["fds"] <= FD_SLACK, (who, first, last)
                assert last["threads"] - first["threads"] <= THREAD_SLACK, (who, first, last)
                assert last["rss_mb"] - first["rss_mb"] <= RSS_SLACK_MB, (who, first, last)
                # shm's memory is memfds: one ring kept across versions, never one more per sync
                assert last["shm_fds"] == first["shm_fds"], (who, first, last)
            if backend == "shm":  # the count does see that memory
                assert usage["sender"][0]["shm_fds"] >= 1, usage["sender"]
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
