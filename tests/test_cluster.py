"""The emulated cluster (weightsync.bench.cluster) and every cross-host transport on it:
shaping within 15% of the set rate, cut and heal, nothing left behind (no namespace, no
process inside one), a clear refusal without iproute2; the deltas of nccl (its chain),
paired and mooncake once per link and bit-exact after every version on 4 hosts; the nccl
chain with 2 and 7 receivers sending the model once out of the trainer's NIC; a receiver
killed mid-sync on the chain, seen at once. Their dense syncs on 4 hosts (bit-exact after
every version, within the link's ceiling, the model once out of the trainer's NIC) run as
the README's ``weightsync bench --hosts 4 ...`` line in tests/test_doc_commands.py.
Needs root (CI runs as root):
where the cluster cannot be made, these tests fail with the reason, they never skip."""

import os
import signal
import subprocess
import sys
import time

import cluster_workers
import pytest
import workers
from procs import CTX, start, stop

from weightsync.bench.cluster import Cluster, parse_rate
from weightsync.bench.runner import BenchOptions, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SINK = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
c, _ = s.accept()
n, t0 = 0, None
while (d := c.recv(1 << 20)):
    t0 = t0 or time.monotonic()
    n += len(d)
print(n / (time.monotonic() - t0))
"""
SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
block = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(block)
c.close()
"""


def ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"wsc{os.getpid()}-")]


