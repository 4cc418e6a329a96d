"""The quantized forms a receiver may hold a tensor in, as data both sides read.

A receiver declares, per tensor, the form it holds (``Form``): today FP8 e4m3 in blocks
with float32 scales (``weightsync.wire.fp8``; vLLM's and DeepSeek's ``X.weight`` with
``X.weight_scale_inv``), the scales either plain or UE8M0 (powers of two). A receiver with
``load_into(module)`` declares it by holding such parameters (``declared_forms``): an
``float8_e4m3fn`` tensor ``P`` beside a tensor ``P_scale_inv``. The trainer quantizes each
declared tensor once per sync and sends it as two wire entries named with the form's tag
(``wire_name``: ``P@fp8-128x128`` and ``P_scale_inv@fp8-128x128``), so receivers holding
other forms, or the tensor unquantized, take their own entries from the same sync.

What a form cannot be produced from (a scale layout the trainer does not know, a block
grid that does not fit the tensor) is said by ``Form.problem``; the trainer refuses such a
declaration in the handshake, naming the tensor and the form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.plan import Plan, TensorSpec, dtype_name
from weightsync.wire.fp8 import scale_shape

#: what separates a tensor's name from its form's tag in a wire entry's name
TAG = "@"
#: the scale tensor beside a quantized one (vLLM, DeepSeek, transformers' FineGrainedFP8)
SCALE_SUFFIX = "_scale_inv"
#: the dtypes of scales the trainer produces
SCALES = ("float32", "ue8m0")
FP8 = "float8_e4m3fn"
#: the dtypes the trainer quantizes from
FLOATS = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Form:
    """One tensor's quantized form: FP8 e4m3 in ``block`` (rows, columns) blocks with
    ``scale`` scales (``"float32"``, or ``"ue8m0"``: float32 powers of two), held with its
    scales under ``scale_name``; ``scale_shape`` as the receiver holds it."""

    block: tuple[int, int]
    scale: str
    scale_name: str
    scale_shape: tuple[int, ...]
    dtype: str = FP8

    @property
    def tag(self) -> str:
        """What names this form in wire entries: ``fp8-128x128`` (``-ue8m0`` for UE8M0)."""
        tail = "" if self.scale == "float32" else f"-{self.scale}"
        return f"fp8-{self.block[0]}x{self.block[1]}{tail}"

    def describe(self) -> str:
        return (
            f"{self.dtype} in {self.block[0]}x{self.block[1]} blocks with {self.scale} scales "
            f"{self.scale_name!r} {list(self.scale_shape)}"
        )

    def problem(self, spec: TensorSpec) -> str | None:
        """What keeps the trainer from producing this form of ``spec`` (None: nothing)."""
        if self.dtype != FP8:
            return f"the trainer quantizes to {FP8} only, not {self.dtype}"
        if self.scale not in SCALES:
            return f"unknown scale layout {self.scale!r} (the trainer makes {', '.join(SCALES)} scales)"
        if spec.dtype not in FLOATS:
            return f"the trainer holds it as {spec.dtype}, not a floating dtype it quantizes"
        if len(spec.shape) not in (2, 3):
            return f"block FP8 needs a 2-D tensor or a 3-D expert stack, the trainer's is {list(spec.shape)}"
        if min(self.block) < 1:
            return f"block {list(self.block)} is not a block"
        if tuple(self.scale_shape) != scale_shape(spec.shape, self.block):
            return (
                f"scales {list(self.scale_shape)} are not a grid of {self.block[0]}x{self.block[1]} blocks "
                f"over {list(spec.shape)} (that would be {list(scale_shape(spec.shape, self.block))})"
            )
        return None

    def specs(self, spec: TensorSpec) -> tuple[TensorSpec, TensorSpec]:
        """The two wire entries of ``spec`` in this form: the FP8 tensor and its scales."""
        return (
            TensorSpec(wire_name(spec.name, self), spec.shape, FP8),
            TensorSpec(wire_name(self.scale_name, self), tuple(self.scale_shape), "float32"),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "block": list(self.block),
            "scale": self.scale,
            "scale_name": self.scale_name,
            "scale_shape": list(self.scale_shape),
        }

    @classmethod
    def from_wire(cls, data: Any) -> Form:
        """Parse a declared form; ValueError saying what does not parse."""
        try:
            block = tuple(int(b) for b in data["block"])
            shape = tuple(int(d) for d in data["scale_shape"])
            form = cls(block, str(data["scale"]), str(data["scale_name"]), shape, str(data["dtype"]))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"a quantized form that does not parse ({type(e).__name__}: {e}): {data!r}"
            ) from e
        if len(form.block) != 2:
            raise ValueError(f"a quantized form's block has two sides, got {list(form.block)}")
        return form


def wire_name(name: str, form: Form) -> str:
    """The wire entry of ``name`` (a quantized tensor or its scales) in ``form``."""
    return f"{name}{TAG}{form.tag}"


def split_tag(name: str) -> tuple[str, tuple[int, int], str] | None:
    """A wire entry's tensor name, block and scale kind (``P@fp8-128x128-ue8m0`` ->
    ``("P", (128, 128), "ue8m0")``); None for an entry no form tags."""
    if not is_tagged(name):
        return None
    base, tag = name.rsplit(TAG, 1)
    parts = tag.split("-")
    try:
        rows, cols = (int(n) for n in parts[1].split("x"))
    except (IndexError, ValueError):
        return None
    scale = parts[2] if len(parts) > 2 else "float32"
    return (base, (rows, cols), scale) if len(parts) <= 3 and scale in SCALES else None


def is_tagged(name: str) -> bool:
    """Whether a wire entry is some form's (receivers that hold no form skip it)."""
    return TAG in name and name.rsplit(TAG, 1)[1].startswith("fp8-")


