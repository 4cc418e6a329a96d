"""Fragments as tensors: what a trainer rank packs from its local shards, and where a
receiver rank lands each fragment in the slices it keeps.

A route (``weightsync.sharding.route``) names fragments by global boxes. Here they meet
real memory:

- ``local_shards`` reads what a rank holds (or keeps) from a module or a state dict: a
  DTensor's local tensor (``to_local()``, never ``full_tensor()``) with the box its
  placements give, a plain tensor as the whole box, or declared shards (Megatron-style:
  the global shape and box of each local tensor).
- ``pair_plan`` plans the fragments one trainer rank sends one receiver rank as an ordinary
  transfer plan (``weightsync.plan``): each fragment is a tensor of the box's shape, named
  after its tensor and box, so the packer, the buckets and the plan hash are the dense
  sync's own. Both ends build it from the route alone.
- ``fragment_tensors`` yields a pair's fragments from the sender's local shards: views of
  the local tensor, copied into the bucket by the packer (a box that cuts rows is made
  contiguous first: one copy more). No rank materializes a full tensor.
- ``trainer_plan`` / ``receiver_plan`` lay a rank's pairs out as one plan (a group of
  buckets per peer), its buckets in the one order every rank moves buckets in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.plan import Bucket, Piece, Plan, TensorSpec, dtype_name, make_plan
from weightsync.sharding.layout import Box, Layout, box_of_dtensor
from weightsync.sharding.route import Fragment, Route
from weightsync.sources import is_dtensor


@dataclass(frozen=True)
class LocalShard:
    """What one rank holds (or keeps) of one global tensor: ``tensor`` is the box ``box``
    of the global tensor ``spec``."""

    spec: TensorSpec
    box: Box
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if tuple(self.tensor.shape) != self.box.lengths:
            raise ValueError(
                f"tensor {self.spec.name!r}: the local tensor's shape {tuple(self.tensor.shape)} is not "
                f"its box's {self.box.lengths}"
            )


def local_shards(obj: torch.nn.Module | Mapping[str, Any]) -> dict[str, LocalShard]:
    """This rank's shard of every tensor of a module's state dict (or a state dict): a
    DTensor's local tensor and box, a plain tensor whole. Tied weights count once, under
    their first name."""
    if isinstance(obj, torch.nn.Module):
        items, seen = {}, set()
        for name, t in obj.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                items[name] = t
    else:
        items = dict(obj)
    out = {}
    for name, t in items.items():
        t = t.detach()
        if is_dtensor(t):
            spec = TensorSpec(name, tuple(t.shape), dtype_name(t.dtype))
            out[name] = LocalShard(spec, box_of_dtensor(t), t.to_local())
        else:
            out[name] = LocalShard(TensorSpec.of(name, t), Box.whole(t.shape), t)
    return out


def declared_shards(shards: Mapping[str, tuple[tuple[int, ...], Box, torch.Tensor]]) -> dict[str, LocalShard]:
    """Shards a framework declares itself (Megatron-style tensor or pipeline parallelism):
    ``{name: (global_shape, box, local_tensor)}``."""
    return {
        name: LocalShard(TensorSpec(name, tuple(shape), dtype_name(t.dtype)), box, t)
        for name, (shape, box, t) in shards.items()
    }


def layout_of(shards: Mapping[str, LocalShard], host: str = "") -> Layout:
    """The layout a rank declares: the box of every tensor it holds or keeps."""
    return Layout({name: s.box for name, s in shards.items()}, host)


def global_specs(shards: Mapping[str, LocalShard]) -> list[TensorSpec]:
    """The global tensors' specs, in the rank's order (every rank of a mesh has the same)."""
    return [s.spec for s in shards.values()]


def region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``tensor`` that ``box`` (in ``tensor``'s own coordinates) covers."""
    return tensor[tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]


def fragment_name(route: Route, fragment: Fragment) -> str:
    """A fragment's name in its pair's plan: the tensor and its box (``w@[0,4]+[2,4]``)."""
    box = fragment.box
    starts, lengths = ",".join(map(str, box.starts)), ",".join(map(str, box.lengths))
    return f"{route.specs[fragment.tensor].name}@[{starts}]+[{lengths}]"


def fragment_spec(route: Route, fragment: Fragment) -> TensorSpec:
    spec = route.specs[fragment.tensor]
    return TensorSpec(fragment_name(route, fragment), fragment.box.lengths, spec.dtype)


def pair_fragments(route: Route, source: int, dest: int) -> list[Fragment]:
    """The fragments trainer rank ``source`` sends receiver rank ``dest``, in route order."""
    return [f for f in route.fragments if f.source == source and f.dest == dest]


