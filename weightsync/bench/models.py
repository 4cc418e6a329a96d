"""What the benchmark moves: synthetic LLM-shaped weights, or a safetensors directory.

A benchmark model travels to worker processes as a list of tensor specs (no bytes), and
each process builds its own tensors: the sender fills them, receivers allocate zeros.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import torch

from weightsync.plan import TensorSpec, as_bytes, dtype_from_name, dtype_name

SHAPES = ("llm", "moe", "small-tensors")
#: ``--shape moe``: experts per layer and experts each token is routed to (a label: the sync
#: moves every expert whatever top-k is)
MOE_EXPERTS, MOE_TOP_K = 8, 2
SMALL_TENSOR_BYTES = 256 * 1024


def _decoder(
    total_bytes: int, dtype: str, layer: Callable[[int, int], list[tuple[str, tuple[int, ...]]]]
) -> list[TensorSpec]:
    """A decoder of about ``total_bytes``: untied embedding and head (the few large
    tensors) around as many layers as fit, each ``layer(hidden, kv)``'s tensors (name
    suffix, shape)."""
    elem = torch.empty(0, dtype=dtype_from_name(dtype)).element_size()
    hidden = 1024 if total_bytes <= 3 << 30 else 4096
    kv = hidden // 4  # grouped-query attention
    vocab = 32768
    per_layer = sum(math.prod(shape) for _, shape in layer(hidden, kv))
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((total_bytes / elem - fixed) / per_layer))
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(layers):
        specs += [TensorSpec(f"model.layers.{i}.{name}", shape, dtype) for name, shape in layer(hidden, kv)]
    specs += [
        TensorSpec("model.norm.weight", (hidden,), dtype),
        TensorSpec("lm_head.weight", (vocab, hidden), dtype),
    ]
    return specs


def _attention(hidden: int, kv: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for proj, rows in (("q", hidden), ("k", kv), ("v", kv)):
        out.append((f"self_attn.{proj}_proj.weight", (rows, hidden)))
        if bias:
            out.append((f"self_attn.{proj}_proj.bias", (rows,)))
    return [*out, ("self_attn.o_proj.weight", (hidden, hidden))]


def _norms(hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]


def llm_specs(total_bytes: int, dtype: str) -> list[TensorSpec]:
    """A Qwen2-like decoder of about ``total_bytes``: untied embedding and head (the few
    large tensors), and per layer 7 projections, 3 biases and 2 norms (many small ones)."""

    def layer(hidden: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
        inter = math.ceil(2.6875 * hidden / 64) * 64
        mlp = [
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
        ]
        return _attention(hidden, kv, bias=True) + mlp + _norms(hidden)

    return _decoder(total_bytes, dtype, layer)


def moe_specs(
    total_bytes: int, dtype: str, experts: int = MOE_EXPERTS, per_expert: bool = False
) -> list[TensorSpec]:
    """A Qwen3-MoE-like decoder of about ``total_bytes``, experts as transformers 5 holds
    them (what FSDP2 shards, ``Shard(0)`` over the experts): per layer attention, a router
    and two stacks, ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
    [E, H, I]; untied embedding and head. ``per_expert``: the checkpoint form instead, each
    expert's ``gate_proj``, ``up_proj`` [I, H] and ``down_proj`` [H, I] (the same bytes)."""

    def layer(hidden: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
        inter = hidden // 2  # each expert narrower than a dense MLP (Qwen3-30B-A3B: 768 of 2048)
        mlp: list[tuple[str, tuple[int, ...]]] = [("mlp.gate.weight", (experts, hidden))]
        if per_expert:
            for e in range(experts):
                mlp += [
                    (f"mlp.experts.{e}.gate_proj.weight", (inter, hidden)),
                    (f"mlp.experts.{e}.up_proj.weight", (inter, hidden)),
                    (f"mlp.experts.{e}.down_proj.weight", (hidden, inter)),
                ]
        else:
            mlp += [
                ("mlp.experts.gate_up_proj", (experts, 2 * inter, hidden)),
                ("mlp.experts.down_proj", (experts, hidden, inter)),
            ]
        return _attention(hidden, kv, bias=False) + mlp + _norms(hidden)

    return _decoder(total_bytes, dtype, layer)


def small_tensor_specs(
    total_bytes: int, dtype: str, tensor_bytes: int = SMALL_TENSOR_BYTES
) -> list[TensorSpec]:
    """``total_bytes`` in tensors of ``tensor_bytes`` each: the worst case for one call per tensor."""
    elem = torch.empty(0, dtype=dtype_from_name(dtype)).element_size()
    count = max(1, total_bytes // tensor_bytes)
    return [TensorSpec(f"blocks.{i}.weight", (tensor_bytes // elem,), dtype) for i in range(count)]


def synthetic_specs(shape: str, size_mb: float, dtype: str, per_expert: bool = False) -> list[TensorSpec]:
    """``per_expert``: an MoE shape in its checkpoint form (one tensor per expert's matrix)."""
    total = int(size_mb * (1 << 20))
    if shape == "llm":
        return llm_specs(total, dtype)
    if shape == "moe":
        return moe_specs(total, dtype, per_expert=per_expert)
    if shape == "small-tensors":
        return small_tensor_specs(total, dtype)
    raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")


def directory_specs(path: str | Path) -> list[TensorSpec]:
    """Specs of every tensor in a directory's ``*.safetensors`` files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors files (the benchmark reads weights from safetensors)"
        )
    specs = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                t = f.get_slice(name)
                specs.append(TensorSpec(name, tuple(t.get_shape()), dtype_name(_st_dtype(t.get_dtype()))))
    return specs


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _st_dtype(name: str) -> torch.dtype:
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise ValueError(f"safetensors dtype {name} is not supported by the benchmark") from None


def zeros(specs: list[TensorSpec], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The receivers' model: every tensor allocated and touched (on ``device``)."""
    return {s.name: torch.zeros(s.shape, dtype=s.torch_dtype, device=device) for s in specs}


def filled(
    specs: list[TensorSpec], seed: int = 0, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The trainer's model: arbitrary bytes (tiled from a random block: filling GBs with
    real random numbers would take longer than the benchmark), on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen).to(device)
    double = torch.cat([block, block])
    state = zeros(specs, device)
    for i, t in enumerate(state.values()):
        raw = as_bytes(t)
        shift = (i * 4099) % block.numel()  # neighbouring tensors differ
        tile = double[shift : shift + block.numel()]
        for start in range(0, raw.numel(), tile.numel()):
            n = min(tile.numel(), raw.numel() - start)
            raw[start : start + n].copy_(tile[:n])
    return state


def filled_values(
    specs: list[TensorSpec], seed: int = 0, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The trainer's model in finite values (tiled from a block of normal samples), for what
    reads them as numbers (a quantizer); integer tensors as ``filled``'s."""
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(1 << 20, generator=gen)
    state = filled(specs, seed, device)
    for i, t in enumerate(state.values()):
        if t.is_floating_point() and t.numel():
            flat = t.view(-1)
            shift = (i * 4099) % block.numel()  # neighbouring tensors differ
            tile = torch.cat([block[shift:], block[:shift]]).to(device=device, dtype=t.dtype)
            for start in range(0, flat.numel(), tile.numel()):
                n = min(tile.numel(), flat.numel() - start)
                flat[start : start + n].copy_(tile[:n])
    return state


def scale_values(state: dict[str, torch.Tensor]) -> None:
    """``filled_values``'s next version: every float times -1.25 (every non-zero element,
    and every FP8 block's sign and scale, changes; magnitudes stay finite for many versions)."""
    for t in state.values():
        if t.is_floating_point():
            t.mul_(-1.25)


def bump(state: dict[str, torch.Tensor], version: int) -> None:
    """Change every byte of every tensor, cheaply (one in-place add over the raw bytes):
    each version differs from the last everywhere, so a receiver that keeps any byte of the
    previous version fails the bench's bit-exact checks. The bytes are arbitrary (floats
    among them are NaN or infinite already): only their equality is ever checked."""
    step = (2 * version + 1) % 256  # odd, so never 0 modulo 256: no byte keeps its value
    for t in state.values():
        if not t.is_contiguous():  # as_bytes would copy, and the change would be lost
            raise ValueError("bump changes tensors in place: they must be contiguous")
        raw = as_bytes(t)
        if raw.numel():
            if t.dtype == torch.bool:  # keep each a valid bool
                raw.bitwise_xor_(1)
            else:
                raw.add_(step)  # wraps modulo 256


def digest(state: dict[str, torch.Tensor]) -> str:
    """One hash over all names and bytes, to compare sender and receivers (device tensors
    are hashed from a host copy, one tensor at a time)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in state.items():
        h.update(name.encode())
        h.update(as_bytes(t if t.device.type == "cpu" else t.cpu()).numpy().data)
    return h.hexdigest()


def module_of(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose state dict is ``state`` (same tensors), so a receiver loads in place."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if not isinstance(child, torch.nn.Module):
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        mod.register_buffer(leaf, tensor)
    return root


def load_directory(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(file))
    return state
