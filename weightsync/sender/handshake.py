"""Trainer rank 0's handshakes: a sync's rounds of offer and answers, and the warm-up.

A sync's handshake (``agree``)::

    rank 0 -> peer   sync {version, plan_hash[, plan], bucket_bytes, force, verify, engine,
                           reroute, delta?, route?, forms?}
    peer -> rank 0   ready {dense?, route? | layout?, forms?} | error {message}
    rank 0 -> peer   again (then a new sync message) | go | abort {message}

Another round is offered where the delta stage (a receiver lacks the base of a delta sync),
the quantized-forms stage (a receiver declared forms it was not served) or the route stage
(a peer declared a new layout) calls for it. The warm-up (``warm_up``)
forms the data plane ahead of the first sync: warmup, ready, go, joined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.config.engine import EngineConfig
from weightsync.delta.send_stage import Outgoing
from weightsync.engines.base import Transport
from weightsync.errors import HandshakeError
from weightsync.plan import Plan, capacity
from weightsync.sender.peers import Peer, SessionPeers
from weightsync.sender.replies import answers
from weightsync.sender.route_stage import Answer, Members, SendRoute
from weightsync.session.channel import PROTOCOL_VERSION, Deadline

log = logging.getLogger("weightsync")


@dataclass(frozen=True)
class Offer:
    """What every sync message of one handshake says, whatever the round."""

    version: int
    force: bool  # a receiver takes a version older than its own (a deliberate rollback)
    engine: dict[str, Any]  # the data plane's description (``Transport.prepare``)
    reroute: bool  # after a loss, receivers wait for the sender's word (``drop_lost_receivers``)


@dataclass(frozen=True)
class Forms:
    """The quantized-forms stage's part in the rounds (``weightsync.quant.send_stage``): its
    fields of every sync message, and the sync encoded again, with the offer that carries
    it, for forms a receiver declared (None: nothing new; ``ValueError``: a form the
    trainer cannot send)."""

    fields: Callable[[], dict[str, Any]]
    again: Callable[[Sequence[Answer]], tuple[Outgoing, Offer] | None]


def agree(
    peers: SessionPeers,
    route: SendRoute,
    config: EngineConfig,
    offer: Offer,
    out: Outgoing,
    trainers: int,
    forms: Forms | None = None,
) -> tuple[int, Outgoing]:
    """Agree on version, bucket size and plan with every receiver (and trainer rank);
    return how many receivers got the full plan, and what this rank packs (the route
    stage's ``own``). Raises ``HandshakeError`` (every peer told) when a peer refuses or
    the route stage finds no way."""
    members = peers.members(trainers)
    while True:
        fields = forms.fields() if forms is not None else {}
        plans_sent, round_peers, replies, deadline = _round(peers, route, config, offer, out, members, fields)
        again = out.again(replies)
        if again is None and forms is not None:
            try:
                reformed = forms.again(peers.answers_of(replies))
            except ValueError as e:
                peers.abort(round_peers, deadline, str(e), e)
            if reformed is not None:
                again, offer = reformed
        if again is None:
            try:
                if route.answered(out, peers.answers_of(replies), members):
                    again = out  # the same sync, offered with the route the new layouts make
            except ValueError as e:
                peers.abort(round_peers, deadline, str(e), e)
        for _, _, ch in round_peers:
            ch.send({"type": "again" if again is not None else "go"}, deadline)
        if again is None:
            return plans_sent, route.own(out, members, config.bucket_bytes)
        out = again


def _round(
    peers: SessionPeers,
    route: SendRoute,
    config: EngineConfig,
    offer: Offer,
    out: Outgoing,
    members: Members,
    stage_fields: dict[str, Any],
) -> tuple[int, list[Peer], list[tuple[int | None, dict[str, Any]]], Deadline]:
    """One round: the sync message to every peer (``stage_fields``: the forms stage's), and
    their answers. Returns how many receivers got the full plan, the peers, their replies
    (rank and reply) and the round's deadline."""
    deadline = Deadline(config.timeout_s, f"in the handshake of version {offer.version}")
    plan = out.plan
    plans_sent = 0
    msg: dict[str, Any] = {}
    fields = {**route.offer(out, members), **stage_fields}
    for rank, ch in peers.channels.items():
        msg = {
            "type": "sync",
            "protocol": PROTOCOL_VERSION,
            "version": offer.version,
            "bucket_bytes": config.bucket_bytes,
            "plan_hash": plan.hash if plan is not None else None,
            "force": offer.force,
            "verify": config.verify,
            "engine": {**offer.engine, "rank": peers.group_rank(rank)},
            "reroute": offer.reroute,
            **out.handshake_fields(),
            **fields,
        }
        if plan is not None and peers.acked_plan.get(rank) != plan.hash:
            msg["plan"] = plan.to_wire()  # unchanged plans travel as their hash only
            plans_sent += 1
        ch.send(msg, deadline)
    first_trainer = len(members.receivers) + 1  # trainer ranks > 0 come after the receivers
    for ch, trainer_msg in peers.trainers.sync_messages(msg, offer.engine, first_rank=first_trainer):
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
