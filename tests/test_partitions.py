"""Partitions on the emulated cluster (weightsync.bench.cluster): a host cut off by its switch
port going down, so no RST or FIN reaches anyone, as when a switch, a NIC or a machine
fails. The control plane's heartbeats (``heartbeat_grace_s``) name the silent peer within
the grace, far before ``timeout_s``; the survivors fail cleanly and everyone takes the next
version after the heal, same processes. Needs root, as CI has: never skipped."""

import time

import cluster_workers
import pytest
import workers
from procs import CTX, start, stop

from weightsync.bench.cluster import Cluster, parse_rate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT_S = 15.0  # the held-out scenario's deadline; the grace derived from it is 5 s
GRACE_S = 5.0


def digests(version, weights="partition_weights"):
    return {n: workers.digest(t) for n, t in getattr(cluster_workers, weights)(version).items()}


class Partition:
    """A trainer on host 0 and ``receivers`` resilient receivers (ranks 0, 1, ...) on hosts
    1, 2, ...; the trainer sends what ``send`` asks for and reports on ``reports``. The last
    host's NIC is slow (250 Mbit/s, 1 Gbit/s the others), so a version takes about 2 s: a
    cut 0.25 s in is mid-transfer even when this machine's cores are busy."""

    def __init__(
        self,
        backend,
        timeout_s=TIMEOUT_S,
        versions=(1, 2, 3),
        receivers=2,
        overrides=(),
        bodies=None,
        weights="partition_weights",
    ):
        self.overrides = [
            f"backend={backend}",
            "update_weights_bucket_megabytes=8",
            f"timeout_s={timeout_s}",
            *overrides,
        ]
        self.versions = list(versions)
        self.n = receivers
        self.bodies = bodies or {}  # rank -> process body (default: workers.run_resilient_receiver)
        self.weights = weights  # what the trainer sends: a function of cluster_workers
        self.cluster = Cluster(receivers + 1, [parse_rate("1gbit")] * receivers + [parse_rate("250mbit")])
        self.reports, self.received, self.commands = CTX.Queue(), CTX.Queue(), CTX.Queue()
        self.procs = []

    def __enter__(self):
        self.cluster.__enter__()
        host = self.cluster.hosts[0]
        self.procs.append(
            start(
                cluster_workers.on_host,
                host.netns,
                cluster_workers.run_commanded_sender,
                host.address,
                self.overrides,
                self.n,
                self.commands,
                self.reports,
                self.weights,
            )
        )
        kind, address = self.reports.get(timeout=60)
        assert kind == "listening"
        self.procs += [
            start(
                cluster_workers.on_host,
                self.cluster.hosts[r + 1].netns,
                self.bodies.get(r, workers.run_resilient_receiver),
                address,
                r,
                self.overrides,
                self.versions,
                self.received,
            )
            for r in range(self.n)
        ]
        return self

    def __exit__(self, *exc):
        self.commands.put(None)
        stop(self.procs)
        self.cluster.__exit__(*exc)

    def send(self, version):
        self.commands.put(("send", version))
        assert self.reports.get(timeout=60) == ("sending", version)

    def add(self, rank):
        self.commands.put(("add", rank))

    def outcome(self, timeout=90):
        return self.reports.get(timeout=timeout)

    def receipts(self, n=2, timeout=90):
        """The next ``n`` receiver reports, by rank, each with the seconds since ``t0`` if set."""
        got = {}
        for _ in range(n):
            report = self.received.get(timeout=timeout)
            got[report[0]] = (report, time.monotonic())
        return got

    def exact(self, version, n=2):
        got = self.receipts(n)
        expected = digests(version, self.weights)
        for rank, (report, _) in sorted(got.items()):
            assert report[1:2] == (version,) and report[3] == version, report[:2]
            assert report[2] == expected, f"receiver rank {rank}: version {version} not bit-exact"


