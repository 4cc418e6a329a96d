"""Landing memory for a pipelined receive (``weightsync.receiver.prefetch``), reused across versions.

Every bucket lands in pool memory (``LandingPool``; a transport that can write anywhere,
``nccl``, receives straight into it; others are copied into it once), and the tensors
handed to the engine are views of it (``PooledAssembler``, the plan layer's assembler over
pool memory). Memory is reused only when no tensor viewing it is alive any more: vLLM's
layerwise reload keeps the tensors of a layer (in ``LayerReloadingInfo.loaded_weights``)
until the layer's last weight arrived and the layer was processed (``_layerwise_process``
ends with ``info.reset()``), or until ``finalize_layerwise_reload`` for layers that never
complete; whatever the engine holds, the use count of the storage it views says when it
let go. During a version the memory in use (queued for the loader, being loaded, held by
the engine, landed ahead) stays within ``receive_buckets_in_flight`` buckets, one arena of
that size allocated once: the transfer waits for the engine to let go, and passes the bound
only when waiting cannot help (the loader waits with nothing queued). The pool keeps its
memory between versions (a steady update allocates nothing proportional to the model, and
pays no page faults) and frees it on ``close``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch

from weightsync.errors import SyncTimeout
from weightsync.plan import Assembler, Bucket, Plan, TensorSpec, as_bytes

# Buckets a transport may receive straight into pool memory ahead of the receiving thread:
# one keeps the wire busy while the thread unpacks the bucket before it.
LANDED_AHEAD = 1


def _use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors viewing it, plus the one this call makes)."""
    # torch 2.13 has no public reference count of a storage
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)  # noqa: SLF001 -- torch 2.13


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class LandingPool:
    """Memory that received buckets land in, reused across versions.

    Bounded (``bound(limit_bytes, ...)``, for the length of one version): buckets land in
    one arena of ``limit_bytes``, allocated once and kept, each range handed out as a
    tensor with a storage of its own (``torch.from_dlpack``), so its use count says when
    nothing views it any more and the range is free again. ``acquire`` takes the first
    free range after the last one handed out (the engine lets go of buckets roughly in
    the order they came, so the arena is used as a ring; a free range across the cursor
    serves when none on either side of it does), and waits for the engine to let go of a
    range when none fits; the limit is passed only when ``may_exceed()`` says waiting
    cannot help (the loader waits for a tensor with nothing queued: the engine holds what
    it needs to complete a layer). A request told that a large one follows soon (``then``:
    more than half the arena, a tensor larger than a bucket) is placed below the top
    ``then`` bytes of the arena, waiting for room there as for any room, so that the large
    one finds those bytes clear of the tensors that come just before it, which the engine
    may still hold when it arrives (its loader looks ahead). Requests larger than the arena, those that
    pass the limit, and every request of an unbounded pool take a buffer of their own from
    the overflow: buffers kept by size (a free one of at least ``nbytes`` and at most
    twice that serves), those the last two versions did not use freed by ``trim``.
    """

    #: the longest ``acquire`` waits between looks at the use counts: the engine lets go
    #: of tensors while it loads, and the loader calls ``released`` when it asks for the
    #: next one, but nothing signals every release
    POLL_S = 0.02
    #: ranges of the arena start on this boundary (any dtype's alignment, a page)
    ALIGN = 4096

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self._arena: torch.Tensor | None = None
        self._ranges: list[list[Any]] = []  # [offset, nbytes, handle] handed out, by offset
        self._cursor = 0  # where the last range handed out ends
        # overflow: size -> [[buffer, generation it was last handed out in], ...]
        self._by_size: dict[int, list[list[Any]]] = {}
        self._generation = 0
        self._lock = threading.Lock()
        self._released_cond = threading.Condition(self._lock)
        #: buffers allocated over the pool's life (the arena counts as one; a steady
        #: version adds none)
        self.allocations = 0
        self.allocated_bytes = 0
        self.limit_bytes: int | None = None
        #: the bytes of the plan being received (set by ``assembler``): the arena's cap
        self.plan_bytes = 0
        self._may_exceed: Callable[[], bool] = lambda: True
        self._wait_s = 0.0
        #: the most bytes in use at once during this version (``next_version`` resets it)
        self.peak_bytes = 0
        #: seconds ``acquire`` waited for the engine to release memory this version
        self.waited_s = 0.0
        #: bytes received elsewhere (the transport's own buffers) and copied in this version
        self.copied_bytes = 0
        #: bytes handed to the engine in place, in memory the transport lends until the
        #: sync's acknowledgement (``Transport.lends``), this version
        self.lent_bytes = 0

    # -------------------------------------------------------------- accounting
    def _entries(self) -> list[list[Any]]:
        return [e for entries in self._by_size.values() for e in entries]

    @property
    def bytes(self) -> int:
        """Bytes the pool holds now (the arena and the overflow)."""
        arena = self._arena.numel() if self._arena is not None else 0
        return arena + sum(size * len(entries) for size, entries in self._by_size.items())

    def in_use_bytes(self) -> int:
        """Bytes that some tensor still views."""
        with self._lock:
            return self._in_use()

    def _in_use(self) -> int:
        self._ranges = [r for r in self._ranges if _use_count(r[2]) > 2]
        return sum(r[1] for r in self._ranges) + sum(
            e[0].numel() for e in self._entries() if _use_count(e[0]) > 2
        )

    def bound(
        self, limit_bytes: int | None, may_exceed: Callable[[], bool] = lambda: True, wait_s: float = 0.0
    ) -> None:
        """Land in an arena of ``limit_bytes`` (None: unbounded, every request from the
        overflow). ``acquire`` waits up to ``wait_s`` for room, and passes the limit at
        once when ``may_exceed()`` is true."""
        self.limit_bytes, self._may_exceed, self._wait_s = limit_bytes, may_exceed, wait_s

    # ---------------------------------------------------------------- the arena
    def _arena_for(self, device: torch.device) -> torch.Tensor | None:
        """The arena on ``device``, as much of it as the bound allows: the limit, capped at
        the plan's bytes (a bound of 2 GiB buckets for a 7 MB model). Made (or grown) when
        none of it is in use; a larger one serves a smaller bound (a delta version)."""
        if self.limit_bytes is None:
            return None
        size = (
            min(self.limit_bytes, _aligned(self.plan_bytes, self.ALIGN))
            if self.plan_bytes
            else self.limit_bytes
        )
        arena = self._arena
        if (arena is None or arena.numel() < size or arena.device != device) and not self._ranges:
            self._arena = arena = None  # dropped before its successor is allocated
            arena = self._arena = torch.empty(size, dtype=torch.uint8, device=device)
            self.allocations += 1
            self.allocated_bytes += size
        if arena is None or arena.device != device:
            return None
        return arena[:size]

    def _gap(self, nbytes: int, size: int, then: int = 0, strict: bool = False) -> int | None:
        """The offset of the first free range of ``nbytes`` at or after the cursor, else
        from the start; with ``then``, one that leaves room for ``then`` bytes after it
        (below the arena's top ``then`` bytes), else (not ``strict``) the arena's end."""
        edges, start = [], 0
        for offset, length, _ in self._ranges:  # sorted by offset
            if offset > start and start < size:
                edges.append((start, min(offset, size)))
            start = _aligned(offset + length, self.ALIGN)
        if start < size:
            edges.append((start, size))
        after = [(max(a, self._cursor), b) for a, b in edges if b > self._cursor]
        before = [(a, min(b, self._cursor)) for a, b in edges if a < self._cursor]
        fits = [a for a, b in after + before + edges if b - _aligned(a, self.ALIGN) >= nbytes]
        fits = [_aligned(a, self.ALIGN) for a in fits]
        ahead = [a for a in fits if _aligned(a + nbytes, self.ALIGN) + then <= size]
        if strict:
            return (ahead or [None])[0]
        if then and not ahead and edges and edges[-1][1] == size:
            # No room after it now: at the arena's end, where it splits none of the room
            # the ranges held now leave when the engine lets go of them.
            top = (size - nbytes) // self.ALIGN * self.ALIGN
            if top >= edges[-1][0]:
                return top
        return (ahead or fits or [None])[0]

    def _from_arena(
        self, arena: torch.Tensor, nbytes: int, then: int = 0, strict: bool = False
    ) -> torch.Tensor | None:
        offset = self._gap(nbytes, arena.numel(), then, strict)
        if offset is None:
            return None
        handle = torch.from_dlpack(arena[offset : offset + nbytes])  # a storage of its own: its own use count
        self._ranges.append([offset, nbytes, handle])
        self._ranges.sort(key=lambda r: r[0])
        self._cursor = offset + nbytes
        return handle[:nbytes]

    # ----------------------------------------------------------- the overflow
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

    def _from_overflow(self, nbytes: int, device: torch.device) -> torch.Tensor:
        entry = self._free_entry(nbytes, device)
        if entry is None:
            entry = [torch.empty(nbytes, dtype=torch.uint8, device=device), self._generation]
            self._by_size.setdefault(nbytes, []).append(entry)
            self.allocations += 1
            self.allocated_bytes += nbytes
        entry[1] = self._generation
        return entry[0][:nbytes]

    # ------------------------------------------------------------------ acquire
    @overload
    def acquire(self, nbytes: int, device: torch.device | None = None, *, then: int = 0) -> torch.Tensor: ...
    @overload
    def acquire(
        self, nbytes: int, device: torch.device | None = None, *, wait: bool, then: int = 0
    ) -> torch.Tensor | None: ...

    def acquire(
        self, nbytes: int, device: torch.device | None = None, *, wait: bool = True, then: int = 0
    ) -> torch.Tensor | None:
        """A uint8 tensor of ``nbytes`` in pool memory, the caller's until it lets go of
        every view of it. Bounded (``bound``): waits for room, or with ``wait=False``
        returns None when there is none; raises ``SyncTimeout`` after ``wait_s``.
        ``then``: the bytes of a large request that will follow soon (this one is placed
        below the arena's top ``then`` bytes; waits for room there while waiting can help)."""
        device = device if device is not None else (self.device or torch.device("cpu"))
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device)
        waited_since = None
        while True:
            with self._lock:
                in_use = self._in_use()
                arena = self._arena_for(device)
                view = None
                large = arena is None or nbytes > arena.numel()
                if not large:
                    soon = then if then <= arena.numel() < 2 * then else 0  # a large one follows
                    view = self._from_arena(arena, nbytes, soon, strict=bool(soon))
                    if view is None and soon and wait and self._may_exceed():
                        view = self._from_arena(arena, nbytes, soon)  # anywhere, rather than beside it
                elif self.limit_bytes is None or in_use + nbytes <= self.limit_bytes:
                    view = self._from_overflow(nbytes, device)
                if (
                    view is None and wait and self._may_exceed()
                ):  # (not to land ahead: the transport's buffer serves)
                    view = self._from_overflow(nbytes, device)
                if view is not None:
                    self.peak_bytes = max(self.peak_bytes, in_use + nbytes)
                    if waited_since is not None:
                        self.waited_s += time.perf_counter() - waited_since
                    return view
                if not wait:
                    return None
                now = time.perf_counter()
                if waited_since is None:
                    waited_since = now
                elif now - waited_since > self._wait_s:
                    self.waited_s += now - waited_since
                    raise SyncTimeout(
                        f"no landing memory for {nbytes} bytes within {self._wait_s:.0f} s: the engine "
                        f"held {in_use} of the {self.limit_bytes} bytes allowed"
                    )
                self._released_cond.wait(self.POLL_S)

    def released(self) -> None:
        """The engine may have let go of memory (the loader asks for its next tensor): wake
        an ``acquire`` that waits for room."""
        with self._lock:
            self._released_cond.notify_all()

    def reserve(self, plan: Plan, limit_bytes: int, device: torch.device | None = None) -> int:
        """Allocate now the landing memory that versions of ``plan`` land in within
        ``limit_bytes`` (the arena, and a buffer for each size of the plan larger than it),
        zeroed so its pages are in before the first transfer; returns the bytes allocated.
        Overflow buffers no version uses are freed by ``trim`` after two versions."""
        device = device if device is not None else (self.device or torch.device("cpu"))
        before = self.allocated_bytes
        self.plan_bytes = sum(spec.nbytes for spec in plan.tensors)
        self.bound(limit_bytes)
        try:
            with self._lock:
                arena = self._arena_for(device)
                if arena is not None and self.allocated_bytes != before:
                    arena.zero_()
                cap = arena.numel() if arena is not None else 0
                held = [
                    self._from_overflow(size, device)
                    for size in sorted(set(landing_sizes(plan)))
                    if size > cap
                ]
                for view in held:
                    view.zero_()
        finally:
            self.bound(None)
        return self.allocated_bytes - before

    def next_version(self) -> None:
        with self._lock:
            self._generation += 1
            self.peak_bytes = 0
            self.waited_s = 0.0
            self.copied_bytes = self.lent_bytes = 0

    def trim(self) -> None:
        """Free the overflow buffers neither this version nor the one before handed out
        (and that nothing references): the pool follows the plan, without churning on
        small timing differences between versions."""
        with self._lock:
            for size in list(self._by_size):
                keep = [
                    e for e in self._by_size[size] if e[1] >= self._generation - 1 or _use_count(e[0]) > 2
                ]
                if keep:
                    self._by_size[size] = keep
                else:
                    del self._by_size[size]

    def close(self) -> None:
        """Drop the arena and every buffer (tensors still viewing one keep it alive until
        they go)."""
        with self._lock:
            self._by_size = {}
            self._arena, self._ranges, self._cursor = None, [], 0

    def assembler(
        self, specs: Sequence[TensorSpec], device: torch.device, buckets: Sequence[Bucket] = ()
    ) -> PooledAssembler:
        """For ``Receiver.receive(landing=pool)``; ``buckets``: the plan's, when known
        before the transfer (the landings before a large tensor then keep its room clear)."""
        self.plan_bytes = sum(spec.nbytes for spec in specs)
        return PooledAssembler(specs, device, self, following=following_landings(specs, buckets))


