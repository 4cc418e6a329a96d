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
    engine's ``weight_scale_inv``). On ``x``'s device; ``x`` is left as it is."""
    if x.dim() not in (2, 3):
        raise ValueError(f"block FP8 takes a 2-D tensor or a 3-D stack, got shape {tuple(x.shape)}")
    stack = x if x.dim() == 3 else x.unsqueeze(0)
    e, n, k = stack.shape
    bn, bk = block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    # Zeros pad the last blocks: they never raise a block's maximum (it is clamped above 0).
    padded = F.pad(stack, (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(e, rows, bn, cols, bk)
    amax = blocks.abs().float().amax(dim=(2, 4), keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale.abs())))
    # the block times the float32 reciprocal (x promotes to float32), as the reference does
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    q = q.view(e, rows * bn, cols * bk)[:, :n, :k].contiguous()
    scales = scale.view(e, rows, cols)
    if x.dim() == 2:
        return q[0], scales[0]
    return q, scales


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """float32 values of a block-quantized tensor (for checks and reports, not for serving)."""
    expanded = scales.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * expanded[..., : q.shape[-2], : q.shape[-1]]