@pytest.mark.parametrize(
    "backend", ["nccl", pytest.param("mooncake", marks=workers.needs_mooncake), "paired"]
)
def test_a_receiver_host_cut_mid_sync_is_named_within_the_grace_and_both_take_the_next_version(backend):
    with Partition(backend) as p:
        p.send(1)
        assert p.outcome()[:2] == ("sent", 1)
        p.exact(1)
        p.send(2)
        time.sleep(0.25)  # into the transfer
        cut = time.monotonic()
        p.cluster.cut(2)  # receiver rank 1's host
        report = p.outcome()
        named = time.monotonic() - cut
        assert report[:2] == ("failed", 2), report
        _, _, _, message, ranks = report
        assert ranks == [1], message
        assert (
            "receiver rank 1" in message
            and "went silent" in message
            and "healthy: receiver rank 0" in message
        ), message
        assert named < GRACE_S + 3 < TIMEOUT_S, named  # the grace, not the deadline
        # Both receivers fail cleanly within the deadline: the healthy one is told at once,
        # the cut one finds its sender silent; each keeps version 1.
        for rank, (report, at) in p.receipts().items():
            _, status, error, held, attempted, torn = report
            assert (status, held, attempted) == ("error", 1, 2), report
            assert at - cut < TIMEOUT_S + 1, (rank, at - cut, error)
        p.cluster.heal(2)
        p.send(3)
        assert p.outcome()[:2] == ("sent", 3)
        p.exact(3)


def test_the_trainer_host_cut_mid_sync_fails_every_receiver_in_the_grace_and_they_rejoin_after_the_heal():
    with Partition("nccl") as p:
        p.send(1)
        assert p.outcome()[:2] == ("sent", 1)
        p.exact(1)
        p.send(2)
        time.sleep(0.25)
        cut = time.monotonic()
        p.cluster.cut(0)
        for rank, (report, at) in p.receipts().items():
            _, status, error, held, attempted, torn = report
            assert (status, held, attempted, torn) == ("error", 1, 2, True), (
                report
            )  # tensors of 2 were handed out
            assert "sender at" in error and "went silent" in error, error
            assert at - cut < GRACE_S + 3, (rank, at - cut)
        kind, version, _, message, ranks = p.outcome()
        assert (kind, version, sorted(ranks)) == ("failed", 2, [0, 1]), message
        p.cluster.heal(0)
        p.send(3)  # the same receiver processes reconnect by themselves
        assert p.outcome()[:2] == ("sent", 3)
        p.exact(3)


@pytest.mark.parametrize(
    "backend,delta",
    [
        ("nccl", "off"),
        pytest.param("mooncake", "off", marks=workers.needs_mooncake),
        ("nccl", "on"),
    ],
    ids=["nccl", "mooncake", "nccl-delta"],
)
def test_with_drop_lost_receivers_the_chain_routes_around_a_receiver_host_cut_mid_sync_in_the_same_sync(
    backend, delta
):
    """3 receivers in a chain (``nccl``'s across hosts, Mooncake's), ``drop_lost_receivers``:
    the middle one's host cut 0.25 s into version 2. The send succeeds, dropping it (named
    within the grace); the two others take version 2 bit-exact in the same sync. They load
    into a model, 1 MiB buckets, so buckets land in its parameters from the wire: over Gloo
    the failed group's receives into them stay pending until its timeout, and the retry
    does not wait them out (only this version's bytes can complete them). The cut one
    fails the version and keeps version 1. After the heal, ``add_receiver`` takes it back
    and version 3 reaches all three. ``nccl-delta``: versions 2 and 3 are delta sections
    against each receiver's model (sparse deltas and dense entries), and the others apply
    version 2 to the base the failed attempt left untouched. There the sender encodes
    before its handshake, so the cut may fall in the handshake (the others wait for the
    go; found this way: the re-route then read a stale answer) or in the transfer."""
    overrides = ["drop_lost_receivers=true", "update_weights_bucket_megabytes=1", f"delta={delta}"]
    weights = "drifting_weights" if delta == "on" else "partition_weights"
    loaders = {0: cluster_workers.run_resilient_loader, 2: cluster_workers.run_resilient_loader}
    with Partition(backend, receivers=3, overrides=overrides, bodies=loaders, weights=weights) as p:
        p.send(1)
        assert p.outcome()[:2] == ("sent", 1)
        p.exact(1, n=3)
        p.send(2)
        time.sleep(0.25)  # into the transfer
        cut = time.monotonic()
        p.cluster.cut(2)  # receiver rank 1's host, the middle of the chain
        report = p.outcome()
        assert report[0] == "sent" and (report[1], report[3]) == (2, [1]), report
        done = time.monotonic() - cut
        got = p.receipts(3)
        expected = digests(2, weights)
        for rank in (0, 2):
            report, at = got[rank]
            assert report[1:2] == (2,) and report[3] == 2 and report[2] == expected, (rank, report[:2])
            if delta == "on":
                assert report[4] == 1, f"receiver rank {rank} took version 2 whole (delta base {report[4]})"
        _, status, error, held, attempted, torn = got[1][0]
        assert (status, held, attempted) == ("error", 1, 2), got[1][0]
        assert done < GRACE_S + 8 < TIMEOUT_S, (
            done
        )  # the grace, the retry through 250 Mbit/s, not the deadline
        p.cluster.heal(2)
        p.add(1)
        p.send(3)
        report = p.outcome()
        assert report[:2] == ("sent", 3), report
        p.exact(3, n=3)


