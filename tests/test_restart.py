"""A trainer that restarts while its replicas keep serving: every ``Sender`` is a session
of its own; a replica told goodbye joins the next sender on the same address at once,
refuses a version older than it holds (``HandshakeError`` on the trainer, naming both), and
takes it with ``force=True``."""

import time

import pytest
import restart_workers
import workers
from procs import CTX, free_port, start, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_replicas_outlive_two_trainer_processes(backend):
    address = f"127.0.0.1:{free_port()}"
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=30"]
    commands, results, trained = CTX.Queue(), CTX.Queue(), CTX.Queue()
    rep = start(restart_workers.replica, address, 0, overrides, commands, results)
    procs = [rep]
    try:
        # the first trainer process sends versions 1 and 2, then exits (saying goodbye)
        procs.append(start(restart_workers.trainer, address, overrides, [(1, False), (2, False)], trained))
        assert trained.get(timeout=120) == ("listening",)
        for v in (1, 2):
            commands.put(v)
            rank, status, got = results.get(timeout=90)
            assert status["ok"] and status["version"] == v, status
            assert got == workers.expected_digests(v)
            assert trained.get(timeout=30) == ("ok", v)
        procs[-1].join(timeout=30)
        assert procs[-1].exitcode == 0

        # a second trainer process on the same address starts over at version 1
        procs.append(
            start(restart_workers.trainer, address, overrides, [(1, False), (1, True), (2, False)], trained)
        )
        assert trained.get(timeout=120) == ("listening",)  # as a trainer builds its Sender before updating
        t0 = time.monotonic()
        commands.put(1)
        rank, status, _ = results.get(timeout=90)
        outcome = trained.get(timeout=60)
        assert time.monotonic() - t0 < 20  # neither side waits out its deadline
        assert outcome[:2] == ("error", "HandshakeError"), outcome
        assert "version 1 is older than version 2" in outcome[2] and "force=True" in outcome[2]
        # a refusal leaves the replica as it was: still serving version 2, not mixed
        assert not status["ok"] and (status["version"], status["mixed"]) == (2, False), status

        commands.put(1)  # the deliberate rollback
        rank, status, got = results.get(timeout=90)
        assert status["ok"] and status["version"] == 1 and got == workers.expected_digests(1), status
        assert trained.get(timeout=30) == ("ok", 1)

        commands.put(2)
        rank, status, got = results.get(timeout=90)
        assert status["ok"] and status["version"] == 2 and got == workers.expected_digests(2), status
        assert trained.get(timeout=30) == ("ok", 2)
        procs[-1].join(timeout=30)

        # no trainer at all any more: the replica's next update fails at once, not at its deadline
        t0 = time.monotonic()
        commands.put(3)
        rank, status, _ = results.get(timeout=60)
        assert time.monotonic() - t0 < 10
        assert not status["ok"] and "no new sender listens" in status["error"], status
        assert (status["version"], status["mixed"]) == (2, False)
        commands.put(None)
    finally:
        stop(procs)
