"""The delta header both sides read, and the digest it carries: how a delta sync's wire
entries map to the version's tensors, and one hash over named tensors (names, dtypes,
shapes, raw bytes) by which a sender and a receiver check that they hold the same base
before a delta is applied."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.delta.format import Kind
from weightsync.plan import TensorSpec, as_bytes, dtype_name

#: the name of a tensor's entry in the dense section
DENSE_SUFFIX = "@dense"


def digest(
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, algorithm: str | None = None
) -> str:
    """One hash over names, dtypes, shapes and raw bytes, to check that a sender and a
    receiver hold the same base. Order matters (pass tensors in plan order).

    ``algorithm``: ``"xxh3_64"`` (default when ``xxhash`` is importable) or ``"blake2b"``
    (hashlib, 128-bit). The result names it (``"xxh3_64:0123..."``), so digests made with
    different algorithms never compare equal by accident. Device tensors are copied to the
    host one at a time, non-contiguous ones made contiguous.
    """
    if algorithm is None:
        try:
            import xxhash

            algorithm = "xxh3_64"
        except ImportError:
            algorithm = "blake2b"
    if algorithm == "xxh3_64":
        import xxhash

        h = xxhash.xxh3_64()
    elif algorithm == "blake2b":
        h = hashlib.blake2b(digest_size=16)
    else:
        raise ValueError(f"unknown digest algorithm {algorithm!r} (xxh3_64 or blake2b)")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        tensor = tensor.detach()
        meta = f"{name}\0{dtype_name(tensor.dtype)}\0{','.join(map(str, tensor.shape))}".encode()
        h.update(struct.pack("<QQ", len(meta), tensor.numel() * tensor.element_size()))
        h.update(meta)
        if tensor.numel():
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            h.update(memoryview(as_bytes(tensor).numpy()))
    return f"{algorithm}:{h.hexdigest()}"


@dataclass(frozen=True)
class DeltaHeader:
    """How a delta sync's wire entries map to the version's tensors (travels in the
    handshake beside the plan)."""

    #: the version and digest of the base the deltas apply to
    base_version: int
    base_digest: str
    #: the version's tensors, in order
    model: tuple[TensorSpec, ...]
    #: per model tensor: how it travels in the delta section
    kinds: tuple[int, ...]
    #: a dense section follows, for receivers without the base
    dense: bool

    def wire_specs(self, payload_bytes: Sequence[int]) -> list[TensorSpec]:
        """The plan's tensors: the delta section (``payload_bytes`` per delta entry), then
        the dense section."""
        out = []
        for spec, kind, size in zip(self.model, self.kinds, payload_bytes):
            out.append(spec if kind == Kind.DENSE else TensorSpec(spec.name, (size,), "uint8"))
        if self.dense:
            out += [
                TensorSpec(s.name + DENSE_SUFFIX, s.shape, s.dtype)
                for s, k in zip(self.model, self.kinds)
                if k != Kind.DENSE
            ]
        return out

    def to_wire(self) -> dict[str, Any]:
        return {
            "base": self.base_version,
            "digest": self.base_digest,
            "model": [s.to_wire() for s in self.model],
            "kinds": list(self.kinds),
            "dense": self.dense,
        }

    @classmethod
    def from_wire(
        cls, data: Any, wire: Sequence[TensorSpec], max_tensor_bytes: int | None = None
    ) -> DeltaHeader:
        """Parse and check against the plan's wire tensors ``wire`` (already within the
        receiver's limits); ValueError if they do not fit together, or if a model tensor is
        larger than ``max_tensor_bytes``."""
        if not isinstance(data, dict):
            raise ValueError("the delta header is not a map")
        base, digest, model, kinds, dense = (
            data.get(k) for k in ("base", "digest", "model", "kinds", "dense")
        )
        if (
            not isinstance(base, int)
            or isinstance(base, bool)
            or not isinstance(digest, str)
            or len(digest) > 128
        ):
            raise ValueError("the delta header names no valid base")
        if (
            not isinstance(model, list)
            or not isinstance(kinds, list)
            or len(model) != len(kinds)
            or not isinstance(dense, bool)
        ):
            raise ValueError("the delta header's tensors and kinds do not match")
        if len(model) > len(wire):  # one wire entry per model tensor at least: refuse before parsing
            raise ValueError(f"the delta header names {len(model)} tensors, the plan has {len(wire)} entries")
        specs = tuple(TensorSpec.from_wire(s, max_tensor_bytes) for s in model)
        valid = {int(k) for k in Kind}
        if not all(isinstance(k, int) and not isinstance(k, bool) and k in valid for k in kinds):
            raise ValueError("the delta header carries an unknown kind")
        header = cls(base, digest, specs, tuple(kinds), dense)
        expected = header.wire_specs([w.nbytes for w in wire[: len(specs)]])
        if [(s.name, s.shape, s.dtype) for s in expected] != [(w.name, w.shape, w.dtype) for w in wire]:
            raise ValueError("the plan's tensors do not match the delta header")
        return header


def base_digest(specs: Sequence[TensorSpec], base: dict[str, torch.Tensor]) -> str | None:
    """The digest of what ``base`` holds for ``specs``, or None if it does not hold them."""
    items = []
    for spec in specs:
        t = base.get(spec.name)
        if t is None or TensorSpec.of(spec.name, t) != spec:
            return None
        items.append((spec.name, t))
    return digest(items)
