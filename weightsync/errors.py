"""The errors of a sync, shared by both sides and every backend: each names the peer, the
version and, where known, the tensor; ``ranks`` lists the receivers to blame."""

from __future__ import annotations

from typing import Any


class SyncError(RuntimeError):
    """A sync failed; the message names the peer, the version and, where known, the tensor.

    ``ranks``: the receivers known to have caused it (died, refused, failed to load), so a
    controller can ``Sender.remove_receiver`` them; empty when no receiver is to blame.
    """

    def __init__(self, message: str, *, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks: list[int] = list(ranks or [])


class SyncTimeout(SyncError, TimeoutError):
    """A peer did not answer within the deadline."""


class PeerLost(SyncError):
    """A peer closed its connection (or its process died)."""


class HandshakeError(SyncError):
    """The two sides disagree on protocol, version, plan or bucket size."""


class ProtocolError(SyncError):
    """A peer sent something that is not a valid message here (malformed, oversized,
    wrongly typed, out of order). Nothing it sent was acted on."""


def in_context(error: Exception, context: str) -> SyncError:
    """The error as a SyncError of its own kind whose message starts with ``context`` (which
    receiver, which version, which sender), however deep in the transfer it arose: the same
    failure reads the same whichever path noticed it first."""
    if str(error).startswith(context):
        return error if isinstance(error, SyncError) else SyncError(str(error))
    kind = type(error) if isinstance(error, SyncError) else SyncError
    ranks = error.ranks if isinstance(error, SyncError) else None
    try:
        return kind(f"{context}: {error}", ranks=ranks)
    except TypeError:  # a subclass with its own constructor: keep its kind, say where
        return SyncError(f"{context}: {error}", ranks=ranks)


class VerificationError(SyncError):
    """Bytes arrived that differ from what the sender sent (``verify`` is on); the message
    names the tensors affected. The receiver's version did not advance."""


class RemoteFailure(SyncError):
    """A receiver took part in the whole sync but reported that it failed (a sink error,
    say). The connections stay usable: the next sync can go ahead on them."""


class Rerouted(SyncError):
    """The sender goes on without a receiver it lost (``drop_lost_receivers``) and sends
    this version again to the others through a new data plane: this receiver's attempt
    ends, and the same ``receive`` call takes the version again."""

    #: the version that comes again
    version: int | None = None

    @classmethod
    def said(cls, peer: str, msg: dict[str, Any]) -> Rerouted:
        """The sender's ``reroute`` message, as this error."""
        error = cls(
            f"{peer} sends version {msg.get('version')} again without the lost receiver(s) {msg.get('lost')}"
        )
        error.version = msg["version"] if isinstance(msg.get("version"), int) else None
        return error


class SourceFailed(SyncError):
    """The trainer's own source raised mid-sync (its exception is the cause): no peer is
    to blame, so the sender reports it at once instead of looking for one that went away."""
