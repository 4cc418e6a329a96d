"""A replica's tensors held in FP8 as vLLM's block-FP8 layers hold them, for receivers that
are not an engine (the demo's and the bench's rollout processes, tests) and for checking
what they hold.

Quantized by default (``quantizable``): each decoder layer's matrices and expert stacks, as
vLLM's FP8 methods quantize linear and MoE layers; embeddings, norms, routers and the output
head stay as the trainer holds them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from weightsync.plan import TensorSpec
from weightsync.wire.forms import FLOATS, FP8, SCALE_SUFFIX
from weightsync.wire.fp8 import quantize_blocks, scale_shape

_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def quantizable(spec: TensorSpec) -> bool:
    """Whether an FP8 replica holds ``spec`` quantized (see the module's docstring)."""
    return (
        spec.dtype in FLOATS
        and len(spec.shape) in (2, 3)
        and _LAYER.search(spec.name) is not None
        and not spec.name.endswith(("norm.weight", "mlp.gate.weight"))
    )


def fp8_holding(
    specs: Iterable[TensorSpec], block: tuple[int, int] = (128, 128), device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Zeroed tensors of a replica holding ``specs`` in FP8 where ``quantizable``: ``P`` in
    ``float8_e4m3fn`` with ``P_scale_inv`` (float32) beside it, the rest as specified.
    ``ModuleSink`` over them declares those forms."""
    return {
        s.name: torch.zeros(s.shape, dtype=s.torch_dtype, device=device) for s in fp8_wire_specs(specs, block)
    }


def fp8_expected(
    tensors: Mapping[str, torch.Tensor], block: tuple[int, int] = (128, 128)
) -> dict[str, torch.Tensor]:
    """What a replica made by ``fp8_holding`` holds once ``tensors`` reached it (the keys in
    the same order): the quantized ones' bytes and scales, the rest as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quantizable(TensorSpec.of(name, t)):
            out[name], out[name + SCALE_SUFFIX] = quantize_blocks(t, block)
        else:
            out[name] = t
    return out


def fp8_wire_specs(specs: Iterable[TensorSpec], block: tuple[int, int] = (128, 128)) -> list[TensorSpec]:
    """What a replica made by ``fp8_holding`` holds, and so what a sync to such replicas
    carries: the quantized tensors' FP8 bytes and scales in their place (estimates and link
    ceilings count these bytes)."""
    out: list[TensorSpec] = []
    for spec in specs:
        if quantizable(spec):
            shape = scale_shape(spec.shape, block)
            out += [
                TensorSpec(spec.name, spec.shape, FP8),
                TensorSpec(spec.name + SCALE_SUFFIX, shape, "float32"),
            ]
        else:
            out.append(spec)
    return out
