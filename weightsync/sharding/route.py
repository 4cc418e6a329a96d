"""The route of a sharded sync (M trainer ranks x N receiver ranks), as data.

``plan_route(specs, holders, needs)`` is a pure, deterministic function of both sides'
layouts (``weightsync.sharding.layout``): it intersects what each trainer rank holds with
what each receiver rank needs into fragments (a tensor, a box of it, the trainer rank that
sends it, the receiver rank that takes it). Every destination byte is covered exactly once
and read only from a rank that holds it; where several ranks hold the same bytes (a
replicated mesh axis, or a trainer whose every rank holds every whole tensor), the sender of
each fragment is chosen so that the bytes through each trainer host's NIC are balanced
(largest fragments first, each to the least loaded holder: the slowest NIC ends within one
fragment of the balanced share). Every rank computes the route from the same inputs; the
``hash`` is what they compare before a byte moves.

What the planner refuses (``RouteError``, naming the tensor): a needed byte that no
trainer rank holds, and holders whose boxes overlap without being equal (no DTensor
placement produces that; a declared layout can).
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box, Layout

ROUTE_FORMAT = 1


class RouteError(ValueError):
    """The layouts of the two sides do not make a route (the message names the tensor)."""


@dataclass(frozen=True, order=True)
class Fragment:
    """One box of one tensor from a trainer rank to a receiver rank (global coordinates)."""

    tensor: int  # index in the route's specs
    dest: int  # receiver rank
    box: Box
    source: int  # trainer rank
    nbytes: int

    def to_wire(self) -> list[Any]:
        return [self.tensor, self.dest, self.box.to_wire(), self.source]


@dataclass(frozen=True)
class Route:
    """The fragments of a sharded sync, in plan order (tensor, then receiver rank, then box).

    ``chains``: receiver ranks that keep exactly the same boxes (the same rank of several
    tensor-parallel replicas), each chain in rank order. Fragments go to a chain's first
    rank only; each rank of the chain passes every bucket on to the next as it arrives, so
    a trainer rank's bytes leave its NIC once however many replicas take them."""

    specs: tuple[TensorSpec, ...]
    fragments: tuple[Fragment, ...]
    hash: str
    chains: tuple[tuple[int, ...], ...] = ()

    def leader(self, dest: int) -> int:
        """The receiver rank whose fragments ``dest`` takes: the first of its chain."""
        for chain in self.chains:
            if dest in chain:
                return chain[0]
        return dest

    def next_in_chain(self, dest: int) -> int | None:
        """The receiver rank ``dest`` passes its buckets on to (None: none)."""
        for chain in self.chains:
            if dest in chain[:-1]:
                return chain[chain.index(dest) + 1]
        return None

    def previous_in_chain(self, dest: int) -> int | None:
        """The receiver rank ``dest`` takes its buckets from (None: from the trainer ranks)."""
        for chain in self.chains:
            if dest in chain[1:]:
                return chain[chain.index(dest) - 1]
        return None

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each trainer rank sends."""
        out: dict[int, int] = defaultdict(int)
        for f in self.fragments:
            out[f.source] += f.nbytes
        return dict(out)

    def received_bytes(self) -> dict[int, int]:
        """Bytes each receiver rank takes (a chain's every rank its first rank's)."""
        out: dict[int, int] = defaultdict(int)
        for f in self.fragments:
            out[f.dest] += f.nbytes
        for chain in self.chains:
            for dest in chain[1:]:
                out[dest] = out.get(chain[0], 0)
        return dict(out)

    def for_source(self, rank: int) -> list[Fragment]:
        return [f for f in self.fragments if f.source == rank]

    def for_dest(self, rank: int) -> list[Fragment]:
        """The fragments receiver rank ``rank`` takes (from a trainer rank, or along its chain)."""
        leader = self.leader(rank)
        return [f for f in self.fragments if f.dest == leader]


def route_hash(
    specs: Sequence[TensorSpec], fragments: Sequence[Fragment], chains: Sequence[Sequence[int]] = ()
) -> str:
    """sha256 over the canonical JSON of the specs, the fragments and the chains."""
    canon = json.dumps(
        [
            ROUTE_FORMAT,
            [s.to_wire() for s in specs],
            [f.to_wire() for f in fragments],
            [list(c) for c in chains],
        ],
        separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()


def _holder_boxes(index: int, spec: TensorSpec, holders: Sequence[Layout]) -> dict[Box, list[int]]:
    """Distinct boxes of ``spec`` held, each with the trainer ranks that hold it; checked
    pairwise equal or disjoint."""
    by_box: dict[Box, list[int]] = defaultdict(list)
    for rank, layout in enumerate(holders):
        box = layout.boxes.get(spec.name)
        if box is None or box.numel == 0:
            continue
        if len(box.starts) != len(spec.shape) or not Box.whole(spec.shape).contains(box):
            raise RouteError(
                f"tensor {spec.name!r}: trainer rank {rank} holds {box}, outside its shape {spec.shape}"
            )
        by_box[box].append(rank)
    boxes = sorted(by_box)  # by their first start: a sweep compares only boxes that meet in dim 0
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a.starts and b.starts[0] >= a.ends[0]:
                break
            if a.intersect(b) is not None:
                raise RouteError(
                    f"tensor {spec.name!r}: trainer ranks {by_box[a]} hold {a} and ranks {by_box[b]} hold {b}, "
                    "which overlap without being equal"
                )
    return dict(sorted(by_box.items()))


def chains_of(needs: Sequence[Layout]) -> tuple[tuple[int, ...], ...]:
    """Receiver ranks that keep exactly the same boxes (hosts aside), two or more, each
    group in rank order: the chains of a route that forwards."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for dest, layout in enumerate(needs):
        boxes = tuple(sorted((n, b) for n, b in layout.boxes.items() if b.numel))
        if boxes:
            groups[boxes].append(dest)
    return tuple(sorted(tuple(g) for g in groups.values() if len(g) > 1))


