"""One hash over named tensors (names, dtypes, shapes, raw bytes): how a sender and a
receiver check that they hold the same base before a delta is applied."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping

import torch

from weightsync.plan import as_bytes, dtype_name

def digest(tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, algorithm: str | None = None) -> str:
    """One hash over names, dtypes, shapes and raw bytes, to check that a sender and a
    receiver hold the same base. Order matters (pass tensors in plan order).

    ``algorithm``: ``"xxh3_64"`` (default when ``xxhash`` is importable) or ``"blake2b"``
    (hashlib, 128-bit). The result names it (``"xxh3_64:0123..."``), so digests made with
    different algorithms never compare equal by accident. Device tensors are copied to the
    host one at a time, non-contiguous ones made contiguous.
    """
    if algorithm is None:
        try:
            import xxhash  # noqa: F401

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
