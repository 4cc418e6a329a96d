"""``SenderLink``: a receiver's control connection to its sender, and what holds across it.

The connection (joined again where the sender dropped it after a failed sync, or joined to
a new sender where the old one said goodbye), the session it belongs to (a restarted
trainer is a new session: nothing agreed carries over) and the plan last agreed over it (an
unchanged plan then travels as its hash). Between syncs it waits for the sender's next
sync message, answering what comes before it: a warm-up (the data plane formed ahead of
the first sync), a re-route's question, a cancel. What one sync's handshake agreed over it
(``Agreed``) is handed once to that sync's ``Transfer`` and ``Outcome``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join, Transport
from weightsync.errors import HandshakeError, PeerLost, SyncError
from weightsync.plan import Plan
from weightsync.receiver.admission import warmup_problem
from weightsync.session import reroute
from weightsync.session.channel import PROTOCOL_VERSION, Channel, Deadline
from weightsync.session.control import connect
from weightsync.stages import Intake

log = logging.getLogger("weightsync")


@dataclass(frozen=True)
class Agreed:
    """One sync as its handshake agreed it, handed once to its ``Transfer`` and its
    ``Outcome``."""

    channel: Channel  #: the connection the sync came over
    version: int
    plan: Plan | None  #: None: the sender announces each bucket's entries as it fills it
    intake: Intake  #: what the stages take of each entry (``weightsync.stages``)
    reroutable: bool  #: the sender may route this sync around a lost receiver
    start: float  #: when the sender started it (``time.perf_counter``)


class SenderLink:
    """Receiver ``rank``'s link to the sender at ``address``; ``new_session`` is called
    when the sender behind the address is a new one (the data plane is then rebuilt)."""

    def __init__(
        self, config: EngineConfig, address: str, rank: int, new_session: Callable[[], None]
    ) -> None:
        self.config = config
        self.address = address
        self.rank = rank
        #: the connection (None: not connected)
        self.channel: Channel | None = None
        #: the plan last agreed with the sender over this connection
        self.plan: Plan | None = None
        self._session: str | None = None  # the sender's session last joined
        self._new_session = new_session

    def connect(self, reach_s: float | None = None) -> Channel:
        """The connection, made (retrying for ``reach_s``, by default ``timeout_s``) where
        there is none or the sender dropped it."""
        if self.channel is not None and self.channel.is_dead():
            self.reset()  # the sender dropped us after a failed sync: join again
        if self.channel is not None:
            return self.channel
        self.channel = ch = connect(self.address, self.rank, self.config, reach_s=reach_s)
        if ch.session != self._session:
            if self._session is not None:  # a new sender (a restarted trainer): nothing carries over
                log.info("receiver rank %d joined a new session at %s", self.rank, self.address)
                self.plan = None
                self._new_session()
            self._session = ch.session
        return ch

    def reset(self) -> None:
        """Close the connection; the next sync connects again (and sends its plan in full)."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.plan = None

    def join_next_session(self, old: Channel) -> Channel:
        """The sender said goodbye: join the sender now listening on the same address (a
        restarted trainer), or fail at once if there is none."""
        self.reset()
        try:
            return self.connect(reach_s=1.0)
        except SyncError as e:
            raise PeerLost(
                f"{old.peer} closed the session (the trainer has stopped sending), and no new sender "
                f"listens at {self.address}: {e}"
            ) from None

    def refuse(self, problem: str, deadline: Deadline) -> None:
        """Tell the sender why not, and take its abort off the line."""
        assert self.channel is not None
        self.channel.send({"type": "error", "message": problem}, deadline)
        try:  # the sender answers every refusal with an abort
            self.channel.recv(deadline, expect="abort")
        except SyncError:
            self.reset()

    def await_warmup(self) -> tuple[Channel, dict[str, Any]]:
        """Connect and wait (``timeout_s``) for the sender's warm-up message: the channel and
        the message. Raises ``PeerLost`` if the sender closes the session instead."""
        ch = self.connect()
        deadline = Deadline(self.config.timeout_s, "for the sender's warm-up")
        msg = ch.recv(deadline, expect=("warmup", "closing"))
        if msg["type"] == "closing":
            # The goodbye of the sender we were connected to, read only now: the warm-up we
            # were asked for is a new sender's at the same address (a restarted trainer).
            ch = self.join_next_session(ch)
            msg = ch.recv(deadline, expect=("warmup", "closing"))
        if msg["type"] == "closing":
            self.reset()
            raise PeerLost(f"{ch.peer} closed the session before its warm-up")
        return ch, msg

    def answer_warmup(
        self,
        ch: Channel,
        msg: dict[str, Any],
        transport: Transport,
        max_tensor_bytes: int | None,
        join: Callable[[Channel, int, dict[str, Any], int], Join],
    ) -> None:
        """Answer the sender's warm-up: check it, join the data plane (``join`` makes this
        receiver's record), say so."""
        deadline = Deadline(self.config.timeout_s, "in the warm-up")
        if msg.get("engine") is None and msg.get("protocol") == PROTOCOL_VERSION:
            ch.send({"type": "joined"}, deadline)  # connections only: the data plane forms in the first sync
            return
        problem, plan = warmup_problem(msg, self.config, max_tensor_bytes)
        if problem is not None:
            self.refuse(problem, deadline)
            raise HandshakeError(f"receiver rank {self.rank} refused the warm-up: {problem}")
        ch.send({"type": "ready"}, deadline)
        ch.recv(deadline, expect="go")  # an abort (another receiver refused) raises HandshakeError
        info = msg["engine"]
        ok = False
        try:
            transport.connect(join(ch, 0, info, msg["capacity"]), info)  # its own deadline: timeout_s
            ch.send({"type": "joined"}, Deadline(self.config.timeout_s, "confirming the warm-up"))
            ok = True
            if plan is not None:
                self.plan = plan
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(
                f"receiver rank {self.rank}: joining the data plane of {ch.peer} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            transport.finish(ok=ok)
            if not ok:
                self.reset()

    def await_sync(
        self, version: int | None, held: int | None, warm: Callable[[Channel, dict[str, Any]], None]
    ) -> dict[str, Any]:
        """The sender's next sync message (of ``version``, where not None), joining again
        where the sender dropped us, a new sender where it said goodbye, and its data plane
        (``warm``) where it warms one up first; it came over ``channel``. ``held``: the
        version this receiver holds, for a re-route's question."""
        what = f" of version {version}" if version is not None else ""
        waiting = Deadline(self.config.timeout_s, f"for the sender to start a sync{what}")
        ch = self.connect()
        while True:
            try:
                msg = ch.recv(waiting, expect=("sync", "closing", "warmup", "cancel", "reroute"))
            except PeerLost:
                if ch.silent:  # its host went quiet (cut off, frozen): no one dropped us to join
                    self.reset()  # the next receive joins again, once the sender answers
                    raise PeerLost(
                        ch.gone(f"while receiver rank {self.rank} waited for a sync{what}")
                    ) from None
                # The sender drops every connection after a sync that failed anywhere
                # (ours may have gone well): join again, within the same deadline.
                self.reset()
                ch = self.connect(reach_s=waiting.left())
                continue
            kind = msg["type"]
            if kind == "reroute":  # idle: it completed the version before the loss, or its sync never came
                reroute.answer(ch, msg.get("version"), held == msg.get("version"), self.config.timeout_s)
            elif kind == "cancel":  # nothing was read: a clean end, the state stays
                raise HandshakeError(
                    f"receiver rank {self.rank}: the sender cancelled the sync of version "
                    f"{msg.get('version')}: {msg.get('message')}"
                )
            elif kind == "closing":
                ch = self.join_next_session(ch)
            elif kind == "warmup":  # the sender forms the data plane ahead of a sync
                try:
                    warm(ch, msg)
                except SyncError as e:  # the sender failed it too; its sync may still come
                    log.warning("receiver rank %d: %s; waiting for the sync", self.rank, e)
                    waiting.left()
                    ch = self.connect()  # again, if the failure closed the connection
            else:
                return msg
