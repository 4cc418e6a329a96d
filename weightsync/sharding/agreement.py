"""The sharded sync's handshake as data: trainer rank 0's offer of a route, each rank's
answer, and the part each rank then plays.

Trainer rank 0 runs the session (``weightsync.sender``). Every sync message of a sharded
sync carries a ``route`` field (``RouteOffer.fields``): the global tensors' specs, the
layout of every rank as far as rank 0 knows it, and the route's hash (None until every
layout is known). Every other rank, a trainer rank > 0 or a receiver rank, compares the
layout the offer names for it with its own (``answer``):

- they differ (the first sync, a model that changed, a new member): it answers ready with
  its layout, and rank 0 offers the sync again with a route that includes it (the
  handshake's ``again``);
- they agree: it computes the route itself from the same layouts, checks the hash (a
  mismatch is refused, naming both hashes) and takes its own ``Part`` of the route.

So every rank holds the same route before a byte moves, and a job whose layouts stay the
same pays one round per sync, as a dense sync does. Everything here is plain data: no
socket, no process group.

A receiver's layout is the boxes it keeps (``FragmentSink``: from a module's DTensors or
plain tensors) or ``"whole"`` (it declared nothing: every tensor whole, reassembled from
its fragments by ``Reassembly``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.fragments import (
    LocalShard,
    RankPlan,
    fragment_tensors,
    global_specs,
    layout_of,
    local_shards,
    pairs_in_order,
    receiver_plan,
    trainer_plan,
)
from weightsync.sharding.layout import Layout
from weightsync.sharding.pieces import checkpoint_plan, checkpoint_shards, converts
from weightsync.sharding.route import Route, RouteError, plan_route
from weightsync.sources import WeightSource
from weightsync.wire.checkpoint import FORMS, is_transformers
from weightsync.wire.forms import is_tagged

#: a receiver that declares no layout takes every tensor whole
WHOLE = "whole"
TRAINER, RECEIVER = "trainer", "receiver"

# What a rank says it holds or keeps: a layout, or WHOLE (a receiver that declared nothing).
Declared = Layout | str


def _wire(declared: Declared) -> Any:
    return declared if isinstance(declared, str) else declared.to_wire()


def _parse(data: Any, side: str) -> Declared:
    if data == WHOLE and side == RECEIVER:
        return WHOLE
    return Layout.from_wire(data)


def _specs(data: Any) -> list[TensorSpec]:
    if not isinstance(data, list):
        raise ValueError("the route offer carries no list of tensor specs")
    return [TensorSpec.from_wire(s) for s in data]


def offered_specs(offer: Any) -> list[TensorSpec]:
    """The global tensors' specs of a route offer (the ``route`` field of a sync message)."""
    if not isinstance(offer, dict):
        raise ValueError("the sync message carries no route (the sender is not running a sharded sync)")
    return _specs(offer.get("specs"))


def offered_layouts(offer: Any) -> tuple[list[Declared | None], list[Declared | None]] | None:
    """The trainer ranks' and receiver ranks' layouts a full route offer names (None where
    rank 0 does not know one yet); None for an offer of the hash only."""
    if not isinstance(offer, dict) or offer.get("compact"):
        return None
    holders, needs = offer.get("holders"), offer.get("needs")
    if not isinstance(holders, list) or not isinstance(needs, list):
        raise ValueError("the route offer carries no layouts")
    return (
        [None if h is None else _parse(h, TRAINER) for h in holders],
        [None if n is None else _parse(n, RECEIVER) for n in needs],
    )


def compute(specs: Sequence[TensorSpec], holders: Sequence[Declared], needs: Sequence[Declared]) -> Route:
    """The route from these layouts (a receiver's ``WHOLE``: every tensor whole as the
    trainer holds it, no quantized form's entry)."""
    plain = [s for s in specs if not is_tagged(s.name)]
    trainers = [h if isinstance(h, Layout) else Layout.whole(specs) for h in holders]
    receivers = [n if isinstance(n, Layout) else Layout.whole(plain) for n in needs]
    return plan_route(specs, trainers, receivers)


