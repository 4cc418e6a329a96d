"""What trainer rank 0 reads from its receivers' control connections: their answers to a
sync, their acknowledgements, and which of them are gone or silent (for errors that name
the peer to blame and the healthy ones)."""

from __future__ import annotations

import time
from typing import Any

from weightsync.errors import HandshakeError, PeerLost, SourceFailed, SyncError
from weightsync.session.channel import Channel, Deadline


def dead_ranks(channels: dict[int, Channel]) -> list[int]:
    """The ranks whose connection is dead (checked without blocking). Once one went silent,
    also those whose heartbeats go unanswered: with the trainer's own host cut off, every
    receiver's grace runs out within a heartbeat, and none of them is healthy."""
    dead = [r for r, ch in channels.items() if ch.is_dead()]
    if any(channels[r].silent for r in dead):
        dead += [r for r, ch in channels.items() if r not in dead and ch.seems_silent()]
    return sorted(dead)


def lost_receivers(
    channels: dict[int, Channel], dead: list[int], what: str, others: tuple[Channel, ...] | list[Channel] = ()
) -> str:
    """The receivers ``dead`` among ``channels`` (and the ``others``, the channels of other
    trainer ranks gone), for an error: each closed, or silent and how that was found; where
    one went silent, also which receivers are healthy, so an operator knows whom not to blame."""
    lost = [channels[r].gone(what) for r in dead] + [ch.gone(what) for ch in others]
    healthy = [f"receiver rank {r}" for r in sorted(channels) if r not in dead]
    if healthy and any(channels[r].silent for r in dead):
        lost.append(f"healthy: {', '.join(healthy)}")
    return "; ".join(lost)


def answers(
    peers: list[tuple[str, int | None, Channel]], deadline: Deadline, refused: str
) -> list[tuple[int | None, dict[str, Any]]]:
    """Read every peer's ``ready`` (rank and reply, in order). If any answered with an
    error, tell every peer to abort and raise ``HandshakeError`` naming the refusers."""
    replies, refusals = [], {}
    for name, rank, ch in peers:
        try:
            reply = ch.recv(deadline, expect=("ready", "error"))
        except SyncError as e:  # silent, gone or too slow: this peer is the one to blame
            if rank is not None and not e.ranks:
                e.ranks = [rank]
            raise
        if reply["type"] == "error":
            refusals[name] = (rank, f"{name} {refused}: {reply.get('message')}")
        replies.append((rank, reply))
    if refusals:
        reason = "; ".join(text for _, text in refusals.values())
        for _, _, ch in peers:
            try:  # best effort: a refusing peer may already have hung up
                ch.send({"type": "abort", "message": reason}, deadline)
            except SyncError:
                pass
        raise HandshakeError(reason, ranks=[r for r, _ in refusals.values() if r is not None])
    return replies


def gather_done(
    channels: dict[int, Channel], version: int, timeout_s: float, confirmed: set[int]
) -> dict[int, str]:
    """Read every receiver's ``done`` for ``version``: those that confirmed it go into
    ``confirmed``; returns the others' failures (rank -> message). Raises ``PeerLost``
    naming the receivers gone without a word (the others' failures follow from them)."""
    deadline = Deadline(timeout_s, f"waiting for receivers to confirm version {version}")
    failures, lost = {}, {}
    for rank, ch in sorted(channels.items()):
        try:
            reply = ch.recv(deadline, expect="done")
        except PeerLost as e:  # read the others: they tell whether this one was alone
            lost[rank] = str(e)
            continue
        if reply.get("ok") is not True:
            failures[rank] = f"receiver rank {rank} failed version {version}: {reply.get('message')}"
        else:
            confirmed.add(rank)
    if lost:
        raise PeerLost("; ".join([*lost.values(), *failures.values()]), ranks=list(lost))
    return failures


def explain(
    error: Exception,
    what: str,
    channels: dict[int, Channel],
    grace_s: float,
    trainers: dict[int, Channel] | None = None,
) -> Exception:
    """Turn a transport error into one that names the receiver(s), or the other trainer
    rank(s) (``trainers``), that went away; a crashed peer's sockets all close at once, but
    the transport may notice first (a receiver whose link to a crashed trainer rank broke
    drops its links to this rank too), so the control connections get ``grace_s`` to show
    the EOF."""
    if isinstance(error, SyncError) and error.ranks:
        return error
    if isinstance(error, SourceFailed):  # the trainer's own failure: no peer to wait for
        error.args = (f"{what} failed: {error}",)  # in place: its cause stays the source's exception
        return error
    others = trainers or {}
    grace = time.monotonic() + grace_s
    while True:
        dead = dead_ranks(channels)
        gone = [ch for _, ch in sorted(others.items()) if ch.is_dead()]
        if dead or gone or time.monotonic() >= grace:
            break
        time.sleep(0.02)
    if isinstance(error, SyncError) and not gone:  # raised by the session: it names the peer already
        error.ranks = dead
        return error
    if dead or gone:  # a peer gone without a word: PeerLost, whichever side noticed first
        names = ", ".join([ch.peer for ch in gone] + [channels[r].peer for r in dead])
        return PeerLost(f"{what} failed: {names} disconnected ({error})", ranks=dead)
    return SyncError(f"{what} to {len(channels)} receiver(s) failed: {error}")
