"""Delta codec: one tensor's new bytes as a small change against the base bytes a receiver holds.

Exact by construction: elements are compared as raw bits (integers of the element size),
never as floats, so -0.0 vs 0.0, NaN payloads and every other bit pattern round-trip. The
codec is pure torch tensor ops, so it runs where the tensors live (CPU on every core, CUDA,
Ascend): ``encode(base, new)`` looks at two tensors and returns the cheapest encoding;
``apply(target, kind, payload)`` rewrites ``target`` (holding the base) in place to be
bit-identical to ``new``; ``digest`` checks that both sides hold the same base.

A delta payload is one 1-D uint8 tensor (``weightsync.delta.format``): a 40-byte header,
then sections padded to 8 bytes saying which elements changed (``INDEX``: sorted positions;
``BITMASK``: a bit per element; ``GAPS``: distances between positions in 4/8/16-bit codes
with escapes) and their new values (whole, or only their low bytes plus the exceptions
whose upper bytes changed: a small optimizer step keeps a bf16 value's upper byte 99% of
the time). ``DENSE`` (no delta pays) and ``EMPTY`` (nothing changed) complete the kinds.
The byte layout and measurements are in docs/delta.md; ``encode`` computes every
candidate's exact size from one scan and builds only the smallest. ``apply`` treats the
payload as untrusted (``weightsync.delta.decoder``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from weightsync.delta.format import (
    FORMAT,
    GAP_WIDTHS,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    Kind,
    flat_ints,
    gap_section_bytes,
    index_dtype,
    index_width,
    indices,
    pad8,
    upper_changed,
)
from weightsync.plan import dtype_name

# Elements per step of a scan: large enough that torch's per-call cost and its threads pay
# off, small enough that a step's temporaries (a bool per 8 bytes) stay small.
CHUNK = 1 << 22
KEEP_FLOOR = 1 << 20  # bytes of changes a scan may keep whatever the tensor's size


@dataclass(frozen=True)
class Encoded:
    """The result of ``encode``.

    ``payload``: the bytes to send (1-D uint8, on the inputs' device); None for DENSE, where
    the caller sends the new tensor as it is (``apply(target, Kind.DENSE, as_bytes(new))``
    copies it). ``nbytes``: bytes on the wire for this tensor (the payload's, or the
    tensor's for DENSE). ``sizes``: what each candidate would have cost, by label
    (``"dense"``, ``"index"``, ``"bitmask"``, ``"gaps8"``, ...; a ``"+low"`` suffix: with
    the low-bytes values), for reports; only candidates that were allowed are listed.
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


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` along the first dimension (index_select: about twice the speed of
    indexing on CPU)."""
    return torch.index_select(values, 0, index)


def _diff(
    cb: torch.Tensor, cn: torch.Tensor, e: int, want_low: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Where two chunks of ``flat_ints`` elements differ: sorted int64 positions, the new
    values there and, if ``want_low``, base ^ new there.

    Elements smaller than 8 bytes are compared as 8-byte words first (8/e at once); only
    the changed words are then split into elements, unless most words changed. The values
    come from the gathered words, not from the chunk (fewer scattered reads)."""
    n = cb.shape[0]
    lanes = 8 // e if e < 8 else 1
    if lanes > 1 and n >= 16 and not cb.storage_offset() % lanes and not cn.storage_offset() % lanes:
        words = n // lanes
        wb, wn = cb[: words * lanes].view(torch.int64), cn[: words * lanes].view(torch.int64)
        changed = wb != wn
        # Counting is cheap, listing is not: a dense change goes element by element at once.
        if 4 * int(torch.count_nonzero(changed)) <= words:
            cw = indices(changed)
            gw = _take(wn, cw)
            gn, xor = gw.view(cb.dtype), (_take(wb, cw) ^ gw).view(cb.dtype)
            lane = indices(xor)
            shift = lanes.bit_length() - 1
            pos = (_take(cw, lane >> shift) << shift) | (lane & (lanes - 1))
            new, xor = _take(gn, lane), _take(xor, lane) if want_low else None
            if words * lanes < n:  # the tail that fills no word
                tail = _diff(cb[words * lanes :], cn[words * lanes :], e, want_low)
                pos = torch.cat([pos, tail[0] + words * lanes])
                new = torch.cat([new, tail[1]])
                xor = torch.cat([xor, tail[2]]) if want_low else None
            return pos, new, xor
    diff = cb != cn
    pos = indices(diff if diff.dim() == 1 else diff.any(dim=1))
    new = _take(cn, pos)
    return pos, new, _take(cb, pos) ^ new if want_low else None


@dataclass
class _Changes:
    """The changed elements of one chunk."""

    pos: torch.Tensor  # global positions, int64
    new: torch.Tensor  # their new values (``flat_ints``)
    xor: torch.Tensor | None  # base ^ new (for the low-bytes form)
    gaps: torch.Tensor  # distances from the previous changed element (the first from -1)

    def stats(self, e: int) -> tuple[int, dict[int, int], list[int]]:
        """The last position, the escape codes each gap width needs ((g - 1) // m for a gap
        g, m = 2**width - 1: 0 where none is needed) and, if ``xor`` is kept, how many
        elements changed at byte L or above, for each L in [1, e). Two host syncs."""
        quotients, q = [], self.gaps - 1
        widest = int(q.max())
        for w, prev in zip(GAP_WIDTHS, (1, *GAP_WIDTHS)):
            if widest < (1 << w) - 1:  # no gap needs an escape at this width (or wider)
                quotients.append(q.new_zeros(()))
                continue
            q = q // (((1 << w) - 1) // ((1 << prev) - 1))  # 15 = 1 * 15, 255 = 15 * 17, ...
            quotients.append(q.sum())
        upper = (
            [torch.count_nonzero(upper_changed(self.xor, low)) for low in range(1, e)]
            if self.xor is not None
            else []
        )
        values = torch.stack([self.pos[-1], *quotients, *upper]).tolist()
        return (
            values[0],
            dict(zip(GAP_WIDTHS, values[1 : 1 + len(GAP_WIDTHS)])),
            [0, *values[1 + len(GAP_WIDTHS) :]],
        )


@dataclass
class _Chunk:
    start: int
    last: int  # its last changed element
    escapes: dict[int, int]  # gap width -> escape codes in this chunk
    changes: _Changes | None  # None: over the memory budget, found again when writing


@dataclass
class _Scan:
    """One pass over a tensor: where it changed and what each encoding would cost."""

    bi: torch.Tensor  # base and new as ``flat_ints``
    ni: torch.Tensor
    e: int
    want_low: bool
    chunks: list[_Chunk]  # those with changes
    count: int
    escapes: dict[int, int]  # gap width -> escape codes
    upper: list[int]  # upper[L]: changed elements with a change at byte L or above (L >= 1)

    def changed_chunks(self) -> Iterator[tuple[_Chunk, _Changes]]:
        last = -1
        for chunk in self.chunks:
            ch = chunk.changes or _changes_in(self.bi, self.ni, chunk.start, self.e, self.want_low, last)
            last = chunk.last
            yield chunk, ch


def _changes_in(
    bi: torch.Tensor, ni: torch.Tensor, start: int, e: int, want_low: bool, last: int
) -> _Changes:
    """The changes of the chunk at ``start``; ``last``: the tensor's changed element before it (or -1)."""
    local, new, xor = _diff(bi[start : start + CHUNK], ni[start : start + CHUNK], e, want_low)
    pos = local + start
    return _Changes(pos, new, xor, torch.diff(pos, prepend=pos.new_full((1,), last)))


def _scan(bi: torch.Tensor, ni: torch.Tensor, e: int, low_bytes: bool) -> _Scan:
    """Find the changes a chunk at a time and add up what each encoding needs. The changes
    are kept for writing the payload while they take less than half the tensor's bytes;
    beyond that they are found again then (a second compare rather than more memory)."""
    numel = bi.shape[0]
    want_low = low_bytes and e > 1
    scan = _Scan(bi, ni, e, want_low, [], 0, dict.fromkeys(GAP_WIDTHS, 0), [0] * e)
    budget = max(numel * e // 2, KEEP_FLOOR)
    kept, last = 0, -1
    for start in range(0, numel, CHUNK):
        ch = _changes_in(bi, ni, start, e, want_low, last)
        n = ch.pos.numel()
        if not n:
            continue
        last, esc, upper = ch.stats(e)
        for w in GAP_WIDTHS:
            scan.escapes[w] += esc[w]
        for low in range(1, len(upper)):
            scan.upper[low] += upper[low]
        scan.count += n
        size = n * (16 + e * (2 if want_low else 1))
        keep = kept + size <= budget
        kept += size if keep else 0
        scan.chunks.append(_Chunk(start, last, esc, ch if keep else None))
    return scan


def _put_gaps(codes: torch.Tensor, at: int, gaps: torch.Tensor, width: int, escapes: int) -> int:
    """Write ``gaps`` as codes from ``codes[at]``; return where the next ones go. A gap g
    becomes (g - 1) // m escapes (code 0: "skip m") and then the code g - escapes * m, in
    [1, m] (m = 2**width - 1)."""
    n = gaps.numel() + escapes
    if not escapes:
        codes[at : at + n] = gaps
    else:
        m = (1 << width) - 1
        q = (gaps - 1) // m
        # the buffer is zero: escapes are already in place
        codes[at : at + n][torch.cumsum(q + 1, 0) - 1] = (gaps - q * m).to(codes.dtype)
    return at + n


def _put_bitmask(mask: torch.Tensor, pos: torch.Tensor) -> None:
    """Set the bits of distinct positions (sums of distinct bits are their OR)."""
    bits = torch.ones_like(pos, dtype=torch.uint8) << (pos & 7).to(torch.uint8)
    mask.index_add_(0, pos >> 3, bits)


def _code_buffer(where: torch.Tensor, width: int, ncodes: int) -> torch.Tensor:
    """Where ``_put_gaps`` writes codes: the section itself for 8 and 16 bits (little-endian;
    a 16-bit code above 32767 wraps to the same bits in int16), a byte per code for 4 bits
    (packed by ``_pack_nibbles``)."""
    if width == 8:
        return where[:ncodes]
    if width == 16:
        return where[: 2 * ncodes].view(torch.int16)
    return where.new_zeros(ncodes + ncodes % 2)


def _pack_nibbles(where: torch.Tensor, codes: torch.Tensor) -> None:
    """4-bit codes, two per byte, the first in the low nibble."""
    where[: codes.numel() // 2] = codes[0::2] | (codes[1::2] << 4)


def encode(
    base: torch.Tensor,
    new: torch.Tensor,
    *,
    kinds: Iterable[Kind] | None = None,
    low_bytes: bool = True,
) -> Encoded:
    """The cheapest way to turn ``base`` into ``new`` on a receiver that holds ``base``.

    Both are tensors of one shape, dtype (any dtype of 1 to 16 bytes) and device; the
    payload is made on that device. Non-contiguous ones are made contiguous (a copy).
    ``kinds`` restricts the candidates (default: all; DENSE is chosen only if allowed, so
    ``kinds=[Kind.INDEX]`` forces INDEX even when it is larger than the tensor);
    ``low_bytes=False`` always sends whole values. Ties go to the earlier kind in the order
    DENSE, EMPTY, INDEX, BITMASK, GAPS.

    On CPU each call uses torch's intra-op threads (every core); calls from several threads
    share them.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"base and new differ: {tuple(base.shape)} {dtype_name(base.dtype)} vs {tuple(new.shape)} {dtype_name(new.dtype)}"
        )
    if base.device != new.device:
        raise ValueError(f"base and new are on different devices: {base.device} and {new.device}")
    allowed = set(Kind) if kinds is None else {Kind(k) for k in kinds}
    if not allowed:
        raise ValueError("no kinds allowed")
    numel, e = new.numel(), new.element_size()
    dense = numel * e
    with torch.no_grad():
        scan = _scan(flat_ints(base.detach()), flat_ints(new.detach()), e, low_bytes)
    count = scan.count
    wi = index_width(numel)

    # Values: whole (L = 0), or the low L bytes of each plus the exceptions.
    value_bytes = {0: pad8(count * e)}
    for low in range(1, e):
        if low_bytes and count:
            exc = scan.upper[low]
            value_bytes[low] = pad8(count * low) + pad8(exc * wi) + pad8(exc * (e - low))
    best_low = min(value_bytes, key=lambda k: (value_bytes[k], k))

    # Where: the exact size of each candidate.
    ncodes = {w: count + scan.escapes[w] for w in GAP_WIDTHS}
    where_bytes: dict[tuple[Kind, int], int] = {}  # (kind, gap width) -> section bytes
    if Kind.INDEX in allowed:
        where_bytes[(Kind.INDEX, 0)] = pad8(count * wi)
    if Kind.BITMASK in allowed:
        where_bytes[(Kind.BITMASK, 0)] = pad8((numel + 7) // 8)
    if Kind.GAPS in allowed:
        for w in GAP_WIDTHS:
            where_bytes[(Kind.GAPS, w)] = pad8(gap_section_bytes(w, ncodes[w]))

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
        raise ValueError(
            f"none of the allowed kinds {sorted(k.name for k in allowed)} can encode this change"
        )
    nbytes, _, kind, width = min(options)
    if kind == Kind.DENSE:
        return Encoded(kind, None, dense, dense, numel, count, sizes)
    low = best_low if kind != Kind.EMPTY else 0
    nexc = scan.upper[low] if low else 0
    header = HEADER.pack(
        MAGIC, FORMAT, int(kind), e, width, low, 0, numel, count, ncodes[width] if width else 0, nexc
    )
    out = torch.zeros(nbytes, dtype=torch.uint8, device=new.device)
    out[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    if kind != Kind.EMPTY:
        with torch.no_grad():
            _write(
                out, scan, kind, width, low, nexc, where_bytes[(kind, width)], ncodes[width] if width else 0
            )
    return Encoded(kind, out, nbytes, dense, numel, count, sizes)


def _write(
    out: torch.Tensor, scan: _Scan, kind: Kind, width: int, low: int, nexc: int, wbytes: int, ncodes: int
) -> None:
    """Write the sections of a payload whose header is in place."""
    count, e, numel = scan.count, scan.e, scan.bi.shape[0]
    itype = index_dtype(numel)
    at = HEADER_BYTES
    where = out[at : at + wbytes]
    at += wbytes
    codes = _code_buffer(where, width, ncodes) if kind == Kind.GAPS else None
    if low:
        lows = out[at : at + count * low].view(count, low)
        at += pad8(count * low)
        exc_index = out[at : at + nexc * itype.itemsize].view(itype)
        at += pad8(nexc * itype.itemsize)
        highs = out[at : at + nexc * (e - low)].view(nexc, e - low)
    else:
        values = out[at : at + count * e].view(scan.bi.dtype).view((count, *scan.bi.shape[1:]))
    k = j = code_at = 0  # changed elements, exceptions and gap codes written
    for chunk, ch in scan.changed_chunks():
        n = ch.pos.numel()
        if kind == Kind.INDEX:
            where.view(itype)[k : k + n] = ch.pos
        elif kind == Kind.BITMASK:
            _put_bitmask(where, ch.pos)
        else:
            code_at = _put_gaps(codes, code_at, ch.gaps, width, chunk.escapes[width])
        if low:
            rows = ch.new.view(torch.uint8).view(n, e)
            lows[k : k + n] = rows[:, :low]
            exc = indices(upper_changed(ch.xor, low))
            exc_index[j : j + exc.numel()] = (exc + k).to(itype)
            highs[j : j + exc.numel()] = _take(rows, exc)[:, low:]
            j += exc.numel()
        else:
            values[k : k + n] = ch.new
        k += n
    if kind == Kind.GAPS and width == 4:
        _pack_nibbles(where, codes)
