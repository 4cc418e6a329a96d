"""Real vLLM replicas on emulated hosts (weightsync.bench.cluster): the trainer's
``VLLMRollout`` on host 0, replica A's processes on host 1, B's on host 2, 1 Gbit/s NICs.
Host 2 is cut off mid-update (its switch port down: no RST, no FIN reaches anyone): the
update fails within the heartbeat grace naming replica B; A serves its old version or the
new one whole, or holds a mix that is reported and kept paused, never a mix reported as a
version; after the heal the next update reaches both, same processes. Needs root, as CI
has: never skipped."""

import os
import queue
import signal

import cluster_workers
import pytest
from procs import CTX, stop

from weightsync.bench.cluster import Cluster, parse_rate
from weightsync.demo.vllm import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(300)]

TIMEOUT_S = 15.0
GRACE_S = 4.0
OVERRIDES = [
    "backend=nccl",
    "update_weights_bucket_megabytes=1",
    f"timeout_s={TIMEOUT_S}",
    f"heartbeat_grace_s={GRACE_S}",
]


def test_a_replica_host_cut_mid_update_fails_naming_it_and_both_serve_the_next_version_after_the_heal(
    tmp_path,
):
    model_dir = save_tiny_model(os.path.join(tmp_path, "model"), seed=5, vocab_size=5000)
    with Cluster(3, [parse_rate("1gbit")] * 3) as cluster:
        commands, reports = CTX.Queue(), CTX.Queue()
        # Not a daemon: vLLM starts processes of its own.
        proc = CTX.Process(
            target=cluster_workers.run_rollout_across_hosts,
            args=(cluster.hosts, model_dir, OVERRIDES, commands, reports),
        )
        proc.start()

        def get(timeout):  # the driver's next report; its death fails at once, not at the timeout
            for _ in range(int(timeout)):
                try:
                    return reports.get(timeout=1)
                except queue.Empty:
                    assert proc.is_alive(), f"the rollout driver died (exit code {proc.exitcode})"
            raise TimeoutError(f"no report from the rollout driver within {timeout} s")

        pids = None
        try:
            commands.put("update")
            kind, report, greedy, trainer, pids = get(240)
            assert kind == "updated" and report.ok, report.summary()
            assert greedy == {"A": trainer, "B": trainer}

            commands.put("cut-update")
            assert get(120) == ("streaming",)
            cluster.cut(2)
            commands.put("cut")
            kind, seconds, message, report, greedy, old, new = get(120)
            assert kind == "failed", (kind, seconds)
            assert seconds < GRACE_S + 3 < TIMEOUT_S, (
                seconds,
                message,
            )  # the grace named it, no deadline did
            assert "replica 'B' (receiver rank 1)" in message and "went silent" in message, message
            ra, rb = report.replicas
            assert (rb.name, rb.ok, rb.version, rb.failed_version) == ("B", False, None, 2), rb
            # B's own account: its link is down, so its kernel finds no route to the sender,
            # or its heartbeats found the sender silent; never "closed", which did not happen
            assert "sender at" in rb.error and (
                "No route to host" in rb.error or "went silent" in rb.error
            ), rb.error
            assert ra.name == "A"
            if ra.mixed:  # tensors of version 2 reached A's reload before the failure
                assert (ra.version, ra.resumed, ra.failed_version) == (None, False, 2), ra
            else:
                assert ra.version in (1, 2) and ra.resumed, ra
                assert greedy["A"] == (old if ra.version == 1 else new)
            assert "B" not in greedy  # B holds part of version 2: never resumed

            cluster.heal(2)
            commands.put("update")
            kind, report, greedy, trainer, after = get(120)
            assert report.ok and [(r.version, r.resumed) for r in report.replicas] == [(3, True)] * 2, (
                report.summary()
            )
            assert greedy == {"A": trainer, "B": trainer}
            assert after == pids  # the same workers, reconnected by themselves
        finally:
            commands.put(None)
            stop([proc])
            for pid in pids.values() if pids else ():  # a driver killed by stop() cannot end its engines
                _end_with_parent(pid)


def _titled(pid, title):
    """True if process ``pid`` runs and vLLM titled it ``title`` (its cmdline's start)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(title)
    except OSError:
        return False


def _end_with_parent(pid):
    """End a replica's worker and its engine core (the worker's parent), if still running:
    each only if it is what it should be (a pid gone may have been reused)."""
    if not _titled(pid, b"VLLM::Worker"):
        return
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return
    ours = [pid] + ([parent] if _titled(parent, b"VLLM::EngineCore") else [])
    for p in ours:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
