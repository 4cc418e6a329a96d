"""The transfer plan: which bytes of which tensor go where in which bucket.

Pure data and pure functions. Sender and receivers compute the same plan from the same
tensor specs and bucket size, so once the plan is agreed (by its hash) no per-bucket
metadata has to travel. A tensor larger than a bucket is split into byte-range pieces over
consecutive buckets and merged on the receiver.

Layout rule, fixed by ``PLAN_FORMAT``: tensors are placed in the order given. A large
tensor (at least ``direct_bytes(bucket_bytes)``) travels alone, in buckets of its own that
hold nothing else: such a bucket is one range of one tensor, so the sender sends it from
the tensor's memory and a receiver lands it straight in its model's parameter (no packing
on either side). Small tensors are packed: each piece starts at a multiple of
``ALIGNMENT`` inside its bucket (so a receiver can view bucket bytes as any dtype); a
tensor that does not fit in the space left starts a new bucket if it fits in a whole one,
and is otherwise split, its first piece filling the space left. Buckets are numbered in
the order they close: a packed bucket stays open while large tensors pass it, at most an
eighth of a bucket's bytes of them (``packed_lag_bytes``): it closes before a large tensor
that would take them beyond, so a small tensor travels at most that far behind its
neighbours in the order given (or one large tensor, if that alone is larger). (An engine
that loads layer by layer, like vLLM's reload, completes a layer only when its norms and
biases arrived, and holds the layer's matrices until then: the lag is memory on every
receiver. A packed bucket left open to the end would hold every layer; one closed a whole
bucket later, as format 3 did, held about three layers of a small model, and the lm_head
passed the last layers' norms.)
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

import torch

from weightsync import platform

PLAN_FORMAT = 4
ALIGNMENT = 64  # bytes; a multiple of every dtype's size, and a cache line
DIRECT_MIN_BYTES = 1 << 20
# What a receiver accepts from the wire, checked spec by spec before anything is built or
# allocated (``WireLimits``). A receiver also refuses any tensor larger than its device's
# memory (``Receiver.max_tensor_bytes``) and a plan whose bucket size is not its own.
MAX_PLAN_BUCKETS = 1 << 22  # a plan from the wire with more buckets is refused, not built
MAX_PLAN_TENSORS = 1 << 20  # tensors in one plan (the largest models have about 10^5)
MAX_PLAN_BYTES = 1 << 50  # 1 PiB in one plan (a 1T-parameter model in fp32 is 4 TB)
MAX_TENSOR_DIMS = 64  # dimensions of one tensor


def direct_bytes(bucket_bytes: int) -> int:
    """Tensors this large travel alone, unpacked. Packing costs a copy on the sender and
    on every receiver; a bucket of its own costs one more transfer call. From 1 MiB (or
    1/64 of a bucket) up, the saved copies outweigh the call."""
    return max(DIRECT_MIN_BYTES, bucket_bytes // 64)


def packed_lag_bytes(bucket_bytes: int) -> int:
    """Bytes of large tensors that may pass an open packed bucket before it closes: an
    eighth of a bucket (8 MiB of 64 MiB buckets, about one layer of a small model). Each
    close costs one more (small) bucket on the wire."""
    return max(1, bucket_bytes // 8)


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical wire name of a dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    return {dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; only real torch dtypes are accepted."""
    try:
        return _dtypes()[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {_show(name)}") from None


def _show(value: Any, limit: int = 100) -> str:
    """A short repr of a value from the wire, never much longer than ``limit`` (a long
    list or string is not rendered whole first)."""
    if isinstance(value, list | tuple | dict) and len(value) > 16:
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, str | bytes) and len(value) > limit:
        return repr(value[:limit]) + "..."
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor as it travels on the wire."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {self.name!r}: bad shape {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if dtype_from_name(self.dtype).itemsize < 1:
            raise ValueError(f"tensor {self.name!r}: sub-byte dtype {self.dtype} is not supported")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), dtype_name(tensor.dtype))

    def to_wire(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_wire(cls, data: Any, max_bytes: int | None = None) -> TensorSpec:
        """Parse a spec from the wire; ValueError naming the tensor and the field if it is
        not sane, or if the tensor is larger than ``max_bytes`` (a receiver may allocate
        what a spec says)."""
        if not isinstance(data, list | tuple) or len(data) != 3:
            raise ValueError(f"tensor spec: expected [name, shape, dtype], got {_show(data)}")
        name, shape, dtype = data
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor spec: name must be a non-empty string, got {_show(name)}")
        if not isinstance(shape, list | tuple) or len(shape) > MAX_TENSOR_DIMS:
            raise ValueError(
                f"tensor {_show(name)}: shape must be a list of at most {MAX_TENSOR_DIMS} sizes, got {_show(shape)}"
            )
        dims = tuple(_wire_int(d, f"tensor {_show(name)}: shape") for d in shape)
        if not isinstance(dtype, str):
            raise ValueError(f"tensor {_show(name)}: dtype must be a string, got {_show(dtype)}")
        spec = cls(name, dims, dtype)
        if max_bytes is not None and spec.nbytes > max_bytes:
            raise ValueError(
                f"tensor {_show(name)}: shape {_show(dims)} of {_show(dtype)} is {spec.nbytes} bytes, "
                f"more than the {max_bytes} bytes a tensor may have here"
            )
        return spec

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """Bytes ``[tensor_offset, tensor_offset + length)`` of tensor number ``tensor``,
    stored at ``bucket_offset`` of its bucket."""

    tensor: int
    tensor_offset: int
    length: int
    bucket_offset: int


@dataclass(frozen=True)
class Bucket:
    """One transfer unit: ``nbytes`` used bytes holding ``pieces``."""

    index: int
    nbytes: int
    pieces: tuple[Piece, ...]

    def to_wire(self) -> list[Any]:
        return [self.index, self.nbytes, [list(astuple(p)) for p in self.pieces]]

    @classmethod
    def from_wire(cls, data: Any) -> Bucket:
        """Parse and bounds-check a bucket from the wire (ValueError naming the field if it
        is not sane): pieces in order, none overlapping another or ending past the bucket."""
        if not isinstance(data, list | tuple) or len(data) != 3:
            raise ValueError(f"bucket: expected [index, nbytes, pieces], got {_show(data)}")
        index = _wire_int(data[0], "bucket index")
        nbytes = _wire_int(data[1], f"bucket {index}: nbytes")
        if not isinstance(data[2], list | tuple):
            raise ValueError(f"bucket {index}: pieces must be a list, got {_show(data[2])}")
        pieces = []
        end = 0
        for raw in data[2]:
            if not isinstance(raw, list | tuple) or len(raw) != len(_PIECE_FIELDS):
                raise ValueError(
                    f"bucket {index}: a piece must be [{', '.join(_PIECE_FIELDS)}], got {_show(raw)}"
                )
            p = Piece(*(_wire_int(v, f"bucket {index}: piece {f}") for v, f in zip(raw, _PIECE_FIELDS)))
            if p.bucket_offset < end:
                raise ValueError(
                    f"bucket {index}: piece bucket_offset {p.bucket_offset} is inside the piece before it (ends at {end})"
                )
            end = p.bucket_offset + p.length
            if end > nbytes:
                raise ValueError(
                    f"bucket {index}: piece bucket_offset {p.bucket_offset} + length {p.length} ends past its {nbytes} bytes"
                )
            pieces.append(p)
        return cls(index, nbytes, tuple(pieces))


_PIECE_FIELDS = ("tensor", "tensor_offset", "length", "bucket_offset")


def _wire_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what}: expected a non-negative integer, got {_show(value)}")
    return value