def pair_plan(route: Route, source: int, dest: int, bucket_bytes: int) -> Plan:
    """The transfer plan of one pair: its fragments as tensors, in route order."""
    return make_plan([fragment_spec(route, f) for f in pair_fragments(route, source, dest)], bucket_bytes)


def fragment_tensors(
    route: Route, source: int, dest: int, shards: Mapping[str, LocalShard]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The pair's fragments, in its plan's order, read from trainer rank ``source``'s shards."""
    for f in pair_fragments(route, source, dest):
        shard = shards[route.specs[f.tensor].name]
        if not shard.box.contains(f.box):
            raise ValueError(
                f"the route has trainer rank {source} send {fragment_name(route, f)}, "
                f"outside the {shard.box} it holds"
            )
        yield fragment_name(route, f), region(shard.tensor, f.box.within(shard.box))


@dataclass(frozen=True)
class RankPlan:
    """One rank's whole part of a sharded sync as one ordinary plan: its fragments grouped by
    peer (the receiver ranks it sends to, or the trainer ranks it takes from), each group's
    buckets laid out exactly as that pair's own plan (``pair_plan``), so both ends of a pair
    hold the same buckets in the same order, and a transport needs only ``peer_of(bucket)``
    to know which link a bucket travels. The groups' buckets take turns (``_levels``):
    a receiver fed by several trainer ranks gets the first bucket of each before the second
    of any, so a tensor with bytes from several of them is complete early, not once the last
    pair began. ``plan.hash`` covers the fragments; the route's hash, agreed by every rank
    first, covers who sends what."""

    plan: Plan
    #: each group's peer rank, in the order the groups' tensors come
    peers: tuple[int, ...]
    #: the peer rank of each bucket, in bucket order
    bucket_peers: tuple[int, ...]

    def peer_of(self, bucket_index: int) -> int:
        """The peer rank bucket ``bucket_index`` travels to or from."""
        return self.bucket_peers[bucket_index]


def _round(route: Route, source: int, dest: int) -> int:
    """The round of pair (source, dest): ``(dest - source) mod K``, K the larger of the two
    sides' rank counts. A round pairs each trainer rank with at most one receiver rank and
    the reverse, so the pairs of one round can run at once: the order links are joined in,
    and the tie-break of the order buckets move in (``_levels``)."""
    ranks = max(
        max((f.source for f in route.fragments), default=0), max((f.dest for f in route.fragments), default=0)
    )
    return (dest - source) % (ranks + 1)


def pairs_in_order(route: Route) -> list[tuple[int, int]]:
    """Every (trainer rank, receiver rank) pair of the route, in round order (``_round``):
    the order every rank joins its links in, and lays its groups out in."""
    pairs = {(f.source, f.dest) for f in route.fragments}
    return sorted(pairs, key=lambda p: (_round(route, *p), *p))


def _pair_plans(route: Route, bucket_bytes: int) -> dict[tuple[int, int], Plan]:
    """Every pair's plan (``pair_plan``), the fragments grouped by pair in one pass."""
    grouped: dict[tuple[int, int], list[TensorSpec]] = {}
    for f in route.fragments:
        grouped.setdefault((f.source, f.dest), []).append(fragment_spec(route, f))
    return {pair: make_plan(specs, bucket_bytes) for pair, specs in grouped.items()}


def _levels(route: Route, plans: Mapping[tuple[int, int], Plan]) -> list[list[tuple[int, int]]]:
    """The order buckets move in, the same on every rank: level k holds the k-th bucket of
    every pair that has one, before any (k + 1)-th (a receiver fed by several trainer ranks
    gets the first bucket of each before the second of any). Within a level, pairs go by a
    list schedule of both ends' NICs, in bytes: next is the pair whose two ends are both
    free first (ties in round order, ``_round``). One total order, so the smallest bucket
    not yet moved is always the next of both its ends and blocking sends cannot deadlock
    (each rank starting from its own peer, a rotation, can: three ranks a side, each waiting
    for the next in a circle); and scheduled, so a receiver rank does not sit idle waiting
    for a trainer rank still busy with a larger pair: with pairs of unequal size (4 FSDP2
    ranks to 2 tensor-parallel ranks: a trainer rank's rows fall in one rank's half of a
    column-parallel tensor), the rounds alone keep the busiest receiver NIC 8% longer than
    its bytes."""
    pairs = sorted(plans, key=lambda p: (_round(route, *p), *p))
    busy: dict[tuple[str, int], int] = {}  # bytes each NIC has moved by the time it is free
    levels: list[list[tuple[int, int]]] = []

    def free(pair: tuple[int, int]) -> int:  # when both its NICs are free
        return max(busy.get(("t", pair[0]), 0), busy.get(("r", pair[1]), 0))

    for k in range(max((len(p.buckets) for p in plans.values()), default=0)):
        waiting = [p for p in pairs if k < len(plans[p].buckets)]
        level: list[tuple[int, int]] = []
        while waiting:
            pick = min(waiting, key=free)
            waiting.remove(pick)
            busy[("t", pick[0])] = busy[("r", pick[1])] = free(pick) + plans[pick].buckets[k].nbytes
            level.append(pick)
        levels.append(level)
    return levels


#: the last schedules, by (route hash, bucket bytes): rank 0 checking ``verify`` plans every
#: rank's part of one route, each from the same pair plans and levels
_SCHEDULES: dict[tuple[str, int], tuple[dict[tuple[int, int], Plan], list[list[tuple[int, int]]]]] = {}
_SCHEDULES_KEPT = 4
_SCHEDULES_LOCK = threading.Lock()  # receivers of one process share them


def _schedule(
    route: Route, bucket_bytes: int
) -> tuple[dict[tuple[int, int], Plan], list[list[tuple[int, int]]]]:
    """Every pair's plan and the order their buckets move in (``_levels``)."""
    key = (route.hash, bucket_bytes)
    with _SCHEDULES_LOCK:
        found = _SCHEDULES.get(key)
    if found is None:
        plans = _pair_plans(route, bucket_bytes)
        found = (plans, _levels(route, plans))
        with _SCHEDULES_LOCK:
            while len(_SCHEDULES) >= _SCHEDULES_KEPT:
                _SCHEDULES.pop(next(iter(_SCHEDULES)))
            _SCHEDULES[key] = found
    return found


def _interleaved(
    route: Route, pairs: list[tuple[int, int]], peers: list[int], bucket_bytes: int
) -> tuple[Plan, tuple[int, ...]]:
    """The pair plans of ``pairs`` (source, dest; in round order; ``peers`` the other end of
    each) as one plan: their tensors one pair after another, their buckets in the order
    every rank moves buckets in (``_levels``), each laid out as the pair's own plan lays it
    out. Returns the plan and each bucket's peer."""
    plans, levels = _schedule(route, bucket_bytes)
    tensors: list[TensorSpec] = []
    groups: dict[tuple[int, int], tuple[int, list[Bucket]]] = {}
    for pair, peer in zip(pairs, peers):
        own = plans[pair]
        groups[pair] = (
            peer,
            [
                Bucket(
                    0,
                    b.nbytes,
                    tuple(
                        Piece(p.tensor + len(tensors), p.tensor_offset, p.length, p.bucket_offset)
                        for p in b.pieces
                    ),
                )
                for b in own.buckets
            ],
        )
        tensors += own.tensors
    buckets: list[Bucket] = []
    owners: list[int] = []
    for k, level in enumerate(levels):
        for pair in level:
            if pair in groups:
                peer, group = groups[pair]
                buckets.append(Bucket(len(buckets), group[k].nbytes, group[k].pieces))
                owners.append(peer)
    return Plan(bucket_bytes, tuple(tensors), tuple(buckets)), tuple(owners)


def trainer_plan(route: Route, source: int, bucket_bytes: int) -> RankPlan:
    """Trainer rank ``source``'s part: its fragments for each receiver rank, a group each,
    in the pairs' order (``_round``), their buckets taking turns."""
    dests = sorted({f.dest for f in route.for_source(source)}, key=lambda d: (_round(route, source, d), d))
    plan, owners = _interleaved(route, [(source, d) for d in dests], dests, bucket_bytes)
    return RankPlan(plan, tuple(dests), owners)


def receiver_plan(route: Route, dest: int, bucket_bytes: int) -> RankPlan:
    """Receiver rank ``dest``'s part: its fragments from each trainer rank, a group each,
    in the pairs' order (``_round``), their buckets taking turns. A rank further down a
    chain (``Route.chains``) takes the plan of its chain's first rank, every bucket from the
    rank before it."""
    dest = route.leader(dest)
    sources = sorted({f.source for f in route.for_dest(dest)}, key=lambda t: (_round(route, t, dest), t))
    plan, owners = _interleaved(route, [(s, dest) for s in sources], sources, bucket_bytes)
    return RankPlan(plan, tuple(sources), owners)
