"""A receiver's version state: which weights it holds, after every sync, on every backend.

One object, one set of rules, used by every path that receives (session transports,
publishers, the vLLM integration):

- ``version``: the last version that arrived completely (None before the first). It
  advances only when every tensor of a version arrived (and passed ``verify``).
- ``failed_version``: the version whose sync failed, if the latest attempt failed; a
  complete sync clears it.
- ``torn``: the failed sync had already delivered something (bytes written into a model,
  tensors handed to a consumer), so a model loaded in place holds a mix of ``version`` and
  ``failed_version``. A later complete sync makes it whole again.
- stale versions: a version older than ``version`` is refused before anything is read,
  unless the sender passes ``force`` (a deliberate rollback). A refusal leaves the state
  as it was.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VersionState:
    """What a receiver holds; see the module docstring for the rules."""

    version: int | None = None
    failed_version: int | None = None
    torn: bool = False

    @property
    def serving(self) -> int | None:
        """The version the weights are entirely at: None while torn (a mix of two)."""
        return None if self.torn else self.version

    def refusal(self, offered: int, force: bool) -> str | None:
        """Why ``offered`` must be refused before anything is read, or None."""
        if self.version is not None and offered < self.version and not force:
            return (
                f"version {offered} is older than version {self.version}, which this receiver holds "
                "(send it with force=True to roll back)"
            )
        return None

    def completed(self, version: int) -> None:
        """Every tensor of ``version`` arrived (and was checked)."""
        self.version, self.failed_version, self.torn = version, None, False

    def failed(self, version: int, delivered: bool) -> None:
        """The sync of ``version`` failed; ``delivered``: something of it was already
        written or handed out."""
        self.failed_version = version
        self.torn = self.torn or delivered
