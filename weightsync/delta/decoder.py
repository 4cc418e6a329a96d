"""Decoding a delta payload into the base a receiver holds, in place (``apply``).

The payload is untrusted (it came off a wire): every size, count and index is checked
against the payload's length and the target before anything is written; a failure raises
``ValueError`` and leaves the target untouched. Decoding allocates at most a small constant
times the payload's length (positions as int64: 16 bytes per 4-bit gap code at most).
Torch tensor ops throughout, so a payload is applied where the target lives (CPU, CUDA,
Ascend); only the 40-byte header is read on the host.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.delta.format import (
    FORMAT,
    GAP_WIDTHS,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    Kind,
    gap_section_bytes,
    index_dtype,
    index_width,
    indices,
    int_view,
    pad8,
)
from weightsync.plan import dtype_name

__all__ = ["apply"]


def _fail(message: str) -> ValueError:
    return ValueError(f"delta payload: {message}")


def _increasing_within(values: torch.Tensor, start: int, end: int) -> bool:
    """Strictly increasing, and every value in [start, end)."""
    if not values.numel():
        return True
    if int(values[0]) < start or int(values[-1]) >= end:
        return False
    return values.numel() < 2 or bool((values[1:] > values[:-1]).all())


def apply(target: torch.Tensor, kind: Kind | int, payload: torch.Tensor | None) -> None:
    """Apply ``encode``'s payload in place: afterwards ``target`` (which held the base bytes)
    is bit-identical to the encoded ``new``.

    ``target`` is contiguous or not (a model parameter's ``.data`` is fine), on the
    payload's device; only the changed elements are written, through indexing, so no
    full-size temporary is made. For DENSE, ``payload`` is the new tensor's raw bytes
    (copied over ``target``). Raises ``ValueError`` (and leaves ``target`` untouched) for a
    payload that does not fit ``target`` or is malformed.
    """
    try:
        kind = Kind(kind)
    except ValueError:
        raise _fail(f"unknown kind {kind!r}") from None
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        what = (
            f"{payload.dtype} tensor of shape {tuple(payload.shape)}"
            if isinstance(payload, torch.Tensor)
            else type(payload).__name__
        )
        raise _fail(f"expected a 1-D uint8 tensor, got a {what}")
    if payload.device != target.device:
        raise ValueError(f"target and payload are on different devices: {target.device} and {payload.device}")
    with torch.no_grad():
        _apply(target.detach(), kind, payload)


def _apply(target: torch.Tensor, kind: Kind, data: torch.Tensor) -> None:
    numel, e = target.numel(), target.element_size()
    length = data.numel()
    if not data.is_contiguous() or data.data_ptr() % 8:
        data = data.clone()  # read as 8-byte aligned integers below
    if kind == Kind.DENSE:
        if length != numel * e:
            raise _fail(f"DENSE payload has {length} bytes, the target {numel * e}")
        if length:
            ints = int_view(target)
            ints.copy_(data.view(ints.dtype).view(ints.shape))
        return

    if length < HEADER_BYTES:
        raise _fail(f"{length} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, fmt, hkind, he, width, low, reserved, hnumel, count, ncodes, nexc = HEADER.unpack(
        bytes(data[:HEADER_BYTES].cpu().numpy())
    )
    if magic != MAGIC or fmt != FORMAT or reserved:
        raise _fail(f"bad header (magic {magic!r}, format {fmt}; expected {MAGIC!r}, {FORMAT})")
    if hkind != kind:
        raise _fail(f"header says kind {hkind}, the caller {kind.name}")
    if he != e or hnumel != numel:
        raise _fail(
            f"encoded for {hnumel} elements of {he} bytes, the target has {numel} of {e} ({dtype_name(target.dtype)})"
        )
    if count > numel:
        raise _fail(f"{count} changed elements of {numel}")
    if kind == Kind.GAPS:
        if width not in GAP_WIDTHS:
            raise _fail(f"gap width {width} (allowed: {GAP_WIDTHS})")
    elif width or ncodes:
        raise _fail(f"gap width {width} and {ncodes} gap codes in a {kind.name} payload")
    if not 0 <= low < max(e, 1) or (low == 0 and nexc):
        raise _fail(f"{low} low bytes with {nexc} exceptions for {e}-byte elements")
    if nexc > count:
        raise _fail(f"{nexc} exceptions for {count} changed elements")
    if kind == Kind.EMPTY:
        if count or low or length != HEADER_BYTES:
            raise _fail(f"EMPTY with {count} changed elements and {length} bytes")
        return

    wi = index_width(numel)
    if kind == Kind.INDEX:
        where_bytes = count * wi
    elif kind == Kind.BITMASK:
        where_bytes = (numel + 7) // 8
    else:
        if ncodes < count:
            raise _fail(f"{ncodes} gap codes for {count} changed elements")
        where_bytes = gap_section_bytes(width, ncodes)
    value_sections = [count * e] if not low else [count * low, nexc * wi, nexc * (e - low)]
    expected = HEADER_BYTES + pad8(where_bytes) + sum(pad8(n) for n in value_sections)
    if length != expected:
        raise _fail(
            f"{length} bytes, but its header ({kind.name}, {count} changed of {numel}) needs {expected}"
        )
    # From here every section lies inside the payload; sizes below are bounded by its length.

    at = HEADER_BYTES
    for size in [where_bytes, *value_sections]:  # padding is zero: one payload per change
        if bool(data[at + size : at + pad8(size)].any()):
            raise _fail("non-zero padding after a section")
        at += pad8(size)
    at = HEADER_BYTES
    where = data[at : at + where_bytes]
    at += pad8(where_bytes)
    pos = _positions(kind, where, numel, count, width, ncodes)

    itype = index_dtype(numel)
    values = lows = exc = highs = None
    if not low:
        values = data[at : at + count * e]
    else:
        lows = data[at : at + count * low].view(count, low)
        at += pad8(count * low)
        exc = data[at : at + nexc * wi].view(itype).long()
        at += pad8(nexc * wi)
        highs = data[at : at + nexc * (e - low)].view(nexc, e - low)
        if not _increasing_within(exc, 0, count):
            raise _fail(f"exception indices are not increasing within [0, {count})")
    if not count:
        return

    # Validated: write. Only ``count`` elements are written.
    ints = int_view(target)  # target.shape, plus (2,) for 16-byte elements
    if not target.is_contiguous():  # (a strided view: elements by their coordinates)
        _write_strided(
            ints, torch.unravel_index(pos, tuple(target.shape)), count, e, values, low, lows, exc, highs
        )
    elif low:  # the low bytes in place, then the exceptions' upper bytes: no gather
        rows = ints.reshape(-1).view(torch.uint8).view(numel, e)
        rows[:, :low].index_put_((pos,), lows)
        if nexc:
            rows[:, low:].index_put_((pos.index_select(0, exc),), highs)
    else:
        flat = ints.reshape((numel, *ints.shape[target.dim() :]))
        flat.index_put_((pos,), values.view(flat.dtype).view((count, *flat.shape[1:])))


def _write_strided(
    ints: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    count: int,
    e: int,
    values: torch.Tensor | None,
    low: int,
    lows: torch.Tensor | None,
    exc: torch.Tensor | None,
    highs: torch.Tensor | None,
) -> None:
    """``_apply``'s write into a non-contiguous target, element by element."""
    if low:
        elems = ints[index]  # a gather of the changed elements' current (base) bits
        rows = elems.view(torch.uint8).view(count, e)
        rows[:, :low] = lows
        if exc.numel():
            rows[exc, low:] = highs
    else:
        elems = values.view(ints.dtype).view((count, *ints.shape[len(index) :]))
    ints.index_put_(index, elems)


def _positions(
    kind: Kind, where: torch.Tensor, numel: int, count: int, width: int, ncodes: int
) -> torch.Tensor:
    """Sorted int64 positions of the changed elements, checked to lie in [0, numel)."""
    if kind == Kind.INDEX:
        pos = where.view(index_dtype(numel)).long()
        if not _increasing_within(pos, 0, numel):
            raise _fail(f"INDEX positions are not increasing within [0, {numel})")
        return pos
    if kind == Kind.BITMASK:
        return _bitmask_positions(where, numel, count)
    return _gap_positions(where, width, ncodes, numel, count)


_BIT = 1 << torch.arange(8, dtype=torch.uint8)  # bit i of a byte is element 8 * byte + i


_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int64)


