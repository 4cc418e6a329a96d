"""The stage contracts: what a sync does besides moving bytes, one small class per concern.

A sync's session (``Sender`` on trainer rank 0, ``Receiver`` on a rollout rank) reads the
same for every transport and every feature; what varies per sync (where bytes go: a dense
plan or a sharded route; a tensor's wire form: whole, or quantized blocks with scales;
whether it travels as a delta) lives in stages. Each side holds one ordered tuple of stages
made by one factory (``weightsync.sender.stages.send_stages``,
``weightsync.receiver.stages.receive_stages``) and loops over it: adding a stage is a new
file and one line in a factory.

The trainer side (``SendStage``), for one sync on the rank that runs the session; every hook
has a default that leaves the sync as it is::

    source -> plan                     before any peer is waited for (refuse what cannot go)
    start -> encode                    the sync's wire entries and plan, stage by stage
    offer -> answered                  each handshake round: fields of the sync message, then
                                       the peers' answers (True from any stage: encode again,
                                       offer another round; ValueError: abort)
    own -> join                        after the go: what this rank packs, its data plane
    account -> checksums, verify       after the transfer: figures, ``verify`` messages
    finished                           the outcome, success or not

A trainer rank that follows rank 0 (``weightsync.sender.ranks``) drives the same objects:
``source`` and ``plan``, then per round ``follow`` (its answer to rank 0's sync message),
then ``own``.

The rollout side (``ReceiveStage``)::

    accept                             the sender's sync message: this stage's ready fields,
                                       or ValueError (the sync is refused, naming why)
    go                                 the go came: what was agreed must hold
    join                               the data plane's ``Join`` record
    entries                            the sync's entries on their way to the consumer

Stages run in the factory's order; a later stage sees what the earlier ones made.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from weightsync.engines.base import Join
from weightsync.plan import Assembler, Plan, TensorSpec
from weightsync.sources import WeightSource
from weightsync.stats import SyncStats

#: a sync's entries as the session hands them out (a generator: a failing consumer is thrown in)
Entries = Generator[tuple[str, torch.Tensor], None, None]

#: an answer of one round of the handshake: the peer's side ("receiver" or "trainer"), its
#: rank, its ready reply
Answer = tuple[str, int, dict[str, Any]]


@dataclass(frozen=True)
class Members:
    """Who takes part in the sync in progress."""

    receivers: tuple[int, ...]  # receiver ranks, in group-rank order
    trainers: int  # trainer ranks that send or hold shards
    host: str  # the host trainer rank 0's bytes leave from (ranks of a host share a NIC)
    senders: int = 1  # trainer ranks that send a share of the buckets


@dataclass(frozen=True)
class Outgoing:
    """One sync as the stages hand it on: the wire entries to pack (``source``) and their
    ``plan`` (None: the source streams its entries)."""

    source: WeightSource
    plan: Plan | None
    version: int


class SendStage:
    """One concern of a sync on the trainer side; the defaults leave the sync as it is."""

    #: the data plane forms in the first sync, not in ``Sender.warm_up`` (it needs answers)
    plane_in_sync = False
    #: each trainer rank's bucket checksums kept apart (its buckets are its own)
    own_buckets = False

    # -- before any peer is waited for
    def source(self, obj: Any, wire_dtype: torch.dtype | None, form: str) -> Any:
        """What the trainer's object becomes (the first stage makes it a ``WeightSource``)."""
        return obj

    def plan(self, src: WeightSource, plan: Plan | None) -> Plan | None:
        """The plan known before anyone is asked (None: agreed in the handshake, or a source
        that streams); raises ``SyncError`` for what the backend cannot carry."""
        return plan

    # -- rank 0, each sync
    def start(self, members: Members | None) -> None:
        """A new sync (or attempt) begins: forget the last one's part (``members``: None on
        a following trainer rank, which learns them from rank 0)."""

    def encode(self, out: Outgoing, members: Members) -> Outgoing:
        """This stage's part of the wire entries (called again after a round that called for
        another: a stage whose input and state did not change returns what it returned)."""
        return out

    def offer(self, out: Outgoing, members: Members) -> dict[str, Any]:
        """Fields this round of the handshake adds to every sync message."""
        return {}

    def answered(self, out: Outgoing, answers: Sequence[Answer], members: Members) -> bool:
        """Take the peers' answers; True when the sync must be encoded and offered again.
        Raises ``ValueError`` saying why the sync cannot go (the session aborts it)."""
        return False

    # -- a trainer rank > 0, each round
    def follow(self, src: WeightSource, msg: Mapping[str, Any], rank: int, host: str) -> dict[str, Any]:
        """A following trainer rank's fields of its ready answer to rank 0's sync message
        (``ValueError``: it refuses, naming why)."""
        return {}

    # -- after the go
    def own(self, out: Outgoing, members: Members, bucket_bytes: int) -> Outgoing:
        """What this rank packs."""
        return out

    def join(self, join: Join, bucket_bytes: int) -> Join:
        """This rank's ``Join`` record once its part is known."""
        return join

    def account(self, stats: SyncStats) -> None:
        """The sync's figures where the stage knows them better than the packer."""

    def checksums(
        self, out: Outgoing, sums: dict[int, dict[int, int]], members: Members, bucket_bytes: int
    ) -> list[list[int]] | None:
        """``verify``: each receiver's list of bucket checksums, in its own plan's order,
        from each trainer rank's (``sums``: trainer rank -> bucket index -> checksum); None:
        every receiver gets the same list, in the plan's order."""
        return None

    def verify_fields(self, mode: str) -> dict[str, Any]:
        """What the ``verify`` message carries beside the buckets' checksums."""
        return {}

    def finished(self, seconds: float | None, ok_ranks: set[int]) -> None:
        """The sync ended; ``seconds``: what it cost past the handshake, None if it failed;
        ``ok_ranks``: the receivers that took it."""


