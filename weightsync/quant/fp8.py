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
    scales = _scales(stack, block, rows, cols)
    if ue8m0:
        scales = torch.pow(2.0, torch.ceil(torch.log2(scales.abs())))
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


def _scales(stack: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Each block's scale: its absolute maximum (float32, clamped at ``AMAX_FLOOR``) over
    ``FP8_MAX``; [e, rows, cols]."""
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
    amax = per_row.view(e, rows, bn, cols).amax(dim=2).float().clamp(min=AMAX_FLOOR)
    return amax / FP8_MAX


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """float32 values of a block-quantized tensor (for checks and reports, not for serving)."""
    expanded = scales.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * expanded[..., : q.shape[-2], : q.shape[-1]]
