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
the order they close: a packed bucket stays open while large tensors pass it.
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

PLAN_FORMAT = 2
ALIGNMENT = 64  # bytes; a multiple of every dtype's size, and a cache line
DIRECT_MIN_BYTES = 1 << 20
MAX_PLAN_BUCKETS = 1 << 22  # a plan from the wire larger than this is refused, not built


def direct_bytes(bucket_bytes: int) -> int:
    """Tensors this large travel alone, unpacked. Packing costs a copy on the sender and
    on every receiver; a bucket of its own costs one more transfer call. From 1 MiB (or
    1/64 of a bucket) up, the saved copies outweigh the call."""
    return max(DIRECT_MIN_BYTES, bucket_bytes // 64)


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
        raise ValueError(f"unknown dtype {name!r}") from None


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
    def from_wire(cls, data: Any) -> TensorSpec:
        name, shape, dtype = data
        if not isinstance(shape, list | tuple) or not isinstance(dtype, str):
            raise ValueError(f"malformed tensor spec {data!r:.200}")
        return cls(name, tuple(shape), dtype)

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
        """Parse and bounds-check a bucket from the wire (ValueError if it is not sane)."""
        index, nbytes, pieces = data
        bucket = cls(_wire_int(index), _wire_int(nbytes), tuple(Piece(*map(_wire_int, p)) for p in pieces))
        for p in bucket.pieces:
            if p.bucket_offset + p.length > bucket.nbytes:
                raise ValueError(f"bucket {bucket.index}: a piece ends at {p.bucket_offset + p.length}, past its {bucket.nbytes} bytes")
        return bucket


def _wire_int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


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
        self.specs: list[TensorSpec] = []
        self._pieces: list[Piece] = []
        self._used = 0
        self._open = False
        self._next_index = 0

    def _close(self) -> list[Bucket]:
        if not self._open:
            return []
        bucket = Bucket(self._next_index, self._used, tuple(self._pieces))
        self._next_index += 1
        self._pieces, self._used, self._open = [], 0, False
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
    def from_wire(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a plan from the wire, refusing one that would take unbounded memory."""
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {data.get('format')!r} is not {PLAN_FORMAT}")
        specs = [TensorSpec.from_wire(t) for t in data["tensors"]]
        bucket_bytes = _wire_int(data["bucket_bytes"])
        if bucket_bytes < ALIGNMENT:
            raise ValueError(f"bucket size {bucket_bytes} is below {ALIGNMENT} bytes")
        buckets = sum(-(-s.nbytes // bucket_bytes) for s in specs) + 1
        if buckets > MAX_PLAN_BUCKETS:
            raise ValueError(f"the plan would have about {buckets} buckets (limit {MAX_PLAN_BUCKETS})")
        return make_plan(specs, bucket_bytes)


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
            buffer[p.bucket_offset : p.bucket_offset + p.length].copy_(src)


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
        if target is None or not target.is_contiguous() or target.numel() * target.element_size() != spec.nbytes:
            return None
        return target

    def unpack(self, bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for p in bucket.pieces:
            spec = self.tensors[p.tensor]
            whole = p.tensor_offset == 0 and p.length == spec.nbytes
            if whole:
                if spec.nbytes == 0:
                    yield spec.name, torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)
                else:
                    raw = buffer[p.bucket_offset : p.bucket_offset + p.length]
                    tensor = raw.view(spec.torch_dtype).view(spec.shape)
                    yield spec.name, tensor.clone() if self.owned and bucket.index not in self._landed else tensor
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