@dataclass(frozen=True)
class Part:
    """One rank's part of an agreed route: its plan (buckets grouped by peer) and the
    links of the data plane, as the data-plane group's ranks (trainer rank 0 is 0,
    receivers 1..N, trainer ranks t > 0 are N + t)."""

    route: Route
    side: str
    #: this rank in the route: its trainer rank, or its place among the sync's receivers
    index: int
    rank_plan: RankPlan
    receivers: int

    def group_rank(self, side: str, index: int) -> int:
        if side == RECEIVER:
            return index + 1
        return 0 if index == 0 else self.receivers + index

    @property
    def links(self) -> tuple[tuple[int, int], ...]:
        """Every link of the route as (from, to) group ranks, in the one order every rank
        joins them: each (trainer rank, receiver rank) pair, then each chain's hops."""
        pairs = [
            (self.group_rank(TRAINER, s), self.group_rank(RECEIVER, d)) for s, d in pairs_in_order(self.route)
        ]
        hops = [
            (self.group_rank(RECEIVER, a), self.group_rank(RECEIVER, b))
            for chain in self.route.chains
            for a, b in zip(chain, chain[1:])
        ]
        return tuple(pairs + hops)

    def peer_of(self, bucket_index: int) -> int:
        """The group rank at the other end of the link bucket ``bucket_index`` arrives on
        (a receiver rank down a chain: the rank before it) or leaves on (a trainer rank)."""
        if self.side == RECEIVER and (before := self.route.previous_in_chain(self.index)) is not None:
            return self.group_rank(RECEIVER, before)
        other = RECEIVER if self.side == TRAINER else TRAINER
        return self.group_rank(other, self.rank_plan.peer_of(bucket_index))

    @property
    def forward(self) -> int | None:
        """A receiver rank of a chain: the group rank it passes every bucket on to."""
        after = self.route.next_in_chain(self.index) if self.side == RECEIVER else None
        return self.group_rank(RECEIVER, after) if after is not None else None

    def tensors(self, shards: Mapping[str, LocalShard]) -> Iterator[tuple[str, torch.Tensor]]:
        """A trainer rank's fragments in its plan's order, read from its local shards."""
        for dest in self.rank_plan.peers:
            yield from fragment_tensors(self.route, self.index, dest, shards)

    def nbytes(self) -> int:
        """The fragment bytes this rank sends or takes."""
        return sum(s.nbytes for s in self.rank_plan.plan.tensors)


#: the last parts computed, by (route hash, side, index, receivers, bucket bytes): a steady
#: job plans its part once, not in every sync (a rank's plan of a large route takes 10-200 ms;
#: rank 0 checking ``verify`` plans every rank's). Receivers of one process share it.
_PARTS: dict[tuple[str, str, int, int, int], Part] = {}
_PARTS_KEPT = 32
_PARTS_LOCK = threading.Lock()


def _part(route: Route, side: str, index: int, receivers: int, bucket_bytes: int) -> Part:
    key = (route.hash, side, index, receivers, bucket_bytes)
    with _PARTS_LOCK:
        part = _PARTS.get(key)
    if part is None:
        plan = trainer_plan if side == TRAINER else receiver_plan
        part = Part(route, side, index, plan(route, index, bucket_bytes), receivers)
        with _PARTS_LOCK:
            while len(_PARTS) >= _PARTS_KEPT:
                _PARTS.pop(next(iter(_PARTS)))
            _PARTS[key] = part
    return part


