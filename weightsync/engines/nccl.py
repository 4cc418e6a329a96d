"""Backend ``nccl``: the sender's (rank 0's) buckets to every receiver, by a collective
broadcast or along a chain of two-rank groups.

Served by NCCL on CUDA, HCCL on Ascend and Gloo on CPU (``platform.collective_backend``).
Route (``engine_kwargs.nccl.topology``): ``broadcast`` is one group of all ranks; Gloo's
broadcast sends the model from the sender once per receiver, which is what a shared link
cannot afford (NCCL pipelines a ring on GPUs itself). ``chain`` is the route ``paired``
takes with one trainer rank: sender -> replica -> replica ..., each link a two-rank group
carrying bytes one way in pieces of ``CHUNK_BYTES``, each piece forwarded as soon as it
arrived, so every link carries the model once and a hop delays the stream by one piece,
not one bucket. ``auto`` chains when a receiver is on another host (its control
connection comes from another address), and broadcasts on one host, where the "wire" is
memory and one collective is the faster.
The group is our own, built from a rendezvous store hosted by the sender on the control
socket's interface, which only ranks holding the group's token (handed out in the
authenticated handshake) may use (``weightsync.engines.rendezvous``); the caller's default process
group is never touched. Double-buffered: two bucket buffers per rank, so the
sender fills bucket k+1 while bucket k is on the wire, and a receiver hands out bucket k
while bucket k+1 arrives. Buckets that are one range of one tensor need no buffer: they
are broadcast from the trainer's tensor into the receiver's parameter, several in flight.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.engines import rendezvous, ring
from weightsync.engines.base import Join, Landing, NextBucket, Producer, Transport
from weightsync.plan import Bucket

log = logging.getLogger("weightsync.engines.nccl")

_burials: list[threading.Thread] = []


def _bury(holder: list) -> None:
    """Destroy failed groups in a background thread. ``holder`` is a list that must hold
    the only references, so the last ones go away in that thread."""
    thread = threading.Thread(target=holder.clear, name="weightsync-drop-group", daemon=True)
    thread.start()
    _burials[:] = [t for t in _burials if t.is_alive()] + [thread]


def _await_burials(limit_s: float = 30.0) -> None:
    """Wait (bounded) until the failed groups are destroyed: their operations, still pending,
    have then ended, so none can write any more into memory they were given."""
    end = time.monotonic() + limit_s
    for thread in _burials:
        thread.join(max(0.0, end - time.monotonic()))


# A group still being destroyed when the interpreter exits would abort the process.
atexit.register(_await_burials)

# Bytes per operation on a chain's link (one constant for every chain: engines.ring)
CHUNK_BYTES = ring.CHUNK_BYTES
TOPOLOGIES = ("broadcast", "chain")


def partner(share: int, replicas: int) -> int:
    """The replica a chain of share ``share`` starts at: a cyclic derangement of the
    indices (``paired``: trainer rank s never feeds the replica on its own device)."""
    return (share + 1) % replicas


def _remote(hosts: tuple[str, ...], here: str | None) -> bool:
    """Whether any of ``hosts`` is another machine than ``here`` (loopback is here)."""
    return any(not h.startswith("127.") and h not in ("::1", here) for h in hosts)


# Broadcasts queued at once. Buckets sent from (or landing in) the model's own tensors need
# no buffer, so more than two can be in flight, hiding each call's latency.
WINDOW = 8
# A receiver whose window is full posts the next bucket while the last pieces of the one it
# waits for are on the wire, so its link does not idle between buckets (``_recv_window``).
POST_EARLY = 2


class CollectiveEngine(Transport):
    name = "nccl"
    #: the routes a sender may name in its handshake
    topologies: tuple[str, ...] = TOPOLOGIES
    reroutes = True  # a failed group's late receives carry the failed version's bytes (settle)

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self.library = platform.collective_backend("nccl", device.type)
        self._kwargs = config.engine_kwargs.nccl
        self._server: rendezvous.StoreServer | None = None  # rank 0: the group's rendezvous
        # The store the current group was built from (torch calls a Python store's methods
        # only while the Python object lives): rank 0's own view, or a client elsewhere.
        self._store: dist.Store | None = None
        # The sync's groups: key None is the group of all ranks (``broadcast``); a chain
        # has one two-rank group per link, keyed (from rank, to rank).
        self._groups: dict[tuple[int, int] | None, dist.ProcessGroup] = {}
        self._group_key: tuple | None = None
        self._chain = False  # this group's route (``topology``)
        self._trainers = 1
        self._replicas = 0
        self._generation = 0
        self._token = ""  # rank 0: the current group's rendezvous token
        self._buffers: list[torch.Tensor] | None = None
        self._landed_in_failure: int | None = (
            None  # a failed sync (its version) left receives posted into the model
        )
        self._join: Join | None = None  # the sync in progress
        #: Receiver: bytes its receives took off its links in the last ``recv_buckets``,
        #: counted piece by piece as each completes (what crossed, not what was planned;
        #: pieces it forwards are not counted again).
        self.received_bytes = 0

    # ------------------------------------------------------------------ group
    @property
    def rank(self) -> int:
        assert self._join is not None, "connect() first"
        return self._join.rank

    def prepare(self, join: Join) -> dict[str, Any]:
        if self._server is None:
            # On the control socket's interface, a free port; peers learn it (and the
            # group's token) from the handshake.
            self._server = rendezvous.serve(join.local_host, self.config.timeout_s)
        if not self._joined():
            self._generation += 1
            self._token = self._server.new_group()  # the previous group's token is void
        return {
            "host": self._server.host,
            "port": self._server.port,
            "group": f"{self._kwargs.group_name}/{self._generation}",
            "token": self._token,
            "library": self.library,
            "topology": self._topology(join),
        }

    def _topology(self, join: Join) -> str:
        chosen = self._kwargs.topology
        if chosen == "auto":
            chosen = "chain" if _remote(join.peer_hosts, join.local_host) else "broadcast"
        return chosen

    def _joined(self) -> bool:
        """This rank is in a working group (its key is reused by the next sync)."""
        return bool(self._groups)

    def start(self, join: Join) -> None:
        """The per-sync state, before any group is joined: the sync's record, buffers."""
        self._join = join
        self._reserve(join.capacity)

    def settle(self, version: int, retake: bool) -> None:
        if self._landed_in_failure is None or (retake and version == self._landed_in_failure):
            return  # the same version taken again need not wait: a late write carries its bytes
        # The failed sync's receives posted into the model's tensors may still be pending,
        # and a peer's operations of that sync may still complete them (Gloo cannot abort;
        # each ends at its timeout, measured here to end up to 18 s after a 15 s deadline):
        # nothing of another version lands in the model before that group is gone. Waited
        # before this receiver is ready, so no peer's operation of the new sync is pending
        # meanwhile; at most what leaves the sender's wait for ready a margin.
        self._landed_in_failure = None
        _await_burials(max(0.0, self.config.timeout_s - 2.0))

    def connect(self, join: Join, info: dict[str, Any]) -> None:
        self.start(join)
        topology = info.get("topology", "broadcast")
        if topology not in self.topologies:
            raise RuntimeError(
                f"the sender's route {topology!r} is not one of {', '.join(self.topologies)}: run the same weightsync on both sides"
            )
        key = (info["host"], info["port"], info["group"], join.world_size, join.senders, topology, join.links)
        if self._groups and key == self._group_key:
            return
        self._drop_group()
        self.arrange(join, topology)
        store = self._rendezvous(join, info)
        log.debug(
            "%s joining group %s as rank %d (%s, %s)",
            join.name,
            info["group"],
            join.rank,
            self.library,
            topology,
        )
        self._open_groups(join, store, info)
        self._group_key = key

    def _open_groups(self, join: Join, store: dist.Store, info: dict[str, Any]) -> None:
        """Join this sync's group(s) (arranged already), built from ``store``."""
        if not self._chain:
            self._groups[None] = platform.new_process_group(
                self.library,
                store,
                join.rank,
                join.world_size,
                self.config.timeout_s,
                bind_host=join.local_host,
            )
        for a, b in self._links():
            if join.rank in (a, b):
                self._groups[(a, b)] = platform.new_process_group(
                    self.library,
                    dist.PrefixStore(f"link/{a}-{b}", store),
                    (a, b).index(join.rank),
                    2,
                    self.config.timeout_s,
                    bind_host=join.local_host,
                )

    # ------------------------------------------------------------------ route
    def arrange(self, join: Join, topology: str) -> None:
        """The route of ``join``'s group (pure: no group is joined): its topology, trainer
        ranks and replicas."""
        self._chain = topology == "chain"
        self._trainers = join.senders
        self._replicas = join.world_size - self._trainers
        if self._trainers < 1 or self._replicas < 1:
            raise RuntimeError(
                f"{self.name}: {self._trainers} trainer rank(s) and {self._replicas} receiver(s) cannot form a route"
            )

    def _trainer_rank(self, share: int) -> int:
        return 0 if share == 0 else self._replicas + share

    @property
    def _share(self) -> int:
        """This trainer rank's share of the buckets (trainer ranks only)."""
        return 0 if self.rank == 0 else self.rank - self._replicas

    def _share_of(self, nbytes: int) -> int:
        """Which trainer rank's share the next piece (of ``nbytes``) is: called once per
        piece, in plan order, on every rank alike."""
        return 0

    def _links(self) -> list[tuple[int, int]]:
        """Every link of a chain as (from, to) ranks, in one order all ranks agree on.
        Ranks join their links' groups in this order, so the lowest link not yet built
        always has both its ends waiting for it: no deadlock."""
        if not self._chain:
            return []
        links = {(self._trainer_rank(s), partner(s, self._replicas) + 1) for s in range(self._trainers)}
        if self._replicas > 1:
            links |= {(j + 1, (j + 1) % self._replicas + 1) for j in range(self._replicas)}
        return sorted(links)

    def hop(self, bucket: Bucket, share: int) -> tuple[int, int | None]:
        """Where a piece of share ``share`` comes from, and the rank to forward it to (None:
        nowhere). On a chain, share s comes from trainer rank s to replica d(s), then goes
        around the ring of replicas; the last replica of the ring keeps it."""
        if not self._chain:
            return 0, None
        me, n = self.rank - 1, self._replicas
        hop = (me - partner(share, n)) % n  # 0: straight from the trainer rank
        source = self._trainer_rank(share) if hop == 0 else (me - 1) % n + 1
        forward = (me + 1) % n + 1 if hop < n - 1 else None
        return source, forward

    def pieces(self, bucket: Bucket, tensor: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """The operations ``bucket``'s bytes (in ``tensor``) take, each with the share that
        sends it: the whole bucket on a broadcast, pieces of ``CHUNK_BYTES`` on a chain. With
        ``hop``, public: the estimator (``weightsync.estimate.routes``) walks a sync's route by them."""
        if not tensor.numel():
            return []
        pieces = (
            [tensor] if not self._chain or tensor.numel() <= CHUNK_BYTES else torch.split(tensor, CHUNK_BYTES)
        )
        return [(p, self._share_of(p.numel())) for p in pieces]

    def _rendezvous(self, join: Join, info: dict[str, Any]) -> dist.Store:
        """The key space of the group described by ``info``, in the store rank 0 hosts."""
        if info.get("library") != self.library:
            raise RuntimeError(
                f"collective library mismatch: sender uses {info.get('library')!r}, "
                f"{join.name} uses {self.library!r} (are both on the same platform?)"
            )
        self._close_store()
        if join.rank == 0:
            assert self._server is not None, "prepare() first"
            store = self._server.store(join.watch)
        else:
            if not isinstance(info.get("token"), str):
                raise RuntimeError(
                    f"the sender's handshake carries no rendezvous token: it runs an older weightsync than "
                    f"{join.name} (run the same version on both sides)"
                )
            host = join.sender_host or info["host"]  # the address that reached the sender
            store = rendezvous.connect(
                host, int(info["port"]), info["token"], self.config.timeout_s, join.watch
            )
        self._store = store
        return dist.PrefixStore(f"weightsync/{info['group']}", store)

    def _close_store(self) -> None:
        store, self._store = self._store, None
        if isinstance(store, rendezvous.StoreClient):
            store.close()

    def _take_groups(self) -> list[dist.ProcessGroup]:
        """Forget this rank's groups; return them (the only references from here on)."""
        groups = list(self._groups.values())
        self._groups.clear()
        self._group_key = None
        return groups

    def _drop_group(self, failed: bool = False) -> None:
        """Leave the group(s). ``failed``: operations may still be pending on them."""
        holder = self._take_groups()  # the only references from here on (see _bury)
        if not holder:
            return
        if self.library != "gloo":
            for group in holder:
                shutdown = getattr(group, "shutdown", None)  # aborts operations still pending
                if shutdown is not None:
                    shutdown()
        elif failed:
            # Gloo cannot abort: destroying a group whose operations are still blocked on a
            # peer waits until they time out. That happens in the background; the next
            # sync joins a new group meanwhile.
            _bury(holder)

    def _wait(self, work: dist.Work) -> None:
        """Wait for one operation; while it is pending, ``watch`` (if set) may abandon it."""
        watch = self._join.watch if self._join is not None else None
        try:
            if watch is not None:
                pause, next_watch = 0.0002, time.monotonic() + 0.02
                while not work.is_completed():
                    time.sleep(pause)
                    pause = min(pause * 2, 0.002)
                    if time.monotonic() >= next_watch:
                        watch()
                        next_watch = time.monotonic() + 0.05
            work.wait()  # raises the operation's error, if it failed
        except BaseException:
            # The traceback keeps this frame: it must not keep the operation, whose
            # sockets would then stay open and leave the peers waiting until their timeout.
            del work
            raise

    def _buffer_count(self) -> int:
        """Bucket buffers this rank keeps: two (one filled or received while the other is
        on the wire or handed out)."""
        return 2

    def _reserve(self, nbytes: int) -> None:
        """Make the bucket buffers hold ``nbytes`` (at most the configured bucket size), so
        a model smaller than a bucket does not cost two full buckets of memory."""
        nbytes = min(max(nbytes, 1), self.config.bucket_bytes)
        count = self._buffer_count()
        if self._buffers is None or self._buffers[0].numel() < nbytes or len(self._buffers) != count:
            self._buffers = None  # free the old ones before allocating the new ones
            # Touched (zeroed) now, during the handshake, not page by page mid-transfer.
            self._buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]

    def _bufs(self) -> list[torch.Tensor]:
        if self._buffers is None:
            self._reserve(self.config.bucket_bytes)
        return self._buffers

    # ------------------------------------------------------------------ data
    def _recv_window(self) -> int:
        """Buckets a receiver keeps posted at once."""
        return WINDOW

    def _post_send(self, bucket: Bucket, piece: torch.Tensor) -> dist.Work:
        """Start moving a piece of ``bucket`` of this rank's share: to all, or to the replica
        this rank's chain starts at."""
        return self._send_op(partner(self._share, self._replicas) + 1 if self._chain else None, piece)

    def send_buckets(self, produce: Producer) -> int:
        bufs = self._bufs()
        # Broadcasts in flight, oldest first, with the buffer slot each one reads (None: it
        # reads the source tensor itself, which stays valid until the sync ends).
        in_flight: deque[tuple[dist.Work, int | None]] = deque()
        slot = 0
        sent = 0
        try:
            while True:
                # Never refill a buffer still on the wire; keep at most WINDOW calls queued.
                while in_flight and (len(in_flight) >= WINDOW or any(s == slot for _, s in in_flight)):
                    self._wait(in_flight.popleft()[0])
                produced = produce(bufs[slot])
                if produced is None:
                    break
                bucket, payload = produced
                packed = payload.data_ptr() == bufs[slot].data_ptr()
                for piece, share in self.pieces(bucket, payload):
                    if share == self._share:  # this rank's pieces (all, but on a chain of shares)
                        in_flight.append((self._post_send(bucket, piece), slot if packed else None))
                        sent += piece.numel()
                if packed:
                    slot = (slot + 1) % len(bufs)
            while in_flight:
                self._wait(in_flight.popleft()[0])
        except BaseException:
            # Let go of the failed group now (our works hold it, and the traceback holds
            # this frame): its sockets close and receivers waiting on them fail at once
            # instead of at their timeout.
            in_flight.clear()
            self._drop_group(failed=True)
            raise
        platform.synchronize(self.device)
        return sent

    # Receiving, for ``nccl`` and ``paired`` alike: which rank each bucket comes from and
    # whether it goes on to a next rank is all that differs (``hop``).
    def _recv_op(self, source: int, tensor: torch.Tensor) -> dist.Work:
        """Start receiving ``tensor`` from rank ``source`` (on a broadcast: from rank 0)."""
        return self._groups[(source, self.rank) if self._chain else None].broadcast(tensor, 0)

    def _send_op(self, to: int | None, tensor: torch.Tensor) -> dist.Work:
        """Start sending ``tensor`` to rank ``to`` (None: to every rank of the group)."""
        return self._groups[(self.rank, to) if to is not None else None].broadcast(tensor, 0)

    def recv_buckets(
        self, next_bucket: NextBucket, landing: Landing | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Post receives in bucket order (the order the senders send in) up to ``WINDOW``
        ahead; a bucket that needs a buffer waits for a free slot. A slot is free again
        once its bucket was consumed and, where it is forwarded, forwarded."""
        bufs = self._bufs()
        self.received_bytes = 0
        free = list(range(len(bufs)))  # buffer slots not holding a posted, handed-out or forwarding bucket
        # Receives posted, in plan order: (bucket, slot, target, its pieces' receives, each
        # with the piece and the rank to forward it to, if any).
        posted: deque[
            tuple[Bucket, int | None, torch.Tensor, list[tuple[dist.Work, torch.Tensor, int | None]]]
        ] = deque()
        # Forwards on the wire, a bucket's together (its pieces may go to several ranks):
        # (works, slot its bytes are in, or None for a landed bucket).
        forwarding: deque[tuple[list[dist.Work], int | None]] = deque()
        pending: Bucket | None = None
        ended = False

        def reclaim(until_free: bool) -> None:
            """Retire the forwards that completed, oldest first; with ``until_free``, wait
            for forwards in order until one gives a buffer slot back. (A forward of a
            landed bucket holds no slot: waiting for the oldest forward alone may free
            nothing while both slots stay on the wire.)"""
            while forwarding and (
                all(w.is_completed() for w in forwarding[0][0]) or (until_free and not free)
            ):
                works, slot = forwarding.popleft()
                for work in works:
                    self._wait(work)
                if slot is not None:
                    free.append(slot)

        def post_ahead() -> None:
            nonlocal pending, ended
            while not ended and len(posted) < self._recv_window():
                if pending is None:
                    pending = next_bucket()
                    if pending is None:
                        ended = True
                        return
                target = landing(pending) if landing is not None else None
                slot = None
                if target is None:
                    # With receives posted, the loop comes back here after the next one;
                    # with none, a slot must be won now or nothing would ever be posted.
                    reclaim(until_free=not posted)
                    if not free:
                        if not posted:  # every slot is posted or forwarding, so unreachable
                            raise RuntimeError(
                                f"{self.name}: no buffer slot for bucket {pending.index} and nothing in flight"
                            )
                        return
                    slot = free.pop(0)
                    target = bufs[slot][: pending.nbytes]
                works = []
                for piece, share in self.pieces(pending, target):
                    source, forward = self.hop(pending, share)
                    works.append((self._recv_op(source, piece), piece, forward))
                posted.append((pending, slot, target, works))
                pending = None

        try:
            post_ahead()
            while posted:
                bucket, slot, target, works = posted.popleft()
                onward = []  # each piece on its way on as soon as it is here
                work = None
                for i, (work, piece, forward) in enumerate(works):
                    if i == max(0, len(works) - POST_EARLY):  # the next bucket is posted as this one ends
                        post_ahead()
                    self._wait(work)
                    self.received_bytes += piece.numel()
                    if forward is not None:
                        onward.append(self._send_op(forward, piece))
                del works, work
                if onward:  # the slot is free once every piece of it left
                    forwarding.append((onward, slot))
                yield bucket, target
                # The consumer asked for more: its views of this bucket are released.
                if slot is not None and not onward:
                    free.append(slot)
                reclaim(until_free=False)
                post_ahead()
            while forwarding:
                for work in forwarding.popleft()[0]:
                    self._wait(work)
        except BaseException:
            # The sync failed or was abandoned: let go of the group(s) and of our pending
            # operations at once, so the senders fail now, not at their timeout.
            if self.library == "gloo" and any(slot is None for _, slot, _, _ in posted):
                self._landed_in_failure = self._join.version
            posted.clear()
            forwarding.clear()
            work = None
            self._drop_group(failed=True)
            raise
        platform.synchronize(self.device)

    def reset(self) -> None:
        self._drop_group()

    def finish(self, ok: bool) -> None:
        # A failed collective leaves the group in an unknown state: build a new one next time.
        if not ok or self._kwargs.rebuild_group:
            self._drop_group(failed=not ok)
        if not ok:
            # The failed group's pending operations still hold (and may still fill) these
            # buffers: the next sync gets its own.
            self._buffers = None
        if self._kwargs.rebuild_group:
            self._buffers = None
            platform.empty_cache()

    def close(self) -> None:
        self._drop_group()
        self._buffers = None
        self._close_store()
        if self._server is not None:
            self._server.close()
            self._server = None
