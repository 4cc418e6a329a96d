"""Partitions on the emulated cluster (weightsync.bench.cluster): a host cut off by its switch
port going down, so no RST or FIN reaches anyone, as when a switch, a NIC or a machine
fails. The control plane's heartbeats (``heartbeat_grace_s``) name the silent peer within
the grace, far before ``timeout_s``; the survivors fail cleanly and everyone takes the next
version after the heal, same processes. Needs root, as CI has: never skipped."""

import queue
import threading
import time

import cluster_workers
import pytest
import workers
from cuts import cut_mid_transfer
from procs import CTX, start, stop

from weightsync.bench.cluster import Cluster, parse_rate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT_S = 15.0  # the held-out scenario's deadline; the grace derived from it is 5 s
GRACE_S = 5.0
# What the bounds after a cut allow beyond the promise (the grace, plus a retry's transfer
# where there is one), for a 2-core machine shared with other runs: the kernel gives up
# when the grace is over, then the process that finds out must be scheduled and report
# through a queue. Named within the grace plus this, a peer was found by heartbeats; one
# that waited out timeout_s (15 s) is far beyond every bound.
LOADED_S = 3.0
# "At once": from the sender's failure reaching this process to a healthy receiver's (each
# through a multiprocessing queue). Measured 0.01-0.02 s on 2 loaded cores; mooncake's
# receiver upstream of the lost one first waits for its write in flight to it (up to 2 s,
# engines/mooncake.py): 2.05-2.10 s. A receiver left to find out by itself would take its
# deadline.
AT_ONCE_S = 1.5
MOONCAKE_WRITE_WAIT_S = 2.0
SLOW_BITS = parse_rate("250mbit")  # the last host's NIC (bits per second)
MiB = 1 << 20


def digests(version, weights="partition_weights"):
    return {n: workers.digest(t) for n, t in getattr(cluster_workers, weights)(version).items()}


