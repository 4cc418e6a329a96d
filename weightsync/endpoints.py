"""``Sender`` and ``Receiver``: the public entry points of a weight sync.

A sync moves one weight version from the trainer (rank 0 sends; other trainer ranks drain
their source) to ``num_receivers`` rollout processes. The sender listens on ``address``;
receivers connect to it. Both are context managers; both offer async variants that run
the blocking transfer in a worker thread, so an asyncio controller's loop never blocks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.config import EngineConfig
from weightsync.engines import Engine, get_engine
from weightsync.engines.naive import NaiveEngine
from weightsync.plan import Assembler, Bucket, Plan, PlanBuilder, TensorSpec, as_bytes, make_plan, pack_pieces, plan_hash
from weightsync.session import (
    PROTOCOL_VERSION,
    Channel,
    ControlServer,
    Deadline,
    HandshakeError,
    PeerLost,
    ProtocolError,
    RemoteFailure,
    SyncError,
    SyncStats,
    VerificationError,
    connect,
)
from weightsync.sinks import ModuleSink, SinkError
from weightsync.sources import WeightSource, as_source
from weightsync.verify import checksum_fn

log = logging.getLogger("weightsync")


def _capacity(plan: Plan | None, bucket_bytes: int) -> int:
    """Buffer size a sync needs: its largest bucket (a streamed sync may fill a whole one)."""
    if plan is None:
        return bucket_bytes
    return max((b.nbytes for b in plan.buckets), default=1)


# ---------------------------------------------------------------------------- sender side
class _Packer:
    """Pulls tensors from a source in plan order and packs buckets from them.

    With a plan, buckets come from it; without one (a bare iterator), buckets are planned
    as tensors arrive and ``announce`` tells receivers each bucket before it is sent.
    Each tensor is held only until its last piece is packed. ``sends(bucket)`` (plan
    mode) says which buckets this rank sends; the others are passed over, their tensors
    still pulled in order (materializing a sharded tensor may be collective).
    """

    def __init__(self, source: WeightSource, bucket_bytes: int, plan: Plan | None, announce, sends=None) -> None:
        self.items = iter(source.tensors())
        self.plan = plan
        self.announce = announce
        self.sends = sends
        self.builder = None if plan is not None else PlanBuilder(bucket_bytes)
        self.ready: list[Bucket] = []
        self.held: dict[int, torch.Tensor] = {}
        self.pulled = 0
        self.position = 0  # buckets of the plan walked past
        self.buckets = 0  # buckets produced
        self.announced_specs = 0
        self.done = False

    def _pull(self) -> bool:
        try:
            name, tensor = next(self.items)
        except StopIteration:
            return False
        spec = TensorSpec.of(name, tensor)
        if self.plan is not None:
            if self.pulled >= len(self.plan.tensors):
                raise SyncError(f"the source yielded tensor {name!r} beyond the {len(self.plan.tensors)} it announced")
            expected = self.plan.tensors[self.pulled]
            if spec != expected:
                raise SyncError(
                    f"the source yielded {spec} where its specs announced {expected}; "
                    "a source must yield exactly what specs() says, in order"
                )
        else:
            self.ready += self.builder.add(spec)
        self.held[self.pulled] = as_bytes(tensor)
        self.pulled += 1
        return True

    def _next_bucket(self) -> Bucket | None:
        if self.plan is not None:
            while self.position < len(self.plan.buckets):
                bucket = self.plan.buckets[self.position]
                self.position += 1
                if self.sends is None or self.sends(bucket):
                    return bucket
                self._pull_for(bucket)  # another rank sends it: walk past, keep order
                self._release(bucket)
            return None
        while not self.ready and not self.done:
            if not self._pull():
                self.ready += self.builder.finish()
                self.done = True
        return self.ready.pop(0) if self.ready else None

    def __call__(self, buffer: torch.Tensor) -> tuple[Bucket, torch.Tensor] | None:
        bucket = self._next_bucket()
        if bucket is None:
            if self.plan is not None and self.pulled < len(self.plan.tensors):
                raise SyncError(f"the source ended after {self.pulled} of {len(self.plan.tensors)} announced tensors")
            if self.plan is not None and next(self.items, None) is not None:
                raise SyncError(f"the source yielded more than the {len(self.plan.tensors)} tensors it announced")
            if self.builder is not None:
                self.announce({"type": "end", "plan_hash": plan_hash(self.builder.specs, self.builder.bucket_bytes)})
            return None
        last = self._pull_for(bucket)
        payload = self._direct(bucket, buffer)
        if payload is None:
            pack_pieces(bucket, buffer, self.held)
            payload = buffer[: bucket.nbytes]
        self._release(bucket)
        if self.builder is not None:
            new = self.builder.specs[self.announced_specs : last + 1]
            self.announced_specs = max(self.announced_specs, last + 1)
            self.announce(
                {
                    "type": "bucket",
                    "bucket": bucket.to_wire(),
                    "tensors": [s.to_wire() for s in new],
                }
            )
        self.buckets += 1
        return bucket, payload

    @property
    def _specs(self) -> Sequence[TensorSpec]:
        return self.plan.tensors if self.plan is not None else self.builder.specs

    def _pull_for(self, bucket: Bucket) -> int:
        """Pull tensors until every one ``bucket`` needs is held; the last one's index."""
        last = max((p.tensor for p in bucket.pieces), default=-1)
        while self.pulled <= last:  # plan mode: pull what this bucket needs
            if not self._pull():
                raise SyncError(f"the source ended after {self.pulled} of {len(self._specs)} announced tensors")
        return last

    def _release(self, bucket: Bucket) -> None:
        specs = self._specs
        for p in bucket.pieces:
            if p.tensor_offset + p.length == specs[p.tensor].nbytes:
                self.held.pop(p.tensor, None)  # its last piece is out: let it go

    def _direct(self, bucket: Bucket, buffer: torch.Tensor) -> torch.Tensor | None:
        """The bucket's bytes as a view of its source tensor, if it is one range of one
        tensor already on the buffer's device: then nothing needs packing."""
        if len(bucket.pieces) != 1:
            return None
        p = bucket.pieces[0]
        src = self.held[p.tensor]
        if p.bucket_offset != 0 or not p.length or src.device != buffer.device:
            return None
        return src[p.tensor_offset : p.tensor_offset + p.length]


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
        self.num_trainers = num_trainers or (dist.get_world_size() if dist.is_initialized() else 1)
        self.engine_cls = get_engine(config.backend)
        if self.engine_cls.all_ranks_send and not 0 <= self.rank < self.num_trainers:
            raise ValueError(f"rank {self.rank} is not one of the {self.num_trainers} trainer rank(s) (num_trainers)")
        self.wire_dtype = wire_dtype
        self.device = platform.local_device(device)
        self.address = address
        self.last_stats: SyncStats | None = None
        self._server: ControlServer | None = None
        self._engine: Engine | None = None
        self._channels: dict[int, Channel] = {}
        # ``paired``: rank 0's connections to the other trainer ranks; theirs to rank 0
        self._trainers: dict[int, Channel] = {}
        self._acked_plan: dict[int, str] = {}
        self._sending: int | None = None  # the version in transfer, for messages
        if self.rank == 0 and not self.engine_cls.sessionless:  # rank 0 runs the session
            self._server = ControlServer(address)
            self.address = self._server.address

    # ------------------------------------------------------------------ membership
    @property
    def num_receivers(self) -> int:
        return len(self._members)

    @property
    def receivers(self) -> list[int]:
        """Ranks of the receivers every sync goes to."""
        return sorted(self._members)

    def remove_receiver(self, rank: int) -> None:
        """Stop syncing to receiver ``rank`` (say, its process died: a failed ``send`` names
        it in ``SyncError.ranks``). The next ``send`` goes to the others."""
        if rank not in self._members:
            raise ValueError(f"receiver rank {rank} is not a member (members: {self.receivers})")
        if len(self._members) == 1:
            raise ValueError(f"receiver rank {rank} is the last receiver; a sync needs at least one")
        self._members.discard(rank)
        if rank in self._channels:
            self._drop_peers([rank])
        if self._engine is not None:
            self._engine.reset()  # the data plane is rebuilt for the new membership

    def add_receiver(self, rank: int) -> None:
        """Sync to receiver ``rank`` again (or a replacement with that rank); the next
        ``send`` waits for it to connect."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"receiver rank must be a non-negative int, got {rank!r}")
        self._members.add(rank)

    def _watch_peers(self) -> None:
        """Raise if a peer's control connection closed (its process is likely gone)."""
        dead = [r for r, ch in self._channels.items() if ch.is_dead()]
        gone = [ch.peer for ch in self._trainers.values() if ch.is_dead()]
        if dead or gone:
            names = ", ".join([self._channels[r].peer for r in dead] + gone)
            raise PeerLost(f"{names} disconnected during the transfer of version {self._sending}", ranks=dead)

    @property
    def _shares_work(self) -> bool:
        """Every trainer rank sends (``paired``), not rank 0 alone."""
        return self.engine_cls.all_ranks_send

    def _group_rank(self, rank: int) -> int:
        """A receiver's rank in the data-plane group: its place among the members, after 0."""
        return self.receivers.index(rank) + 1

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Wait (up to ``timeout_s``) until every receiver (and, with ``paired``, every
        other trainer rank) is connected. ``send`` calls it."""
        if self._server is None:  # a sessionless backend, or not rank 0
            if self._shares_work and self.rank != 0:
                self._connect_to_rank0()
            return
        for rank in [r for r, ch in self._channels.items() if ch.is_dead()]:
            self._drop_peers([rank])  # it went away since the last sync: accept it anew
        for i in [i for i, ch in self._trainers.items() if ch.is_dead()]:
            self._trainers.pop(i).close()
        trainers = self.num_trainers if self._shares_work else 1
        missing = (self._members - set(self._channels)) | {("trainer", i) for i in range(1, trainers) if i not in self._trainers}
        if self._engine is None:
            self._engine = self.engine_cls(self.config, self.device, 0, self.num_receivers + trainers)
            self._engine.watch = self._watch_peers
            wildcard = self._server.host in ("", "0.0.0.0", "::")
            self._engine.local_host = None if wildcard else self._server.host
        if missing:
            for key, ch in self._server.accept(missing, self.config).items():
                if isinstance(key, int):
                    self._channels[key] = ch
                else:
                    self._trainers[key[1]] = ch
            self._engine.reset()  # new members: every rank joins a new data-plane group
        self._engine.world_size = self.num_receivers + trainers
        self._engine.num_senders = trainers

    def _connect_to_rank0(self) -> None:
        """Trainer rank > 0 of ``paired``: join rank 0's session (once; again after a failure)."""
        ch = self._trainers.get(0)
        if ch is not None and not ch.is_dead():
            return
        self._drop_peers()
        self._trainers[0] = ch = connect(self.address, self.rank, self.config, role="trainer")
        if self._engine is None:
            self._engine = self.engine_cls(self.config, self.device, self.rank, None)
            self._engine.watch = self._watch_peers
        self._engine.local_host = ch.sock.getsockname()[0]
        self._engine.sender_host = ch.sock.getpeername()[0]

    def _drop_peers(self, ranks: list[int] | None = None) -> None:
        """Close connections to these receivers (None: to every peer, trainers included)."""
        for rank in list(self._channels) if ranks is None else ranks:
            self._channels.pop(rank).close()
            self._acked_plan.pop(rank, None)
        if ranks is None:
            for ch in self._trainers.values():
                ch.close()
            self._trainers.clear()

    def close(self) -> None:
        """Close connections (telling receivers the session ends, so they do not wait to
        join again), the engine and the listening socket."""
        for ch in self._channels.values():
            try:
                ch.send({"type": "closing"}, Deadline(1.0, "saying goodbye"))
            except SyncError:
                pass
        self._drop_peers()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.engine_cls.colocated:
            NaiveEngine.forget(self.address)

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
        src = as_source(source, wire_dtype or self.wire_dtype)
        start = time.perf_counter()
        if self.engine_cls.colocated:  # every trainer rank hands over to its own rollout
            if not src.reiterable:
                src = as_source(dict(src.tensors()))
            NaiveEngine.publish(self.address, version, src)
            specs = src.specs() or []
            stats = SyncStats(version, tensors=len(specs), bytes=sum(s.nbytes for s in specs), receivers=self.num_receivers)
            return self._finish_stats(stats, start)
        if self.rank != 0 and not self._shares_work:
            count = sum(1 for _ in src.tensors())  # materializing shards is collective
            return self._finish_stats(SyncStats(version, tensors=count), start)
        if self.engine_cls.sessionless:  # the engine publishes and gathers acks itself (disk)
            if self._engine is None:
                self._engine = self.engine_cls(self.config, self.device, 0, None)
            self._sending = version
            return self._finish_stats(self._engine.publish(src, version, self.receivers, force), start)

        specs = src.specs()
        plan = make_plan(specs, self.config.bucket_bytes) if specs is not None else None
        self._check_plan(plan)  # before waiting for anyone
        self.connect()  # waiting for peers to start is not part of the sync's time
        start = time.perf_counter()
        self._sending = version
        assert self._engine is not None
        if self.rank != 0:
            return self._finish_stats(self._send_share(src, version, plan), start)
        stats = SyncStats(version, receivers=self.num_receivers)
        # "broken": the transport or a peer failed mid-protocol, so connections and group
        # are in an unknown state and are rebuilt; "refused": a receiver refused or failed
        # cleanly, everyone is between syncs and the connections stay.
        outcome = "broken"
        went = False  # the go was given: other trainer ranks then wait for the outcome
        try:
            self._engine.begin(version)
            self._engine.reserve(_capacity(plan, self.config.bucket_bytes))
            info = self._engine.prepare(self._server.host)
            stats.plan_sent_to = self._handshake(version, plan, info, force)
            went = True
            self._engine.connect(info)
            stats.handshake_s = time.perf_counter() - start  # handshake and group join
            deadline = Deadline(self.config.timeout_s, f"in the transfer of version {version}")
            packer, produce, sums = self._producer(src, plan, deadline)
            t0 = time.perf_counter()
            stats.bytes = self._engine.send_buckets(produce)
            stats.transfer_s = time.perf_counter() - t0
            stats.buckets, stats.tensors = packer.buckets, packer.pulled
            if self._trainers:
                stats.bytes += self._gather_shares(version, sums, deadline)
                stats.buckets = len(plan.buckets)
            if self.config.verify != "off":
                order = [sums[b.index] for b in plan.buckets] if plan is not None else list(sums.values())
                self._broadcast_msg({"type": "verify", "mode": self.config.verify, "checksums": order}, deadline)
            self._gather_done(version)
            outcome = "ok"
            log.info("sent version %d: %d tensors, %.1f MB in %d buckets to %d receivers",
                     version, stats.tensors, stats.bytes / 1e6, stats.buckets, self.num_receivers)
        except (HandshakeError, RemoteFailure) as e:
            outcome = "refused"
            if went:
                self._tell_trainers(version, str(e))
            raise
        except Exception as e:
            raise self._explain(e, version) from e
        finally:
            if outcome == "ok":
                self._tell_trainers(version, None)
            self._engine.finish(ok=outcome != "broken")
            if outcome == "ok" and plan is not None:
                self._acked_plan = {r: plan.hash for r in self._channels}
            if outcome == "broken":
                self._drop_peers()  # receivers see the failure and reconnect
        return self._finish_stats(stats, start)

    def _check_plan(self, plan: Plan | None) -> None:
        """Refuse what the backend cannot carry, before anything is sent."""
        if self._shares_work and plan is None:
            raise SyncError(
                f"backend {self.config.backend!r} needs a source that announces its tensors up front "
                "(a module or a state dict, the same on every trainer rank), not a bare iterator"
            )
        if plan is None or self.engine_cls.splits_tensors:
            return
        bucket = self.config.bucket_bytes
        for spec in plan.tensors:
            if spec.nbytes > bucket:
                raise SyncError(
                    f"backend {self.config.backend!r} never splits a tensor, and tensor {spec.name!r} "
                    f"({spec.nbytes / 2**20:.1f} MiB) is larger than a bucket ({bucket / 2**20:g} MiB): "
                    f"set update_weights_bucket_megabytes to at least {math.ceil(spec.nbytes / 2**20)}"
                )

    def _producer(self, src: WeightSource, plan: Plan | None, deadline: Deadline):
        """The packer over ``src`` and a producer for the engine that also records each
        sent bucket's checksum (bucket index -> checksum) when ``verify`` is on."""
        packer = _Packer(
            src, self.config.bucket_bytes, plan, lambda m: self._broadcast_msg(m, deadline),
            sends=self._engine.sends if self._shares_work else None,
        )
        checksum = checksum_fn(self.config.verify)
        sums: dict[int, int] = {}

        def produce(buffer: torch.Tensor) -> tuple[Bucket, torch.Tensor] | None:
            produced = packer(buffer)
            if produced is not None and checksum is not None:
                sums[produced[0].index] = checksum(produced[1])  # what leaves, before the transport
            return produced

        return packer, produce, sums

    def _gather_shares(self, version: int, sums: dict[int, int], deadline: Deadline) -> int:
        """Rank 0 of ``paired``: wait until every other trainer rank sent its share; merge
        their checksums into ``sums``; return the bytes they sent."""
        sent = 0
        for i, ch in sorted(self._trainers.items()):
            reply = ch.recv(deadline, expect="sent")
            if reply.get("ok") is not True:
                raise SyncError(f"trainer rank {i} failed to send its share of version {version}: {reply.get('message')}")
            for index, value in reply.get("checksums") or []:
                sums[int(index)] = value
            sent += int(reply.get("bytes") or 0)
        return sent

    def _tell_trainers(self, version: int, failure: str | None) -> None:
        """Rank 0 of ``paired``: the outcome, so every trainer rank's ``send`` agrees."""
        deadline = Deadline(self.config.timeout_s, f"reporting version {version} to the trainer ranks")
        for ch in list(self._trainers.values()):
            try:
                ch.send({"type": "result", "ok": failure is None, "message": failure}, deadline)
            except SyncError:
                pass  # it went away; it reconnects at its next send

    def _send_share(self, src: WeightSource, version: int, plan: Plan) -> SyncStats:
        """Trainer rank > 0 of ``paired``: follow rank 0's sync, send this rank's share."""
        assert self._engine is not None
        ch = self._trainers[0]
        stats = SyncStats(version, receivers=self.num_receivers)
        msg = ch.recv(Deadline(self.config.timeout_s, f"for trainer rank 0 to start version {version}"), expect="sync")
        deadline = Deadline(self.config.timeout_s, f"in the transfer of version {version}")
        problem = None
        if msg.get("version") != version:
            problem = f"trainer rank 0 sends version {msg.get('version')!r}, trainer rank {self.rank} version {version}"
        elif msg.get("plan_hash") != plan.hash:
            problem = (
                f"trainer rank {self.rank} holds other tensors than trainer rank 0 (plan {plan.hash[:12]} vs "
                f"{str(msg.get('plan_hash'))[:12]}): every rank must pass the same names, shapes and dtypes"
            )
        elif msg.get("verify") != self.config.verify or msg.get("bucket_bytes") != self.config.bucket_bytes:
            problem = f"trainer rank {self.rank}'s verify / bucket size differ from trainer rank 0's"
        if problem is not None:
            ch.send({"type": "error", "message": problem}, deadline)
            ch.recv(deadline, expect="abort")
            raise HandshakeError(problem)
        ch.send({"type": "ready"}, deadline)
        ch.recv(deadline, expect="go")  # an abort raises HandshakeError here
        ok = False
        try:
            info = msg["engine"]
            self._engine.rank = int(info["rank"])
            self._engine.begin(version)
            self._engine.connect(info)
            packer, produce, sums = self._producer(src, plan, deadline)
            t0 = time.perf_counter()
            stats.bytes = self._engine.send_buckets(produce)
            stats.transfer_s = time.perf_counter() - t0
            stats.buckets, stats.tensors = packer.buckets, packer.pulled
            ch.send({"type": "sent", "ok": True, "bytes": stats.bytes, "checksums": list(sums.items())}, deadline)
            result = ch.recv(Deadline(self.config.timeout_s, f"for the outcome of version {version}"), expect="result")
            ok = True
        except Exception as e:
            try:
                ch.send({"type": "sent", "ok": False, "message": f"{type(e).__name__}: {e}"}, deadline)
            except SyncError:
                pass
            self._drop_peers()  # connect anew at the next send
            raise e if isinstance(e, SyncError) else SyncError(
                f"trainer rank {self.rank}: sending its share of version {version} failed: {e}"
            ) from e
        finally:
            self._engine.finish(ok=ok)
        if result.get("ok") is not True:
            raise SyncError(f"version {version} failed (reported by trainer rank 0): {result.get('message')}")
        return stats

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

    def _handshake(self, version: int, plan: Plan | None, info: dict[str, Any], force: bool) -> int:
        """Agree on version, bucket size and plan with every receiver; return how many
        receivers got the full plan."""
        deadline = Deadline(self.config.timeout_s, f"in the handshake of version {version}")
        plans_sent = 0
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
            }
            if plan is not None and self._acked_plan.get(rank) != plan.hash:
                msg["plan"] = plan.to_wire()  # unchanged plans travel as their hash only
                plans_sent += 1
            ch.send(msg, deadline)
        for i, ch in self._trainers.items():  # they computed the plan themselves: hash only
            ch.send({**msg, "plan": None, "engine": {**info, "rank": self.num_receivers + i}}, deadline)
        peers = [(f"receiver rank {r}", r, ch) for r, ch in sorted(self._channels.items())]
        peers += [(f"trainer rank {i}", None, ch) for i, ch in sorted(self._trainers.items())]
        refusals = {}
        for name, rank, ch in peers:
            reply = ch.recv(deadline, expect=("ready", "error"))
            if reply["type"] == "error":
                refusals[name] = (rank, f"{name} refused version {version}: {reply.get('message')}")
        if refusals:
            reason = "; ".join(text for _, text in refusals.values())
            for _, _, ch in peers:
                try:  # best effort: a refusing peer may already have hung up
                    ch.send({"type": "abort", "message": reason}, deadline)
                except SyncError:
                    pass
            raise HandshakeError(reason, ranks=[r for r, _ in refusals.values() if r is not None])
        for _, _, ch in peers:
            ch.send({"type": "go"}, deadline)
        return plans_sent

    def _gather_done(self, version: int) -> None:
        deadline = Deadline(self.config.timeout_s, f"waiting for receivers to confirm version {version}")
        failures, lost = {}, {}
        for rank, ch in sorted(self._channels.items()):
            try:
                reply = ch.recv(deadline, expect="done")
            except PeerLost as e:  # read the others: they tell whether this one was alone
                lost[rank] = str(e)
                continue
            if reply.get("ok") is not True:
                failures[rank] = f"receiver rank {rank} failed version {version}: {reply.get('message')}"
        if lost:  # a receiver gone without a word is to blame; the others' failures follow from it
            raise PeerLost("; ".join([*lost.values(), *failures.values()]), ranks=list(lost))
        if failures:
            raise RemoteFailure("; ".join(failures.values()), ranks=list(failures))

    def _explain(self, error: Exception, version: int) -> Exception:
        """Turn a transport error into one that names the peer(s) that went away."""
        if isinstance(error, SyncError) and error.ranks:
            return error
        # A crashed peer's sockets all close at once, but the transport may notice first:
        # give its control connection a moment to show the EOF.
        grace = time.monotonic() + min(2.0, self.config.timeout_s)
        while not (dead := [r for r, ch in self._channels.items() if ch.is_dead()]) and time.monotonic() < grace:
            time.sleep(0.02)
        if isinstance(error, SyncError):  # raised by the session: it names the peer already
            error.ranks = dead
            return error
        if dead:
            names = ", ".join(self._channels[r].peer for r in dead)
            return SyncError(f"sync of version {version} failed: {names} disconnected ({error})", ranks=dead)
        return SyncError(f"sync of version {version} to {self.num_receivers} receiver(s) failed: {error}")