def plan_route(
    specs: Sequence[TensorSpec], holders: Sequence[Layout], needs: Sequence[Layout], forward: bool = True
) -> Route:
    """The route from trainer ranks holding ``holders[r]`` to receiver ranks needing
    ``needs[q]``. A tensor a receiver's layout does not name is not sent to it. With
    ``forward``, receiver ranks that keep the same boxes form a chain (``Route.chains``)."""
    chains = chains_of(needs) if forward else ()
    followers = {d for chain in chains for d in chain[1:]}
    needs = [Layout({}, layout.host) if d in followers else layout for d, layout in enumerate(needs)]
    hosts = [layout.host or f"trainer-{rank}" for rank, layout in enumerate(holders)]
    candidates: list[tuple[int, int, Box, list[int], int]] = []
    for index, spec in enumerate(specs):
        held = _holder_boxes(index, spec, holders)
        itemsize = spec.torch_dtype.itemsize
        for dest, layout in enumerate(needs):
            need = layout.boxes.get(spec.name)
            if need is None or need.numel == 0:
                continue
            if len(need.starts) != len(spec.shape) or not Box.whole(spec.shape).contains(need):
                raise RouteError(
                    f"tensor {spec.name!r}: receiver rank {dest} needs {need}, outside {spec.shape}"
                )
            covered = 0
            for box, ranks in held.items():
                piece = need.intersect(box)
                if piece is not None:
                    candidates.append((index, dest, piece, ranks, piece.numel * itemsize))
                    covered += piece.numel
            if covered != need.numel:
                raise RouteError(
                    f"tensor {spec.name!r}: receiver rank {dest} needs {need}, of which "
                    f"{need.numel - covered} elements no trainer rank holds"
                )
    load: dict[str, int] = defaultdict(int)
    own: dict[int, int] = defaultdict(int)
    chosen: list[Fragment] = []
    # Largest first, each to its least loaded holder (by host, then by rank): deterministic.
    for index, dest, box, ranks, nbytes in sorted(candidates, key=lambda c: (-c[4], c[0], c[1], c[2])):
        source = min(ranks, key=lambda r: (load[hosts[r]], own[r], r))
        load[hosts[source]] += nbytes
        own[source] += nbytes
        chosen.append(Fragment(index, dest, box, source, nbytes))
    fragments = tuple(sorted(chosen))
    return Route(tuple(specs), fragments, route_hash(specs, fragments, chains), chains)


def nic_bytes(route: Route, holders: Sequence[Layout], needs: Sequence[Layout]) -> dict[str, dict[str, int]]:
    """Bytes through each host's NIC by direction: ``{host: {"sent": n, "received": m}}``
    (ranks of one host share it; trainer ranks without a host are hosts of their own)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0})
    for f in route.fragments:
        out[holders[f.source].host or f"trainer-{f.source}"]["sent"] += f.nbytes
        out[needs[f.dest].host or f"receiver-{f.dest}"]["received"] += f.nbytes
    taken = route.received_bytes()
    for chain in route.chains:  # each rank of a chain passes its bytes on to the next
        for a, b in zip(chain, chain[1:]):
            out[needs[a].host or f"receiver-{a}"]["sent"] += taken.get(a, 0)
            out[needs[b].host or f"receiver-{b}"]["received"] += taken.get(a, 0)
    return dict(out)


def whole_needs(specs: Sequence[TensorSpec], declared: Mapping[int, Layout], receivers: int) -> list[Layout]:
    """Receiver layouts for ``receivers`` ranks: the declared ones, whole tensors for the rest
    (a receiver that declares nothing takes every tensor whole, as in a dense sync)."""
    return [declared.get(q) or Layout.whole(specs) for q in range(receivers)]
