"""End-to-end verification of bucket bytes (config key ``verify``).

The sender checksums each bucket as it leaves, every receiver each bucket as it arrives;
the sender's list follows the transfer on the control channel and a receiver compares.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch


def checksum_fn(mode: str) -> Callable[[torch.Tensor], int] | None:
    """The checksum of a uint8 tensor's bytes for ``mode`` (None for ``off``)."""
    if mode == "off":
        return None
    if mode == "crc32":
        return lambda t: zlib.crc32(_host_bytes(t))
    if mode == "xxh3":
        import xxhash

        return lambda t: xxhash.xxh3_64_intdigest(_host_bytes(t))
    raise ValueError(f"unknown verify mode {mode!r}")


def _host_bytes(t: torch.Tensor) -> memoryview:
    # Device buckets are copied to the host: checksums run on the CPU.
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.numpy())
