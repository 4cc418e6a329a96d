"""``Outcome``: how one sync ends on a receiver.

Given once, when the transfer starts, everything the end needs (the link to the sender, the
transport, the version state, the version, whether the sender may route around a lost
receiver), so that ``Transfer`` hands its end down here and nothing returns to ``Receiver``:
the acknowledgement (``done``) and the version state set once; or, for a failed transfer,
the failure explained (a silent sender named), routed around where the sender may
(``weightsync.session.reroute``), or reported.
"""

from __future__ import annotations

import time
from typing import NoReturn

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Transport
from weightsync.errors import PeerLost, Rerouted, SyncError, VerificationError, in_context
from weightsync.receiver.link import Agreed, SenderLink
from weightsync.session import reroute
from weightsync.session.channel import Deadline
from weightsync.state import VersionState
from weightsync.stats import SyncStats


class Outcome:
    """The end of the ``agreed`` sync for receiver ``rank``. ``stats`` gets the transfer's
    and the sync's seconds; ``reported`` is True once the outcome was told to the sender."""

    def __init__(
        self,
        link: SenderLink,
        transport: Transport,
        state: VersionState,
        config: EngineConfig,
        rank: int,
        agreed: Agreed,
        stats: SyncStats,
    ) -> None:
        self._link, self._transport, self._state = link, transport, state
        self._timeout_s, self._rank = config.timeout_s, rank
        self._ch, self.version, self._reroutable = agreed.channel, agreed.version, agreed.reroutable
        self.stats, self._start = stats, agreed.start
        self._t0 = time.perf_counter()  # the transfer starts
        self.reported = False

    def failed(self, e: Exception, delivered: bool) -> NoReturn:
        """The data plane failed with ``e`` (``delivered``: something reached the consumer):
        raise the ``Rerouted`` that takes the version again, or the failure, named."""
        ch, v = self._ch, self.version
        cause: Exception = e
        if not isinstance(e, PeerLost) and ch.seems_silent():  # another receiver gave up on it first
            cause = PeerLost(
                f"{ch.peer} went silent during the transfer of version {v}: nothing heard for "
                f"{ch.unheard_s():.1f} s (heartbeat_grace_s={ch.grace_s:g}); the data plane then failed: {e}"
            )
        if self._reroutable and (rerouted := self._rerouted(cause, delivered)) is not None:
            raise rerouted from e
        self._finish(ok=False, message=f"transfer failed: {cause}", broken=True, delivered=delivered)
        error = in_context(
            cause, f"receiver rank {self._rank}: transfer of version {v} from {ch.peer} failed"
        )
        if error is e:
            raise e
        raise error from e

    def ended(self, problem: str | None, delivered: bool, consumer_failed: bool) -> None:
        """The transfer ended (``problem``: why the version is not whole, None: it is): tell
        the sender, set the version state; a problem the consumer did not cause raises
        ``VerificationError`` (a consumer's own error is raised again by ``Transfer``)."""
        self.stats.transfer_s = time.perf_counter() - self._t0
        self._finish(ok=problem is None, message=problem, delivered=delivered)
        self.stats.seconds = time.perf_counter() - self._start
        self.reported = True
        if problem is not None and not consumer_failed:
            raise VerificationError(problem)

    def _rerouted(self, cause: Exception, delivered: bool) -> Rerouted | None:
        """The sender's ``reroute`` (the version comes again: ``weightsync.session.reroute``),
        or None (the sender failed the sync, or is gone itself)."""
        ch = self._ch
        if not isinstance(cause, Rerouted) and (ch.is_dead() or ch.seems_silent()):
            return None  # the sender is the one lost
        self._transport.finish(ok=False)
        self._state.failed(self.version, delivered)
        try:
            return reroute.await_word(ch, self.version, cause, self._timeout_s)
        except SyncError:
            return None

    def _finish(self, ok: bool, message: str | None, broken: bool = False, delivered: bool = False) -> None:
        version = self.version
        self._transport.finish(ok=not broken)  # mirrors the sender: only a broken transport rebuilds
        try:
            if self._link.channel is not None:
                self._link.channel.send(
                    {"type": "done", "version": version, "ok": ok, "message": message},
                    Deadline(self._timeout_s, f"confirming version {version}"),
                )
        except SyncError:
            self._link.reset()
            ok = False
        if ok:
            self._state.completed(version)
        else:
            self._state.failed(version, delivered)
            if broken:  # the transport failed: reconnect at the next sync
                self._link.reset()