def _landings(tensors: Sequence[TensorSpec], buckets: Sequence[Bucket]) -> list[tuple[int, int]]:
    """``(bucket index, bytes)`` of each bucket that takes pool memory (``PooledAssembler``),
    in plan order: a bucket that is one range of one tensor lands in that tensor's buffer
    (where a tensor is split over buckets, its whole size, taken by its first bucket), a
    packed bucket in a buffer of its own size."""
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    for bucket in buckets:
        first = bucket.pieces[0] if bucket.pieces else None
        if len(bucket.pieces) == 1 and first is not None and first.bucket_offset == 0 and first.length:
            if first.tensor in seen:
                continue
            seen.add(first.tensor)
            size = tensors[first.tensor].nbytes
        else:
            size = bucket.nbytes
        if size:
            out.append((bucket.index, size))
    return out


def landing_sizes(plan: Plan) -> list[int]:
    """The size of the pool buffer each bucket of ``plan`` that takes one lands in, in plan
    order (``_landings``)."""
    return [size for _, size in _landings(plan.tensors, plan.buckets)]


#: landings before a large one that keep clear of its room: vLLM's loader still holds one of
#: the last layer's matrices when it waits for the lm_head (the third landing before it here)
LOOKAHEAD = 4


def following_landings(
    tensors: Sequence[TensorSpec], buckets: Sequence[Bucket], lookahead: int = LOOKAHEAD
) -> dict[int, int]:
    """For each bucket that takes pool memory, the largest of the ``lookahead`` landings
    after it."""
    sizes = _landings(tensors, buckets)
    return {
        index: max((size for _, size in sizes[k + 1 : k + 1 + lookahead]), default=0)
        for k, (index, _) in enumerate(sizes)
    }


