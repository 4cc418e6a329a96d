"""FP8 (e4m3) in blocks, as vLLM and DeepSeek hold it, quantized once on the trainer.

The convention is vLLM 0.32's ``vllm.utils.deep_gemm.per_block_cast_to_fp8`` (the one its
block-FP8 checkpoints and DeepGEMM use): per block of ``block`` rows by columns (128 x 128 by
default; the last blocks of a dimension that is not a multiple are smaller), the absolute
maximum in float32, clamped below at 1e-4; the scale is that over 448 (e4m3's largest
finite value), rounded up to a power of two for UE8M0 scales; the block is multiplied by
the scale's float32 reciprocal and cast to ``float8_e4m3fn``. The float32 scales are what
the engine calls ``weight_scale_inv`` (it multiplies by them to dequantize), shaped
``[ceil(n / block_n), ceil(k / block_k)]``. ``tests/test_quant.py`` checks the bytes against
vLLM's function. An expert stack ``[E, n, k]`` is quantized expert by expert (scales
``[E, ceil(n / block_n), ceil(k / block_k)]``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: e4m3's largest finite value
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: the smallest block maximum a scale is computed from (an all-zero block keeps a finite scale)
AMAX_FLOOR = 1e-4


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the scales of a 2-D tensor (or a stack of them) quantized in ``block``s."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def quantize_blocks(
    x: torch.Tensor, block: tuple[int, int] = (128, 128), ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D, or 3-D: a stack) in FP8 e4m3 by blocks, and its float32 scales (the
    engine's ``weight_scale_inv``). On ``x``'s device; ``x`` is left as it is.

    The same arithmetic as the reference, in fewer passes over memory: block maxima from
    ``|x|`` in ``x``'s own dtype (the maximum of exactly converted values converts exactly),
    then the product and the cast a strip of row blocks at a time, so the float32 product
    stays in cache (several times the reference's speed on a CPU: BENCHMARKS.md)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"block FP8 takes a 2-D tensor or a 3-D stack, got shape {tuple(x.shape)}")
    stack = x if x.dim() == 3 else x.unsqueeze(0)
    e, n, k = stack.shape
    bn, bk = block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    scales = scales_of(_amax(stack, block, rows, cols), ue8m0)
    # each column's reciprocal, per row block: the block times the float32 reciprocal (x
    # promotes to float32), as the reference does
    inverse = (1.0 / scales).repeat_interleave(bk, dim=-1)[..., :k]  # [e, rows, k]
    q = torch.empty(stack.shape, dtype=torch.float8_e4m3fn, device=x.device)
    step = max(1, _STRIP // max(bn * k, 1))  # row blocks per strip
    for i in range(e):
        for r in range(0, rows, step):
            top, bottom = r * bn, min(n, (r + step) * bn)
            strip = stack[i, top:bottom].unflatten(0, (-1, bn)) if (bottom - top) % bn == 0 else None
            if strip is not None:
                q[i, top:bottom].view(-1, bn, k).copy_(strip * inverse[i, r : r + step, None, :])
            else:  # the last, shorter row block
                for b in range(r, min(rows, r + step)):
                    lo, hi = b * bn, min(n, (b + 1) * bn)
                    q[i, lo:hi].copy_(stack[i, lo:hi] * inverse[i, b])
    if x.dim() == 2:
        return q[0], scales[0]
    return q, scales


#: elements of x per strip whose float32 product is made at once (4 MiB of it)
_STRIP = 1 << 20


def scales_of(amax: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """Blocks' scales from their absolute maxima: clamped below at ``AMAX_FLOOR``, over
    ``FP8_MAX``, for UE8M0 rounded up to a power of two (float32)."""
    scales = amax.float().clamp(min=AMAX_FLOOR) / FP8_MAX
    return torch.pow(2.0, torch.ceil(torch.log2(scales))) if ue8m0 else scales


def _amax(stack: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Each block's absolute maximum, float32; [e, rows, cols]."""
    e, n, k = stack.shape
    bn, bk = block
    whole = k // bk * bk
    parts = []  # per row: the maximum of each column block
    if whole:
        parts.append(stack[..., :whole].unflatten(-1, (-1, bk)).abs().amax(dim=-1))
    if whole < k:
        parts.append(stack[..., whole:].abs().amax(dim=-1, keepdim=True))
    per_row = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # [e, n, cols]
    # zero rows pad the last row block: they never raise a maximum (clamped above 0)
    per_row = F.pad(per_row, (0, 0, 0, rows * bn - n))
    return per_row.view(e, rows, bn, cols).amax(dim=2).float()


def box_amax(x: torch.Tensor, starts: tuple[int, int], block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The absolute maxima, over the part of each block that ``x`` holds, of the blocks of a
    larger tensor that ``x`` meets: ``x`` is a box of it ([..., h, w]; a stack's leading
    dimension as it is) whose first element is at ``starts`` (row, column) of the whole.
    float32 [..., blocks down, blocks across], from the block holding ``x``'s first element
    (none where ``x`` is empty). A block cut between boxes gets its maximum as the largest of
    theirs (``weightsync.quant.sharded``)."""
    *lead, h, w = x.shape
    bn, bk = block
    top, left = starts[0] % bn, starts[1] % bk
    if not h or not w:
        return torch.zeros((*lead, 0, 0), dtype=torch.float32, device=x.device)
    rows, cols = math.ceil((top + h) / bn), math.ceil((left + w) / bk)
    stack = x.reshape(-1, h, w)
    if not top and not left:
        return _amax(stack, block, rows, cols).view(*lead, rows, cols)
    out = torch.empty((stack.shape[0], rows, cols), dtype=torch.float32, device=x.device)
    for i in range(stack.shape[0]):
        for b in range(rows):  # a band of one block's rows, zero columns before and after
            band = stack[i, max(0, b * bn - top) : min(h, (b + 1) * bn - top)]
            band = F.pad(band, (left, cols * bk - left - w))
            out[i, b] = band.abs().unflatten(-1, (cols, bk)).amax(dim=-1).amax(dim=0).float()
    return out.view(*lead, rows, cols)


def quantize_box(
    x: torch.Tensor, starts: tuple[int, int], scales: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``x``, a box of a larger tensor whose first element is at ``starts`` (row, column) of
    the whole, in FP8 e4m3 with the whole tensor's block ``scales`` ([..., blocks down,
    blocks across] of the whole; a stack's leading dimension as ``x``'s): the bytes
    ``quantize_blocks`` gives those elements of the whole, given the same scales."""
    *_, h, w = x.shape
    bn, bk = block
    stack, grid = x.reshape(-1, h, w), scales.reshape(-1, *scales.shape[-2:])
    q = torch.empty(stack.shape, dtype=torch.float8_e4m3fn, device=x.device)
    inverse = 1.0 / grid  # as the reference: the block times its scale's float32 reciprocal
    r0, c0 = starts
    for i in range(stack.shape[0]):
        for b in range(r0 // bn, math.ceil((r0 + h) / bn)):
            lo, hi = max(0, b * bn - r0), min(h, (b + 1) * bn - r0)
            across = inverse[i, b].repeat_interleave(bk)[c0 : c0 + w]
            q[i, lo:hi].copy_(stack[i, lo:hi] * across)
    return q.view(x.shape)


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """float32 values of a block-quantized tensor (for checks and reports, not for serving)."""
    expanded = scales.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * expanded[..., : q.shape[-2], : q.shape[-1]]
