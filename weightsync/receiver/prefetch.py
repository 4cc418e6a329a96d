"""Pipelined receive into an engine's own loader, with landing memory reused across versions.

An inference engine (vLLM) loads a version through a call that consumes an iterator of
``(name, tensor)`` (``reload``). ``receive_into`` runs the receiver's transfer in a
background thread, so buckets arrive (and are unpacked) while the engine processes the
layers whose tensors came before. The sender is told the version arrived only after
``reload`` returned (``Receiver.receive(settle=...)``), so a loader error, even in the
engine's final processing, fails the sync on the sender too.

The hand-off between the two threads (``_Handoff``) is bounded in bytes; the received
tensors live in landing memory (``weightsync.receiver.landing.LandingPool``), which bounds what the
engine may hold and is reused across versions.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.errors import HandshakeError, SyncTimeout
from weightsync.receiver.landing import (
    LANDED_AHEAD,
    LOOKAHEAD,
    LandingPool,
    PooledAssembler,
    following_landings,
    landing_sizes,
)

log = logging.getLogger("weightsync.receiver.prefetch")

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


# ------------------------------------------------------------------------ handoff
class _Handoff:
    """Items from the receiving thread to the loader, bounded in bytes (one item always
    fits), then one end: ``("end", None)`` or ``("error", exception)``."""

    def __init__(self, limit_bytes: int, on_get: Callable[[], None] = lambda: None) -> None:
        self.limit = max(1, limit_bytes)
        self.on_get = on_get  # the loader asks for the next item: the engine let go of the last
        self.items: collections.deque[tuple[str, Any, int]] = collections.deque()
        self.bytes = 0
        self.peak_bytes = 0
        self.waiting = 0  # the loader waits in get
        self.cond = threading.Condition()

    def starved(self) -> bool:
        """The loader waits for an item and none is queued."""
        return self.waiting > 0 and not self.items

    def put(self, item: Any, nbytes: int, timeout: float) -> bool:
        """Queue an item; False if there was no room within ``timeout``."""
        with self.cond:
            if self.items and self.bytes + nbytes > self.limit:
                self.cond.wait(timeout)
                if self.items and self.bytes + nbytes > self.limit:
                    return False
            self.items.append(("item", item, nbytes))
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            self.cond.notify_all()
            return True

    def end(self, kind: str, payload: Any = None) -> None:
        with self.cond:
            self.items.append((kind, payload, 0))
            self.cond.notify_all()

    def get(self, timeout: float) -> tuple[str, Any]:
        with self.cond:
            self.waiting += 1
            self.on_get()
            try:
                arrived = self.cond.wait_for(lambda: bool(self.items), timeout)
            finally:
                self.waiting -= 1
            if not arrived:
                return "error", SyncTimeout(f"no tensor from the receiving thread within {timeout:.0f} s")
            kind, payload, nbytes = self.items.popleft()
            self.bytes -= nbytes
            self.cond.notify_all()
            return kind, payload

    def clear(self) -> None:
        with self.cond:
            self.items.clear()
            self.bytes = 0
            self.cond.notify_all()


@dataclass
class PipelineResult:
    """What one pipelined receive did."""

    #: tensors the loader took
    applied: int = 0
    #: the first failure: of the transfer (the loader's stream ended cleanly) or the loader's
    error: BaseException | None = None
    #: seconds inside ``reload`` (from its call to its return)
    load_s: float = 0.0
    #: seconds from the call until the first tensor was ready (handshake, group, first bucket)
    first_s: float = 0.0
    #: seconds the loader waited for tensors (the transfer was behind)
    wait_s: float = 0.0
    #: most bytes queued ahead of the loader
    queued_peak_bytes: int = 0
    #: most landing memory in use at once (queued, loading, held by the engine, landed ahead)
    landing_peak_bytes: int = 0
    #: seconds the receiving thread waited for the engine to release landing memory
    landing_wait_s: float = 0.0
    #: bytes the transport received into its own buffers, then copied into landing memory
    landing_copied_bytes: int = 0
    #: bytes the engine loaded in place from memory the transport lends (``Transport.lends``)
    landing_lent_bytes: int = 0


def receive_into(
    receiver: Any,
    version: int,
    reload: Reload,
    *,
    pool: LandingPool | None,
    in_flight_bytes: int,
    timeout_s: float,
) -> PipelineResult:
    """Receive ``version`` with ``receiver`` (a session ``Receiver``) in a background thread
    and load it through ``reload`` in this one; never raises for a failed sync (the result
    says what failed). A transfer that fails ends the loader's stream cleanly (so the
    engine finalizes its reload); a loader that raises (or stops early) stops the transfer
    and the sender is told."""
    result = PipelineResult()
    handoff = (
        _Handoff(in_flight_bytes, on_get=pool.released) if pool is not None else _Handoff(in_flight_bytes)
    )
    loaded = threading.Event()
    load_error: list[BaseException | None] = [None]
    stop: list[BaseException | None] = [None]  # set by the loader side: throw this into the sync
    guard_s = timeout_s * 2 + 30  # the receiver's own deadlines end first

    def settle() -> None:
        handoff.end("end")
        if not loaded.wait(guard_s):
            raise SyncTimeout(f"the engine did not finish loading version {version} within {guard_s:.0f} s")
        if load_error[0] is not None:
            raise load_error[0]

    # Landing memory in use stays within the in-flight bound, passed only when the loader
    # waits with nothing queued (the engine holds what it needs to complete a layer) or
    # has stopped (the receiving thread must get on to stopping the transfer). Without a
    # pool (``backend=sharded``) tensors are put together from fragments in memory of their own.
    if pool is not None:
        pool.next_version()
        pool.bound(in_flight_bytes, lambda: handoff.starved() or stop[0] is not None, timeout_s)
    items = receiver.receive(version, landing=pool, settle=settle)

    def receiving() -> None:
        try:
            while True:
                item = next(items)
                nbytes = item[1].nbytes
                while not handoff.put(item, nbytes, timeout=0.1):
                    if stop[0] is not None:
                        break
                del item
                if stop[0] is not None:
                    items.throw(stop[0])  # drains the transfer and tells the sender; re-raises
        except StopIteration:
            pass
        except BaseException as e:
            if stop[0] is None:
                handoff.end("error", e)
            elif e is not stop[0]:
                log.debug("receiving thread: %r after the loader failed", e)
        finally:
            items.close()

    t_start = time.perf_counter()
    thread = threading.Thread(target=receiving, name=f"weightsync-receive-v{version}", daemon=True)
    thread.start()
    kind, first = handoff.get(guard_s)
    result.first_s = time.perf_counter() - t_start
    reached_end = kind == "end"
    if kind == "error":
        result.error = first
    elif kind == "item":

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal reached_end, first
            item, first = first, None  # the loader alone decides how long a tensor lives
            while True:
                yield item
                item = None
                result.applied += 1
                t0 = time.perf_counter()
                kind, payload = handoff.get(guard_s)
                result.wait_s += time.perf_counter() - t0
                if kind == "end":
                    reached_end = True
                    return
                if kind == "error":
                    # End the stream cleanly so the engine finalizes its reload (layers that
                    # got nothing keep their tensors) instead of leaving them half set up.
                    result.error = payload
                    return
                item = payload

        t0 = time.perf_counter()
        try:
            reload(stream())
            if not reached_end and result.error is None:
                raise RuntimeError(f"the loader stopped before the end of version {version}")
        except Exception as e:  # the model's loader refused a tensor
            load_error[0] = e
            result.error = result.error or e
        result.load_s = time.perf_counter() - t0
    if load_error[0] is not None and not reached_end:
        stop[0] = load_error[0]  # the transfer is still going: stop it, tell the sender
        handoff.clear()
    loaded.set()
    thread.join(guard_s)
    if thread.is_alive():
        log.error(
            "weightsync: the receiving thread of version %s did not end within %.0f s", version, guard_s
        )
        result.error = result.error or SyncTimeout(f"the transfer of version {version} did not end")
    handoff.clear()
    result.queued_peak_bytes = handoff.peak_bytes
    if pool is not None:
        pool.bound(None)
        result.landing_peak_bytes = pool.peak_bytes
        result.landing_wait_s = pool.waited_s
        result.landing_copied_bytes = pool.copied_bytes
        result.landing_lent_bytes = pool.lent_bytes
        pool.trim()
    return result


__all__ = [
    "LANDED_AHEAD",
    "LOOKAHEAD",
    "HandshakeError",
    "LandingPool",
    "PipelineResult",
    "PooledAssembler",
    "following_landings",
    "landing_sizes",
    "receive_into",
]
