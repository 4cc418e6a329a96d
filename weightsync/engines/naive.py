"""Backend ``naive``: trainer and rollout colocated in one process; no transport.

The sender publishes its source under the session address; receivers in the same process
read the trainer's tensors directly (no copy, no buckets). Colocated RL alternates train
and sync, so the trainer's tensors are not modified while receivers read them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from weightsync.engines.base import Engine

_mailboxes: dict[str, tuple[int, Any]] = {}
_changed = threading.Condition()


class NaiveEngine(Engine):
    name = "naive"
    colocated = True
    sessionless = True

    def connect(self, info: dict[str, Any]) -> None:  # nothing to join
        pass

    def send_buckets(self, produce):  # pragma: no cover - colocated engines move no buckets
        raise NotImplementedError("the naive engine hands tensors over in process, not in buckets")

    def recv_buckets(self, next_bucket, landing=None):  # pragma: no cover
        raise NotImplementedError("the naive engine hands tensors over in process, not in buckets")

    @staticmethod
    def publish(address: str, version: int, source: Any) -> None:
        """Make ``source`` the current weights at ``address`` in this process."""
        with _changed:
            _mailboxes[address] = (version, source)
            _changed.notify_all()

    @staticmethod
    def collect(address: str, newer_than: int | None, version: int | None, timeout_s: float) -> tuple[int, Any]:
        """Wait for weights at ``address``: exactly ``version`` if given, else any version
        newer than ``newer_than``."""
        deadline = time.monotonic() + timeout_s
        with _changed:
            while True:
                current = _mailboxes.get(address)
                if current is not None:
                    if version is not None and current[0] == version:
                        return current
                    if version is None and (newer_than is None or current[0] > newer_than):
                        return current
                left = deadline - time.monotonic()
                if left <= 0:
                    have = "nothing" if current is None else f"version {current[0]}"
                    want = f"version {version}" if version is not None else f"a version newer than {newer_than}"
                    raise TimeoutError(
                        f"naive backend: waited {timeout_s:.1f} s at {address!r} for {want}, "
                        f"the sender published {have} (the naive backend only works inside one process)"
                    )
                _changed.wait(left)

    @staticmethod
    def forget(address: str) -> None:
        with _changed:
            _mailboxes.pop(address, None)