class RouteOffer:
    """Trainer rank 0's side: the layouts it has heard, the route they make."""

    def __init__(self) -> None:
        self.holders: dict[int, Declared] = {}  # trainer rank -> layout
        self.needs: dict[int, Declared] = {}  # receiver rank -> layout or WHOLE
        self._route: tuple[Any, Route] | None = None
        #: the ranks (side, rank) that answered the current route's hash: offered only the hash
        self._holding: set[tuple[str, int]] = set()
        self._compact = False  # whether the last offer carried only the hash

    def route(
        self, specs: Sequence[TensorSpec], own: Layout, receivers: Sequence[int], trainers: int
    ) -> Route | None:
        """The route of this sync's members, once every layout is known (else None).
        Raises ``RouteError`` when the layouts make none (the message names the tensor)."""
        self.holders[0] = own
        if any(t not in self.holders for t in range(trainers)) or any(r not in self.needs for r in receivers):
            return None
        holders = [self.holders[t] for t in range(trainers)]
        needs = [self.needs[r] for r in receivers]
        key = (tuple(specs), tuple(holders), tuple(needs))
        if self._route is None or self._route[0] != key:
            self._route = (key, compute(specs, holders, needs))
            self._holding = set()
        return self._route[1]

    def fields(
        self, specs: Sequence[TensorSpec], own: Layout, receivers: Sequence[int], trainers: int
    ) -> dict[str, Any]:
        """The ``route`` field of this sync's messages (the same for every peer). Layouts
        heard earlier that make no route with these specs are asked for again. Where every
        peer answered the route's hash before (a steady job), only the hash goes: the
        specs and layouts of a large model are hundreds of KB per peer and sync."""
        try:
            route = self.route(specs, own, receivers, trainers)
        except RouteError:
            self.holders, self.needs, route = {0: own}, {}, None
        peers = {(RECEIVER, r) for r in receivers} | {(TRAINER, t) for t in range(1, trainers)}
        self._compact = route is not None and peers <= self._holding
        if self._compact:
            assert route is not None
            return {"hash": route.hash, "compact": True}
        return {
            "hash": route.hash if route is not None else None,
            "specs": [s.to_wire() for s in specs],
            "holders": [_wire(self.holders[t]) if t in self.holders else None for t in range(trainers)],
            "needs": [_wire(self.needs[r]) if r in self.needs else None for r in receivers],
        }

    def take(self, replies: Sequence[tuple[str, int, dict[str, Any]]]) -> bool:
        """Layouts from the answers (side, rank, reply); True when one is new, so the sync
        is offered again with the route they make (or when a rank offered only the hash
        does not hold that route: it is offered again in full)."""
        changed = False
        current = self._route[1].hash if self._route is not None else None
        for side, rank, reply in replies:
            if reply.get("route") is not None and reply.get("route") == current:
                self._holding.add((side, rank))
                continue
            self._holding.discard((side, rank))
            changed = changed or self._compact
            if "layout" not in reply:
                continue
            book = self.holders if side == TRAINER else self.needs
            declared = _parse(reply["layout"], side)
            if book.get(rank) != declared:
                book[rank] = declared
                changed = True
        return changed

    def forget(self, side: str, rank: int) -> None:
        """A peer left: its layout is asked again if it comes back."""
        (self.holders if side == TRAINER else self.needs).pop(rank, None)
        self._holding.discard((side, rank))


class Agreement:
    """A trainer rank > 0's or a receiver rank's side: answers offers, keeps the last route
    it computed (a steady job computes it once)."""

    def __init__(self, side: str, bucket_bytes: int) -> None:
        self.side = side
        self.bucket_bytes = bucket_bytes
        self._route: Route | None = None
        self._own: Declared | None = None  # this rank's layout in the route last agreed
        self._receivers = 0  # the receiver ranks of that route

    def specs(self, offer: Any) -> list[TensorSpec] | None:
        """The global tensors' specs of an offer: carried, or (an offer of the hash only)
        the agreed route's, when this rank holds it (else None)."""
        if isinstance(offer, dict) and offer.get("compact"):
            held = self._route is not None and self._route.hash == offer.get("hash")
            return list(self._route.specs) if held and self._route is not None else None
        return offered_specs(offer)

    def answer(
        self, offer: Any, index: int, own: Declared, specs: Sequence[TensorSpec] | None = None
    ) -> tuple[Part | None, dict[str, Any]]:
        """This rank's part of the offered route and the fields of its ready answer; no
        part (and its layout in the answer) while the offer does not name its layout yet.
        ``specs``: a trainer rank's own global specs, which must be rank 0's. Raises
        ValueError saying what differs."""
        if not isinstance(offer, dict):
            raise ValueError("the sync message carries no route (the sender is not running a sharded sync)")
        if offer.get("compact"):  # the hash only: the route agreed before, if nothing changed here
            route = self._route
            same = route is not None and route.hash == offer.get("hash") and self._own == own
            if same and specs is not None and list(specs) != list(route.specs):  # type: ignore[union-attr]
                same = False
            if not same or route is None:
                return None, {"layout": _wire(own)}
            return _part(route, self.side, index, self._receivers, self.bucket_bytes), {"route": route.hash}
        offered = _specs(offer.get("specs"))
        if specs is not None and list(specs) != offered:
            theirs = {s.name: s for s in offered}
            diff = next((s for s in specs if theirs.get(s.name) != s), None)
            what = f"{diff} vs {theirs.get(diff.name)}" if diff is not None else "other tensor names"
            raise ValueError(
                f"trainer rank {index} holds other tensors than trainer rank 0 ({what}): every trainer rank "
                "must shard the same model"
            )
        holders, needs = offer.get("holders"), offer.get("needs")
        if not isinstance(holders, list) or not isinstance(needs, list):
            raise ValueError("the route offer carries no layouts")
        mine = holders if self.side == TRAINER else needs
        if not 0 <= index < len(mine):
            raise ValueError(f"{self.side} {index} is not in the route offer ({len(mine)} {self.side} ranks)")
        if offer.get("hash") is None or mine[index] != _wire(own):
            return None, {"layout": _wire(own)}
        if self._route is None or self._route.hash != offer["hash"]:
            try:
                route = compute(
                    offered, [_parse(h, TRAINER) for h in holders], [_parse(n, RECEIVER) for n in needs]
                )
            except RouteError as e:
                raise ValueError(f"the offered layouts make no route: {e}") from e
            if route.hash != offer["hash"]:
                raise ValueError(
                    f"route hash: trainer rank 0 {offer['hash'][:12]}, {self.side} {index} computed "
                    f"{route.hash[:12]} from the same layouts (run the same weightsync everywhere)"
                )
            self._route = route
        self._own, self._receivers = own, len(needs)
        return _part(self._route, self.side, index, len(needs), self.bucket_bytes), {"route": offer["hash"]}


