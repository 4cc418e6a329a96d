"""Trainer rank 0's handshakes: a sync's rounds of offer and answers, and the warm-up.

A sync's handshake (``agree``)::

    rank 0 -> peer   sync {version, plan_hash[, plan], bucket_bytes, force, verify, engine,
                           reroute, <the stages' fields>}
    peer -> rank 0   ready {<the stages' fields>} | error {message}
    rank 0 -> peer   again (then a new sync message) | go | abort {message}

Each round's sync message carries every stage's fields (``SendStages.offer``); when any
stage's reading of the answers calls for it (``SendStages.answered``), the sync is encoded
again and offered in another round. The warm-up (``warm_up``) forms the data plane ahead of
the first sync: warmup, ready, go, joined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join, Transport
from weightsync.errors import HandshakeError
from weightsync.plan import Plan, capacity
from weightsync.sender.peers import Peer, SessionPeers
from weightsync.sender.replies import answers
from weightsync.session.channel import PROTOCOL_VERSION, Deadline
from weightsync.stages import Outgoing, SendStages

log = logging.getLogger("weightsync")


@dataclass(frozen=True)
class Offer:
    """What every sync message of one handshake says, whatever the round."""

    version: int
    force: bool  # a receiver takes a version older than its own (a deliberate rollback)
    reroute: Callable[[Plan | None], bool]  # whether receivers lost in it may be routed around


@dataclass
class Plane:
    """The data plane a sync offers: its ``Join`` record and the transport's description
    of it, grown when a later round's plan needs larger buffers than the first."""

    transport: Transport
    join: Join
    senders: int
    info: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.info = self._prepare()

    def fit(self, plan: Plan | None, bucket_bytes: int) -> None:
        need = capacity(plan, bucket_bytes)
        if need > self.join.capacity:
            self.join = replace(self.join, capacity=need)
            self.info = self._prepare()

    def _prepare(self) -> dict[str, Any]:
        return {
            **self.transport.prepare(self.join),
            "world_size": self.join.world_size,
            "senders": self.senders,
        }


def agree(
    peers: SessionPeers,
    stages: SendStages,
    config: EngineConfig,
    offer: Offer,
    plane: Plane,
    base: Outgoing,
    out: Outgoing,
) -> tuple[int, Outgoing]:
    """Agree on version, bucket size and plan with every receiver (and trainer rank);
    ``out``: ``base`` as the stages encoded it. Returns how many receivers got the full
    plan, and what this rank packs (the stages' ``own``). Raises ``HandshakeError`` (every
    peer told) when a peer refuses or a stage finds no way."""
    members = stages.members
    assert members is not None
    while True:
        plans_sent, round_peers, replies, deadline = _round(peers, stages, config, offer, plane, out)
        try:
            again = stages.answered(out, peers.answers_of(replies))
            if again:
                out = stages.encode(base)
                plane.fit(out.plan, config.bucket_bytes)
        except ValueError as e:
            peers.abort(round_peers, deadline, str(e), e)
        for _, _, ch in round_peers:
            ch.send({"type": "again" if again else "go"}, deadline)
        if not again:
            return plans_sent, stages.own(out, members, config.bucket_bytes)


def _round(
    peers: SessionPeers,
    stages: SendStages,
    config: EngineConfig,
    offer: Offer,
    plane: Plane,
    out: Outgoing,
) -> tuple[int, list[Peer], list[tuple[int | None, dict[str, Any]]], Deadline]:
    """One round: the sync message to every peer, and their answers. Returns how many
    receivers got the full plan, the peers, their replies (rank and reply) and the round's
    deadline."""
    deadline = Deadline(config.timeout_s, f"in the handshake of version {offer.version}")
    plan = out.plan
    plans_sent = 0
    msg: dict[str, Any] = {}
    fields = stages.offer(out)
    for rank, ch in peers.channels.items():
        msg = {
            "type": "sync",
            "protocol": PROTOCOL_VERSION,
            "version": offer.version,
            "bucket_bytes": config.bucket_bytes,
            "plan_hash": plan.hash if plan is not None else None,
            "force": offer.force,
            "verify": config.verify,
            "engine": {**plane.info, "rank": peers.group_rank(rank)},
            "reroute": offer.reroute(plan),
            **fields,
        }
        if plan is not None and peers.acked_plan.get(rank) != plan.hash:
            msg["plan"] = plan.to_wire()  # unchanged plans travel as their hash only
            plans_sent += 1
        ch.send(msg, deadline)
    first_trainer = len(peers.receivers) + 1  # trainer ranks > 0 come after the receivers
    for ch, trainer_msg in peers.trainers.sync_messages(msg, plane.info, first_rank=first_trainer):
        ch.send(trainer_msg, deadline)
    every = peers.peers()
    return plans_sent, every, answers(every, deadline, f"refused version {offer.version}"), deadline


def warm_up(peers: SessionPeers, transport: Transport, config: EngineConfig, plan: Plan | None) -> None:
    """Form the data plane with every connected receiver (``Sender.warm_up``); buffers sized
    by ``plan`` where there is one (1 byte otherwise: the first sync sizes them)."""
    size = capacity(plan, config.bucket_bytes) if plan is not None else 1
    join = peers.join(0, 1, size)
    outcome = "broken"
    try:
        info = {**transport.prepare(join), "world_size": join.world_size, "senders": 1}
        deadline = Deadline(config.timeout_s, "in the warm-up")
        msg: dict[str, Any] = {
            "type": "warmup",
            "protocol": PROTOCOL_VERSION,
            "bucket_bytes": config.bucket_bytes,
            "capacity": size,
        }
        if plan is not None:  # receivers may prepare for it (landing memory); the first sync sends its hash
            msg |= {"plan": plan.to_wire(), "plan_hash": plan.hash}
        for rank, ch in peers.channels.items():
            ch.send({**msg, "engine": {**info, "rank": peers.group_rank(rank)}}, deadline)
        every = peers.peers()
        answers(every, deadline, "refused the warm-up")
        for _, _, ch in every:
            ch.send({"type": "go"}, deadline)
        transport.connect(join, info)  # its own deadline: timeout_s
        joined = Deadline(config.timeout_s, "waiting for receivers to confirm the warm-up")
        for _, _, ch in every:
            ch.recv(joined, expect="joined")
        outcome = "ok"
        if plan is not None:
            peers.acked_plan = {r: plan.hash for r in peers.channels}
    except HandshakeError:
        outcome = "refused"
        raise
    except Exception as e:
        peers.raise_explained(e, "warm-up")
    finally:
        transport.finish(ok=outcome != "broken")
        if outcome == "broken":
            peers.drop()  # receivers see the failure and reconnect
    log.info("warmed up: %d receivers joined the %s data plane", len(peers.receivers), config.backend)


def warm_connections(peers: SessionPeers, config: EngineConfig) -> None:
    """Tell the receivers that this warm-up makes no data plane (a route needs every rank's
    layout, other trainer ranks join in their first ``send``), so those waiting in
    ``Receiver.warm_up`` return."""
    deadline = Deadline(config.timeout_s, "in the warm-up")
    try:
        peers.broadcast({"type": "warmup", "protocol": PROTOCOL_VERSION, "engine": None}, deadline)
        for ch in peers.channels.values():
            ch.recv(deadline, expect="joined")
    except Exception as e:
        peers.drop()
        peers.raise_explained(e, "warm-up")