def _popcount(where: torch.Tensor) -> int:
    return int(_POPCOUNT.to(where.device)[where.long()].sum())


def _bitmask_positions(where: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    if numel % 8 and where.numel() and int(where[-1]) >> (numel % 8):
        raise _fail(f"BITMASK has bits set past element {numel}")
    marked = _popcount(where)
    if marked != count:
        raise _fail(f"BITMASK marks {marked} elements, the header says {count}")
    nonzero = indices(where)  # only bytes with a bit set are unpacked
    bits = (where[nonzero].unsqueeze(1) & _BIT.to(where.device)) != 0
    rows, lanes = torch.nonzero(bits, as_tuple=True)
    return (nonzero[rows] << 3) | lanes


def _gap_positions(where: torch.Tensor, width: int, ncodes: int, numel: int, count: int) -> torch.Tensor:
    """Positions from gap codes: each code advances the position by itself, an escape
    (code 0) by 2**width - 1 without marking an element."""
    if width == 4:
        if ncodes % 2 and int(where[-1]) >> 4:
            raise _fail("GAPS has a non-zero padding nibble")
        codes = torch.stack([where & 15, where >> 4], dim=1).reshape(-1)[:ncodes].long()
    elif width == 8:
        codes = where.long()
    else:
        pairs = where.view(-1, 2).long()
        codes = pairs[:, 0] | (pairs[:, 1] << 8)
    emits = codes != 0
    marked = int(torch.count_nonzero(emits))
    if marked != count:
        raise _fail(f"GAPS has {marked} positions, the header says {count}")
    if ncodes and not bool(emits[-1]):
        raise _fail("GAPS ends with an escape")
    if marked == ncodes:  # no escapes: the running sum of the codes is the positions
        pos = codes.cumsum(0) - 1
    else:
        reach = torch.where(emits, codes, (1 << width) - 1).cumsum(0) - 1
        # The i-th marking code is code i + (escapes before it): escapes are few, so this
        # beats selecting by the mask.
        escapes = indices(~emits)
        before = torch.zeros(count, dtype=torch.int64, device=codes.device)
        before.index_add_(
            0, escapes - torch.arange(escapes.numel(), device=codes.device), torch.ones_like(escapes)
        )
        pos = reach.index_select(0, torch.arange(count, device=codes.device) + before.cumsum(0))
    if count and int(pos[-1]) >= numel:
        raise _fail(f"GAPS position {int(pos[-1])} is past {numel} elements")
    return pos


def apply_many(items: Iterable[tuple[torch.Tensor, Kind | int, torch.Tensor | None]]) -> None:
    """``apply`` each (target, kind, payload), EMPTY ones skipped. Host targets are applied on
    every core at once (torch releases the GIL in its kernels; its many small ops would
    leave the other cores idle), device ones in order. The first failure is raised once the
    others finished; targets are distinct tensors."""
    work = [item for item in items if Kind(item[1]) != Kind.EMPTY]
    workers = min(os.cpu_count() or 1, len(work))
    if workers <= 1 or any(target.device.type != "cpu" for target, _, _ in work):
        for target, kind, payload in work:
            apply(target, kind, payload)
        return
    work.sort(key=lambda item: -item[0].numel())  # the largest first: the pool ends together
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightsync-apply") as pool:
        for future in [pool.submit(apply, *item) for item in work]:
            future.result()
