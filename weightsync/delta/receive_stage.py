"""The receiver's delta stage: how one sync's wire entries reach the consumer and the base.

``DeltaReceive`` is the stage on the receiver (the sender's is
``weightsync.delta.send_stage.DeltaSend``): from the sync message's delta header it checks
the plan and the model, decides whether this receiver holds the base (then it applies
deltas) or asks for a dense section, and makes the sync's intake an ``Incoming`` that routes
each wire entry (take, stage, skip) and applies the staged deltas once every byte arrived.
A dense sync keeps the plain intake of ``weightsync.stages``, unless a streaming receiver
keeps its base up to date. See ``weightsync.delta.send_stage`` for
the wire layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.delta.decoder import apply_many
from weightsync.delta.format import Kind
from weightsync.delta.header import DeltaHeader, base_digest
from weightsync.errors import ProtocolError
from weightsync.plan import Assembler, Bucket, Plan, TensorSpec, as_bytes
from weightsync.stages import Intake, Offered, ReceiveStage
from weightsync.state import VersionState
from weightsync.stats import SyncStats
from weightsync.verify import Checks

log = logging.getLogger("weightsync")


class DeltaReceive(ReceiveStage):
    """A receiver's delta stage across syncs: its mode and (a streaming receiver's) base."""

    def __init__(self, mode: str, rank: int) -> None:
        self.mode = mode
        self.rank = rank
        #: delta auto or on, with ``receive()``: a copy of the last version, the base deltas apply to
        self.base: dict[str, torch.Tensor] = {}
        self._incoming: Incoming | None = None  # the sync in progress, where deltas are in play

    def accept(self, offered: Offered) -> None:
        """The sync's intake, and whether it asks for a dense section. An answer declaring
        something (another stage's) is not this sync's: it comes again."""
        if offered.declared:
            return
        intake = self.intake(
            offered.msg.get("delta"), offered.plan, offered.sink, offered.state, offered.max_tensor_bytes
        )
        offered.intake = intake
        offered.fields["dense"] = isinstance(intake, Incoming) and intake.wants_dense

    def go(self, peer: str, version: int) -> None:
        if self._incoming is not None:
            self._incoming.go(peer, version)

    def intake(
        self, wire: Any, plan: Plan | None, sink: Any, state: VersionState, max_tensor_bytes: int | None
    ) -> Intake:
        """How this receiver takes the sync of ``plan`` (None: a streamed one, never
        relative) whose message carried ``wire`` as its delta header (None: a dense sync);
        with a sink, its model tensors are checked against it. Raises ValueError (a
        ``SinkError`` among them) saying what does not fit."""
        self._incoming = None
        header = (
            DeltaHeader.from_wire(wire, plan.tensors, max_tensor_bytes)
            if wire is not None and plan is not None
            else None
        )
        if sink is not None and plan is not None:
            sink.check(header.model if header is not None else plan.tensors)
        specs = list(plan.tensors) if plan is not None else []
        if header is None and (self.mode == "off" or sink is not None):
            return Intake(specs)  # no delta in play, no base to keep: entries as they come
        base = self.base if sink is None else {n: t.data for n, t in sink.targets.items()}
        holds = header is not None and self._holds_base(header, base, state)
        self._incoming = Incoming(
            header,
            specs,
            holds,
            self.base if self.mode != "off" and sink is None else None,
            base if holds else None,
        )
        return self._incoming

    def _holds_base(self, header: DeltaHeader, base: dict[str, torch.Tensor], state: VersionState) -> bool:
        """Whether the base of a delta sync is what this receiver holds: the same version,
        complete, and the same bytes (a digest over them, computed now)."""
        if state.version != header.base_version or state.torn:
            return False
        if base_digest(header.model, base) != header.base_digest:
            log.info(
                "receiver rank %d: its copy of version %d differs from the sender's (digest): taking it whole",
                self.rank,
                header.base_version,
            )
            return False
        return True


@dataclass
class Route:
    """What a receiver does with each wire entry of a sync."""

    #: per wire entry: model tensor index and what to do: "take" (hand over as it comes),
    #: "stage" (a delta payload or DENSE entry kept until the end), "skip"
    actions: list[tuple[int, str]]
    #: the receiver applies deltas (it holds the base)
    relative: bool


def route(header: DeltaHeader | None, wire_count: int, holds_base: bool) -> Route:
    """The receiver's plan for one sync's wire entries."""
    if header is None:
        return Route([(i, "take") for i in range(wire_count)], relative=False)
    n = len(header.model)
    if holds_base:
        return Route([(i, "stage") for i in range(n)] + [(-1, "skip")] * (wire_count - n), relative=True)
    actions = [(i, "take" if k == Kind.DENSE else "skip") for i, k in enumerate(header.kinds)]
    actions += [(i, "take") for i, k in enumerate(header.kinds) if k != Kind.DENSE]
    return Route(actions, relative=False)


class Incoming(Intake):
    """A receiver's handling of one sync's wire entries (``route``): what its consumer gets
    as it arrives, what is staged until the end, what is skipped, and (a relative sync) the
    deltas applied once everything arrived. ``base``: a streaming receiver's copy of the
    version (``delta`` on or auto, without a sink), kept up to date; ``target``: where a
    relative sync applies (that copy, or the sink's own tensors)."""

    def __init__(
        self,
        header: DeltaHeader | None,
        specs: list[TensorSpec],
        holds_base: bool,
        base: dict[str, torch.Tensor] | None,
        target: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(specs)
        self.header = header
        self.route = route(header, len(specs), holds_base)
        self.index = {spec.name: i for i, spec in enumerate(specs)}
        self.base = base
        self.target = target
        self.staged: dict[int, torch.Tensor] = {}
        self.applied = False  # a relative sync's staged entries were applied to ``target``
        self._handed = False  # ... checked, and handed to the consumer

    @property
    def relative(self) -> bool:
        """This receiver applies deltas to the base it holds."""
        return self.route.relative

    @property
    def wants_dense(self) -> bool:
        """A delta sync whose base this receiver lacks (it asks for a dense section)."""
        return self.header is not None and not self.route.relative

    def go(self, peer: str, version: int) -> None:
        """The sender gave the go: a delta sync whose base this receiver lacks must come
        with the dense section it asked for (taking the deltas alone would hand out only
        the tensors sent whole, and report the version complete)."""
        if self.wants_dense and self.header is not None and not self.header.dense:
            raise ProtocolError(
                f"{peer} gave the go of version {version} as deltas against version "
                f"{self.header.base_version}, which this receiver does not hold, without the dense "
                "section it asked for"
            )

    @property
    def consumer_has_all(self) -> bool:
        """Whether every tensor of the version was handed to the consumer (a relative sync's
        only once applied and checked)."""
        return not self.relative or self._handed

    def delivered(self, arrived: bool, handed_out: bool) -> bool:
        """Whether the model (or consumer) may hold some of the version now: a relative
        sync only once it applied, any other once bytes ``arrived`` (they may have landed
        in the model) or tensors were ``handed_out``."""
        return self.applied or handed_out or (arrived and not self.relative)

    def assembler(
        self, device: torch.device, sink: Any, owned: bool, landing: Any, buckets: Sequence[Bucket]
    ) -> Assembler:
        """The plan layer's assembler for these entries: into ``landing``'s pooled memory
        (``weightsync.receiver.prefetch``; a dense sync), else into the sink's tensors where entries
        are taken whole; a delta sync's staged entries are copied out, so never ``owned``."""
        if landing is not None and self.header is None:
            return landing.assembler(self.specs, device, buckets)
        destination = self.destination(sink) if sink is not None else None
        return Assembler(self.specs, device, destination, owned=owned and self.header is None)

    def grow(self) -> None:
        """A streamed sync announced more entries (never a delta sync: it has a plan)."""
        self.index.update({s.name: i for i, s in enumerate(self.specs) if s.name not in self.index})

    def destination(self, sink: Any) -> Callable[[TensorSpec], torch.Tensor | None]:
        """Where a sink may receive an entry in place: its model tensor for entries taken
        whole, nowhere for staged or skipped ones."""
        header = self.header
        if header is None:
            return sink.destination

        def destination(spec: TensorSpec) -> torch.Tensor | None:
            i = self.index.get(spec.name)
            if i is None:
                return None
            m, action = self.route.actions[i]
            return sink.destination(header.model[m]) if action == "take" else None

        return destination

    def take(self, name: str, tensor: torch.Tensor, owned: bool) -> tuple[str, torch.Tensor] | None:
        """What the consumer gets of one wire entry now (None: nothing, yet)."""
        if self.header is None:
            item = (name, tensor)
        else:
            m, action = self.route.actions[self.index[name]]
            if action == "skip":
                return None
            if action == "stage":  # applied once everything arrived
                self.staged[m] = tensor.clone()
                return None
            item = (self.header.model[m].name, tensor.clone() if owned else tensor)
        if self.base is not None:
            keep(self.base, *item)
        return item

    def finish(
        self, sent: dict[str, Any], checks: Checks, stats: SyncStats
    ) -> tuple[str | None, list[tuple[str, torch.Tensor]]]:
        """Once every byte arrived and the sender's ``verify`` message (``sent``) with it: a
        dense sync's buckets checked; a relative sync's staged deltas applied to the base
        in place (it is then the new version) and the reconstructed tensors checked. Returns
        what failed (None: all well) and what the consumer gets now: a relative sync's
        tensors (views of the base), none if they failed."""
        if not self.relative:
            return checks.buckets(self.specs, sent.get("checksums")), []
        assert self.header is not None and self.target is not None
        self.applied = True
        apply_staged(self.header, self.staged, self.target)
        self.staged.clear()
        stats.delta_base = self.header.base_version
        if checks.fn is not None and (
            detail := verify_tensors(self.header, self.target, sent.get("tensors"), checks.fn)
        ):
            return checks.failed(detail), []
        self._handed = True
        return None, [(spec.name, self.target[spec.name]) for spec in self.header.model]


def apply_staged(header: DeltaHeader, staged: dict[int, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
    """Apply a delta section to ``base`` in place (every model tensor once)."""
    work = []
    for i, (spec, kind) in enumerate(zip(header.model, header.kinds)):
        target, payload = base[spec.name], staged[i]
        if kind == Kind.DENSE:
            as_bytes(target).copy_(as_bytes(payload))
        else:
            work.append((target, kind, payload))
    apply_many(work)


def keep(base: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    """A streaming receiver's base: keep a copy of what arrived whole (allocated once)."""
    held = base.get(name)
    if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
        held = base[name] = torch.empty(tensor.shape, dtype=tensor.dtype)
    held.copy_(tensor)


def verify_tensors(
    header: DeltaHeader, base: dict[str, torch.Tensor], sent: Any, checksum: Any
) -> str | None:
    """``verify`` after applying a delta sync: the reconstructed tensors against the
    sender's checksums of them; what differs, or None."""
    if not isinstance(sent, list) or len(sent) != len(header.model):
        return "(the sender's checksums do not cover the version's tensors)"
    bad = [s.name for s, theirs in zip(header.model, sent) if checksum(as_bytes(base[s.name])) != theirs]
    if not bad:
        return None
    more = f" and {len(bad) - 16} more" if len(bad) > 16 else ""
    return f"after applying deltas; tensors affected: {', '.join(bad[:16])}{more}"