class ShardSource(WeightSource):
    """A trainer rank's source in a sharded sync: its local shards (a DTensor's local
    tensor, a plain tensor whole, or declared shards), never a gathered tensor. What it
    sends is decided by the route: ``Part.tensors``."""

    def __init__(self, shards: Mapping[str, LocalShard]) -> None:
        self.shards = dict(shards)
        self._specs = global_specs(self.shards)
        self._layouts: dict[str, Layout] = {}  # by host: asked for in every round of a handshake

    @classmethod
    def of(cls, obj: Any, wire_dtype: torch.dtype | None = None, form: str = "module") -> ShardSource:
        """A module, a state dict (DTensors or plain tensors) or declared shards
        (``weightsync.sharding.declared_shards``) as a sharded source. ``form="checkpoint"``:
        a transformers model whose checkpoint form differs from its own sends the
        checkpoint's pieces of its shards (``weightsync.sharding.pieces``)."""
        if wire_dtype is not None:
            raise ValueError(
                "backend=sharded sends each shard in its own dtype: cast the model (or declare shards of "
                "the dtype to send) instead of passing wire_dtype"
            )
        if isinstance(obj, ShardSource):
            return obj
        if isinstance(obj, Mapping) and obj and all(isinstance(v, LocalShard) for v in obj.values()):
            return cls(obj)
        if form not in FORMS:
            raise ValueError(f"form {form!r}: expected one of {', '.join(FORMS)}")
        if isinstance(obj, (torch.nn.Module, Mapping)):
            shards = local_shards(obj)
            if form == "checkpoint" and is_transformers(obj):
                plan = checkpoint_plan(obj, {n: s.spec for n, s in shards.items()})
                if converts(plan):
                    return cls(checkpoint_shards(obj, shards))
            return cls(shards)
        raise TypeError(
            f"backend=sharded cannot send a {type(obj).__name__}: pass an nn.Module, a state dict or declared "
            "shards (weightsync.sharding.declared_shards); each rank's layout must be known before the sync"
        )

    def specs(self) -> list[TensorSpec]:
        return self._specs

    def layout(self, host: str) -> Layout:
        if host not in self._layouts:
            self._layouts[host] = layout_of(self.shards, host)
        return self._layouts[host]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise RuntimeError("a sharded source is sent by the fragments its route gives it (Part.tensors)")


def receiver_checksums(
    route: Route, receivers: int, bucket_bytes: int, sums: Mapping[int, Mapping[int, int]]
) -> list[list[int]]:
    """``verify``: each receiver rank's list of bucket checksums in its own plan's order,
    from each trainer rank's checksums of its own buckets (``sums``: trainer rank -> bucket
    index -> checksum). The k-th bucket of a pair is the same bytes at both ends; a rank down
    a chain takes its chain leader's buckets, so its leader's list."""
    by_pair: dict[tuple[int, int], list[int]] = {}
    for source, own in sums.items():
        plan = _part(route, TRAINER, source, receivers, bucket_bytes).rank_plan
        for bucket in plan.plan.buckets:
            by_pair.setdefault((source, plan.peer_of(bucket.index)), []).append(own[bucket.index])
    out = []
    for dest in range(receivers):
        plan = _part(route, RECEIVER, dest, receivers, bucket_bytes).rank_plan
        leader, taken = route.leader(dest), {}
        order = []
        for bucket in plan.plan.buckets:
            source = plan.peer_of(bucket.index)
            k = taken[source] = taken.get(source, -1) + 1
            order.append(by_pair[(source, leader)][k])
        out.append(order)
    return out


def own_part(route: Route, receivers: int, bucket_bytes: int) -> Part:
    """Trainer rank 0's part of the route it offered."""
    return _part(route, TRAINER, 0, receivers, bucket_bytes)
