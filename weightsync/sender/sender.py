"""``Sender``: the trainer side of a weight sync.

One path per family. With a publisher backend (``naive``, ``disk``) the publisher hands the
version over. With a transport backend, trainer rank 0 runs the session; every sync goes
plan -> handshake -> transport -> acknowledgements. Other trainer ranks drain their source
(materializing sharded tensors is collective), or, where every trainer rank sends
(``paired``), follow rank 0's sync and send their share (``weightsync.sender.ranks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import SECRET_ENV
from weightsync.delta.send_stage import Outgoing, SendStage
from weightsync.engines.base import Join, Publisher, Transport
from weightsync.engines.registry import get_engine
from weightsync.errors import HandshakeError, PeerLost, RemoteFailure, SyncError
from weightsync.plan import Plan, capacity, make_plan
from weightsync.sender.packer import producer
from weightsync.sender.ranks import TrainerFollower, TrainerPeers
from weightsync.sender.replies import answers, dead_ranks, explain, gather_done, lost_receivers
from weightsync.sender.route_stage import DenseSend, Members, SendRoute
from weightsync.sender.sharded_route import ShardedSend
from weightsync.session import reroute
from weightsync.session.auth import reachable_from_other_hosts
from weightsync.session.channel import PROTOCOL_VERSION, Channel, Deadline
from weightsync.session.control import ControlServer, PartlyConnected
from weightsync.sharding.agreement import RECEIVER, TRAINER
from weightsync.sources import WeightSource, as_source
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
    ) -> None:
        config.validate()
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers}: need at least one receiver")
        self.config = config
        self._members = set(range(num_receivers))
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._num_trainers = num_trainers or (dist.get_world_size() if dist.is_initialized() else 1)
        self.engine_cls = get_engine(config.backend)
        self._all_send = issubclass(self.engine_cls, Transport) and self.engine_cls.all_ranks_send
        sharded = issubclass(self.engine_cls, Transport) and self.engine_cls.sharded
        #: the route stage: what each sync's wire entries are and where they go
        self._route: SendRoute = ShardedSend() if sharded else DenseSend()
        if self._all_send and not 0 <= self.rank < self.num_trainers:
            raise ValueError(
                f"rank {self.rank} is not one of the {self.num_trainers} trainer rank(s) (num_trainers)"
            )
        self.wire_dtype = wire_dtype
        self.device = platform.local_device(device)
        self.address = address
        self.last_stats: SyncStats | None = None
        self._publisher: Publisher | None = None
        self._transport: Transport | None = None
        self._server: ControlServer | None = None
        self._channels: dict[int, Channel] = {}  # receiver rank -> its control connection
        self._trainers = TrainerPeers(self.num_trainers - 1 if self._all_send else 0)
        self._follower: TrainerFollower | None = None
        self._acked_plan: dict[int, str] = {}  # receiver rank -> plan hash it holds
        self._delta_stage = SendStage(
            config.delta, config.bucket_bytes
        )  # the delta stage (weightsync.delta.send_stage)
        self._confirmed: set[int] = set()  # receivers that confirmed the last sync
        self._rerouting = False  # the failed sync's others wait to take its version again
        self._dropped: set[int] = set()  # lost and dropped (drop_lost_receivers), not added back
        self._doing = ""  # what the session is in, for messages ("the transfer of version 3")
        if issubclass(self.engine_cls, Publisher):
            self._publisher = self.engine_cls(config, self.device, address)
        elif self.rank == 0:  # rank 0 runs the session
            self._transport = self.engine_cls(config, self.device)
            self._server = ControlServer(address)
            self.address = self._server.address
            if config.secret() is None and reachable_from_other_hosts(self._server.sock.getsockname()[0]):
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
        if others != self._trainers.count:
            self._trainers.close()  # a new set of trainer ranks joins at the next send
            self._trainers.count = others
            if self._transport is not None:
                self._transport.reset()

    @property
    def num_receivers(self) -> int:
        return len(self._members)

    @property
    def receivers(self) -> list[int]:
        """Ranks of the receivers every sync goes to."""
        return sorted(self._members)

    @property
    def dropped(self) -> list[int]:
        """Ranks of the receivers lost mid-sync and dropped (``drop_lost_receivers``) that
        were not added back (``add_receiver``) or removed (``remove_receiver``) since."""
        return sorted(self._dropped)

    def remove_receiver(self, rank: int) -> None:
        """Stop syncing to receiver ``rank`` (say, its process died: a failed ``send`` names
        it in ``SyncError.ranks``). The next ``send`` goes to the others. A receiver dropped
        already (``drop_lost_receivers``) stays dropped."""
        if rank in self._dropped:
            self._dropped.discard(rank)
            return
        if rank not in self._members:
            raise ValueError(f"receiver rank {rank} is not a member (members: {self.receivers})")
        if len(self._members) == 1:
            raise ValueError(f"receiver rank {rank} is the last receiver; a sync needs at least one")
        self._members.discard(rank)
        if rank in self._channels:
            self._drop_receivers([rank])
        if self._transport is not None:
            self._transport.reset()  # the data plane is rebuilt for the new membership

    def add_receiver(self, rank: int) -> None:
        """Sync to receiver ``rank`` again (or a replacement with that rank); the next
        ``send`` waits for it to connect."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"receiver rank must be a non-negative int, got {rank!r}")
        self._members.add(rank)
        self._dropped.discard(rank)

    def _watch_peers(self) -> None:
        """Raise if a peer's control connection closed (its process is likely gone)."""
        dead = dead_ranks(self._channels)
        gone = self._trainers.dead()
        if dead or gone:
            raise PeerLost(lost_receivers(self._channels, dead, f"during {self._doing}", gone), ranks=dead)

    def _group_rank(self, rank: int) -> int:
        """A receiver's rank in the data-plane group: its place among the members, after 0."""
        return self.receivers.index(rank) + 1

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Wait (up to ``timeout_s``) until every receiver (and, with ``paired``, every
        other trainer rank) is connected. ``send`` calls it."""
        if self._follower is not None:
            self._follower.connect()
        if self._server is None:  # a publisher, or a trainer rank that does not run the session
            return
        assert self._transport is not None
        # Gone since the last sync: accept them anew. One that went silent (its host cut off,
        # say) gets the heartbeat grace to come back, not the whole deadline.
        silent = {}
        for rank in dead_ranks(self._channels):
            if self._channels[rank].silent:
                silent[rank] = self._channels[rank].gone("since the last sync")
            self._drop_receivers([rank])
        missing: set[Any] = (self._members - set(self._channels)) | self._trainers.missing()
        if missing:
            accepted: dict[Any, Channel] = {}
            grace = self.config.heartbeat_grace if silent and missing <= set(silent) else None
            try:
                accepted = self._server.accept(missing, self.config, seconds=grace)
            except PartlyConnected as e:
                accepted = e.connected  # those that came stay connected for the next try
                if grace is not None:
                    raise PeerLost(
                        "; ".join(
                            f"{silent[r]}, and it did not come back within {grace:.1f} s" for r in e.ranks
                        ),
                        ranks=e.ranks,
                    ) from None
                raise
            finally:
                for key, ch in accepted.items():
                    if isinstance(key, int):
                        self._channels[key] = ch
                    else:
                        self._trainers.channels[key[1]] = ch
                self._transport.reset()  # new members: every rank joins a new data-plane group

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
        transport = self._transport
        if self._server is None or transport is None:
            return
        self._doing = "the warm-up"
        if self._trainers.count or self._route.forms_in_sync:
            self._warm_connections_only()
            return
        specs = as_source(source, self.wire_dtype).specs() if source is not None else None
        plan = make_plan(specs, self.config.bucket_bytes) if specs is not None else None
        size = capacity(plan, self.config.bucket_bytes) if plan is not None else 1
        join = self._join(0, 1, size)
        outcome = "broken"
        try:
            info = {**transport.prepare(join), "world_size": join.world_size, "senders": 1}
            deadline = Deadline(self.config.timeout_s, "in the warm-up")
            msg: dict[str, Any] = {
                "type": "warmup",
                "protocol": PROTOCOL_VERSION,
                "bucket_bytes": self.config.bucket_bytes,
                "capacity": size,
            }
            if (
                plan is not None
            ):  # receivers may prepare for it (landing memory); the first sync sends its hash
                msg |= {"plan": plan.to_wire(), "plan_hash": plan.hash}
            for rank, ch in self._channels.items():
                ch.send({**msg, "engine": {**info, "rank": self._group_rank(rank)}}, deadline)
            peers = [(f"receiver rank {r}", r, ch) for r, ch in sorted(self._channels.items())]
            answers(peers, deadline, "refused the warm-up")
            for _, _, ch in peers:
                ch.send({"type": "go"}, deadline)
            transport.connect(join, info)  # its own deadline: timeout_s
            joined = Deadline(self.config.timeout_s, "waiting for receivers to confirm the warm-up")
            for _, _, ch in peers:
                ch.recv(joined, expect="joined")
            outcome = "ok"
            if plan is not None:
                self._acked_plan = {r: plan.hash for r in self._channels}
        except HandshakeError:
            outcome = "refused"
            raise
        except Exception as e:
            self._raise_explained(e, "warm-up")
        finally:
            transport.finish(ok=outcome != "broken")
            if outcome == "broken":
                self._drop_receivers()  # receivers see the failure and reconnect
        log.info("warmed up: %d receivers joined the %s data plane", self.num_receivers, self.config.backend)

    def _join(self, version: int, senders: int, capacity_bytes: int) -> Join:
        """Trainer rank 0's ``Join`` record: the host of the data plane, on the control
        socket's interface (any, where that listens on a wildcard)."""
        assert self._server is not None
        wildcard = self._server.host in ("", "0.0.0.0", "::")
        return Join(
            version=version,
            rank=0,
            world_size=self.num_receivers + senders,
            senders=senders,
            capacity=capacity_bytes,
            name="trainer rank 0",
            local_host=None if wildcard else self._server.host,
            peer_hosts=tuple(self._channels[r].sock.getpeername()[0] for r in sorted(self._channels)),
            watch=self._watch_peers,
        )

    def _warm_connections_only(self) -> None:
        """Tell the receivers that this warm-up makes no data plane (other trainer ranks
        join it in their first ``send``), so those waiting in ``Receiver.warm_up`` return."""
        deadline = Deadline(self.config.timeout_s, "in the warm-up")
        try:
            for ch in self._channels.values():
                ch.send({"type": "warmup", "protocol": PROTOCOL_VERSION, "engine": None}, deadline)
            for ch in self._channels.values():
                ch.recv(deadline, expect="joined")
        except Exception as e:
            self._drop_receivers()
            self._raise_explained(e, "warm-up")

    def _drop_receivers(self, ranks: list[int] | None = None) -> None:
        """Close connections to these receivers (None: to every peer, trainers included)."""
        for rank in list(self._channels) if ranks is None else ranks:
            self._channels.pop(rank).close()
            self._acked_plan.pop(rank, None)
        if ranks is None:
            self._trainers.close()

    def close(self) -> None:
        """Close connections (telling receivers the session ends, so they do not wait to
        join again), the engine and the listening socket."""
        for ch in self._channels.values():
            try:
                ch.send({"type": "closing"}, Deadline(1.0, "saying goodbye"))
            except SyncError:
                pass
        self._drop_receivers()
        for engine in (self._transport, self._publisher):
            if engine is not None:
                engine.close()
        self._transport = self._publisher = None
        if self._follower is not None:
            self._follower.close()
        if self._server is not None:
            self._server.close()
            self._server = None

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
        src = self._route.source(source, wire_dtype or self.wire_dtype)
        start = time.perf_counter()
        self._doing = f"the transfer of version {version}"
        if self._publisher is not None and (self.rank == 0 or self._publisher.colocated):
            return self._finish_stats(self._publisher.publish(src, version, self.receivers, force), start)
        if self._transport is None:  # this rank does not send: drain
            count = sum(1 for _ in src.tensors())  # materializing shards is collective
            return self._finish_stats(SyncStats(version, tensors=count), start)
        # before waiting for anyone: what the backend cannot carry is refused now
        plan = self._route.plan(src, self.config, self.engine_cls, self._all_send)
        self.connect()  # waiting for peers to start is not part of the sync's time
        start = time.perf_counter()
        if self._follower is not None:
            stats = self._route.follow(
                self._follower, self._transport, src, version, plan, self.num_receivers
            )
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
                with self._only(again):
                    stats = self._sync_once(src, version, plan, force, start)
                stats.dropped = dropped
                return stats
            except PeerLost as e:
                rerouting, self._rerouting = self._rerouting, False
                if not self.config.drop_lost_receivers or not set(self._members) - set(e.ranks):
                    raise
                dropped += e.ranks
                self._members -= set(e.ranks)
                self._dropped |= set(e.ranks)
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
                others = {r: self._channels[r] for r in again or self._channels if r in self._channels}
                again = reroute.tell(others, version, dropped, self.config.timeout_s)
            except Exception as e:
                self._drop_receivers()
                self._raise_explained(e, f"re-routing version {version}")
            if not again:  # every receiver left had completed it before the loss
                return SyncStats(version, receivers=self.num_receivers, dropped=dropped)

    @contextlib.contextmanager
    def _only(self, ranks: list[int] | None) -> Iterator[None]:
        """The sync in this block goes to these receivers only (None: every member)."""
        if ranks is None:
            yield
            return
        members, channels = self._members, self._channels
        self._members, self._channels = set(ranks), {r: channels[r] for r in ranks}
        try:
            yield
        finally:  # channels the block dropped stay dropped
            self._members = members
            self._channels = {r: ch for r, ch in channels.items() if r not in ranks} | self._channels

    def _sync_once(
        self, src: WeightSource, version: int, plan: Plan | None, force: bool, start: float
    ) -> SyncStats:
        """Trainer rank 0 over a transport, in phases: the delta stage, the handshake, the
        transfer, verification, acknowledgements."""
        transport = self._transport
        assert transport is not None and self._server is not None
        stats = SyncStats(version, receivers=self.num_receivers)
        self._confirmed = set()
        self._route.start()
        senders = self._trainers.count + 1
        # Before the handshake: the plan of a delta sync depends on what changed.
        try:
            out = self._delta_stage.encode(src, plan, version, self.receivers, senders)
        except Exception as e:  # the source failed before the handshake: end the receivers' wait
            self.cancel(version, f"{type(e).__name__}: {e}")
            raise
        join = self._join(version, senders, capacity(out.plan, self.config.bucket_bytes))
        # "broken": the transport or a peer failed mid-protocol, so connections and group
        # are in an unknown state and are rebuilt; "refused": a receiver refused or failed
        # cleanly, everyone is between syncs and the connections stay.
        outcome, lost = "broken", []
        went = False  # the go was given: other trainer ranks then wait for the outcome
        try:
            info = {**transport.prepare(join), "world_size": join.world_size, "senders": senders}
            stats.plan_sent_to, out = self._handshake(version, out, info, force)
            went = True
            transport.connect(self._route.join(join, self.config.bucket_bytes), info)
            stats.handshake_s = time.perf_counter() - start  # handshake and group join
            deadline = Deadline(self.config.timeout_s, f"in the transfer of version {version}")
            sums = self._transfer(out, stats, deadline)
            self._verification(out, sums, deadline)
            self._gather_done(version)
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
                self._trainers.tell(version, str(e), self.config.timeout_s)
            raise
        except Exception as e:
            error = self._explain(e, f"sync of version {version}")
            if (
                self._may_reroute(out.plan)
                and isinstance(error, PeerLost)
                and set(self._channels) - set(error.ranks)
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
                self._trainers.tell(version, None, self.config.timeout_s)
            out.finished(
                time.perf_counter() - start - stats.handshake_s if outcome == "ok" else None,
                self._confirmed if outcome != "ok" else set(self._channels),
            )
            transport.finish(ok=outcome not in ("broken", "rerouted"))
            if outcome == "ok" and out.plan is not None:
                self._acked_plan = {r: out.plan.hash for r in self._channels}
            if outcome in ("broken", "rerouted"):  # receivers see the failure and reconnect
                self._drop_receivers(lost if outcome == "rerouted" else None)
        return stats

    def _may_reroute(self, plan: Plan | None) -> bool:
        """Receivers lost in this sync may be routed around in it (the source is then read
        again: it must announce its tensors, a bare iterator could not be)."""
        return (
            self.config.drop_lost_receivers
            and self.engine_cls.reroutes
            and plan is not None
            and not self._trainers.count
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
            announce=lambda m: self._broadcast_msg(m, deadline),
            sends=transport.sends if self._all_send else None,
        )
        t0 = time.perf_counter()
        stats.wire_bytes = transport.send_buckets(produce)  # buckets, alignment padding included
        stats.transfer_s = time.perf_counter() - t0
        stats.buckets, stats.tensors, stats.bytes = packer.buckets, packer.pulled, packer.nbytes
        # each trainer rank's checksums: kept apart where its buckets are its own
        rank_sums = {0: sums}
        if self._trainers.channels:
            assert out.plan is not None
            kept = rank_sums if self._route.own_buckets else None
            stats.wire_bytes += self._trainers.gather_shares(out.version, sums, deadline, kept)
            stats.buckets = len(out.plan.buckets)
            stats.bytes = sum(s.nbytes for s in out.plan.tensors)
        self._route.account(stats)
        out.account(stats)  # a delta sync counts the model's bytes, not the wire's
        return rank_sums

    def _verification(self, out: Outgoing, rank_sums: dict[int, dict[int, int]], deadline: Deadline) -> None:
        """``verify``: the sent buckets' checksums follow the transfer, in plan order (and a
        delta sync's checksums of the tensors receivers reconstruct)."""
        mode = self.config.verify
        if mode == "off":
            return
        lists = self._route.checksums(out, rank_sums, self._members_now(), self.config.bucket_bytes)
        if lists is not None:  # each receiver rank's own buckets
            for q, rank in enumerate(self.receivers):
                self._channels[rank].send({"type": "verify", "mode": mode, "checksums": lists[q]}, deadline)
            return
        sums = rank_sums[0]
        order = [sums[b.index] for b in out.plan.buckets] if out.plan is not None else list(sums.values())
        self._broadcast_msg(
            {"type": "verify", "mode": mode, "checksums": order, **out.verify_fields(mode)}, deadline
        )

    async def send_async(self, source: Any, version: int, **kwargs: Any) -> SyncStats:
        """``send`` in a worker thread, for asyncio controllers."""
        return await asyncio.to_thread(self.send, source, version, **kwargs)

    def _finish_stats(self, stats: SyncStats, start: float) -> SyncStats:
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return stats

    def _broadcast_msg(self, msg: dict[str, Any], deadline: Deadline) -> None:
        for ch in self._channels.values():
            ch.send(msg, deadline)

    def _handshake(
        self, version: int, out: Outgoing, info: dict[str, Any], force: bool
    ) -> tuple[int, Outgoing]:
        """Agree on version, bucket size and plan with every receiver (and trainer rank);
        return how many receivers got the full plan, and what this rank packs. Another
        round is offered where the delta stage has a receiver's answer call for it (a dense
        section for a receiver without the base), or the route stage (a new layout)."""
        members = self._members_now()
        while True:
            plans_sent, peers, replies, deadline = self._offer(version, out, info, force, members)
            again = out.again(replies)
            if again is None:
                sides = [(RECEIVER, r) for r in sorted(self._channels)]
                sides += [(TRAINER, i) for i in sorted(self._trainers.channels)]
                answered = [(side, rank, reply) for (side, rank), (_, reply) in zip(sides, replies)]
                try:
                    if self._route.answered(out, answered, members):
                        again = out  # the same sync, offered with the route the new layouts make
                except ValueError as e:
                    self._abort(peers, deadline, str(e), e)
            for _, _, ch in peers:
                ch.send({"type": "again" if again is not None else "go"}, deadline)
            if again is None:
                return plans_sent, self._route.own(out, members, self.config.bucket_bytes)
            out = again

    def _members_now(self) -> Members:
        """The sync's members as the route stage sees them."""
        assert self._server is not None
        host = self._server.host  # in a layout: where rank 0's bytes leave from
        return Members(
            receivers=tuple(self.receivers),
            trainers=self.num_trainers,
            host=socket.gethostname() if host in ("", "0.0.0.0", "::") else host,
        )

    def _abort(
        self,
        peers: list[tuple[str, int | None, Channel]],
        deadline: Deadline,
        reason: str,
        cause: Exception | None = None,
    ) -> NoReturn:
        """End the handshake: every peer told why, ``HandshakeError`` raised."""
        for _, _, ch in peers:
            with contextlib.suppress(SyncError):
                ch.send({"type": "abort", "message": reason}, deadline)
        raise HandshakeError(reason) from cause

    def _offer(
        self, version: int, out: Outgoing, info: dict[str, Any], force: bool, members: Members
    ) -> tuple[int, list[tuple[str, int | None, Channel]], list[tuple[int | None, dict[str, Any]]], Deadline]:
        """One round of the handshake: the sync message to every peer, and their answers.
        Returns how many receivers got the full plan, the peers, their replies (rank and
        reply) and the round's deadline."""
        deadline = Deadline(self.config.timeout_s, f"in the handshake of version {version}")
        plan = out.plan
        plans_sent = 0
        msg: dict[str, Any] = {}
        route = self._route.offer(out, members)
        for rank, ch in self._channels.items():
            msg = {
                "type": "sync",
                "protocol": PROTOCOL_VERSION,
                "version": version,
                "bucket_bytes": self.config.bucket_bytes,
                "plan_hash": plan.hash if plan is not None else None,
                "force": force,
                "verify": self.config.verify,
                "engine": {**info, "rank": self._group_rank(rank)},
                "reroute": self._may_reroute(plan),  # after a loss, wait for the sender's word
                **out.handshake_fields(),
                **route,
            }
            if plan is not None and self._acked_plan.get(rank) != plan.hash:
                msg["plan"] = plan.to_wire()  # unchanged plans travel as their hash only
                plans_sent += 1
            ch.send(msg, deadline)
        for ch, trainer_msg in self._trainers.sync_messages(msg, info, first_rank=self.num_receivers + 1):
            ch.send(trainer_msg, deadline)
        peers = [(f"receiver rank {r}", r, ch) for r, ch in sorted(self._channels.items())]
        peers += self._trainers.peers()
        return plans_sent, peers, answers(peers, deadline, f"refused version {version}"), deadline

    def _gather_done(self, version: int) -> None:
        self._confirmed = set()
        failures = gather_done(self._channels, version, self.config.timeout_s, self._confirmed)
        if failures:
            raise RemoteFailure("; ".join(failures.values()), ranks=list(failures))

    def cancel(self, version: int, reason: str) -> None:
        """Tell the receivers waiting for the sync of ``version`` that it will not come."""
        deadline = Deadline(min(2.0, self.config.timeout_s), f"cancelling version {version}")
        for ch in self._channels.values():
            with contextlib.suppress(SyncError):  # best effort: one gone does not stop the others
                ch.send({"type": "cancel", "version": version, "message": reason}, deadline)

    def _explain(self, error: Exception, what: str) -> Exception:
        return explain(error, what, self._channels, min(2.0, self.config.timeout_s), self._trainers.channels)

    def _raise_explained(self, error: Exception, what: str) -> NoReturn:
        """Raise ``error`` explained; one explained in place keeps its own cause (never
        itself)."""
        explained = self._explain(error, what)
        if explained is error:
            raise error
        raise explained from error
