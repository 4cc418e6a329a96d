"""``Sender``: the trainer side of a weight sync.

One path per family. With a publisher backend (``naive``, ``disk``) the publisher hands the
version over. With a transport backend, trainer rank 0 runs the session; every sync goes
plan -> handshake -> transport -> acknowledgements. Other trainer ranks drain their source
(materializing distributed tensors is collective), or, where every trainer rank sends
(``paired``), follow rank 0's sync and send their share (``weightsync.sender.ranks``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import SECRET_ENV
from weightsync.engines.base import Publisher, Transport
from weightsync.engines.registry import get_engine
from weightsync.errors import HandshakeError, PeerLost, RemoteFailure
from weightsync.plan import Plan, capacity, make_plan
from weightsync.sender import handshake
from weightsync.sender.packer import producer
from weightsync.sender.peers import SessionPeers
from weightsync.sender.ranks import TrainerFollower
from weightsync.sender.stages import send_stages
from weightsync.session import reroute
from weightsync.session.auth import reachable_from_other_hosts
from weightsync.session.channel import Deadline
from weightsync.session.control import ControlServer
from weightsync.sources import DEFAULT_FORM, WeightSource
from weightsync.stages import Outgoing
from weightsync.stats import SyncStats

log = logging.getLogger("weightsync")


class Sender:
    """The trainer side of a weight sync.

    Args:
        config: engine configuration (backend, bucket size, timeout, ...).
        address: ``host:port`` the sender listens on (rank 0); port 0 picks a free port,
            readable afterwards from ``sender.address``. Not used by ``disk``, which
            publishes into ``engine_kwargs.disk.path`` instead (see docs/disk.md).
        num_receivers: how many receivers take part in every sync (ranks ``0 ..
            num_receivers-1``; ``remove_receiver`` / ``add_receiver`` change the set).
        rank: this trainer's rank; over a transport only rank 0 sends and other ranks
            drain their source, except with ``paired``, where every rank sends a share (ranks
            > 0 connect to rank 0 at ``address``); with the colocated ``naive`` backend every
            rank hands its tensors to the receivers in its own process (default: the rank in
            the default process group, or 0).
        num_trainers: trainer ranks taking part (``paired`` only; default: the default
            process group's size, or 1). Every one of them calls ``send`` for every version.
            May be changed between sends (``sender.num_trainers = M``); the next send then
            waits for the new set of trainer ranks and builds a new data plane.
        device: device of the transfer buffers (default: this process's accelerator, or CPU).
        wire_dtype: cast multi-byte floating tensors to this dtype for the wire.
        form: the names a transformers model goes under where engines load other names than
            it holds (an MoE's fused experts): ``"checkpoint"`` (default: the names and layouts
            of its checkpoint, as views; a sharded route cuts them from each rank's shards) or
            ``"module"`` (its own) (docs/moe.md).
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str,
        num_receivers: int,
        *,
        rank: int | None = None,
        num_trainers: int | None = None,
        device: str | torch.device | None = None,
        wire_dtype: torch.dtype | None = None,
        form: str = DEFAULT_FORM,
    ) -> None:
        config.validate()
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers}: need at least one receiver")
        self.config = config
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._num_trainers = num_trainers or (dist.get_world_size() if dist.is_initialized() else 1)
        self.engine_cls = get_engine(config.backend)
        self._all_send = issubclass(self.engine_cls, Transport) and self.engine_cls.all_ranks_send
        #: what each sync's wire entries are and where they go (``weightsync.stages``)
        self._stages = send_stages(config, self.engine_cls, self._all_send)
        if self._all_send and not 0 <= self.rank < self.num_trainers:
            raise ValueError(
                f"rank {self.rank} is not one of the {self.num_trainers} trainer rank(s) (num_trainers)"
            )
        self.wire_dtype = wire_dtype
        self.form = form
        self.device = platform.local_device(device)
        self.address = address
        self.last_stats: SyncStats | None = None
        self._publisher: Publisher | None = None
        self._transport: Transport | None = None
        server: ControlServer | None = None
        self._follower: TrainerFollower | None = None
        self._confirmed: set[int] = set()  # receivers that confirmed the last sync
        self._rerouting = False  # the failed sync's others wait to take its version again
        if issubclass(self.engine_cls, Publisher):
            self._publisher = self.engine_cls(config, self.device, address)
        elif self.rank == 0:  # rank 0 runs the session
            self._transport = self.engine_cls(config, self.device)
            server = ControlServer(address)
            self.address = server.address
            if config.secret() is None and reachable_from_other_hosts(server.sock.getsockname()[0]):
                log.warning(
                    "the sender's control socket listens on %s, which other hosts can reach, and no shared "
                    "secret is set: anyone who reaches it can join as a receiver (and be handed the weights "
                    "and the data-plane rendezvous token), and receivers cannot tell this sender from an "
                    "impostor. Set %s (or auth_secret) to the same value on the trainer and every rollout "
                    "process, or listen on a loopback address.",
                    self.address,
                    SECRET_ENV,
                )
        elif self._all_send:
            self._transport = self.engine_cls(config, self.device)
            self._follower = TrainerFollower(config, address, self.rank)
        others = self.num_trainers - 1 if self._all_send else 0
        #: who takes part and how to reach them (trainer rank 0's connections)
        self._peers = SessionPeers(config, num_receivers, others, server, self._reset_plane)

    # ------------------------------------------------------------------ membership
    @property
    def num_trainers(self) -> int:
        return self._num_trainers

    @num_trainers.setter
    def num_trainers(self, count: int) -> None:
        if not isinstance(count, int) or count < 1 or (self._all_send and not 0 <= self.rank < count):
            raise ValueError(f"num_trainers={count!r}: need at least 1, and rank {self.rank} among them")
        self._num_trainers = count
        others = count - 1 if self._all_send else 0
        if others != self._peers.trainers.count:
            self._peers.trainers.close()  # a new set of trainer ranks joins at the next send
            self._peers.trainers.count = others
            self._reset_plane()

    @property
    def num_receivers(self) -> int:
        return len(self._peers.receivers)

    @property
    def receivers(self) -> list[int]:
        """Ranks of the receivers every sync goes to."""
        return self._peers.receivers

    @property
    def dropped(self) -> list[int]:
        """Ranks of the receivers lost mid-sync and dropped (``drop_lost_receivers``) that
        were not added back (``add_receiver``) or removed (``remove_receiver``) since."""
        return self._peers.dropped

    def remove_receiver(self, rank: int) -> None:
        """Stop syncing to receiver ``rank`` (say, its process died: a failed ``send`` names
        it in ``SyncError.ranks``). The next ``send`` goes to the others. A receiver dropped
        already (``drop_lost_receivers``) stays dropped."""
        self._peers.remove(rank)

    def add_receiver(self, rank: int) -> None:
        """Sync to receiver ``rank`` again (or a replacement with that rank); the next
        ``send`` waits for it to connect."""
        self._peers.add(rank)

    def _reset_plane(self) -> None:
        if self._transport is not None:
            self._transport.reset()

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Wait (up to ``timeout_s``) until every receiver (and, with ``paired``, every
        other trainer rank) is connected. ``send`` calls it."""
        if self._follower is not None:
            self._follower.connect()
        self._peers.connect()  # a publisher, or a trainer rank not running the session: nothing

    def warm_up(self, source: Any = None) -> None:
        """Connect every receiver and form the data plane now, so the first ``send`` pays
        for neither (rank 0 over a transport; elsewhere ``connect``).

        Every receiver must be waiting for the sender meanwhile: in ``Receiver.warm_up``
        (an engine's init call: ``VLLMRollout`` does this) or in ``Receiver.receive``.
        ``source``: what ``send`` will send (a module, a state dict); the transport's
        buffers are then sized by its plan, as a sync would size them. Without one they
        are left to the first sync (1-byte buffers now, rather than two full buckets of
        2 GiB by default for a model that may need far less): ``nccl`` keeps its group and
        grows them, ``shm`` makes its ring then. With ``paired`` and more than one trainer
        rank only the connections are made (the other trainer ranks join the data plane in
        their first ``send``).
        Raises ``SyncError`` naming the receivers that refused or failed to join.
        """
        self.connect()
        if self._peers.server is None or self._transport is None:
            return
        self._peers.doing = "the warm-up"
        if self._peers.trainers.count or self._stages.plane_in_sync:
            handshake.warm_connections(self._peers, self.config)  # the data plane forms in the first sync
            return
        specs = (
            self._stages.source(source, self.wire_dtype, self.form).specs() if source is not None else None
        )
        plan = make_plan(specs, self.config.bucket_bytes) if specs is not None else None
        handshake.warm_up(self._peers, self._transport, self.config, plan)

    def close(self) -> None:
        """Close connections (telling receivers the session ends, so they do not wait to
        join again), the engine and the listening socket."""
        self._peers.close()
        for engine in (self._transport, self._publisher):
            if engine is not None:
                engine.close()
        self._transport = self._publisher = None
        if self._follower is not None:
            self._follower.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ sync
    def send(
        self, source: Any, version: int, *, wire_dtype: torch.dtype | None = None, force: bool = False
    ) -> SyncStats:
        """Send one weight version to every receiver and wait until all confirmed it.

        ``source``: an ``nn.Module``, a state dict, an iterable of ``(name, tensor)`` or a
        ``WeightSource``. A receiver refuses a version older than the one it holds unless
        ``force`` (a deliberate rollback). Raises ``SyncError`` (naming the peer, with its
        rank in ``.ranks``) on any failure.
        """
        src = self._stages.source(source, wire_dtype or self.wire_dtype, self.form)
        start = time.perf_counter()
        self._peers.doing = f"the transfer of version {version}"
        if self._publisher is not None and (self.rank == 0 or self._publisher.colocated):
            return self._finish_stats(self._publisher.publish(src, version, self.receivers, force), start)
        if self._transport is None:  # this rank does not send: drain
            count = sum(1 for _ in src.tensors())  # materializing shards is collective
            return self._finish_stats(SyncStats(version, tensors=count), start)
        # before waiting for anyone: what the backend cannot carry is refused now
        plan = self._stages.plan(src)
        self.connect()  # waiting for peers to start is not part of the sync's time
        start = time.perf_counter()
        if self._follower is not None:
            stats = self._follower.send(self._transport, self._stages, src, version, plan, self.num_receivers)
            return self._finish_stats(stats, start)
        return self._finish_stats(self._send_session(src, version, plan, force, start), start)

    def _send_session(
        self, src: WeightSource, version: int, plan: Plan | None, force: bool, start: float
    ) -> SyncStats:
        """One sync; with ``drop_lost_receivers``, receivers lost in it leave the members,
        and where the transport routes around them the others take the version again now."""
        dropped: list[int] = []
        again: list[int] | None = None  # the receivers that take the version again
        while True:
            try:
                with self._peers.only(again):
                    stats = self._sync_once(src, version, plan, force, start)
                stats.dropped = dropped
                return stats
            except PeerLost as e:
                rerouting, self._rerouting = self._rerouting, False
                if not self.config.drop_lost_receivers or not self._peers.lose(e.ranks):
                    raise
                dropped += e.ranks
                if not rerouting:
                    e.args = (
                        f"{e}; dropped from the receivers (drop_lost_receivers): the next sync goes to "
                        f"receiver rank(s) {self.receivers}",
                    )
                    raise
            log.warning(
                "version %d: receiver rank(s) %s lost and dropped (drop_lost_receivers); the others take "
                "it again through a new data plane",
                version,
                dropped,
            )
            try:  # to those of this attempt still connected (one that held it said so at an earlier re-route)
                channels = self._peers.channels
                others = {r: channels[r] for r in again or channels if r in channels}
                again = reroute.tell(others, version, dropped, self.config.timeout_s)
            except Exception as e:
                self._peers.drop()
                self._peers.raise_explained(e, f"re-routing version {version}")
            if not again:  # every receiver left had completed it before the loss
                return SyncStats(version, receivers=self.num_receivers, dropped=dropped)

    def _sync_once(
        self, src: WeightSource, version: int, plan: Plan | None, force: bool, start: float
    ) -> SyncStats:
        """Trainer rank 0 over a transport, in phases: the stages' encoding, the handshake,
        the transfer, verification, acknowledgements."""
        transport = self._transport
        assert transport is not None and self._peers.server is not None
        stats = SyncStats(version, receivers=self.num_receivers)
        self._confirmed = set()
        senders = self._peers.trainers.count + 1
        self._stages.start(self._peers.members(self.num_trainers, senders))
        bucket = self.config.bucket_bytes
        base = Outgoing(src, plan, version)
        # Before the handshake: what goes on the wire may depend on what changed.
        try:
            out = self._stages.encode(base)
        except Exception as e:  # the source failed before the handshake: end the receivers' wait
            self.cancel(version, f"{type(e).__name__}: {e}")
            raise
        join = self._peers.join(version, senders, capacity(out.plan, bucket))
        # "broken": the transport or a peer failed mid-protocol, so connections and group
        # are in an unknown state and are rebuilt; "refused": a receiver refused or failed
        # cleanly, everyone is between syncs and the connections stay.
        outcome, lost = "broken", []
        went = False  # the go was given: other trainer ranks then wait for the outcome
        try:
            plane = handshake.Plane(transport, join, senders)
            offer = handshake.Offer(version, force, self._may_reroute)
            stats.plan_sent_to, out = handshake.agree(
                self._peers, self._stages, self.config, offer, plane, base, out
            )
            went = True
            transport.connect(self._stages.join(plane.join, bucket), plane.info)
            stats.handshake_s = time.perf_counter() - start  # handshake and group join
            deadline = Deadline(self.config.timeout_s, f"in the transfer of version {version}")
            sums = self._transfer(out, stats, deadline)
            self._verification(out, sums, deadline)
            self._confirmed = set()
            self._peers.gather_done(version, self._confirmed)
            outcome = "ok"
            log.info(
                "sent version %d: %d tensors, %.1f MB in %d buckets to %d receivers",
                version,
                stats.tensors,
                stats.bytes / 1e6,
                stats.buckets,
                self.num_receivers,
            )
        except (HandshakeError, RemoteFailure) as e:
            outcome = "refused"
            if went:
                self._peers.trainers.tell(version, str(e), self.config.timeout_s)
            raise
        except Exception as e:
            error = self._peers.explain(e, f"sync of version {version}")
            if (
                self._may_reroute(out.plan)
                and isinstance(error, PeerLost)
                and set(self._peers.channels) - set(error.ranks)
            ):
                outcome, self._rerouting, lost = (
                    "rerouted",
                    True,
                    error.ranks,
                )  # the others stay connected for it
            # explained in place (a SourceFailed, a peer already named): it keeps its own cause,
            # for a SourceFailed the source's exception, where `from e` would make it its own
            if error is e:
                raise
            raise error from e
        finally:
            if outcome == "ok":
                self._peers.trainers.tell(version, None, self.config.timeout_s)
            self._stages.finished(
                time.perf_counter() - start - stats.handshake_s if outcome == "ok" else None,
                self._confirmed if outcome != "ok" else set(self._peers.channels),
            )
            transport.finish(ok=outcome not in ("broken", "rerouted"))
            if outcome == "ok" and out.plan is not None:
                self._peers.acked_plan = {r: out.plan.hash for r in self._peers.channels}
            elif out.plan is not None:
                # a receiver adopts a new plan at the handshake, before the transfer: after a
                # failed sync one that held another may hold this one or that, so the next
                # sync sends it its plan
                for r, held in list(self._peers.acked_plan.items()):
                    if held != out.plan.hash:
                        del self._peers.acked_plan[r]
            if outcome in ("broken", "rerouted"):  # receivers see the failure and reconnect
                self._peers.drop(lost if outcome == "rerouted" else None)
        return stats

    def _may_reroute(self, plan: Plan | None) -> bool:
        """Receivers lost in this sync may be routed around in it (the source is then read
        again: it must announce its tensors, a bare iterator could not be)."""
        return (
            self.config.drop_lost_receivers
            and self.engine_cls.reroutes
            and plan is not None
            and not self._peers.trainers.count
        )

    def _transfer(self, out: Outgoing, stats: SyncStats, deadline: Deadline) -> dict[int, dict[int, int]]:
        """Pack ``out`` by its plan and move it (other trainer ranks send their shares);
        returns, when ``verify`` is on, each sent bucket's checksum by trainer rank (rank 0's
        are every bucket's, unless the route stage keeps each rank's own)."""
        transport = self._transport
        assert transport is not None
        packer, produce, sums = producer(
            out.source,
            self.config.bucket_bytes,
            out.plan,
            self.config.verify,
            announce=lambda m: self._peers.broadcast(m, deadline),
            sends=transport.sends if self._all_send else None,
        )
        t0 = time.perf_counter()
        stats.wire_bytes = transport.send_buckets(produce)  # buckets, alignment padding included
        stats.transfer_s = time.perf_counter() - t0
        transport.account(stats)
        stats.buckets, stats.tensors, stats.bytes = packer.buckets, packer.pulled, packer.nbytes
        # each trainer rank's checksums: kept apart where its buckets are its own
        rank_sums = {0: sums}
        if self._peers.trainers.channels:
            assert out.plan is not None
            kept = rank_sums if self._stages.own_buckets else None
            stats.wire_bytes += self._peers.trainers.gather_shares(out.version, sums, deadline, kept)
            stats.buckets = len(out.plan.buckets)
            stats.bytes = sum(s.nbytes for s in out.plan.tensors)
        self._stages.account(stats)  # where a stage knows the sync's figures better than the packer
        return rank_sums

    def _verification(self, out: Outgoing, rank_sums: dict[int, dict[int, int]], deadline: Deadline) -> None:
        """``verify``: the sent buckets' checksums follow the transfer, in plan order, with
        the fields stages add (each receiver's own list, where a stage routes buckets)."""
        mode = self.config.verify
        if mode == "off":
            return
        lists = self._stages.checksums(out, rank_sums, self.config.bucket_bytes)
        if lists is not None:  # each receiver rank's own buckets
            for q, rank in enumerate(self.receivers):
                self._peers.channels[rank].send(
                    {"type": "verify", "mode": mode, "checksums": lists[q]}, deadline
                )
            return
        sums = rank_sums[0]
        order = [sums[b.index] for b in out.plan.buckets] if out.plan is not None else list(sums.values())
        self._peers.broadcast(
            {"type": "verify", "mode": mode, "checksums": order, **self._stages.verify_fields(mode)}, deadline
        )

    async def send_async(self, source: Any, version: int, **kwargs: Any) -> SyncStats:
        """``send`` in a worker thread, for asyncio controllers."""
        return await asyncio.to_thread(self.send, source, version, **kwargs)

    def _finish_stats(self, stats: SyncStats, start: float) -> SyncStats:
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return stats

    def cancel(self, version: int, reason: str) -> None:
        """Tell the receivers waiting for the sync of ``version`` that it will not come."""
        self._peers.cancel(version, reason)