class WireLimits:
    """Counts what a receiver accepts from the wire, spec by spec, before anything is built
    or allocated: at most ``MAX_PLAN_TENSORS`` tensors, each at most ``max_tensor_bytes``,
    at most ``max_total_bytes`` together, in at most ``MAX_PLAN_BUCKETS`` buckets of
    ``bucket_bytes``. Each refusal is a ValueError naming the tensor and the limit."""

    def __init__(
        self, bucket_bytes: int, max_tensor_bytes: int | None = None, max_total_bytes: int = MAX_PLAN_BYTES
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.max_total_bytes = max_total_bytes
        self.tensors = 0
        self.total_bytes = 0
        self.buckets = 1  # at most: each tensor's whole buckets, plus one packed bucket

    def spec(self, data: Any) -> TensorSpec:
        """Parse the next spec from the wire and count it."""
        if self.tensors >= MAX_PLAN_TENSORS:
            raise ValueError(f"plan tensors: more than {MAX_PLAN_TENSORS} tensors in one plan")
        spec = TensorSpec.from_wire(data, self.max_tensor_bytes)
        self.tensors += 1
        self.total_bytes += spec.nbytes
        if self.total_bytes > self.max_total_bytes:
            raise ValueError(
                f"tensor {_show(spec.name)}: it brings the plan to {self.total_bytes} bytes, "
                f"more than the {self.max_total_bytes} bytes a plan may have"
            )
        self.buckets += -(-spec.nbytes // self.bucket_bytes)
        if self.buckets > MAX_PLAN_BUCKETS:
            raise ValueError(
                f"tensor {_show(spec.name)}: the plan would have about {self.buckets} buckets (limit {MAX_PLAN_BUCKETS})"
            )
        return spec


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


class PlanBuilder:
    """Places tensors into buckets one at a time (the layout rule of this module).

    ``add`` returns the buckets that became full; ``finish`` returns the last one. Used
    directly when a source cannot tell its specs up front: the sender then announces
    each bucket as it closes.
    """

    def __init__(self, bucket_bytes: int) -> None:
        if bucket_bytes < ALIGNMENT:
            raise ValueError(f"bucket size must be at least {ALIGNMENT} bytes, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.direct_bytes = direct_bytes(bucket_bytes)
        self.lag_bytes = packed_lag_bytes(bucket_bytes)
        self.specs: list[TensorSpec] = []
        self._pieces: list[Piece] = []
        self._used = 0
        self._open = False
        self._passed = 0  # bytes of large tensors placed since the packed bucket opened
        self._next_index = 0

    def _close(self) -> list[Bucket]:
        if not self._open:
            return []
        bucket = Bucket(self._next_index, self._used, tuple(self._pieces))
        self._next_index += 1
        self._pieces, self._used, self._open, self._passed = [], 0, False, 0
        return [bucket]

    def _put(self, tensor: int, tensor_offset: int, length: int) -> None:
        self._open = True
        start = _align(self._used) if length else self._used
        self._pieces.append(Piece(tensor, tensor_offset, length, start))
        self._used = start + length

    def _space_left(self) -> int:
        return self.bucket_bytes - _align(self._used) if self._open else 0

    def add(self, spec: TensorSpec) -> list[Bucket]:
        """Place one more tensor; return the buckets closed by doing so."""
        index = len(self.specs)
        self.specs.append(spec)
        n = spec.nbytes
        closed: list[Bucket] = []
        if n >= self.direct_bytes:  # alone, in whole buckets; the packed bucket stays open
            if self._passed + n > self.lag_bytes:  # ... unless this one would pass it too far
                closed += self._close()
            if self._open:
                self._passed += n
            for offset in range(0, n, self.bucket_bytes):
                length = min(self.bucket_bytes, n - offset)
                closed.append(Bucket(self._next_index, length, (Piece(index, offset, length, 0),)))
                self._next_index += 1
            return closed
        if n == 0 or n <= self._space_left():
            self._put(index, 0, n)
            return closed
        if n <= self.bucket_bytes:
            closed += self._close()
            self._put(index, 0, n)
            return closed
        offset = 0
        while offset < n:
            room = self._space_left()
            if room <= 0:
                closed += self._close()
                room = self.bucket_bytes
            length = min(room, n - offset)
            self._put(index, offset, length)
            offset += length
        return closed

    def finish(self) -> list[Bucket]:
        """Close the last bucket."""
        return self._close()


class StreamedPlan:
    """A receiver's check of a plan announced bucket by bucket (a source that could not
    tell its specs up front): each announcement's new specs pass ``WireLimits`` and its
    bucket must be the next one, no larger than a bucket, with every piece continuing its
    tensor exactly where the previous piece ended. ``specs`` (the list the receiver's
    ``Assembler`` reads) grows only by what passed."""

    def __init__(
        self,
        bucket_bytes: int,
        specs: list[TensorSpec],
        max_tensor_bytes: int | None = None,
        max_total_bytes: int = MAX_PLAN_BYTES,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.specs = specs
        self.limits = WireLimits(bucket_bytes, max_tensor_bytes, max_total_bytes)
        self._names = {s.name for s in specs}
        self._filled = [0] * len(specs)  # bytes of each tensor announced so far
        self.buckets = 0

    def announce(self, tensors: Any, bucket: Any) -> tuple[list[TensorSpec], Bucket]:
        """Check one announcement (``tensors``: the new specs, ``bucket``: the bucket);
        return the new specs and the bucket, or raise ValueError naming the field."""
        if not isinstance(tensors, list | tuple):
            raise ValueError(f"announced tensors: expected a list, got {type(tensors).__name__}")
        new = [self.limits.spec(t) for t in tensors]
        b = Bucket.from_wire(bucket)
        if b.index >= MAX_PLAN_BUCKETS:
            raise ValueError(
                f"bucket index: {b.index}, more than the {MAX_PLAN_BUCKETS} buckets a plan may have"
            )
        if b.index != self.buckets:
            raise ValueError(f"bucket index: {b.index} announced where bucket {self.buckets} is next")
        if b.nbytes > self.bucket_bytes:
            raise ValueError(
                f"bucket {b.index}: nbytes {b.nbytes} is more than a bucket ({self.bucket_bytes} bytes)"
            )
        names = set()
        for spec in new:
            if spec.name in self._names or spec.name in names:
                raise ValueError(f"tensor {_show(spec.name)} is announced twice")
            names.add(spec.name)
        known = len(self.specs) + len(new)
        filled = {}
        for p in b.pieces:
            if p.tensor >= known:
                raise ValueError(
                    f"bucket {b.index}: piece tensor {p.tensor} was never announced ({known} were)"
                )
            spec = self.specs[p.tensor] if p.tensor < len(self.specs) else new[p.tensor - len(self.specs)]
            done = filled.get(p.tensor, self._filled[p.tensor] if p.tensor < len(self._filled) else 0)
            if p.tensor_offset != done or done + p.length > spec.nbytes:
                raise ValueError(
                    f"bucket {b.index}: piece tensor_offset {p.tensor_offset} and length {p.length} of tensor "
                    f"{_show(spec.name)} ({spec.nbytes} bytes) do not continue its {done} bytes announced before"
                )
            filled[p.tensor] = done + p.length
        self.specs.extend(new)
        self._names |= names
        self._filled += [0] * len(new)
        for i, n in filled.items():
            self._filled[i] = n
        self.buckets += 1
        return new, b


@dataclass(frozen=True)
class Plan:
    """A complete, agreed transfer plan. Derived deterministically from
    ``(tensors, bucket_bytes)``; ``hash`` identifies it on the wire."""

    bucket_bytes: int
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    hash: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.hash:
            object.__setattr__(self, "hash", plan_hash(self.tensors, self.bucket_bytes))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack/JSON-safe form; the buckets are recomputed by the receiver."""
        return {
            "format": PLAN_FORMAT,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [t.to_wire() for t in self.tensors],
        }

    @classmethod
    def from_wire(
        cls,
        data: Any,
        *,
        bucket_bytes: int | None = None,
        max_tensor_bytes: int | None = None,
        max_total_bytes: int = MAX_PLAN_BYTES,
    ) -> Plan:
        """Rebuild a plan from the wire, refusing one that would take unbounded memory
        (ValueError naming the field): see ``WireLimits``. ``bucket_bytes``: the bucket
        size this side is configured with; a plan of another size is refused."""
        if not isinstance(data, dict):
            raise ValueError(f"plan: expected a map, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {_show(data.get('format'))} is not {PLAN_FORMAT}")
        wire_bucket = _wire_int(data.get("bucket_bytes"), "plan bucket_bytes")
        if wire_bucket < ALIGNMENT:
            raise ValueError(f"plan bucket_bytes: {wire_bucket} is below {ALIGNMENT} bytes")
        if bucket_bytes is not None and wire_bucket != bucket_bytes:
            raise ValueError(
                f"plan bucket_bytes: {wire_bucket}, where this side's buckets are {bucket_bytes} bytes"
            )
        tensors = data.get("tensors")
        if not isinstance(tensors, list | tuple):
            raise ValueError(f"plan tensors: expected a list, got {type(tensors).__name__}")
        if len(tensors) > MAX_PLAN_TENSORS:
            raise ValueError(
                f"plan tensors: {len(tensors)} tensors, more than the {MAX_PLAN_TENSORS} a plan may have"
            )
        limits = WireLimits(wire_bucket, max_tensor_bytes, max_total_bytes)
        return make_plan([limits.spec(t) for t in tensors], wire_bucket)


def plan_hash(tensors: Sequence[TensorSpec], bucket_bytes: int) -> str:
    """Stable hash of a plan (sha256 over its canonical JSON form)."""
    canon = json.dumps(
        [PLAN_FORMAT, ALIGNMENT, bucket_bytes, [t.to_wire() for t in tensors]],
        separators=(",", ":"),
    )
    return hashlib.sha256(canon.encode()).hexdigest()


def make_plan(specs: Iterable[TensorSpec], bucket_bytes: int) -> Plan:
    """Plan the transfer of ``specs`` in buckets of ``bucket_bytes`` bytes."""
    builder = PlanBuilder(bucket_bytes)
    buckets: list[Bucket] = []
    for spec in specs:
        buckets += builder.add(spec)
    buckets += builder.finish()
    names = [s.name for s in builder.specs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor {dup!r} appears twice in the plan")
    return Plan(bucket_bytes, tuple(builder.specs), tuple(buckets))


def capacity(plan: Plan | None, bucket_bytes: int) -> int:
    """Buffer size a sync needs: its largest bucket (a streamed sync may fill a whole one)."""
    if plan is None:
        return bucket_bytes
    return max((b.nbytes for b in plan.buckets), default=1)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (copying only if it is not contiguous)."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def pack_pieces(bucket: Bucket, buffer: torch.Tensor, tensor_bytes: Mapping[int, torch.Tensor]) -> None:
    """Copy the pieces of ``bucket`` into ``buffer`` from flat byte views (see ``as_bytes``)
    of its tensors, keyed by plan index."""
    for p in bucket.pieces:
        if p.length:
            src = tensor_bytes[p.tensor][p.tensor_offset : p.tensor_offset + p.length]
            platform.copy_bytes(buffer[p.bucket_offset : p.bucket_offset + p.length], src)


class Assembler:
    """Turns received buckets back into named tensors (the receiver's half of the plan).

    Whole tensors come out as views into the bucket buffer (valid until the next bucket
    is requested); split tensors are merged into the tensor ``destination(spec)`` returns
    (a sink's own parameter: no temporary, no second copy), or else into a new tensor.

    ``owned``: every tensor that comes out is the caller's to keep. Without a
    ``destination``, a bucket that is one range of one tensor then lands in a new tensor
    (no copy), and a tensor packed with others is copied out of the buffer.
    """

    def __init__(
        self,
        tensors: Sequence[TensorSpec],
        device: torch.device,
        destination: Callable[[TensorSpec], torch.Tensor | None] | None = None,
        *,
        owned: bool = False,
    ) -> None:
        self.tensors = tensors
        self.device = device
        self.owned = owned
        if owned and destination is None:
            destination = self._new_tensor
        self.destination = destination
        self._partial: dict[int, torch.Tensor] = {}
        self._landed: set[int] = set()  # buckets written straight into their destination

    def _new_tensor(self, spec: TensorSpec) -> torch.Tensor:
        return torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)

    def landing(self, bucket: Bucket) -> torch.Tensor | None:
        """Where the transport may write a bucket that is one range of one tensor: that
        range of the tensor's destination (the model's own parameter), or None."""
        if self.destination is None or len(bucket.pieces) != 1:
            return None
        p = bucket.pieces[0]
        if p.bucket_offset != 0 or not p.length:
            return None
        target = self._target(p.tensor)
        if target is None:
            return None
        if p.length != self.tensors[p.tensor].nbytes:
            self._partial.setdefault(p.tensor, target)  # its other pieces go to the same tensor
        self._landed.add(bucket.index)
        return as_bytes(target)[p.tensor_offset : p.tensor_offset + p.length]

    def _target(self, index: int) -> torch.Tensor | None:
        if index in self._partial:
            return self._partial[index]
        spec = self.tensors[index]
        target = self.destination(spec) if self.destination is not None else None
        if (
            target is None
            or not target.is_contiguous()
            or target.numel() * target.element_size() != spec.nbytes
        ):
            return None
        return target

    def unpack(
        self, bucket: Bucket, buffer: torch.Tensor, lent: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``bucket``'s complete tensors. ``lent``: ``buffer`` stays unchanged until the sync's
        acknowledgement (``Transport.lends``); this assembler copies as it would otherwise
        (``owned`` tensors outlive the sync), a pooled one may hand out views of it."""
        for p in bucket.pieces:
            spec = self.tensors[p.tensor]
            whole = p.tensor_offset == 0 and p.length == spec.nbytes
            if whole:
                if spec.nbytes == 0:
                    yield spec.name, torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
                else:
                    raw = buffer[p.bucket_offset : p.bucket_offset + p.length]
                    tensor = raw.view(spec.torch_dtype).view(spec.shape)
                    yield (
                        spec.name,
                        tensor.clone() if self.owned and bucket.index not in self._landed else tensor,
                    )
                continue
            full = self._partial.get(p.tensor)
            if full is None:
                full = self._target(p.tensor)
                if full is None:
                    full = torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
                self._partial[p.tensor] = full
            dst = as_bytes(full)[p.tensor_offset : p.tensor_offset + p.length]
            src = buffer[p.bucket_offset : p.bucket_offset + p.length]
            if dst.data_ptr() != src.data_ptr() or dst.device != src.device:  # else it landed in place
                dst.copy_(src)
            if p.tensor_offset + p.length == spec.nbytes:
                self._landed.discard(bucket.index)
                yield spec.name, self._partial.pop(p.tensor)

    @property
    def incomplete(self) -> list[str]:
        """Names of split tensors still waiting for pieces."""
        return [self.tensors[i].name for i in self._partial]


def shortfall(
    tensors: Sequence[TensorSpec],
    buckets: Sequence[Bucket],
    received: Iterable[int],
    incomplete: Sequence[str],
) -> str:
    """What a receive that ended early lacks: the buckets of ``buckets`` whose index is not
    in ``received``, the tensors with a piece in them, and ``incomplete`` (split tensors
    still waiting for pieces), each list cut short after a few names."""

    def few(items: Sequence[Any]) -> str:
        return ", ".join(map(str, items[:6])) + (f", ... ({len(items)} in all)" if len(items) > 6 else "")

    got = set(received)
    lost = [b for b in buckets if b.index not in got]
    names = list(dict.fromkeys(tensors[p.tensor].name for b in lost for p in b.pieces))
    parts = (
        [f"{len(lost)} of {len(buckets)} bucket(s) did not arrive ({few([b.index for b in lost])})"]
        if lost
        else []
    )
    if names:
        parts.append(f"tensor(s) {few(names)} missing")
    if incomplete:
        parts.append(f"split tensor(s) {few(list(incomplete))} still waiting for pieces")
    return "; ".join(parts) or "no bucket is missing, but fewer tensors came out than the plan holds"
