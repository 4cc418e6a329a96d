"""End-to-end verification of bucket bytes (config key ``verify``).

The sender checksums each bucket as it leaves (``weightsync.sender.packer.producer``), every
receiver each bucket as it arrives (``Checks``); the sender's list follows the transfer on
the control channel and a receiver compares. A delta sync checks the tensors a receiver
reconstructs instead (``weightsync.delta.receive_stage``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

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


def tensor_digest(t: torch.Tensor) -> str:
    """A digest of one tensor's bytes (a view's: only the elements it covers)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def named_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``dtype|shape|digest`` of each tensor, by name: equal only for the same bytes read
    as the same dtype and shape."""
    return {name: f"{t.dtype}|{tuple(t.shape)}|{tensor_digest(t)}" for name, t in named}


class Checks:
    """``verify`` on a receiver, for one sync: each bucket's checksum as it arrives, held
    against the sender's list that follows the transfer; ``who`` and ``version`` name what
    failed in the message."""

    def __init__(self, mode: str, who: str, version: int) -> None:
        self.mode, self.who, self.version = mode, who, version
        self.fn = checksum_fn(mode)
        self.sums: list[tuple[Any, int]] = []  # (bucket, checksum), in arrival order

    @property
    def on(self) -> bool:
        return self.fn is not None

    def add(self, bucket: Any, buffer: torch.Tensor) -> None:
        if self.fn is not None:
            self.sums.append((bucket, self.fn(buffer)))

    def sent(self, channel: Any, deadline: Any) -> dict[str, Any]:
        """The sender's ``verify`` message (empty when verification is off)."""
        return channel.recv(deadline, expect="verify") if self.on else {}

    def buckets(self, specs: Sequence[Any], sent: Any) -> str | None:
        """Our checksums against the sender's; the damage (naming the tensors), or None."""
        if not self.on:
            return None
        if not isinstance(sent, list) or len(sent) != len(self.sums):
            return f"{self.who}: the sender's checksums of version {self.version} do not cover its {len(self.sums)} buckets"
        bad = [bucket for (bucket, mine), theirs in zip(self.sums, sent) if mine != theirs]
        if not bad:
            return None
        names = sorted({specs[p.tensor].name for b in bad for p in b.pieces})
        return self.failed(
            f"in {len(bad)} bucket(s) {[b.index for b in bad][:8]}; tensors affected: {', '.join(names[:16])}"
            + (f" and {len(names) - 16} more" if len(names) > 16 else "")
        )

    def failed(self, detail: str) -> str:
        return f"{self.who}: version {self.version} failed verification ({self.mode}) {detail}"