def rate(cluster: Cluster, src: int, dst: int, mb: int = 60) -> float:
    """Payload bytes/s of one TCP stream from host ``src`` to host ``dst``."""
    sink = cluster.popen(dst, [sys.executable, "-c", SINK, "5001"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    source = cluster.popen(src, [sys.executable, "-c", SOURCE, cluster.hosts[dst].address, "5001", str(mb)])
    assert source.wait(timeout=60) == 0
    out, _ = sink.communicate(timeout=60)
    return float(out)


def reaches(cluster: Cluster, src: int, dst: int) -> bool:
    probe = "import socket,sys\ntry:\n socket.create_connection((sys.argv[1], 9), timeout=1)\nexcept ConnectionRefusedError:\n sys.exit(0)\nexcept OSError:\n sys.exit(1)"
    return cluster.popen(src, [sys.executable, "-c", probe, cluster.hosts[dst].address]).wait(timeout=10) == 0


def test_shaped_nics_cut_heal_and_nothing_left_behind():
    stale = f"wsc{2**22 + 17}-0000-h0"  # a namespace left by a dead run (no such pid)
    subprocess.run(["ip", "netns", "add", stale], check=True)
    outside = subprocess.Popen(["sleep", "600"])  # a process of ours outside the cluster
    inside, here = None, []
    try:
        with Cluster(3, [parse_rate("1gbit"), parse_rate("1gbit"), parse_rate("400mbit")]) as cluster:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert stale not in listed  # removed at start
            before = cluster.counters()
            fast = rate(cluster, 0, 1)
            slow = rate(cluster, 0, 2)  # host 2 receives at its own, lower rate
            assert 0.85 * 125e6 <= fast <= 1.15 * 125e6, fast
            assert 0.85 * 50e6 <= slow <= 1.15 * 50e6, slow
            after = cluster.counters()
            assert after[0]["tx_bytes"] - before[0]["tx_bytes"] >= 120 * 2**20  # both streams left host 0
            assert after[1]["rx_bytes"] - before[1]["rx_bytes"] >= 60 * 2**20
            assert reaches(cluster, 0, 1)
            cluster.cut(1)
            assert not reaches(cluster, 0, 1) and reaches(cluster, 0, 2)
            cluster.heal(1)
            assert reaches(cluster, 0, 1)
            assert len(ours()) == 4  # the switch and three hosts
            # left running on host 2: a child of ours and its own child
            inside = cluster.popen(2, ["sh", "-c", "sleep 600 & exec sleep 600"])
            end = time.monotonic() + 10
            while len(cluster.processes()[cluster.hosts[2].netns]) < 2 and time.monotonic() < end:
                time.sleep(0.05)
            left = cluster.processes()
            here = left[cluster.hosts[2].netns]
            assert len(here) == 2 and inside.pid in here, left
            assert all(outside.pid not in pids for pids in left.values()), left
        assert ours() == []
        assert inside.wait(timeout=5) == -signal.SIGKILL  # close killed both
        assert all(gone(pid) for pid in here), here
        assert outside.poll() is None  # and only what ran inside its namespaces
    finally:
        outside.kill()
        outside.wait()
        for pid in here:  # should close have left them (they are this test's)
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if inside is not None:
            inside.wait(timeout=5)


def gone(pid: int) -> bool:
    """No process ``pid`` runs (none, or a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_without_iproute2_the_cluster_refuses_naming_what_is_missing():
    code = "from weightsync.bench.cluster import Cluster\nwith Cluster(2): pass"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": "/nonexistent"},
    )
    assert done.returncode != 0
    assert "ClusterUnavailable: an emulated cluster needs iproute2's `ip`" in done.stderr


@pytest.mark.mooncake
def test_deltas_cross_each_link_once_over_every_cross_host_transport_and_arrive_bit_exact():
    """AdamW versions of a bf16 model (256 KiB tensors) with delta=on to 3 receiver hosts: after
    the dense warm-up only deltas travel, each receiver holds the sender's bytes after every
    version (the bench compares their digests per version), and the encoded bytes leave the
    trainer's NIC once per sync, not once per receiver (the NIC counters cover the timed
    delta syncs only)."""
    rows = run_bench(
        BenchOptions(
            backends=["nccl", "paired", "mooncake"],
            bucket_mb=[4],
            receivers=3,
            size_mb=24,
            shape="small-tensors",
            update="adamw",
            deltas=["on"],
            repeats=2,
            hosts=4,
            link="1gbit",
            timeout_s=60,
        )
    )
    assert [(r.backend, r.delta) for r in rows] == [("nccl", "on"), ("paired", "on"), ("mooncake", "on")]
    for row in rows:
        assert row.versions_checked == 3, (row.backend, row.versions_checked)  # each version's bytes
        assert 0 < row.density < 0.1 and row.wire_bytes < 0.1 * row.bytes, (
            row.backend,
            row.density,
            row.wire_bytes,
        )
        sent = row.nic_bytes[0]["tx_bytes"]
        # packet headers and control messages on top; one copy per receiver would be 3x
        assert row.wire_bytes <= sent < 1.3 * row.wire_bytes + 256 * 1024, (
            row.backend,
            row.wire_bytes,
            row.nic_bytes,
        )
        assert all(n["rx_bytes"] >= row.wire_bytes for n in row.nic_bytes[1:]), (row.backend, row.nic_bytes)


@pytest.mark.parametrize("receivers", [2, 7])
def test_the_nccl_chain_sends_the_model_once_whatever_the_receivers(receivers):
    """2 receivers: the shortest chain with a forwarding replica; 7: more than the 3
    receiver hosts, so replicas share a NIC. (A chain of 1 receiver is a broadcast's route.)"""
    rows = run_bench(
        BenchOptions(
            backends=["nccl"],
            bucket_mb=[6],
            receivers=receivers,
            size_mb=16,
            repeats=1,
            shape="small-tensors",
            hosts=4,
            link="10gbit",
            timeout_s=60,
        )
    )
    (row,) = rows
    assert row.bytes <= row.nic_bytes[0]["tx_bytes"] < 1.3 * row.bytes, row.nic_bytes
    # the chain's last replica forwards nothing; each other one forwards what it received
    received = sorted(n["rx_bytes"] for n in row.nic_bytes[1:])
    assert received[-1] >= row.bytes


# The killed receiver's peers see its connections reset at once: the sender fails 0.03 s
# after the kill here, RST_SEEN_S with room for a loaded machine. A sender that missed the
# reset would wait out TIMEOUT_S: 20 s after the kill (the sync started a fraction of a
# second before it, once every process was up), far above the bound.
TIMEOUT_S = 20
RST_SEEN_S = 3


def test_a_receiver_killed_mid_sync_on_the_chain_fails_the_sync_naming_it_and_the_survivors_go_on():
    q = CTX.Queue()
    go = CTX.Event()  # every process started up: the sync's clock starts with the sync
    overrides = ["backend=nccl", "update_weights_bucket_megabytes=4", f"timeout_s={TIMEOUT_S}"]
    with Cluster(4, parse_rate("1gbit")) as cluster:
        sender = start(
            cluster_workers.on_host,
            cluster.hosts[0].netns,
            cluster_workers.run_failing_then_recovering_sender,
            cluster.hosts[0].address,
            overrides,
            3,
            q,
            go,
        )
        kind, address = q.get(timeout=60)
        assert kind == "listening"
        victim = start(
            cluster_workers.on_host,
            cluster.hosts[1].netns,
            workers.run_resilient_receiver,
            address,
            0,
            overrides,
            [1],
            q,
            (1, 8),
            None,
            go,
        )
        survivors = [
            start(
                cluster_workers.on_host,
                cluster.hosts[r + 1].netns,
                workers.run_resilient_receiver,
                address,
                r,
                overrides,
                [1, 2],
                q,
                None,
                None,
                go,
            )
            for r in (1, 2)
        ]
        try:
            assert sorted(q.get(timeout=90) for _ in range(3)) == [(r, "ready") for r in range(3)]
            go.set()
            victim.join(timeout=90)
            died_at = time.monotonic()  # within milliseconds of the kill (the join wakes on its exit)
            assert victim.exitcode == -signal.SIGKILL
            # The sender's failure, 2 survivors' errors, 2 versions 2 and the sender's "sent", in
            # any order: a survivor reports after its acknowledgement, so maybe after "sent".
            reports = [q.get(timeout=90) for _ in range(6)]
            assert ("sent", 2) in reports, reports
            failed = next(r for r in reports if r[0] == "failed")
            _, seconds, message, ranks, failed_at = failed
            assert ranks == [0] and "receiver rank 0" in message, message
            assert failed_at - died_at < RST_SEEN_S, (failed_at - died_at, seconds)
            errors = [r for r in reports if len(r) == 6 and r[1] == "error"]
            assert sorted(r[0] for r in errors) == [1, 2] and all(r[3:] == (None, 1, True) for r in errors), (
                errors
            )
            got = [r for r in reports if len(r) == 4 and r[1] == 2]
            assert sorted(r[0] for r in got) == [1, 2]
            expected = {n: workers.digest(t.contiguous()) for n, t in workers.big_weights(2).items()}
            assert all(r[2] == expected and r[3] == 2 for r in got)
        finally:
            stop([sender, victim, *survivors])