class Partition:
    """A trainer on host 0 and ``receivers`` resilient receivers (ranks 0, 1, ...) on hosts
    1, 2, ...; the trainer sends what ``send`` asks for and reports on ``reports``; the
    receivers' reports reach ``arrivals`` with the moment each came; trainer ranks > 0
    (``trainers``) on the hosts after the receivers'. The last receiver's host (host
    ``receivers``) has the slow NIC (250 Mbit/s, 1 Gbit/s every other host, trainer ranks'
    included), so a version takes about 2 s; ``cut_mid_sync`` cuts a host once the NICs'
    counters show the version under way."""

    def __init__(
        self,
        backend,
        timeout_s=TIMEOUT_S,
        versions=(1, 2, 3),
        receivers=2,
        overrides=(),
        bodies=None,
        weights="partition_weights",
        trainers=1,
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
        self.trainers = trainers  # trainer ranks > 0 on the hosts after the receivers'
        rates = [parse_rate("1gbit")] * receivers + [SLOW_BITS] + [parse_rate("1gbit")] * (trainers - 1)
        self.cluster = Cluster(receivers + trainers, rates)
        self.reports, self.received, self.commands = CTX.Queue(), CTX.Queue(), CTX.Queue()
        self.followers = CTX.Queue()  # trainer ranks > 0: what they failed (rank 0 reports the outcome)
        self.arrivals = queue.Queue()  # (receiver report, time.monotonic() when it came)
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
                self.trainers,
            )
        )
        kind, address = self.reports.get(timeout=60)
        assert kind == "listening"
        self.procs += [
            start(
                cluster_workers.on_host,
                self.cluster.hosts[self.n + t].netns,
                cluster_workers.run_following_trainer,
                address,
                t,
                self.trainers,
                self.overrides,
                self.n,
                self.versions,
                self.followers,
                self.weights,
            )
            for t in range(1, self.trainers)
        ]
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
        threading.Thread(target=self._collect, daemon=True).start()
        return self

    def _collect(self):
        """Each receiver report as it comes, timed here rather than when the test reads it."""
        while (report := self.received.get()) is not None:
            self.arrivals.put((report, time.monotonic()))

    def __exit__(self, *exc):
        self.commands.put(None)
        stop(self.procs)
        self.received.put(None)
        self.cluster.__exit__(*exc)

    def send(self, version):
        self.commands.put(("send", version))
        assert self.reports.get(timeout=60) == ("sending", version)

    def cut_mid_sync(self, version, host, watch=None, arrived=16 * MiB, total=None):
        """Send ``version`` and cut ``host`` once each of the ``watch`` hosts (default: the cut
        one) received ``arrived`` bytes of it, less than ``total`` (default: the version's
        size); returns the moment of the cut."""
        if total is None:
            total = sum(t.nbytes for t in getattr(cluster_workers, self.weights)(version).values())
        return cut_mid_transfer(
            self.cluster, host, lambda: self.send(version), watch=watch, arrived=arrived, total=total
        )

    def add(self, rank):
        self.commands.put(("add", rank))

    def outcome(self, timeout=90):
        return self.reports.get(timeout=timeout)

    def sent(self, version):
        """The sender's next outcome: ``version`` sent (or the report, in the failure)."""
        report = self.outcome()
        assert report[:2] == ("sent", version), report

    def receipts(self, n=2, timeout=90):
        """The next ``n`` receiver reports, by rank, each with the moment it came."""
        got = {}
        for _ in range(n):
            report, at = self.arrivals.get(timeout=timeout)
            got[report[0]] = (report, at)
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
        p.sent(1)
        p.exact(1)
        cut = p.cut_mid_sync(2, 2)  # receiver rank 1's host
        report = p.outcome()
        failed = time.monotonic()
        assert report[:2] == ("failed", 2), report
        _, _, _, message, ranks = report
        assert ranks == [1], message
        assert (
            "receiver rank 1" in message
            and "went silent" in message
            and "healthy: receiver rank 0" in message
        ), message
        assert failed - cut < GRACE_S + LOADED_S < TIMEOUT_S, failed - cut  # the grace, not the deadline
        # Both receivers fail cleanly and keep version 1: the healthy one is told at once
        # (the sender drops the failed sync), the cut one finds its sender silent by its own
        # heartbeats, within the grace.
        got = p.receipts()
        for report, _ in got.values():
            _, status, error, held, attempted, torn = report
            assert (status, held, attempted) == ("error", 1, 2), report
        (_, _, error, *_), told = got[0]
        assert "sender at" in error and "disconnected" in error, error  # the sender hung up on it
        assert told - failed < AT_ONCE_S + (MOONCAKE_WRITE_WAIT_S if backend == "mooncake" else 0), (
            told - failed,
            error,
        )
        (_, _, error, *_), found = got[1]
        assert "sender at" in error and "went silent" in error, error
        assert found - cut < GRACE_S + LOADED_S, (found - cut, error)
        print(
            f"\nsender failed {failed - cut:.2f} s after the cut; the healthy receiver {told - failed:+.2f} s "
            f"after it; the cut one {found - cut:.2f} s after the cut: {error}"
        )
        p.cluster.heal(2)
        p.send(3)
        p.sent(3)
        p.exact(3)


def test_the_trainer_host_cut_mid_sync_fails_every_receiver_in_the_grace_and_they_rejoin_after_the_heal():
    with Partition("nccl") as p:
        p.send(1)
        p.sent(1)
        p.exact(1)
        # cut once both receivers' NICs took two 8 MiB buckets: each handed out tensors of 2
        cut = p.cut_mid_sync(2, 0, watch=(1, 2))
        for rank, (report, at) in p.receipts().items():
            _, status, error, held, attempted, torn = report
            assert (status, held, attempted, torn) == ("error", 1, 2, True), report
            assert "sender at" in error and "went silent" in error, error
            assert at - cut < GRACE_S + LOADED_S, (rank, at - cut)
        kind, version, _, message, ranks = p.outcome()
        assert (kind, version, sorted(ranks)) == ("failed", 2, [0, 1]), message
        p.cluster.heal(0)
        p.send(3)  # the same receiver processes reconnect by themselves
        p.sent(3)
        p.exact(3)