# ---------------------------------------------------------------------------- receiver side
class Receiver:
    """The rollout side of a weight sync.

    Args:
        config: engine configuration; must agree with the sender's (backend, bucket size).
        address: the sender's ``host:port``.
        rank: this receiver's index, ``0 .. num_receivers-1``.
        device: device of the transfer buffers (default: this process's accelerator, or CPU).

    State after each sync:

    - ``version``: the last version that arrived completely (None before the first); it
      advances only when every tensor of a version arrived (and passed ``verify``);
    - ``failed_version``: the version whose sync failed, if the latest attempt failed;
    - ``torn``: True when that failed sync had already delivered some tensors, so a model
      loaded in place holds a mix of ``version`` and ``failed_version``. A later complete
      sync (a retry of the same version, or a newer one) makes it whole again.

    A version older than ``version`` is refused unless the sender passes ``force=True``.
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str,
        rank: int,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.address = address
        self.rank = rank
        self.device = platform.local_device(device)
        self.engine_cls = get_engine(config.backend)
        self.version: int | None = None
        self.failed_version: int | None = None
        self.torn = False
        self.last_stats: SyncStats | None = None
        self._channel: Channel | None = None
        self._engine: Engine | None = None
        self._plan: Plan | None = None
        self._receiving: int | None = None  # the version in transfer, for messages

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        """Connect to the sender (retrying until ``timeout_s``). ``receive`` calls it."""
        if self._channel is not None and self._channel.is_dead():
            self._reset()  # the sender dropped us after a failed sync: join again
        if self.engine_cls.sessionless or self._channel is not None:
            return
        if self._engine is None:
            self._engine = self.engine_cls(self.config, self.device, self.rank + 1, None)
            self._engine.watch = self._watch_sender
        self._channel = connect(self.address, self.rank, self.config)
        self._engine.local_host = self._channel.sock.getsockname()[0]
        self._engine.sender_host = self._channel.sock.getpeername()[0]

    def _watch_sender(self) -> None:
        ch = self._channel
        if ch is not None and ch.is_dead():
            raise PeerLost(f"{ch.peer} closed the control connection during the transfer of version {self._receiving}")

    def _reset(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._plan = None

    def close(self) -> None:
        self._reset()
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ public sync API
    def receive(self, version: int | None = None, *, owned: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive one weight version, yielding ``(name, tensor)``.

        ``version``: the version expected (a different one fails on both sides); None
        takes whatever the sender sends. A yielded tensor may be a view into a transfer
        buffer: it is valid until the next item is requested, so copy what you keep; or
        pass ``owned=True`` to get tensors you may keep (a large tensor is then received
        straight into a new tensor where the backend allows, not copied twice).
        Stopping early (``break``) drains the rest and marks the version as failed.
        """
        return self._sync(version, sink=None, owned=owned)

    def load_into(self, module: torch.nn.Module, version: int | None = None) -> SyncStats:
        """Receive one version and copy it in place into ``module`` by name.

        Checks names, shapes and dtypes against the module before writing anything (when
        the sender's source announced its specs). Names the module has but the sync did not
        carry are logged and listed in ``stats.missing``.
        """
        sink = ModuleSink(module)
        items = self._sync(version, sink=sink)
        for name, tensor in items:
            try:
                sink.load(name, tensor)
            except Exception as e:  # let the sync drain and report, then re-raise here
                items.throw(e)
        stats = self.last_stats
        assert stats is not None
        stats.missing = sink.missing()
        if stats.missing:
            log.warning(
                "receiver rank %d: %d model tensor(s) not carried by version %s: %s",
                self.rank, len(stats.missing), stats.version, ", ".join(stats.missing[:8]),
            )
        return stats

    async def receive_async(self, version: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``receive`` with each blocking step in a worker thread."""
        items = self.receive(version)
        end = object()
        while (item := await asyncio.to_thread(next, items, end)) is not end:
            yield item  # type: ignore[misc]

    async def load_into_async(self, module: torch.nn.Module, version: int | None = None) -> SyncStats:
        """``load_into`` in a worker thread."""
        return await asyncio.to_thread(self.load_into, module, version)

    # ------------------------------------------------------------------ internals
    def _sync(self, version: int | None, sink: ModuleSink | None, owned: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        if self.engine_cls.colocated:
            yield from self._sync_colocated(version, sink, owned)
            return
        if self.engine_cls.sessionless:
            yield from self._sync_sessionless(version, sink)
            return
        start = time.perf_counter()
        self.connect()
        assert self._channel is not None and self._engine is not None
        ch = self._channel
        what = f" of version {version}" if version is not None else ""
        try:
            waiting = Deadline(self.config.timeout_s, f"for the sender to start a sync{what}")
            while True:
                try:
                    msg = ch.recv(waiting, expect=("sync", "closing"))
                except PeerLost:
                    # The sender drops every connection after a sync that failed anywhere
                    # (ours may have gone well): join again, within the same deadline.
                    waiting.left()
                    self._reset()
                    self.connect()
                    ch = self._channel
                    assert ch is not None
                    continue
                if msg["type"] == "closing":
                    raise PeerLost(f"{ch.peer} closed the session (the trainer has stopped sending)")
                break
            start = time.perf_counter()  # the sync starts when the sender starts it
            v, plan = self._accept(msg, version, sink)
            self._engine.begin(v)
            self._engine.reserve(_capacity(plan, self.config.bucket_bytes))
            ch.recv(Deadline(self.config.timeout_s, f"for the go of version {v}"), expect="go")
            self._engine.rank = msg["engine"]["rank"]  # our place in this sync's data-plane group
            self._engine.connect(msg["engine"])
        except HandshakeError:
            raise  # a clean refusal: both sides are between syncs, the connection stays
        except SyncError:
            self._reset()
            raise
        except Exception as e:  # a bad engine description, a data plane that cannot be joined
            self._reset()
            raise SyncError(f"receiver rank {self.rank}: joining the sync from {ch.peer} failed: {type(e).__name__}: {e}") from e
        stats = SyncStats(v, receivers=1, handshake_s=time.perf_counter() - start)
        self._receiving = v
        deadline = Deadline(self.config.timeout_s, f"in the transfer of version {v}")
        specs: list[TensorSpec] = list(plan.tensors) if plan is not None else []
        next_bucket = self._plan_reader(plan) if plan is not None else self._stream_reader(ch, specs, deadline)
        assembler = Assembler(specs, self.device, sink.destination if sink is not None else None, owned=owned)
        buckets = self._engine.recv_buckets(next_bucket, assembler.landing if assembler.destination is not None else None)
        checksum = checksum_fn(self.config.verify)
        received: list[tuple[Bucket, int | None]] = []  # each bucket with its checksum
        consumer_error: BaseException | None = None
        problem: str | None = None
        t0 = time.perf_counter()
        try:
            for bucket, buffer in buckets:
                received.append((bucket, checksum(buffer) if checksum is not None else None))
                stats.bytes += bucket.nbytes
                for item in assembler.unpack(bucket, buffer):
                    stats.tensors += 1
                    try:
                        yield item
                    except BaseException as e:  # the consumer failed or stopped early
                        consumer_error = e
                        break
                if consumer_error is not None:
                    break
            if consumer_error is not None:
                for _ in buckets:  # keep the transfer going so the sender is not stranded
                    pass
                problem = f"receiver rank {self.rank} did not complete version {v}: {consumer_error!r}"
            elif assembler.incomplete or stats.tensors != len(specs):
                raise SyncError(f"version {v} ended with incomplete tensors: {assembler.incomplete}")
            if checksum is not None:
                sent = ch.recv(deadline, expect="verify").get("checksums")
                if problem is None:
                    problem = self._verify(v, specs, received, sent)
        except Exception as e:
            buckets.close()  # let the engine drop its pending receives now
            self._finish(v, ok=False, message=f"transfer failed: {e}", broken=True, delivered=bool(received))
            raise (e if isinstance(e, SyncError) else SyncError(f"receiver rank {self.rank}: transfer of version {v} from {ch.peer} failed: {e}")) from e
        stats.buckets = len(received)
        stats.transfer_s = time.perf_counter() - t0
        self._finish(v, ok=problem is None, message=problem, delivered=bool(received))
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        if consumer_error is not None:
            raise consumer_error
        if problem is not None:
            raise VerificationError(problem)

    def _verify(self, version: int, specs: list[TensorSpec], received: list, sent: Any) -> str | None:
        """Compare our checksums with the sender's; describe the damage, or None."""
        if not isinstance(sent, list) or len(sent) != len(received):
            return f"receiver rank {self.rank}: the sender's checksums of version {version} do not cover its {len(received)} buckets"
        bad = [bucket for (bucket, mine), theirs in zip(received, sent) if mine != theirs]
        if not bad:
            return None
        names = sorted({specs[p.tensor].name for b in bad for p in b.pieces})
        return (
            f"receiver rank {self.rank}: version {version} failed verification ({self.config.verify}) in "
            f"{len(bad)} bucket(s) {[b.index for b in bad][:8]}; tensors affected: {', '.join(names[:16])}"
            + (f" and {len(names) - 16} more" if len(names) > 16 else "")
        )

    def _finish(self, version: int, ok: bool, message: str | None, broken: bool = False, delivered: bool = False) -> None:
        assert self._engine is not None
        self._engine.finish(ok=not broken)  # mirrors the sender: only a broken transport rebuilds
        try:
            if self._channel is not None:
                self._channel.send(
                    {"type": "done", "version": version, "ok": ok, "message": message},
                    Deadline(self.config.timeout_s, f"confirming version {version}"),
                )
        except SyncError:
            self._reset()
            ok = False
        if ok:
            self.version, self.failed_version, self.torn = version, None, False
        else:
            self.failed_version = version
            self.torn = self.torn or delivered
            if broken:  # the transport failed: reconnect at the next sync
                self._reset()

    def _accept(self, msg: dict[str, Any], expected: int | None, sink: ModuleSink | None) -> tuple[int, Plan | None]:
        """Check the sender's sync message; reply ready, or error (and raise) naming both values."""
        assert self._channel is not None
        v = msg.get("version")
        problem = None
        plan: Plan | None = None
        try:
            if msg.get("protocol") != PROTOCOL_VERSION:
                problem = f"protocol version: sender {msg.get('protocol')!r}, receiver {PROTOCOL_VERSION}"
            elif not isinstance(v, int) or isinstance(v, bool):
                problem = f"version {v!r} is not an integer"
            elif expected is not None and v != expected:
                problem = f"version: sender sends {v}, receiver expects {expected}"
            elif self.version is not None and v < self.version and msg.get("force") is not True:
                problem = (
                    f"version {v} is older than version {self.version}, which this receiver holds "
                    "(send it with force=True to roll back)"
                )
            elif msg.get("verify", "off") != self.config.verify:
                problem = f"verify: sender {msg.get('verify')!r}, receiver {self.config.verify!r} (set the same value on both sides)"
            elif not isinstance(msg.get("engine"), dict) or not isinstance(msg["engine"].get("rank"), int):
                problem = "the sync message carries no valid engine description"
            elif msg.get("bucket_bytes") != self.config.bucket_bytes:
                problem = (
                    f"bucket size: sender {msg.get('bucket_bytes')} bytes, receiver {self.config.bucket_bytes} bytes "
                    "(update_weights_bucket_megabytes must match)"
                )
            elif msg.get("plan_hash") is not None:
                if "plan" in msg:
                    plan = Plan.from_wire(msg["plan"])
                    if plan.hash != msg["plan_hash"]:
                        problem = f"plan hash: sender {msg['plan_hash']}, receiver computed {plan.hash}"
                elif self._plan is not None and self._plan.hash == msg["plan_hash"]:
                    plan = self._plan
                else:
                    have = self._plan.hash if self._plan is not None else None
                    problem = f"plan hash: sender {msg['plan_hash']}, receiver holds {have}"
                if problem is None and sink is not None and plan is not None:
                    sink.check(plan.tensors)
        except (ValueError, TypeError, KeyError) as e:
            problem = str(e)
        deadline = Deadline(self.config.timeout_s, f"answering the sync of version {v}")
        if problem is not None:
            self._channel.send({"type": "error", "message": problem}, deadline)
            try:  # the sender answers every refusal with an abort: take it off the line
                self._channel.recv(deadline, expect="abort")
            except SyncError:
                self._reset()
            raise HandshakeError(f"receiver rank {self.rank} refused version {v}: {problem}")
        if plan is not None:  # a streamed sync leaves the agreed plan as it was
            self._plan = plan
        self._channel.send({"type": "ready"}, deadline)
        return v, plan

    @staticmethod
    def _plan_reader(plan: Plan):
        buckets = iter(plan.buckets)
        return lambda: next(buckets, None)

    def _stream_reader(self, ch: Channel, specs: list[TensorSpec], deadline: Deadline):
        def next_bucket() -> Bucket | None:
            msg = ch.recv(deadline, expect=("bucket", "end"))
            if msg["type"] == "end":
                mine = plan_hash(specs, self.config.bucket_bytes)
                if msg.get("plan_hash") != mine:
                    raise SyncError(f"streamed plan hash: sender {msg.get('plan_hash')}, receiver computed {mine}")
                return None
            specs.extend(TensorSpec.from_wire(t) for t in msg["tensors"])
            bucket = Bucket.from_wire(msg["bucket"])
            if bucket.nbytes > self.config.bucket_bytes or any(
                p.tensor >= len(specs) or p.tensor_offset + p.length > specs[p.tensor].nbytes for p in bucket.pieces
            ):
                raise ProtocolError(f"{ch.peer} announced bucket {bucket.index} with unknown tensors, or out of bounds")
            return bucket

        return next_bucket

    def _sync_colocated(
        self, version: int | None, sink: ModuleSink | None, owned: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        v, src = NaiveEngine.collect(self.address, self.version, version, self.config.timeout_s)
        specs = src.specs()
        if sink is not None and specs is not None:
            sink.check(specs)
        stats = SyncStats(v, receivers=1)
        try:
            for name, tensor in src.tensors():
                stats.tensors += 1
                stats.bytes += tensor.nbytes
                yield name, tensor.clone() if owned else tensor  # else: the trainer's own memory
        except BaseException:
            self.failed_version = v
            raise
        stats.seconds = time.perf_counter() - start
        self.version, self.failed_version, self.last_stats = v, None, stats

    def _sync_sessionless(self, version: int | None, sink: ModuleSink | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Take one published version from a sessionless engine (disk) and acknowledge it;
        the version, failure and torn states follow the same rules as over a session."""
        start = time.perf_counter()
        if self._engine is None:
            self._engine = self.engine_cls(self.config, self.device, self.rank + 1, None)
        engine = self._engine
        pub = engine.open(self.rank, self.version, version)
        v = pub.version
        problem = engine.refusal(pub, self.version)
        if problem is None and sink is not None:
            try:
                sink.check(pub.specs)  # before anything is written, as over a session
            except SinkError as e:
                problem = str(e)
        if problem is not None:  # a clean refusal: nothing read, the state stays
            engine.ack(pub, self.rank, "refused", problem)
            raise HandshakeError(f"receiver rank {self.rank} refused version {v}: {problem}")
        engine.ack(pub, self.rank, "reading")
        self._receiving = v
        stats = SyncStats(v, receivers=1, buckets=len(pub.shards), handshake_s=time.perf_counter() - start)
        t0 = time.perf_counter()
        try:
            for name, tensor in pub.tensors(self.rank, self.device):
                stats.tensors += 1
                stats.bytes += tensor.nbytes
                yield name, tensor  # a new tensor: owned by the caller either way
        except BaseException as e:  # a damaged shard, a failed or stopped consumer
            self.failed_version = v
            self.torn = self.torn or stats.tensors > 0
            what = "stopped early" if isinstance(e, GeneratorExit) else repr(e)
            engine.ack(pub, self.rank, "failed", f"receiver rank {self.rank} did not complete version {v}: {what}")
            raise
        engine.ack(pub, self.rank, "ok")
        stats.transfer_s = time.perf_counter() - t0
        stats.seconds = time.perf_counter() - start
        self.version, self.failed_version, self.torn, self.last_stats = v, None, False, stats
