"""The delta payload's wire format, shared by the encoder (``weightsync.delta``) and the
decoder (``weightsync.delta.decoder``).

A payload is one 1-D uint8 tensor: a 40-byte header (``HEADER``), then sections padded to
8 bytes: where the changes are (positions, a bitmask or gap codes), then their values.
Integers are little-endian (every platform torch runs on). The layout is in docs/delta.md.
"""

from __future__ import annotations

import enum
import struct

import torch

from weightsync.plan import dtype_name

MAGIC = b"WD"
FORMAT = 1
#: magic, format, kind, element size, gap width, low bytes, reserved (0), numel, changed
#: elements, gap codes, exceptions
HEADER = struct.Struct("<2sBBBBBBQQQQ")
HEADER_BYTES = HEADER.size  # 40
GAP_WIDTHS = (4, 8, 16)
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Kind(enum.IntEnum):
    """How a tensor travels. The values go on the wire; never renumber them."""

    DENSE = 0  #: the tensor's own bytes (``payload`` is None: send the tensor)
    EMPTY = 1  #: unchanged: a header only
    INDEX = 2  #: sorted positions + values
    BITMASK = 3  #: one bit per element + values
    GAPS = 4  #: gaps between positions in 4/8/16-bit codes with escapes + values


def pad8(n: int) -> int:
    return -(-n // 8) * 8


def index_width(numel: int) -> int:
    """Bytes of a position (and of an exception's index) in a tensor of ``numel`` elements."""
    return 4 if numel < 2**31 else 8


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def gap_section_bytes(width: int, ncodes: int) -> int:
    return (ncodes * width + 7) // 8


def int_view(target: torch.Tensor) -> torch.Tensor:
    """``target``'s elements as integers of the same size, sharing its memory (any strides):
    the codec compares and moves bits, never float values (-0.0, NaN payloads survive).
    16-byte elements (complex128) become (..., 2) int64."""
    e = target.element_size()
    if e in INT_OF_SIZE:
        return target.view(INT_OF_SIZE[e])
    if target.is_complex():
        return torch.view_as_real(target).view(torch.int64)
    raise ValueError(f"cannot apply a delta to dtype {dtype_name(target.dtype)} ({e}-byte elements)")


def flat_ints(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat integer tensor: (numel,), or (numel, 2) int64 for
    16-byte elements. A view if ``tensor`` is contiguous, else an integer copy."""
    ints = int_view(tensor)
    extra = tuple(ints.shape[tensor.dim() :])
    if not tensor.is_contiguous():
        ints = ints.contiguous()
    return ints.reshape((tensor.numel(), *extra))


def indices(mask: torch.Tensor) -> torch.Tensor:
    """The int64 indices where a 1-D ``mask`` is nonzero, in order."""
    return torch.nonzero(mask).squeeze(1)


def upper_changed(xor: torch.Tensor, low: int) -> torch.Tensor:
    """Which elements of ``xor`` (base ^ new, as ``flat_ints`` gives them) changed in a byte
    at index ``low`` or above (a bool per element)."""
    if xor.dim() == 1:  # signed shift: zero exactly when no bit at or above 8 * low is set
        return (xor >> (8 * low)) != 0
    e = xor.shape[1] * xor.element_size()
    return xor.view(torch.uint8).reshape(-1, e)[:, low:].ne(0).any(dim=1)
