"""Backend ``naive``: trainer and rollout colocated in one process; no transport.

A publisher: the sender publishes its source under the session address, and receivers in
the same process read the trainer's tensors directly (no copy, no buckets). Colocated RL
alternates train and sync, so the trainer's tensors are not modified while receivers read
them. Every trainer rank hands over to the receivers of its own process (``colocated``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from weightsync.engines.base import Offer, Publisher
from weightsync.errors import SyncTimeout
from weightsync.sources import WeightSource, as_source
from weightsync.stats import SyncStats


@dataclass
class _Publication:
    serial: int  # tells two publications of one version apart
    version: int
    source: WeightSource
    force: bool


# One mailbox per address, shared by every sender and receiver of this process.
_mailboxes: dict[str, _Publication] = {}
_changed = threading.Condition()
_serials = itertools.count(1)


class _NaiveOffer(Offer):
    def __init__(self, publication: _Publication, taken: list[int]) -> None:
        self.publication = publication
        self.version = publication.version
        self.force = publication.force
        self.specs = publication.source.specs()
        self._taken = taken

    def tensors(self, device: torch.device, owned: bool) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.publication.source.tensors():
            yield name, tensor.clone() if owned else tensor  # else: the trainer's own memory

    def ack(self, state: str, message: str | None = None) -> None:
        if state in ("ok", "failed", "refused"):  # read (or declined): wait for another one next time
            self._taken[0] = self.publication.serial


class NaivePublisher(Publisher):
    name = "naive"
    colocated = True

    def __init__(self, config, device, address) -> None:
        super().__init__(config, device, address)
        self._taken = [0]  # receivers: the serial of the publication last read
        self._published = False

    def publish(self, source: WeightSource, version: int, receivers: Sequence[int], force: bool) -> SyncStats:
        """Make ``source`` the current weights at ``address`` in this process (at once: a
        colocated receiver reads them when it next receives)."""
        if not source.reiterable:
            source = as_source(dict(source.tensors()))
        with _changed:
            _mailboxes[self.address] = _Publication(next(_serials), version, source, force)
            self._published = True
            _changed.notify_all()
        specs = source.specs() or []
        return SyncStats(
            version, tensors=len(specs), bytes=sum(s.nbytes for s in specs), receivers=len(receivers)
        )

    def offer(self, rank: int, version: int | None) -> Offer:
        """Wait for a publication at ``address`` not read yet (of ``version``, if given)."""
        timeout_s = self.config.timeout_s
        deadline = time.monotonic() + timeout_s
        with _changed:
            while True:
                current = _mailboxes.get(self.address)
                if current is not None and current.serial != self._taken[0]:
                    if version is None or current.version == version:
                        return _NaiveOffer(current, self._taken)
                left = deadline - time.monotonic()
                if left <= 0:
                    have = (
                        "nothing new"
                        if current is None or current.serial == self._taken[0]
                        else f"version {current.version}"
                    )
                    want = f"version {version}" if version is not None else "a new version"
                    raise SyncTimeout(
                        f"naive backend: receiver rank {rank} waited {timeout_s:.1f} s at {self.address!r} for {want}, "
                        f"the sender published {have} (the naive backend only works inside one process)"
                    )
                _changed.wait(left)

    def close(self) -> None:
        if self._published:  # a sender's close withdraws its publication
            with _changed:
                _mailboxes.pop(self.address, None)
