"""Delta codec: one tensor's new bytes as a small change against the base bytes a receiver holds.

Exact by construction: elements are compared as raw bits (integers of the element size),
never as floats, so -0.0 vs 0.0, NaN payloads and every other bit pattern round-trip. The
codec is pure: ``encode(base, new)`` looks at two CPU tensors and returns the cheapest
encoding; ``apply(target, kind, payload)`` rewrites ``target`` (holding the base) in place
to be bit-identical to ``new``; ``digest`` checks that both sides hold the same base.

A delta payload is one 1-D uint8 tensor: a 40-byte header, then sections padded to 8
bytes saying which elements changed (``INDEX``: sorted positions; ``BITMASK``: a bit per
element; ``GAPS``: distances between positions in 4/8/16-bit codes with escapes) and their
new values (whole, or only their low bytes plus the exceptions whose upper bytes changed:
a small optimizer step keeps a bf16 value's upper byte 99% of the time). ``DENSE`` (no delta
pays) and ``EMPTY`` (nothing changed) complete the kinds. The byte layout and measurements
are in docs/delta.md; ``encode`` computes every candidate's exact size from one scan and
builds only the smallest. Validation: ``apply`` treats the payload as untrusted. Every size, count and index is
checked against the payload length and the target before anything is written, a failure
raises ``ValueError``, and the target is left untouched. Decoding allocates at most a
small constant times the payload length (a bitmask unpacks to 8 bytes per payload byte).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from weightsync.digest import digest
from weightsync.plan import dtype_name

__all__ = ["HEADER_BYTES", "Encoded", "Kind", "apply", "digest", "encode"]

MAGIC = b"WD"
FORMAT = 1
_HEADER = struct.Struct("<2sBBBBBBQQQQ")
HEADER_BYTES = _HEADER.size  # 40
GAP_WIDTHS = (4, 8, 16)
_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Kind(enum.IntEnum):
    """How a tensor travels. The values go on the wire; never renumber them."""

    DENSE = 0  #: the tensor's own bytes (``payload`` is None: send the tensor)
    EMPTY = 1  #: unchanged: a header only
    INDEX = 2  #: sorted positions + values
    BITMASK = 3  #: one bit per element + values
    GAPS = 4  #: gaps between positions in 4/8/16-bit codes with escapes + values


@dataclass(frozen=True)
class Encoded:
    """The result of ``encode``.

    ``payload``: the bytes to send (1-D uint8, CPU); None for DENSE, where the caller sends
    the new tensor as it is (``apply(target, Kind.DENSE, as_bytes(new))`` copies it).
    ``nbytes``: bytes on the wire for this tensor (the payload's, or the tensor's for DENSE).
    ``sizes``: what each candidate would have cost, by label (``"dense"``, ``"index"``,
    ``"bitmask"``, ``"gaps8"``, ...; a ``"+low"`` suffix: with the low-bytes values), for
    reports; only candidates that were allowed are listed.
    """

    kind: Kind
    payload: torch.Tensor | None
    nbytes: int
    dense_nbytes: int
    numel: int
    changed: int
    sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def density(self) -> float:
        """Fraction of elements whose bits changed."""
        return self.changed / self.numel if self.numel else 0.0


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _index_width(numel: int) -> int:
    return 4 if numel < 2**31 else 8


def _int_view(target: torch.Tensor) -> torch.Tensor:
    """``target``'s elements as integers of the same size, sharing its memory (any strides).
    16-byte elements (complex128) become (..., 2) int64."""
    e = target.element_size()
    if e in _TORCH_INT_OF_SIZE:
        return target.view(_TORCH_INT_OF_SIZE[e])
    if target.is_complex():
        return torch.view_as_real(target).view(torch.int64)
    raise ValueError(f"cannot apply a delta to dtype {dtype_name(target.dtype)} ({e}-byte elements)")


def _element_rows(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a (numel, element size) uint8 array: no copy if it is contiguous,
    else an integer copy (exact whatever the bits)."""
    if not tensor.numel():
        return np.zeros((0, tensor.element_size()), dtype=np.uint8)
    ints = _int_view(tensor).reshape(-1)
    if ints.stride(0) != 1:  # (contiguous() keeps the stride of a single element)
        ints = torch.empty(ints.shape, dtype=ints.dtype).copy_(ints)
    return ints.view(torch.uint8).numpy().reshape(tensor.numel(), tensor.element_size())


