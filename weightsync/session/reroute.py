"""The re-route exchange of ``drop_lost_receivers``, both sides of it.

A receiver is lost in a sync the transport can route around (``Transport.reroutes``): the
sender tells each other receiver ``reroute {version, lost}``, and each answers
``rerouted {version, has}`` once, wherever the message finds it: in the transfer (its
attempt failed: it said ``done`` first), in the handshake (it answered ``ready`` and waits
for the go), or idle (it completed the version before the loss, or its sync never came).
Those that do not hold the version take it again through a new data plane, in the same
``send`` and ``receive`` calls. Messages a receiver sent in the attempt left behind come
before its answer and are read past.
"""

from __future__ import annotations

from typing import Any

from weightsync.errors import Rerouted
from weightsync.session.channel import Channel, Deadline

#: what a receiver may have sent in the attempt the sender left, before its answer
_LEFT_BEHIND = ("ready", "error", "done")


def tell(channels: dict[int, Channel], version: int, lost: list[int], timeout_s: float) -> list[int]:
    """Sender: re-route ``version`` around the ``lost`` to ``channels``; returns the ranks
    that do not hold it (to send it to again), in order."""
    deadline = Deadline(timeout_s, f"re-routing version {version}")
    for ch in channels.values():
        ch.send({"type": "reroute", "version": version, "lost": lost}, deadline)
    again = []
    for rank, ch in sorted(channels.items()):
        while (reply := ch.recv(deadline, expect=("rerouted", *_LEFT_BEHIND)))["type"] != "rerouted":
            pass
        if reply.get("has") is not True:
            again.append(rank)
    return again


def answer(ch: Channel, version: Any, has: bool, timeout_s: float) -> None:
    """Receiver: tell the sender re-routing ``version`` whether this receiver holds it
    (then it is left out of the retry)."""
    ch.send(
        {"type": "rerouted", "version": version, "has": has},
        Deadline(timeout_s, f"answering the re-route of version {version}"),
    )


def await_word(ch: Channel, version: int, cause: Exception, timeout_s: float) -> Rerouted:
    """Receiver whose attempt at ``version`` failed (``cause``): unless the sender's
    ``reroute`` is what ended it, say so and wait for it; answer it. Raises ``SyncError``
    when the sender fails the sync instead (it closes the connection) or is gone."""
    if not isinstance(cause, Rerouted):
        deadline = Deadline(timeout_s, f"for the sender's word after version {version} failed here")
        ch.send(
            {"type": "done", "version": version, "ok": False, "message": f"transfer failed: {cause}"},
            deadline,
        )
        cause = Rerouted.said(ch.peer, ch.recv(deadline, expect="reroute"))
    answer(ch, version, False, timeout_s)
    return cause