def test_a_link_that_flaps_for_2_s_inside_a_30_s_deadline_completes_the_version_bit_exact():
    with Partition("nccl", timeout_s=30) as p:  # grace 10 s
        p.send(1)
        assert p.outcome()[:2] == ("sent", 1)
        p.exact(1)
        p.send(2)
        time.sleep(0.25)
        p.cluster.cut(2)
        time.sleep(2)
        p.cluster.heal(2)
        assert p.outcome()[:2] == ("sent", 2)
        p.exact(2)


def test_a_receiver_host_cut_between_syncs_is_named_by_the_next_sync_within_the_grace():
    with Partition("nccl", versions=(1, 2, 2)) as p:
        p.send(1)
        assert p.outcome()[:2] == ("sent", 1)
        p.exact(1)
        p.cluster.cut(2)
        time.sleep(GRACE_S + 2)  # idle: the heartbeats alone find it out
        started = time.monotonic()
        p.send(2)
        kind, version, seconds, message, ranks = p.outcome()
        assert (kind, version, ranks) == ("failed", 2, [1]), message
        assert "receiver rank 1" in message and "went silent since the last sync" in message, message
        assert time.monotonic() - started < GRACE_S + 2 < TIMEOUT_S
        p.cluster.heal(2)
        p.send(2)  # the trainer retries the version once the host is back
        assert p.outcome()[:2] == ("sent", 2)
        # Rank 0 takes it; rank 1 may first report its own failed attempt at version 2.
        expected, seen = digests(2), {}
        while len(seen) < 2:
            report = p.received.get(timeout=90)
            if report[1] == 2:
                seen[report[0]] = report
        assert all(r[2] == expected and r[3] == 2 for r in seen.values())


def test_a_peer_that_stops_answering_heartbeats_seems_silent_before_its_grace_runs_out():
    """The rule a receiver uses when its data plane breaks (another receiver gave up on the
    same cut trainer a moment sooner): two heartbeats unanswered blame the peer; an idle,
    answering peer is never blamed, however long the connection was quiet."""
    with Cluster(2, [parse_rate("1gbit")] * 2) as cluster:
        reports, listener_cmds, watcher_cmds = CTX.Queue(), CTX.Queue(), CTX.Queue()
        a, b = cluster.hosts
        procs = [
            start(
                cluster_workers.on_host,
                b.netns,
                cluster_workers.run_quiet_listener,
                b.address,
                reports,
                listener_cmds,
            )
        ]
        try:
            kind, port = reports.get(timeout=60)
            procs.append(
                start(
                    cluster_workers.on_host,
                    a.netns,
                    cluster_workers.run_heartbeat_watcher,
                    (b.address, port),
                    GRACE_S,
                    reports,
                    watcher_cmds,
                )
            )
            time.sleep(3.5)  # idle for 3 heartbeat intervals, each answered
            watcher_cmds.put("check")
            silent, unheard = reports.get(timeout=30)
            assert not silent and unheard < 1.5, unheard
            cluster.cut(1)
            time.sleep(3.5)  # 3 heartbeats unanswered, the 5 s grace not yet over
            watcher_cmds.put("check")
            silent, unheard = reports.get(timeout=30)
            assert silent and 2.5 < unheard < GRACE_S, unheard
        finally:
            watcher_cmds.put(None)
            listener_cmds.put(None)
            stop(procs)