@pytest.mark.parametrize("links", ["collective", pytest.param("mooncake", marks=workers.needs_mooncake)])
def test_a_sharded_trainer_rank_host_cut_mid_sync_is_named_within_the_grace_and_the_next_version_is_exact(
    links,
):
    """``sharded`` with 2 trainer ranks, each holding every whole tensor (a balanced share
    each), receivers chained: trainer rank 1's host cut once receiver 0 took 16 MiB of
    version 2. Trainer rank 0 fails the sync naming trainer rank 1 within the grace; both
    receivers fail cleanly and keep version 1; after the heal, version 3 is exact. Over Gloo
    pairs and over Mooncake writes (whose write cut off in flight may still land after the
    heal: the buffer it targets was kept, not reused)."""
    with Partition("sharded", trainers=2, overrides=[f"engine_kwargs.sharded.links={links}"]) as p:
        p.send(1)
        p.sent(1)
        p.exact(1)
        cut = p.cut_mid_sync(2, 3, watch=(1,))  # hosts: 0 trainer rank 0, 1-2 receivers, 3 trainer rank 1
        report = p.outcome()
        failed = time.monotonic()
        assert report[:2] == ("failed", 2), report
        assert "trainer rank 1" in report[3] and "went silent" in report[3], report[3]
        assert failed - cut < GRACE_S + LOADED_S < TIMEOUT_S, failed - cut  # the grace, not the deadline
        for report, at in p.receipts().values():
            _, status, error, held, attempted, torn = report
            assert (status, held, attempted) == ("error", 1, 2), report
            assert at - cut < GRACE_S + LOADED_S, (at - cut, error)
        p.cluster.heal(3)
        p.send(3)
        p.sent(3)
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
    the middle one's host cut once 8 MiB of version 2 reached it. The send succeeds, dropping it (named
    within the grace); the two others take version 2 bit-exact in the same sync. They load
    into a model, 1 MiB buckets, so buckets land in its parameters from the wire: over Gloo
    the failed group's receives into them stay pending until its timeout, and the retry
    does not wait them out (only this version's bytes can complete them). The cut one
    fails the version and keeps version 1. After the heal, ``add_receiver`` takes it back
    and version 3 reaches all three. ``nccl-delta``: versions 2 and 3 are delta sections
    against each receiver's model (sparse deltas and dense entries), and the others apply
    version 2 to the base the failed attempt left untouched. (A cut timed by a sleep once
    fell in that variant's handshake, as the sender encodes before it, and found the
    re-route reading a stale answer; the cut here falls in the transfer.)"""
    overrides = ["drop_lost_receivers=true", "update_weights_bucket_megabytes=1", f"delta={delta}"]
    weights = "drifting_weights" if delta == "on" else "partition_weights"
    loaders = {0: cluster_workers.run_resilient_loader, 2: cluster_workers.run_resilient_loader}
    with Partition(backend, receivers=3, overrides=overrides, bodies=loaders, weights=weights) as p:
        p.send(1)
        p.sent(1)
        p.exact(1, n=3)
        # receiver rank 1's host, the middle of the chain; the delta section's dense entries
        # alone are 32 MiB
        cut = p.cut_mid_sync(2, 2, arrived=8 * MiB, total=32 * MiB if delta == "on" else None)
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
        # The promise: the lost one named within the grace, then the version again to the
        # two others, whose slowest NIC (receiver rank 2's) takes it at 250 Mbit/s. A sender
        # that waited out timeout_s before the retry would take 15 s and more.
        retry_s = sum(t.nbytes for t in getattr(cluster_workers, weights)(2).values()) * 8 / SLOW_BITS
        assert done < GRACE_S + retry_s + LOADED_S < TIMEOUT_S, (done, retry_s)
        print(f"\nversion 2 sent {done:.2f} s after the cut (the bound {GRACE_S + retry_s + LOADED_S:.2f} s)")
        p.cluster.heal(2)
        p.add(1)
        p.send(3)
        report = p.outcome()
        assert report[:2] == ("sent", 3), report
        p.exact(3, n=3)


def test_a_link_that_flaps_for_2_s_mid_sync_is_ridden_out_and_a_host_cut_between_syncs_is_named_by_the_next_sync():
    """One cluster, two partitions of the same receiver host. A 2 s flap in the middle of
    version 2, inside the 5 s grace: TCP carries the version on once the link is back, and
    it completes bit-exact. Then a cut while idle between syncs: the heartbeats alone find
    it out, and the next sync fails within the grace (not at ``timeout_s``) naming it;
    after the heal the trainer retries that version and both take it."""
    with Partition("nccl", versions=(1, 2, 3, 3)) as p:
        p.send(1)
        p.sent(1)
        p.exact(1)
        p.cut_mid_sync(2, 2)
        time.sleep(2)
        p.cluster.heal(2)
        p.sent(2)
        p.exact(2)

        p.cluster.cut(2)
        time.sleep(GRACE_S + 2)  # idle: the heartbeats alone find it out
        started = time.monotonic()
        p.send(3)
        kind, version, seconds, message, ranks = p.outcome()
        assert (kind, version, ranks) == ("failed", 3, [1]), message
        assert "receiver rank 1" in message and "went silent since the last sync" in message, message
        assert time.monotonic() - started < GRACE_S + 2 < TIMEOUT_S
        p.cluster.heal(2)
        p.send(3)  # the trainer retries the version once the host is back
        p.sent(3)
        # Rank 0 takes it; rank 1 may first report its own failed attempt at version 3.
        expected, seen = digests(3), {}
        while len(seen) < 2:
            report, _ = p.arrivals.get(timeout=90)
            if report[1] == 3:
                seen[report[0]] = report
        assert all(r[2] == expected and r[3] == 3 for r in seen.values())


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


def test_the_trainer_host_cut_as_a_sync_starts_is_named_by_the_waiting_receivers_in_the_grace_and_they_rejoin():
    """The trainer's host cut as version 2 starts (its handshake meets the cut: its sync
    message reaches no one): the receivers, waiting for that sync, find the sender silent
    by their own heartbeats and fail within the grace naming it, rather than taking the silence
    for a sender that dropped them and trying to join it again for another ``timeout_s``
    ("could not reach the sender ... within 15.0 s" 20 s after the cut; where the heal came
    first, the join found version 3 where version 2 was expected, refused it and failed the
    trainer's version 3 too). After the heal they rejoin by themselves and version 3 reaches
    both exactly."""
    with Partition("nccl") as p:
        p.send(1)
        p.sent(1)
        p.exact(1)
        # Cut just before the sender starts version 2, so its handshake meets the cut and its
        # sync message reaches no one, whatever the machine's load (cut just after, the sync
        # may get through first: the cut then lands in the transfer, as in
        # test_the_trainer_host_cut_mid_sync_fails_every_receiver_in_the_grace_and_they_rejoin_after_the_heal)
        p.cluster.cut(0)
        cut = time.monotonic()
        p.send(2)
        for rank, (report, at) in p.receipts().items():
            _, status, error, held, attempted, torn = report
            assert (status, held, attempted, torn) == ("error", 1, 2, False), report
            assert "sender at" in error and "went silent while" in error and "waited for a sync" in error, (
                error
            )
            assert at - cut < GRACE_S + LOADED_S, (rank, at - cut, error)
        kind, version, _, message, ranks = p.outcome()
        assert (kind, version) == ("failed", 2) and ranks, message
        assert time.monotonic() - cut < GRACE_S + LOADED_S, message  # the sender's own grace, too
        p.cluster.heal(0)
        p.send(3)
        p.sent(3)
        p.exact(3)