def declared_forms(
    targets: Mapping[str, torch.Tensor],
    ue8m0: bool | Mapping[str, bool] = False,
    block: tuple[int, int] = (128, 128),
) -> dict[str, Form]:
    """The forms a module's tensors declare: every ``float8_e4m3fn`` tensor ``P`` with a
    tensor ``P_scale_inv`` beside it. The block is ``block`` (vLLM's and DeepSeek's 128 x
    128) along each dimension where the scales' grid fits it; elsewhere the smallest block
    that covers the dimension (scales [2, 2] over [200, 130] fit 128 x 128, as they would
    100 x 65: a grid alone cannot tell). ``ue8m0``: the scales are powers of two (for every
    tensor, or by name); a float32 tensor cannot say so itself."""
    forms = {}
    for name, t in targets.items():
        scale = targets.get(name + SCALE_SUFFIX)
        if t.dtype != torch.float8_e4m3fn or scale is None or t.dim() not in (2, 3) or scale.dim() != t.dim():
            continue
        sides = zip(t.shape[-2:], scale.shape[-2:], block)
        block_of = tuple(b if -(-n // b) == count else -(-n // max(count, 1)) for n, count, b in sides)
        pow2 = ue8m0 if isinstance(ue8m0, bool) else bool(ue8m0.get(name, False))
        kind = "ue8m0" if pow2 and scale.dtype == torch.float32 else dtype_name(scale.dtype)
        forms[name] = Form(block_of, kind, name + SCALE_SUFFIX, tuple(scale.shape))  # type: ignore[arg-type]
    return forms


def offered(msg: Mapping[str, Any], rank: int) -> dict[str, str]:
    """The forms the sender's sync message serves ``rank`` (tensor name -> tag)."""
    forms = msg.get("forms") or {}
    mine = forms.get(str(rank), {}) if isinstance(forms, Mapping) else {}
    return dict(mine) if isinstance(mine, Mapping) else {}


def untagged_specs(plan: Plan) -> list[TensorSpec]:
    """The plan's tensors as the trainer holds them (no form's entries)."""
    return [s for s in plan.tensors if not is_tagged(s.name)]