def _as_ints(rows: np.ndarray) -> np.ndarray:
    """(n, e) uint8 rows as n integers of e bytes, or (n, 2) int64 for 16-byte elements."""
    e = rows.shape[1]
    if e in _INT_OF_SIZE:
        return rows.view(_INT_OF_SIZE[e]).reshape(-1)
    return rows.view(np.int64)


CHUNK = 1 << 18  # elements per step of a scan: its temporaries stay in the core's cache
KEEP_FLOOR = 1 << 20  # bytes of changes a scan may keep whatever the tensor's size
_UINT_OF_SIZE = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _changed_in(bi: np.ndarray, ni: np.ndarray, e: int) -> np.ndarray:
    """Positions (int64, sorted) where two chunks of ``_as_ints`` elements differ.

    Elements smaller than 8 bytes are compared as 8-byte words first (8/e at once); only
    the changed words are then compared element by element, unless most words changed."""
    n = bi.shape[0]
    if e >= 8 or n < 16:
        diff = bi != ni
        return np.flatnonzero(diff if diff.ndim == 1 else diff.any(axis=1))
    lanes = 8 // e
    shift = lanes.bit_length() - 1
    words = n // lanes
    wb, wn = bi[: words * lanes].view(np.int64), ni[: words * lanes].view(np.int64)
    cw = np.flatnonzero(wb != wn)
    if 4 * cw.size > words:  # dense change: one pass over the elements is cheaper
        return np.flatnonzero(bi != ni)
    lane = np.flatnonzero(wb[cw].view(bi.dtype) != wn[cw].view(bi.dtype))
    pos = (cw[lane >> shift] << shift) | (lane & (lanes - 1))
    if words * lanes < n:
        pos = np.concatenate([pos, np.flatnonzero(bi[words * lanes :] != ni[words * lanes :]) + words * lanes])
    return pos


def _upper_changed(xor: np.ndarray, e: int, low: int) -> np.ndarray:
    """Which elements (base ^ new, as ``_as_ints`` gives them) changed in a byte at index
    ``low`` or above."""
    if e in _UINT_OF_SIZE:
        return (xor.view(_UINT_OF_SIZE[e]) >> np.uint8(8 * low)) != 0
    return xor.view(np.uint8).reshape(-1, e)[:, low:].any(axis=1)


