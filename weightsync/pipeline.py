"""Pipelined receive into an engine's own loader, with landing memory reused across versions.

An inference engine (vLLM) loads a version through a call that consumes an iterator of
``(name, tensor)`` (``reload``). ``receive_into`` runs the receiver's transfer in a
background thread, so buckets arrive (and are unpacked) while the engine processes the
layers whose tensors came before, and hands the tensors over through a queue bounded in
bytes (``receive_buckets_in_flight`` buckets). The sender is told the version arrived only
after ``reload`` returned (``Receiver.receive(settle=...)``), so a loader error, even in
the engine's final processing, fails the sync on the sender too.

Landing memory (``LandingPool``): every bucket lands in a buffer of the pool (a transport
that can write anywhere, ``nccl``, receives straight into it; others are copied into it
once), and the tensors handed to the engine are views of it. A buffer is reused only when
no tensor viewing its storage is alive any more: vLLM's layerwise reload keeps the tensors
of a layer (in ``LayerReloadingInfo.loaded_weights``) until the layer's last weight arrived
and the layer was processed (``_layerwise_process`` ends with ``info.reset()``), or until
``finalize_layerwise_reload`` for layers that never complete; whatever the engine holds,
the storage's use count says when it let go. The pool keeps its buffers between versions
(so a steady update allocates nothing proportional to the model, and pays no page faults),
drops those a version did not use, and frees everything on ``close``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.plan import Assembler, Bucket, Plan, TensorSpec
from weightsync.session import HandshakeError, SyncTimeout

log = logging.getLogger("weightsync.pipeline")

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
# Buckets a transport may receive straight into pool memory ahead of the receiving thread:
# one keeps the wire busy while the thread unpacks the bucket before it.
LANDED_AHEAD = 1


def _use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors viewing it, plus the one this call makes)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class LandingPool:
    """Buffers that received buckets land in, reused across versions.

    ``acquire(nbytes)`` returns a uint8 view of a free buffer (one whose storage nothing
    else references) of at least ``nbytes`` and at most twice that, or of a new one.
    ``trim()`` (after a version) frees the buffers the last two versions did not use.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        # size -> [[buffer, generation it was last handed out in], ...]
        self._by_size: dict[int, list[list[Any]]] = {}
        self._generation = 0
        self._lock = threading.Lock()
        #: buffers allocated over the pool's life (a steady version adds none)
        self.allocations = 0
        self.allocated_bytes = 0

    def _entries(self) -> list[list[Any]]:
        return [e for entries in self._by_size.values() for e in entries]

    @property
    def bytes(self) -> int:
        """Bytes the pool holds now."""
        return sum(size * len(entries) for size, entries in self._by_size.items())

    def in_use_bytes(self) -> int:
        """Bytes of buffers that some tensor still views."""
        with self._lock:
            return sum(e[0].numel() for e in self._entries() if _use_count(e[0]) > 2)

    def _free_entry(self, nbytes: int, device: torch.device) -> list[Any] | None:
        for e in self._by_size.get(nbytes, ()):  # the same plan every version: exact sizes recur
            if e[0].device == device and _use_count(e[0]) <= 2:
                return e
        best = None
        for size, entries in self._by_size.items():
            if nbytes < size <= 2 * nbytes and (best is None or size < best[0].numel()):
                for e in entries:
                    if e[0].device == device and _use_count(e[0]) <= 2:
                        best = e
                        break
        return best

    def acquire(self, nbytes: int, device: torch.device | None = None) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` in pool memory, the caller's until it lets go of
        every view of it."""
        device = device if device is not None else (self.device or torch.device("cpu"))
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device)
        with self._lock:
            entry = self._free_entry(nbytes, device)
            if entry is None:
                entry = [torch.empty(nbytes, dtype=torch.uint8, device=device), self._generation]
                self._by_size.setdefault(nbytes, []).append(entry)
                self.allocations += 1
                self.allocated_bytes += nbytes
            entry[1] = self._generation
            return entry[0][:nbytes]

    def reserve(self, plan: Plan, in_flight_bytes: int, device: torch.device | None = None) -> int:
        """Allocate now the landing memory a first version of ``plan`` needs, so it does
        not fault fresh memory in mid transfer; returns the bytes allocated.

        Replays where the plan's buckets land (``landing_sizes``), each buffer held while
        the next ones land, up to what the pipeline holds at once when the loader keeps
        pace: ``in_flight_bytes`` queued for the loader, the tensor it loads, the one the
        receiving thread is handing over and the bucket landed ahead of it. Buffers the pool
        holds already are reused by the same rule as in a sync; new ones are zeroed (their
        pages are in). Reserved buffers no version uses are freed by ``trim`` after two
        versions."""
        newest = 2 + LANDED_AHEAD  # buffers beyond the queue: loading, being handed over, landed ahead
        before = self.allocated_bytes
        queued: collections.deque[torch.Tensor] = collections.deque()  # oldest first
        queued_bytes = 0
        recent: collections.deque[torch.Tensor] = collections.deque(maxlen=newest)
        for size in landing_sizes(plan):
            allocations = self.allocations
            view = self.acquire(size, device)
            if self.allocations != allocations:
                view.zero_()  # a new buffer: its pages are in now, not mid-transfer
            if len(recent) == newest:  # the oldest of the newest moves on to the queue
                queued.append(recent[0])
                queued_bytes += recent[0].numel()
            recent.append(view)
            # the queue holds at least one buffer, and older ones only within in_flight_bytes
            while len(queued) > 1 and queued_bytes > in_flight_bytes:
                queued_bytes -= queued.popleft().numel()
        return self.allocated_bytes - before

    def next_version(self) -> None:
        with self._lock:
            self._generation += 1

    def trim(self) -> None:
        """Free the buffers neither this version nor the one before handed out (and that
        nothing references): the pool follows the plan, without churning on small timing
        differences between versions."""
        with self._lock:
            for size in list(self._by_size):
                keep = [e for e in self._by_size[size] if e[1] >= self._generation - 1 or _use_count(e[0]) > 2]
                if keep:
                    self._by_size[size] = keep
                else:
                    del self._by_size[size]

    def close(self) -> None:
        """Drop every buffer (tensors still viewing one keep it alive until they go)."""
        with self._lock:
            self._by_size = {}

    def assembler(self, specs: Sequence[TensorSpec], device: torch.device) -> PooledAssembler:
        """For ``Receiver.receive(landing=pool)``."""
        return PooledAssembler(specs, device, self)


def landing_sizes(plan: Plan) -> list[int]:
    """The pool buffer each bucket of ``plan`` lands in (``PooledAssembler``), by size, in
    plan order: a bucket that is one range of one tensor lands in that tensor's buffer
    (where a tensor is split over buckets, its whole size, once), a packed bucket in a
    buffer of its own size."""
    sizes: list[int] = []
    seen: set[int] = set()
    for bucket in plan.buckets:
        first = bucket.pieces[0] if bucket.pieces else None
        if len(bucket.pieces) == 1 and first is not None and first.bucket_offset == 0 and first.length:
            if first.tensor in seen:
                continue
            seen.add(first.tensor)
            size = plan.tensors[first.tensor].nbytes
        else:
            size = bucket.nbytes
        if size:
            sizes.append(size)
    return sizes


class PooledAssembler(Assembler):
    """An ``Assembler`` whose tensors all live in pool memory and may be kept: a bucket
    that is one range of one tensor lands in that tensor's pool buffer, a packed bucket in
    a pool buffer of its own (its tensors are views of it), split tensors are merged in a
    pool buffer of their full size.

    At most ``ahead`` buckets land in pool memory before they are unpacked: a transport
    that posts receives further ahead (``nccl`` posts up to 8) receives the others into
    its own two buffers, copied into the pool when unpacked, so the pool does not grow
    with the transport's window."""

    def __init__(self, tensors: Sequence[TensorSpec], device: torch.device, pool: LandingPool, ahead: int = LANDED_AHEAD) -> None:
        super().__init__(tensors, device, destination=self._pooled, owned=False)
        self.pool = pool
        self.ahead = max(1, ahead)
        self._targets: dict[int, torch.Tensor] = {}  # bucket index -> the bytes it lands in

    def _pooled(self, spec: TensorSpec) -> torch.Tensor:
        raw = self.pool.acquire(spec.nbytes, self.device)
        return raw.view(spec.torch_dtype).view(spec.shape) if spec.nbytes else torch.empty(
            spec.shape, dtype=spec.torch_dtype, device=self.device)

    def _land(self, bucket: Bucket) -> torch.Tensor:
        target = super().landing(bucket)  # one range of one tensor: that range of its buffer
        if target is None:
            target = self.pool.acquire(bucket.nbytes, self.device)  # packed: a buffer of its own
        return target

    def landing(self, bucket: Bucket) -> torch.Tensor | None:
        if len(self._targets) >= self.ahead:
            return None  # enough landed ahead of the consumer: the transport's own buffer
        target = self._targets[bucket.index] = self._land(bucket)
        return target

    def unpack(self, bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        target = self._targets.pop(bucket.index, None)
        if target is None:  # in the transport's own memory: one copy into the pool
            target = self._land(bucket)
        if bucket.nbytes and target.data_ptr() != buffer.data_ptr():
            target.copy_(buffer[: bucket.nbytes])
        yield from super().unpack(bucket, target)


# ------------------------------------------------------------------------ handoff
class _Handoff:
    """Items from the receiving thread to the loader, bounded in bytes (one item always
    fits), then one end: ``("end", None)`` or ``("error", exception)``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = max(1, limit_bytes)
        self.items: collections.deque[tuple[str, Any, int]] = collections.deque()
        self.bytes = 0
        self.peak_bytes = 0
        self.cond = threading.Condition()

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
            if not self.cond.wait_for(lambda: bool(self.items), timeout):
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


def receive_into(
    receiver: Any,
    version: int,
    reload: Reload,
    *,
    pool: LandingPool,
    in_flight_bytes: int,
    timeout_s: float,
) -> PipelineResult:
    """Receive ``version`` with ``receiver`` (a session ``Receiver``) in a background thread
    and load it through ``reload`` in this one; never raises for a failed sync (the result
    says what failed). A transfer that fails ends the loader's stream cleanly (so the
    engine finalizes its reload); a loader that raises (or stops early) stops the transfer
    and the sender is told."""
    result = PipelineResult()
    handoff = _Handoff(in_flight_bytes)
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

    pool.next_version()
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
        log.error("weightsync: the receiving thread of version %s did not end within %.0f s", version, guard_s)
        result.error = result.error or SyncTimeout(f"the transfer of version {version} did not end")
    handoff.clear()
    result.queued_peak_bytes = handoff.peak_bytes
    pool.trim()
    return result


__all__ = ["HandshakeError", "LandingPool", "PipelineResult", "PooledAssembler", "landing_sizes", "receive_into"]