_Stage = TypeVar("_Stage", bound=SendStage)


@dataclass
class SendStages:
    """The trainer side's stages in their order, asked as one."""

    stages: tuple[SendStage, ...]
    members: Members | None = field(default=None, repr=False)  # the sync in progress

    def of(self, kind: type[_Stage]) -> _Stage:
        """The stage of this kind (for a caller that reads one stage's state)."""
        return next(s for s in self.stages if isinstance(s, kind))

    @property
    def plane_in_sync(self) -> bool:
        return any(s.plane_in_sync for s in self.stages)

    @property
    def own_buckets(self) -> bool:
        return any(s.own_buckets for s in self.stages)

    def source(self, obj: Any, wire_dtype: torch.dtype | None, form: str) -> WeightSource:
        for s in self.stages:
            obj = s.source(obj, wire_dtype, form)
        return obj

    def plan(self, src: WeightSource) -> Plan | None:
        plan: Plan | None = None
        for s in self.stages:
            plan = s.plan(src, plan)
        return plan

    def start(self, members: Members | None) -> None:
        self.members = members
        for s in self.stages:
            s.start(members)

    def encode(self, out: Outgoing) -> Outgoing:
        for s in self.stages:
            out = s.encode(out, self._members)
        return out

    def offer(self, out: Outgoing) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for s in self.stages:
            fields |= s.offer(out, self._members)
        return fields

    def answered(self, out: Outgoing, answers: Sequence[Answer]) -> bool:
        # every stage reads every round (one declaration may concern several)
        again = [s.answered(out, answers, self._members) for s in self.stages]
        return any(again)

    def follow(self, src: WeightSource, msg: Mapping[str, Any], rank: int, host: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for s in self.stages:
            fields |= s.follow(src, msg, rank, host)
        return fields

    def own(self, out: Outgoing, members: Members, bucket_bytes: int) -> Outgoing:
        for s in self.stages:
            out = s.own(out, members, bucket_bytes)
        return out

    def join(self, join: Join, bucket_bytes: int) -> Join:
        for s in self.stages:
            join = s.join(join, bucket_bytes)
        return join

    def account(self, stats: SyncStats) -> None:
        for s in self.stages:
            s.account(stats)

    def checksums(
        self, out: Outgoing, sums: dict[int, dict[int, int]], bucket_bytes: int
    ) -> list[list[int]] | None:
        for s in self.stages:
            lists = s.checksums(out, sums, self._members, bucket_bytes)
            if lists is not None:
                return lists
        return None

    def verify_fields(self, mode: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for s in self.stages:
            fields |= s.verify_fields(mode)
        return fields

    def finished(self, seconds: float | None, ok_ranks: set[int]) -> None:
        for s in self.stages:
            s.finished(seconds, ok_ranks)

    @property
    def _members(self) -> Members:
        assert self.members is not None, "a sync's stages are asked after start()"
        return self.members


# ------------------------------------------------------------------ the rollout side
@dataclass
class Offered:
    """A sync message as a receiver's stages read it, and what they make of it."""

    msg: dict[str, Any]
    sink: Any  # ``load_into``'s ModuleSink (None: ``receive``)
    held: Plan | None  # the plan last agreed with this sender
    config: Any  # the receiver's EngineConfig
    state: Any  # the receiver's VersionState
    rank: int
    host: str  # this receiver's address toward the sender (ranks of a host share a NIC)
    max_tensor_bytes: int | None
    needs: Any = None  # the receiver's hook: the box kept of each offered tensor
    vet: Any = None  # the receiver's hook: the offered tensors checked before anything moves
    #: made by the stages: the plan this receiver takes (None: streamed, or another round)
    plan: Plan | None = None
    #: the ready answer's fields
    fields: dict[str, Any] = field(default_factory=dict)
    #: this answer declares something the offer lacked: it comes again, and the stages after
    #: the declaring one take the sync as offered then
    declared: bool = False
    #: how the sync's entries reach the consumer (``Intake``; the default: as they come)
    intake: Intake | None = None


class Intake:
    """How one sync's wire entries reach the consumer: here, each as it comes, into the
    landing's or the sink's memory where they offer it; the buckets checked at the end. A
    stage that stages or skips entries (the delta stage's ``Incoming``) refines it."""

    def __init__(self, specs: list[TensorSpec]) -> None:
        self.specs = specs  # a streamed plan's list grows while it arrives

    @property
    def consumer_has_all(self) -> bool:
        """Whether every tensor of the version was handed to the consumer (here: once the
        last entry was)."""
        return True

    def assembler(
        self, device: torch.device, sink: Any, owned: bool, landing: Any, buckets: Sequence[Any]
    ) -> Any:
        """The plan layer's assembler: into ``landing``'s pooled memory
        (``weightsync.receiver.prefetch``), else into the sink's tensors."""
        if landing is not None:
            return landing.assembler(self.specs, device, buckets)
        return Assembler(self.specs, device, sink.destination if sink is not None else None, owned=owned)

    def grow(self) -> None:
        """A streamed sync announced more entries (``specs`` grew)."""

    def take(self, name: str, tensor: torch.Tensor, owned: bool) -> tuple[str, torch.Tensor] | None:
        """What the consumer gets of one wire entry now (None: nothing, yet)."""
        return name, tensor

    def delivered(self, arrived: bool, handed_out: bool) -> bool:
        """Whether the model (or consumer) may hold some of the version now."""
        return arrived or handed_out

    def finish(self, sent: dict[str, Any], checks: Any, stats: SyncStats) -> tuple[str | None, list]:
        """Once every byte and the sender's ``verify`` message (``sent``) arrived: what
        failed (None: all well), and what the consumer gets now."""
        return checks.buckets(self.specs, sent.get("checksums")), []


class ReceiveStage:
    """One concern of a sync on the rollout side; the defaults leave the sync as it is."""

    def sink(self, module: Any) -> Any:
        """What ``load_into`` lands tensors in (the first stage makes it a ``ModuleSink``)."""
        return module

    def owned(self, owned: bool, landing: Any) -> bool:
        """``receive``'s arguments as this stage takes them: whether entries are received
        into tensors the consumer may keep. Raises ValueError for what it cannot do."""
        return owned

    def accept(self, offered: Offered) -> None:
        """Read the sender's sync message: set what the stage makes in ``offered``; raise
        ``ValueError`` (or KeyError, TypeError: an offer that does not parse) to refuse it."""

    def go(self, peer: str, version: int) -> None:
        """The sender gave the go: what this stage needed of the offer must hold (else
        ``ProtocolError``)."""

    def join(self, join: Join) -> Join:
        """This receiver's ``Join`` record with its links (where the stage has any)."""
        return join

    def entries(self, entries: Entries) -> Entries:
        """``receive``'s entries on their way to the consumer."""
        return entries


@dataclass(frozen=True)
class ReceiveStages:
    """The rollout side's stages in their order, asked as one."""

    stages: tuple[ReceiveStage, ...]

    def sink(self, module: Any) -> Any:
        for s in self.stages:
            module = s.sink(module)
        return module

    def owned(self, owned: bool, landing: Any) -> bool:
        for s in self.stages:
            owned = s.owned(owned, landing)
        return owned

    def accept(self, offered: Offered) -> Intake:
        for s in self.stages:
            s.accept(offered)
        if offered.intake is None:
            offered.intake = Intake(list(offered.plan.tensors) if offered.plan is not None else [])
        return offered.intake

    def go(self, peer: str, version: int) -> None:
        for s in self.stages:
            s.go(peer, version)

    def join(self, join: Join) -> Join:
        for s in self.stages:
            join = s.join(join)
        return join

    def entries(self, entries: Entries) -> Entries:
        for s in self.stages:
            entries = s.entries(entries)
        return entries
