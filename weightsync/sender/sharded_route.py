"""``ShardedSend``: the sender's route stage of ``backend=sharded``.

Each trainer rank holds local shards (``ShardSource``) and sends only the fragments the
route gives it; each receiver keeps only its part. The route forms in the handshake
(``weightsync.sharding.agreement``): trainer rank 0 offers the layouts it has heard, peers
whose layout the offer lacks answer with it and the sync is offered again, at most
``MAX_ROUTE_ROUNDS`` times. After the go, rank 0 packs its own fragments by its own plan;
its links and per-bucket peers go into the ``Join`` record, and ``verify`` hands each
receiver the checksums of its own buckets. Quantized forms that receivers' layouts name are
entries of every trainer rank's source (``weightsync.quant.sharded``): when they change, the
other trainer ranks' layouts are asked again, and after the go every rank quantizes its
shard, the scales of cut blocks agreed between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.engines.base import Join
from weightsync.plan import Plan, capacity
from weightsync.quant.sharded import FormedSource, wanted
from weightsync.sharding.agreement import (
    TRAINER,
    Agreement,
    Part,
    RouteOffer,
    ShardSource,
    offered_layouts,
    own_part,
    receiver_checksums,
)
from weightsync.sources import IteratorSource, WeightSource
from weightsync.stages import Answer, Members, Outgoing, SendStage
from weightsync.stats import SyncStats

#: rounds of the handshake in which ranks may still declare a new layout
MAX_ROUTE_ROUNDS = 3


class ShardedSend(SendStage):
    """The route stage under ``backend=sharded``, on trainer rank 0 (``offer``,
    ``answered``, ``own``) and on a following trainer rank (``follow``, ``own``): the same
    object, so a rank's part and its quantized forms are made one way."""

    plane_in_sync = True  # the route needs every rank's layout: it forms in the first sync
    own_buckets = True

    def __init__(self, timeout_s: float, bucket_bytes: int) -> None:
        self._timeout_s = timeout_s  # trainer ranks agreeing quantized scales wait this long
        self._offer = RouteOffer()  # rank 0: the layouts heard and the route they make
        self._agreement = Agreement(TRAINER, bucket_bytes)  # a following rank: the route agreed last
        self._part: Part | None = None  # this rank's part of the sync in progress
        self._rounds = 0  # rounds of the current handshake that changed the route
        self._formed: ShardSource | None = None  # this sync's source with the forms receivers keep
        self._tags: dict[str, frozenset[str]] = {}  # the forms the receivers' layouts named last
        self._trainers = 1  # the trainer ranks of the offer that named them
        self._following = False

    def source(self, obj: Any, wire_dtype: torch.dtype | None, form: str) -> WeightSource:
        return ShardSource.of(obj, wire_dtype, form)

    def plan(self, src: WeightSource, plan: Plan | None) -> Plan | None:
        return None  # each rank's plan comes from the route, agreed in the handshake

    def start(self, members: Members | None) -> None:
        self._part, self._rounds, self._formed = None, 0, None
        self._following = members is None

    # -- trainer rank 0
    def offer(self, out: Outgoing, members: Members) -> dict[str, Any]:
        src = self._source(out, members)
        fields = self._offer.fields(
            src.specs(), src.layout(members.host), members.receivers, members.trainers
        )
        return {"route": fields}

    def answered(self, out: Outgoing, answers: Sequence[Answer], members: Members) -> bool:
        try:
            if not self._offer.take(answers):
                return False
            src = self._source(out, members)
            self._offer.route(src.specs(), src.layout(members.host), members.receivers, members.trainers)
        except ValueError as e:  # a RouteError, or a layout that does not parse
            for side, rank, _ in answers:
                self._offer.forget(side, rank)  # asked again at the next sync
            raise ValueError(f"the layouts of this sync's ranks make no route: {e}") from e
        self._rounds += 1
        if self._rounds > MAX_ROUTE_ROUNDS:
            raise ValueError(f"the ranks' layouts changed in each of {self._rounds} rounds")
        return True

    # -- a following trainer rank
    def follow(self, src: WeightSource, msg: Mapping[str, Any], rank: int, host: str) -> dict[str, Any]:
        offer = msg.get("route")
        layouts = offered_layouts(offer)  # an offer of the route's hash only: the last full offer's
        if layouts is not None:
            holders, needs = layouts
            self._trainers = len(holders)
            self._wants(wanted(needs))
        formed = self._formed_of(self._shards(src), self._trainers)
        self._part, fields = self._agreement.answer(offer, rank, formed.layout(host), formed.specs())
        return fields

    # -- after the go, either rank
    def own(self, out: Outgoing, members: Members, bucket_bytes: int) -> Outgoing:
        if self._following:
            src = self._formed_of(self._shards(out.source), self._trainers)
            if self._part is None:
                raise RuntimeError("trainer rank 0 gave the go before the route was agreed")
        else:
            src = self._source(out, members)
            route = self._offer.route(
                src.specs(), src.layout(members.host), members.receivers, members.trainers
            )
            if route is None:
                raise RuntimeError("the sharded handshake ended without a route")  # answered prevents it
            self._part = own_part(route, len(members.receivers), bucket_bytes)
        if isinstance(src, FormedSource):  # after the go: every trainer rank quantizes now
            src.quantize()
        part = self._own()
        return Outgoing(IteratorSource(part.tensors(src.shards)), part.rank_plan.plan, out.version)

    def join(self, join: Join, bucket_bytes: int) -> Join:
        part = self._own()
        plan = part.rank_plan.plan
        return dataclasses.replace(
            join, capacity=capacity(plan, bucket_bytes), links=part.links, peer_of=part.peer_of
        )

    def account(self, stats: SyncStats) -> None:
        part = self._own()
        if self._following:  # this rank's fragments, without the buckets' alignment
            stats.bytes = part.nbytes()
        else:  # every trainer rank's fragments
            stats.bytes = sum(part.route.received_bytes().values())
            stats.tensors = len(part.route.fragments)
        if isinstance(self._formed, FormedSource):
            stats.quantized, stats.quantize_s = self._formed.quantized, self._formed.seconds

    def checksums(
        self, out: Outgoing, sums: dict[int, dict[int, int]], members: Members, bucket_bytes: int
    ) -> list[list[int]] | None:
        return receiver_checksums(self._own().route, len(members.receivers), bucket_bytes, sums)

    def forget(self, side: str, rank: int) -> None:
        self._offer.forget(side, rank)

    def _source(self, out: Outgoing, members: Members) -> ShardSource:
        """Rank 0's source for this sync: the trainer's shards, with the quantized entries
        the receivers' layouts name. When those change, the other trainer ranks' layouts
        (which lack them) are asked again."""
        if self._wants(wanted(self._offer.needs[r] for r in members.receivers if r in self._offer.needs)):
            for t in range(1, members.trainers):
                self._offer.forget(TRAINER, t)
        return self._formed_of(self._shards(out.source), members.trainers)

    def _wants(self, tags: dict[str, frozenset[str]]) -> bool:
        """The forms the receivers' layouts name; True when they changed."""
        changed, self._tags = tags != self._tags, tags
        return changed

    def _formed_of(self, src: ShardSource, trainers: int) -> ShardSource:
        """``src`` with the quantized entries of ``_tags`` (one source per sync, kept while
        they stay the same)."""
        if not self._tags:
            self._formed = src
        elif not (
            isinstance(self._formed, FormedSource)
            and self._formed.base is src
            and self._formed.tags == self._tags
        ):
            self._formed = FormedSource(src, self._tags, trainers, self._timeout_s)
        return self._formed

    def _own(self) -> Part:
        if self._part is None:
            raise RuntimeError("the sharded sync has no part before its go")
        return self._part

    @staticmethod
    def _shards(src: WeightSource) -> ShardSource:
        if isinstance(src, FormedSource):
            return src.base
        if not isinstance(src, ShardSource):  # source() made it one
            raise TypeError(f"backend=sharded sends a ShardSource, not a {type(src).__name__}")
        return src
