"""Soak: 50 consecutive syncs with changing weights to 3 receivers, all bit-exact, with no
growth in open descriptors, threads, shared-memory descriptors or memory beyond a bound."""

import pytest
import workers
from procs import CTX, start

from weightsync import EngineConfig, Sender

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SYNCS = 50
# Bounds on growth between the first sync and the last: each figure's slope over the syncs
# after WARM_UP (the median of the pairwise slopes: robust to one step, such as the
# allocator's, or a transport's thread pool growing once under load: CI saw mooncake's
# receiver at +2 threads, +1 descriptor, once in 50 syncs), far below one thread, one
# descriptor or a 1 MiB bucket kept per sync (or one every few syncs); and the total growth
# within a small slack.
FD_SLACK, THREAD_SLACK, RSS_SLACK_MB = 3, 3, 32
WARM_UP, RSS_SLOPE_MB, COUNT_SLOPE = 10, 0.1, 0.02


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
                for key, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK)):
                    slope = workers.rss_slope(samples[WARM_UP:], key)
                    assert slope <= COUNT_SLOPE, (who, key, slope, [r[key] for r in samples])
                    assert last[key] - first[key] <= slack, (who, first, last)
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