def _escapes(gaps: np.ndarray, width: int) -> int:
    """Escape codes needed for ``gaps`` (each >= 1) in ``width``-bit codes."""
    m = (1 << width) - 1
    big = gaps[gaps > m]
    return int(((big - 1) // m).sum()) if big.size else 0


def _chunk_escapes(gaps: np.ndarray) -> dict[int, int]:
    widest = int(gaps.max())
    return {w: _escapes(gaps, w) if widest >= 1 << w else 0 for w in GAP_WIDTHS}


@dataclass
class _Changes:
    """The changed elements of one chunk."""

    pos: np.ndarray  # global positions, int32 (int64 for tensors of 2**31 elements or more)
    new: np.ndarray  # their new values (``_as_ints``)
    xor: np.ndarray | None  # base ^ new (for the low-bytes form)


@dataclass
class _Chunk:
    start: int
    escapes: dict[int, int]  # gap width -> escape codes in this chunk
    changes: _Changes | None  # None: over the memory budget, found again when writing


@dataclass
class _Scan:
    """One pass over a tensor: where it changed and what each encoding would cost."""

    bi: np.ndarray  # base and new as ``_as_ints``
    ni: np.ndarray
    e: int
    want_low: bool
    chunks: list[_Chunk]  # those with changes
    count: int
    escapes: dict[int, int]  # gap width -> escape codes
    upper: list[int]  # upper[L]: changed elements with a change at byte L or above (L >= 1)

    def changes(self, chunk: _Chunk) -> _Changes:
        return chunk.changes or _changes_in(self.bi, self.ni, chunk.start, self.e, self.want_low)

    def changed_chunks(self) -> Iterator[tuple[_Chunk, _Changes]]:
        for chunk in self.chunks:
            yield chunk, self.changes(chunk)


def _changes_in(bi: np.ndarray, ni: np.ndarray, start: int, e: int, want_low: bool) -> _Changes:
    cb, cn = bi[start : start + CHUNK], ni[start : start + CHUNK]
    local = _changed_in(cb, cn, e)
    new = cn[local]
    xor = cb[local] ^ new if want_low else None
    ptype = np.int32 if bi.shape[0] < 2**31 else np.int64
    return _Changes((local + start).astype(ptype, copy=False), new, xor)


def _scan(brows: np.ndarray, nrows: np.ndarray, low_bytes: bool) -> _Scan:
    """Find the changes a chunk at a time and add up what each encoding needs. The changes
    are kept for writing the payload while they take less than half the tensor's bytes;
    beyond that they are found again then (a second compare rather than more memory)."""
    numel, e = brows.shape
    bi, ni = _as_ints(brows), _as_ints(nrows)
    want_low = low_bytes and e > 1
    scan = _Scan(bi, ni, e, want_low, [], 0, dict.fromkeys(GAP_WIDTHS, 0), [0] * e)
    budget = max(numel * e // 2, KEEP_FLOOR)
    kept, last = 0, -1
    for start in range(0, numel, CHUNK):
        ch = _changes_in(bi, ni, start, e, want_low)
        if not ch.pos.size:
            continue
        gaps = np.diff(ch.pos, prepend=last)
        last = int(ch.pos[-1])
        esc = _chunk_escapes(gaps)
        for w in GAP_WIDTHS:
            scan.escapes[w] += esc[w]
        if want_low:
            for low in range(1, e):
                scan.upper[low] += int(np.count_nonzero(_upper_changed(ch.xor, e, low)))
        scan.count += ch.pos.size
        size = ch.pos.nbytes + ch.new.nbytes + (ch.xor.nbytes if ch.xor is not None else 0)
        keep = kept + size <= budget
        kept += size if keep else 0
        scan.chunks.append(_Chunk(start, esc, ch if keep else None))
    return scan


def _gap_section_bytes(width: int, ncodes: int) -> int:
    return (ncodes * width + 7) // 8


def _put_gaps(codes: np.ndarray, at: int, gaps: np.ndarray, width: int, escapes: int) -> int:
    """Write ``gaps`` as codes from ``codes[at]``; return where the next ones go. A gap g
    becomes (g - 1) // m escapes (code 0: "skip m") and then the code g - escapes * m, in
    [1, m] (m = 2**width - 1)."""
    n = gaps.size + escapes
    if not escapes:
        codes[at : at + n] = gaps
    else:
        m = (1 << width) - 1
        q = (gaps - 1) // m
        block = codes[at : at + n]
        block[:] = 0
        block[_cumsum(q + 1) - 1] = gaps - q * m
    return at + n


def _put_bitmask(mask: np.ndarray, pos: np.ndarray) -> None:
    """Set the bits of sorted positions (a chunk starts at a multiple of 8 elements, so no
    byte is shared with another chunk)."""
    byte = pos >> 3
    bits = np.left_shift(np.uint8(1), (pos & 7).astype(np.uint8))
    starts = np.flatnonzero(np.diff(byte, prepend=-1))
    mask[byte[starts]] = np.bitwise_or.reduceat(bits, starts)


def encode(
    base: torch.Tensor,
    new: torch.Tensor,
    *,
    kinds: Iterable[Kind] | None = None,
    low_bytes: bool = True,
) -> Encoded:
    """The cheapest way to turn ``base`` into ``new`` on a receiver that holds ``base``.

    Both are CPU tensors of one shape and dtype (any dtype of 1 to 16 bytes); non-contiguous
    ones are made contiguous (a copy). ``kinds`` restricts the candidates (default: all;
    DENSE is chosen only if allowed, so ``kinds=[Kind.INDEX]`` forces INDEX even when it is
    larger than the tensor); ``low_bytes=False`` always sends whole values. Ties go to the
    earlier kind in the order DENSE, EMPTY, INDEX, BITMASK, GAPS.

    Single-threaded numpy that releases the GIL: encode tensors in a thread pool to use
    more cores.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"base and new differ: {tuple(base.shape)} {dtype_name(base.dtype)} vs {tuple(new.shape)} {dtype_name(new.dtype)}"
        )
    if base.device.type != "cpu" or new.device.type != "cpu":
        raise ValueError(f"encode takes CPU tensors, got {base.device} and {new.device}")
    allowed = set(Kind) if kinds is None else {Kind(k) for k in kinds}
    if not allowed:
        raise ValueError("no kinds allowed")
    numel, e = new.numel(), new.element_size()
    dense = numel * e
    scan = _scan(_element_rows(base.detach()), _element_rows(new.detach()), low_bytes)
    count = scan.count
    wi = _index_width(numel)

    # Values: whole (L = 0), or the low L bytes of each plus the exceptions.
    value_bytes = {0: _pad8(count * e)}
    for low in range(1, e):
        if low_bytes and count:
            exc = scan.upper[low]
            value_bytes[low] = _pad8(count * low) + _pad8(exc * wi) + _pad8(exc * (e - low))
    best_low = min(value_bytes, key=lambda k: (value_bytes[k], k))

    # Where: the exact size of each candidate.
    ncodes = {w: count + scan.escapes[w] for w in GAP_WIDTHS}
    where_bytes: dict[tuple[Kind, int], int] = {}  # (kind, gap width) -> section bytes
    if Kind.INDEX in allowed:
        where_bytes[(Kind.INDEX, 0)] = _pad8(count * wi)
    if Kind.BITMASK in allowed:
        where_bytes[(Kind.BITMASK, 0)] = _pad8((numel + 7) // 8)
    if Kind.GAPS in allowed:
        for w in GAP_WIDTHS:
            where_bytes[(Kind.GAPS, w)] = _pad8(_gap_section_bytes(w, ncodes[w]))

    sizes: dict[str, int] = {}
    options: list[tuple[int, int, Kind, int]] = []  # (bytes, tie order, kind, gap width)
    if Kind.DENSE in allowed:
        sizes["dense"] = dense
        options.append((dense, 0, Kind.DENSE, 0))
    if Kind.EMPTY in allowed and count == 0:
        sizes["empty"] = HEADER_BYTES
        options.append((HEADER_BYTES, 1, Kind.EMPTY, 0))
    for (kind, w), wbytes in where_bytes.items():
        label = kind.name.lower() + (str(w) if w else "")
        sizes[label] = HEADER_BYTES + wbytes + value_bytes[0]
        if best_low:
            sizes[label + "+low"] = HEADER_BYTES + wbytes + value_bytes[best_low]
        options.append((HEADER_BYTES + wbytes + value_bytes[best_low], 100 * int(kind) + w, kind, w))
    if not options:
        raise ValueError(f"none of the allowed kinds {sorted(k.name for k in allowed)} can encode this change")
    nbytes, _, kind, width = min(options)
    if kind == Kind.DENSE:
        return Encoded(kind, None, dense, dense, numel, count, sizes)

    low = best_low if kind != Kind.EMPTY else 0
    nexc = scan.upper[low] if low else 0
    header = _HEADER.pack(MAGIC, FORMAT, int(kind), e, width, low, 0, numel, count, ncodes[width] if width else 0, nexc)
    out = np.zeros(nbytes, dtype=np.uint8)
    out[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
    if kind == Kind.EMPTY:
        return Encoded(kind, torch.from_numpy(out), nbytes, dense, numel, count, sizes)

    at = HEADER_BYTES
    where = out[at : at + where_bytes[(kind, width)]]
    at += where_bytes[(kind, width)]
    itype = np.int32 if wi == 4 else np.int64
    if kind == Kind.GAPS:
        # 4-bit codes go one per byte first, packed in pairs at the end
        codes = where[: 2 * ncodes[16]].view("<u2") if width == 16 else where if width == 8 else np.zeros(ncodes[4] + 1, np.uint8)
    if low:
        lows = out[at : at + count * low].reshape(count, low)
        at += _pad8(count * low)
        exc_index = out[at : at + nexc * wi].view(itype)
        at += _pad8(nexc * wi)
        highs = out[at : at + nexc * (e - low)].reshape(nexc, e - low)
    else:
        values = out[at : at + count * e].view(scan.bi.dtype).reshape((count, 2) if e == 16 else (count,))
    k = j = code_at = 0  # changed elements, exceptions and gap codes written
    last = -1
    for chunk, ch in scan.changed_chunks():
        n = ch.pos.size
        if kind == Kind.INDEX:
            where.view(itype)[k : k + n] = ch.pos
        elif kind == Kind.BITMASK:
            _put_bitmask(where, ch.pos)
        else:
            code_at = _put_gaps(codes, code_at, np.diff(ch.pos, prepend=last), width, chunk.escapes[width])
        last = int(ch.pos[-1])
        if low:
            rows = ch.new.view(np.uint8).reshape(n, e)
            lows[k : k + n] = rows[:, :low]
            exc = np.flatnonzero(_upper_changed(ch.xor, e, low))
            exc_index[j : j + exc.size] = exc + k
            highs[j : j + exc.size] = rows[exc, low:]
            j += exc.size
        else:
            values[k : k + n] = ch.new
        k += n
    if kind == Kind.GAPS and width == 4:
        where[: (ncodes[4] + 1) // 2] = codes[0 : ncodes[4] : 2] | (codes[1 : ncodes[4] + 1 : 2] << 4)
    return Encoded(kind, torch.from_numpy(out), nbytes, dense, numel, count, sizes)


# --- apply -------------------------------------------------------------------------------


def _fail(message: str) -> ValueError:
    return ValueError(f"delta payload: {message}")


def _strictly_increasing(values: np.ndarray) -> bool:
    return values.size < 2 or bool(np.all(values[1:] > values[:-1]))


def apply(target: torch.Tensor, kind: Kind | int, payload: torch.Tensor | None) -> None:
    """Apply ``encode``'s payload in place: afterwards ``target`` (which held the base bytes)
    is bit-identical to the encoded ``new``.

    ``target`` is a CPU tensor, contiguous or not (a model parameter's ``.data`` is fine);
    only the changed elements are written, through indexing, so no full-size temporary is
    made. For DENSE, ``payload`` is the new tensor's raw bytes (copied over ``target``).
    Raises ``ValueError`` (and leaves ``target`` untouched) for a payload that does not
    fit ``target`` or is malformed.
    """
    try:
        kind = Kind(kind)
    except ValueError:
        raise _fail(f"unknown kind {kind!r}") from None
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        what = f"{payload.dtype} tensor of shape {tuple(payload.shape)}" if isinstance(payload, torch.Tensor) else type(payload).__name__
        raise _fail(f"expected a 1-D uint8 tensor, got a {what}")
    if payload.device.type != "cpu" or target.device.type != "cpu":
        raise ValueError(f"apply takes CPU tensors, got target on {target.device} and payload on {payload.device}")
    target = target.detach()
    numel, e = target.numel(), target.element_size()
    length = payload.numel()
    if not payload.is_contiguous() or payload.data_ptr() % 8:
        payload = payload.clone()  # read as 8-byte aligned integers below
    if kind == Kind.DENSE:
        if length != numel * e:
            raise _fail(f"DENSE payload has {length} bytes, the target {numel * e}")
        if length:
            ints = _int_view(target)
            ints.copy_(payload.view(ints.dtype).view(ints.shape))
        return

    data = payload.numpy()
    if length < HEADER_BYTES:
        raise _fail(f"{length} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, fmt, hkind, he, width, low, reserved, hnumel, count, ncodes, nexc = _HEADER.unpack(data[:HEADER_BYTES].tobytes())
    if magic != MAGIC or fmt != FORMAT or reserved:
        raise _fail(f"bad header (magic {magic!r}, format {fmt}; expected {MAGIC!r}, {FORMAT})")
    if hkind != kind:
        raise _fail(f"header says kind {hkind}, the caller {kind.name}")
    if he != e or hnumel != numel:
        raise _fail(f"encoded for {hnumel} elements of {he} bytes, the target has {numel} of {e} ({dtype_name(target.dtype)})")
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

    wi = _index_width(numel)
    if kind == Kind.INDEX:
        where_bytes = count * wi
    elif kind == Kind.BITMASK:
        where_bytes = (numel + 7) // 8
    else:
        if ncodes < count:
            raise _fail(f"{ncodes} gap codes for {count} changed elements")
        where_bytes = _gap_section_bytes(width, ncodes)
    value_sections = [count * e] if not low else [count * low, nexc * wi, nexc * (e - low)]
    expected = HEADER_BYTES + _pad8(where_bytes) + sum(_pad8(n) for n in value_sections)
    if length != expected:
        raise _fail(f"{length} bytes, but its header ({kind.name}, {count} changed of {numel}) needs {expected}")
    # From here every section lies inside the payload; sizes below are bounded by its length.

    at = HEADER_BYTES
    for size in [where_bytes, *value_sections]:  # padding is zero: one payload per change
        if data[at + size : at + _pad8(size)].any():
            raise _fail("non-zero padding after a section")
        at += _pad8(size)
    at = HEADER_BYTES
    where = data[at : at + where_bytes]
    at += _pad8(where_bytes)
    pos = _decode_positions(kind, where, numel, count, width, ncodes, wi)

    if not low:
        values = data[at : at + count * e].reshape(count, e)
    else:
        lows = data[at : at + count * low].reshape(count, low)
        at += _pad8(count * low)
        exc = data[at : at + nexc * wi].view(np.int32 if wi == 4 else np.int64)
        at += _pad8(nexc * wi)
        highs = data[at : at + nexc * (e - low)].reshape(nexc, e - low)
        if nexc and (exc[0] < 0 or exc[-1] >= count or not _strictly_increasing(exc)):
            raise _fail(f"exception indices are not increasing within [0, {count})")
        values = None  # built from the target's current bytes below
    if not count:
        return

    # Validated: write. Only ``count`` elements are read and written.
    ints = _int_view(target)  # target.shape, plus (2,) for 16-byte elements
    extra = tuple(ints.shape[target.dim() :])
    pos_t = torch.from_numpy(pos)
    if target.is_contiguous():
        flat, index = ints.reshape((numel, *extra)), (pos_t,)  # a view
    else:
        flat, index = ints, torch.unravel_index(pos_t, tuple(target.shape))
    if values is None:
        elems = flat[index]  # a gather of the changed elements' current (base) bits
        rows = elems.view(torch.uint8).numpy().reshape(count, e)
        rows[:, :low] = lows
        if nexc:
            rows[exc, low:] = highs
    else:
        elems = torch.from_numpy(np.ascontiguousarray(values)).view(flat.dtype).reshape((count, *extra))
    flat.index_put_(index, elems)


def _decode_positions(kind: Kind, where: np.ndarray, numel: int, count: int, width: int, ncodes: int, wi: int) -> np.ndarray:
    """Sorted int64 positions of the changed elements, checked to lie in [0, numel)."""
    if kind == Kind.INDEX:
        pos = where.view(np.int32 if wi == 4 else np.int64).astype(np.int64)
        if count and (pos[0] < 0 or pos[-1] >= numel or not _strictly_increasing(pos)):
            raise _fail(f"INDEX positions are not increasing within [0, {numel})")
        return pos
    if kind == Kind.BITMASK:
        if numel % 8 and where.size and int(where[-1]) >> (numel % 8):
            raise _fail(f"BITMASK has bits set past element {numel}")
        return _bitmask_positions(where, count)
    if width == 4:
        if ncodes % 2 and where[-1] >> 4:
            raise _fail("GAPS has a non-zero padding nibble")
    return _gap_positions(where, width, ncodes, numel, count)


def _bitmask_positions(where: np.ndarray, count: int) -> np.ndarray:
    pos = np.empty(count, dtype=np.int64)
    k = 0
    step = max(CHUNK // 8, 1)
    for start in range(0, where.size, step):
        block = where[start : start + step]
        nonzero = np.flatnonzero(block)  # only bytes with a bit set are unpacked
        if not nonzero.size:
            continue
        bits = np.flatnonzero(np.unpackbits(block[nonzero], bitorder="little"))
        if k + bits.size > count:
            raise _fail(f"BITMASK marks more elements than the {count} its header says")
        pos[k : k + bits.size] = ((nonzero[bits >> 3] + start) << 3) | (bits & 7)
        k += bits.size
    if k != count:
        raise _fail(f"BITMASK marks {k} elements, the header says {count}")
    return pos


# How far each code advances (an escape, code 0, advances 2**w - 1), and whether it marks a
# changed element; for 4-bit codes by packed byte: (low nibble, high nibble).
_ADVANCE8 = np.array([255, *range(1, 256)], dtype=np.int64)
_ADVANCE4 = np.array([[(b & 15) or 15, (b >> 4) or 15] for b in range(256)], dtype=np.int64)
_EMITS4 = np.array([[(b & 15) != 0, (b >> 4) != 0] for b in range(256)], dtype=np.bool_)


def _cumsum(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).cumsum(0).numpy()  # (several times numpy's speed)


def _gap_positions(where: np.ndarray, width: int, ncodes: int, numel: int, count: int) -> np.ndarray:
    pos = np.empty(count, dtype=np.int64)
    k, total, step = 0, -1, max(CHUNK, 2)  # total: the position the codes so far lead to
    for start in range(0, ncodes, step):
        n_codes = min(step, ncodes - start)
        if width == 4:
            packed = where[start // 2 : (start + n_codes + 1) // 2]
            advance = np.take(_ADVANCE4, packed, axis=0).reshape(-1)[:n_codes]
            emits = np.take(_EMITS4, packed, axis=0).reshape(-1)[:n_codes]
        else:
            block = where[start : start + n_codes] if width == 8 else where.view("<u2")[start : start + n_codes]
            emits = block != 0
            if width == 8:
                advance = np.take(_ADVANCE8, block)
            else:
                advance = block.astype(np.int64)
                advance[~emits] = (1 << 16) - 1
        n = int(np.count_nonzero(emits))
        if k + n > count:
            raise _fail(f"GAPS has more positions than the {count} its header says")
        reach = _cumsum(advance)
        reach += total
        total = int(reach[-1])
        pos[k : k + n] = reach if n == n_codes else reach[emits]
        k += n
    if k != count:
        raise _fail(f"GAPS has {k} positions, the header says {count}")
    if ncodes and (not count or int(pos[-1]) != total):
        raise _fail("GAPS ends with an escape")
    if count and pos[-1] >= numel:
        raise _fail(f"GAPS position {int(pos[-1])} is past {numel} elements")
    return pos