class PooledAssembler(Assembler):
    """An ``Assembler`` whose tensors all live in pool memory and may be kept: a bucket
    that is one range of one tensor lands in that tensor's pool buffer, a packed bucket in
    a pool buffer of its own (its tensors are views of it), split tensors are merged in a
    pool buffer of their full size.

    At most ``ahead`` buckets land in pool memory before they are unpacked: a transport
    that posts receives further ahead (``nccl`` posts up to 8) receives the others into
    its own two buffers, copied into the pool when unpacked, so the pool does not grow
    with the transport's window.

    A bucket in memory the transport lends until the sync's acknowledgement (``ipc``: the
    trainer's own tensors; the engine is done loading before the receiver answers) is not
    copied: its whole tensors go out as views of it, and so does a split tensor whose
    pieces lie one after another in the same lent memory (as the trainer holds it); a split
    tensor whose pieces do not is merged in the pool, the pieces before too."""

    def __init__(
        self,
        tensors: Sequence[TensorSpec],
        device: torch.device,
        pool: LandingPool,
        ahead: int = LANDED_AHEAD,
        following: dict[int, int] | None = None,
    ) -> None:
        super().__init__(tensors, device, destination=self._pooled, owned=False)
        self.pool = pool
        self.ahead = max(1, ahead)
        self._targets: dict[int, torch.Tensor] = {}  # bucket index -> the bytes it lands in
        self._wait = True  # acquire waits for room in the pool (not while the transport asks ahead)
        # bucket index -> the largest of the next landings (``following_landings``): a large
        # tensor after the last layer (the lm_head) then finds room clear of its tensors
        self._following = following or {}
        self._then = 0
        # a split tensor read in place so far: tensor index -> lent bytes of its whole length
        self._spans: dict[int, torch.Tensor] = {}

    def _pooled(self, spec: TensorSpec) -> torch.Tensor | None:
        if not spec.nbytes:
            return torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
        raw = self.pool.acquire(spec.nbytes, self.device, wait=self._wait, then=self._then)
        return None if raw is None else raw.view(spec.torch_dtype).view(spec.shape)

    def _land(self, bucket: Bucket) -> torch.Tensor | None:
        """Where ``bucket`` lands; None only when not waiting and the pool has no room."""
        self._then = self._following.get(bucket.index, 0)
        first = bucket.pieces[0] if len(bucket.pieces) == 1 else None
        if first is not None and first.bucket_offset == 0 and first.length:
            return super().landing(bucket)  # one range of one tensor: that range of its buffer
        return self.pool.acquire(
            bucket.nbytes, self.device, wait=self._wait, then=self._then
        )  # packed: its own

    def landing(self, bucket: Bucket) -> torch.Tensor | None:
        if len(self._targets) >= self.ahead:
            return None  # enough landed ahead of the consumer: the transport's own buffer
        self._wait = False  # no room in the pool now: the transport's own buffer
        try:
            target = self._land(bucket)
        finally:
            self._wait = True
        if target is not None:
            self._targets[bucket.index] = target
        return target

    def unpack(
        self, bucket: Bucket, buffer: torch.Tensor, lent: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if lent and bucket.index not in self._targets:
            yield from self._lent(bucket, buffer)
            return
        for p in bucket.pieces:  # a tensor read in place so far that continues in this bucket
            if p.tensor in self._spans:
                self._merge(p.tensor, p.tensor_offset)
        target = self._targets.pop(bucket.index, None)
        if target is None:  # in the transport's own memory: one copy into the pool
            target = self._land(bucket)
        if bucket.nbytes and target.data_ptr() != buffer.data_ptr():
            target.copy_(buffer[: bucket.nbytes])
            self.pool.copied_bytes += bucket.nbytes
        yield from super().unpack(bucket, target)

    def _lent(self, bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for p in bucket.pieces:
            spec = self.tensors[p.tensor]
            src = buffer[p.bucket_offset : p.bucket_offset + p.length]
            last = p.tensor_offset + p.length == spec.nbytes
            if not spec.nbytes:
                yield spec.name, torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
                continue
            span = _span(src, spec.nbytes) if p.tensor_offset == 0 else self._spans.pop(p.tensor, None)
            if span is not None and span[p.tensor_offset :].data_ptr() != src.data_ptr():
                self._spans[p.tensor] = span  # not where the earlier pieces continue
                self._merge(p.tensor, p.tensor_offset)
                span = None
            if span is not None:
                self.pool.lent_bytes += p.length
                if last:
                    yield spec.name, span.view(spec.torch_dtype).view(spec.shape)
                else:
                    self._spans[p.tensor] = span
                continue
            full = self._partial.get(p.tensor)
            if full is None:
                full = self._partial[p.tensor] = self._pooled(spec)
                assert full is not None  # acquire waits for room
            as_bytes(full)[p.tensor_offset : p.tensor_offset + p.length].copy_(src)
            self.pool.copied_bytes += p.length
            if last:
                yield spec.name, self._partial.pop(p.tensor)

    def _merge(self, index: int, upto: int) -> None:
        """A split tensor read in place so far continues elsewhere: its first ``upto`` bytes
        (still lent) into a pool buffer of its full size, where its other pieces go."""
        span = self._spans.pop(index)
        full = self._partial.get(index)
        if full is None:
            full = self._pooled(self.tensors[index])
            assert full is not None  # acquire waits for room
        as_bytes(full)[:upto].copy_(span[:upto])
        self.pool.copied_bytes += upto
        self.pool.lent_bytes -= upto
        self._partial[index] = full

    @property
    def incomplete(self) -> list[str]:
        return super().incomplete + [self.tensors[i].name for i in self._spans]


def _span(piece: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of ``piece``'s storage from where ``piece`` starts (None where the storage
    ends before): where a tensor's later pieces lie if it is laid out as its sender holds it."""
    storage = piece.untyped_storage()
    if piece.storage_offset() + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=piece.device).set_(
        storage, piece.storage_offset(), (nbytes,)
    )
