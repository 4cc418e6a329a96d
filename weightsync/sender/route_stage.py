"""The sender's route stage: what a sync's wire entries are and where they go.

``Sender`` chooses one stage when it is made (``route_stage``) and then reads the same for
every transport; it asks the stage, in the order of a sync:

1. ``source``: what the trainer's object becomes (a cast for the wire, or local shards);
2. ``plan``: the plan known before anyone is asked (None: agreed in the handshake, or a
   source that streams);
3. ``offer`` / ``answered``: the fields each handshake round adds to the sync message, and
   whether the peers' answers call for another round;
4. ``own``: after the go, what this rank itself packs (its wire entries and their plan);
5. ``join``: its links in the data plane's ``Join`` record;
6. ``account`` / ``checksums``: what it adds to the stats, and each receiver's list of
   bucket checksums under ``verify``.

Two stages: ``DenseSend`` (every receiver takes every tensor, by one plan) and
``ShardedSend`` (``weightsync.sender.sharded_route``: each rank sends or keeps its part of
a route agreed in the handshake). A stage that changes where a tensor's bytes go (a
fragment) changes ``source`` and ``own``, and its receiving counterpart
(``weightsync.receiver.route_stage``) how the receiver lands it: the session stays as it is.
The forms stage (``weightsync.quant.send_stage``: quantized blocks with their scales, per
receiver whatever the route) and then the delta stage (``weightsync.delta.send_stage``) run
between ``plan`` and ``offer``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.delta.send_stage import Outgoing
from weightsync.engines.base import Join, Transport
from weightsync.errors import SyncError
from weightsync.plan import Plan, make_plan
from weightsync.sender.ranks import TrainerFollower
from weightsync.sources import WeightSource, as_source
from weightsync.stats import SyncStats


@dataclass(frozen=True)
class Members:
    """Who takes part in the sync in progress, as the route stage needs it."""

    receivers: tuple[int, ...]  # receiver ranks, in group-rank order
    trainers: int  # trainer ranks that send or hold shards
    host: str  # the host trainer rank 0's bytes leave from (ranks of a host share a NIC)


#: an answer of one round of the handshake: the peer's side ("receiver" or "trainer"), its
#: rank, its ready reply
Answer = tuple[str, int, dict[str, Any]]


class SendRoute:
    """The contract, with the dense plan's answers as its defaults (``DenseSend``)."""

    #: the data plane forms in the first sync, not in ``warm_up`` (a route needs layouts)
    forms_in_sync = False
    #: each trainer rank's bucket checksums kept apart (its buckets are its own)
    own_buckets = False

    def source(self, obj: Any, wire_dtype: torch.dtype | None, form: str) -> WeightSource:
        return as_source(obj, wire_dtype, form)

    def plan(self, src: WeightSource, config: EngineConfig, engine_cls: type, all_send: bool) -> Plan | None:
        """The plan every receiver takes, checked against what the backend carries, before
        anyone is waited for (None for a source that streams its entries)."""
        specs = src.specs()
        plan = make_plan(specs, config.bucket_bytes) if specs is not None else None
        carriable(plan, config, engine_cls, all_send)
        return plan

    def follow(
        self,
        follower: TrainerFollower,
        transport: Transport,
        src: WeightSource,
        version: int,
        plan: Plan | None,
        receivers: int,
    ) -> SyncStats:
        """A trainer rank > 0 (``paired``, ``sharded``): follow rank 0's sync and send this
        rank's share."""
        assert plan is not None  # carriable: every trainer rank announces its tensors
        return follower.send_share(transport, src, version, plan, receivers)

    def start(self) -> None:
        """A new sync (or attempt) begins: forget the last one's part."""

    def offer(self, out: Outgoing, members: Members) -> dict[str, Any]:
        """Fields this round of the handshake adds to every sync message."""
        return {}

    def answered(self, out: Outgoing, answers: Sequence[Answer], members: Members) -> bool:
        """Take the peers' answers; True when the sync must be offered again. Raises
        ``ValueError`` saying why the sync cannot go (the session aborts it)."""
        return False

    def own(self, out: Outgoing, members: Members, bucket_bytes: int) -> Outgoing:
        """After the go: what this rank packs."""
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

    def forget(self, side: str, rank: int) -> None:
        """A peer left (or gave an answer that makes no route)."""


class DenseSend(SendRoute):
    """Every receiver takes every tensor whole, by one plan (every transport but
    ``sharded``)."""


def carriable(plan: Plan | None, config: EngineConfig, engine_cls: type, all_send: bool) -> None:
    """Refuse, before anything is sent, what the backend cannot carry: a bare iterator
    where every trainer rank sends (``all_send``), a tensor larger than a bucket where the
    backend never splits one."""
    if all_send and plan is None:
        raise SyncError(
            f"backend {config.backend!r} needs a source that announces its tensors up front "
            "(a module or a state dict, the same on every trainer rank), not a bare iterator"
        )
    if plan is None or engine_cls.splits_tensors:
        return
    bucket = config.bucket_bytes
    for spec in plan.tensors:
        if spec.nbytes > bucket:
            raise SyncError(
                f"backend {config.backend!r} never splits a tensor, and tensor {spec.name!r} "
                f"({spec.nbytes / 2**20:.1f} MiB) is larger than a bucket ({bucket / 2**20:g} MiB): "
                f"set update_weights_bucket_megabytes to at least {math.ceil(spec.nbytes / 2**20)}"
            )
