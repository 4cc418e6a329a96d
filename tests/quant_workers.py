"""Process bodies of tests/test_quant.py (importable under spawn): receivers holding some
tensors in FP8 with block scales (float32 or UE8M0) and the rest as the trainer holds them."""

import torch
import workers

from weightsync import EngineConfig, ModuleSink, Receiver
from weightsync.quant.fp8 import scale_shape

# Shapes that are not multiples of 128, a 1-D tensor, an expert stack, and an embedding and
# norm that a quantized replica keeps in bf16. Values differ per tensor and per version, so a
# scale or a block landed in the wrong place shows.
SHAPES = {
    "embed.weight": (300, 64),
    "layers.0.proj.weight": (200, 130),
    "layers.0.mlp.weight": (384, 256),
    "layers.0.experts.gate_up_proj": (3, 96, 130),
    "layers.0.norm.weight": (64,),
}
#: what an FP8 receiver holds quantized (as vLLM keeps embeddings and norms in bf16)
QUANTIZED = ("layers.0.proj.weight", "layers.0.mlp.weight", "layers.0.experts.gate_up_proj")
BLOCK = (128, 128)


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + version)
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        t = torch.randn(shape, generator=g) * (1 + i) + version
        if t.dim() > 1:  # one block of each matrix far larger than the rest: its own scale
            t.view(-1, t.shape[-1])[:5, :7] *= 40
        out[name] = t.to(torch.bfloat16)
    return out


def sparse_weights(version: int) -> dict[str, torch.Tensor]:
    """``weights(1)`` with one row of each matrix changed per later version (an RL step
    changes few elements): most FP8 bytes and scales stay, as deltas need."""
    out = weights(1)
    for name, t in out.items():
        if t.dim() > 1 and version > 1:
            rows = t.view(-1, t.shape[-1])
            rows[version % rows.shape[0]] += version
    return out


def holding(fp8: bool) -> dict[str, torch.Tensor]:
    """A replica's tensors: bf16, or FP8 with scales for ``QUANTIZED``."""
    held = {}
    for name, shape in SHAPES.items():
        if fp8 and name in QUANTIZED:
            held[name] = torch.zeros(shape, dtype=torch.float8_e4m3fn)
            held[name + "_scale_inv"] = torch.zeros(scale_shape(shape, BLOCK), dtype=torch.float32)
        else:
            held[name] = torch.zeros(shape, dtype=torch.bfloat16)
    return held


def run_receiver(address, rank, overrides, versions, queue, form="bf16"):
    """``form``: ``bf16``, ``fp8`` (float32 scales), ``ue8m0`` or ``bf16-scales`` (a scale
    layout the trainer does not make). Reports ``(rank, version, digests, missing)`` per
    version, or ``(rank, "error", message)``."""
    held = holding(form != "bf16")
    if form == "bf16-scales":
        for name in QUANTIZED:
            held[name + "_scale_inv"] = held[name + "_scale_inv"].to(torch.bfloat16)
    sink = ModuleSink(held, ue8m0=form == "ue8m0")
    try:
        with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
            for v in versions:
                stats = receiver.load_into(sink, version=v)
                queue.put(
                    (
                        rank,
                        v,
                        {n: workers.digest(t) for n, t in held.items()},
                        stats.missing,
                        stats.delta_base,
                    )
                )
    except Exception as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))
