"""LoRA adapters on the trainer side: what a LoRA-only sync carries.

A trainer that fine-tunes a LoRA adapter (PEFT) changes only the adapter's tensors; the base
weights stay as loaded. A LoRA sync sends ``LoRAAdapter.tensors`` (PEFT's own checkpoint
names, ``base_model.model.<module>.lora_A.weight``, the names of ``adapter_model.safetensors``)
and the adapter's config (rank, alpha, target modules) beside them; the base is either
never sent (the replicas loaded the same checkpoint: the trainer's ``base_weights`` digested
and held against each replica's checkpoint by value, ``base_difference``, a mismatch refused)
or sent once as an ordinary version.

Nothing here imports ``peft``: a model is read through the attributes PEFT models have
(``peft_config``, ``get_base_model``), and PEFT's own ``get_peft_model_state_dict`` is
imported only when a model is read.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: The part of a PEFT parameter name that marks an adapter's own tensor (``lora_A``,
#: ``lora_B``, ``lora_embedding_A`` ...), never a base weight.
LORA_MARK = ".lora_"


@dataclass
class LoRAAdapter:
    """One version of a LoRA adapter: its tensors and its config.

    ``tensors``: PEFT checkpoint names -> tensors (the ``adapter_model.safetensors`` names),
    or any source ``Sender.send`` takes that yields them (a ``WeightSource``).
    ``config``: PEFT's ``LoraConfig`` as JSON-safe data (``r``, ``lora_alpha``,
    ``target_modules`` ...), what vLLM reads from ``adapter_config.json``.
    """

    tensors: Mapping[str, torch.Tensor] | Any
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def nbytes(self) -> int:
        """The adapter's bytes (of a mapping; a source's from its specs)."""
        if isinstance(self.tensors, Mapping):
            return sum(t.nbytes for t in self.tensors.values())
        return sum(spec.nbytes for spec in self.tensors.specs() or ())

    def describe(self) -> str:
        """Rank, alpha and target modules, for messages."""
        targets = self.config.get("target_modules")
        return f"rank {self.config.get('r')}, alpha {self.config.get('lora_alpha')}, targets {targets}"


def _json_safe(value: Any) -> Any:
    """PEFT's config values as JSON-like data: sets sorted, enums by value."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def lora_adapter(model: Any, adapter_name: str = "default") -> LoRAAdapter:
    """The adapter ``adapter_name`` of a PEFT model (``peft.PeftModel``), as PEFT saves it.

    A ``LoRAAdapter`` is returned as it is. The tensors are the model's own (no copy): the
    sync reads them before the next optimizer step changes them."""
    if isinstance(model, LoRAAdapter):
        return model
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping):
        raise TypeError(
            f"a LoRA sync needs a PEFT model (peft.PeftModel) or a weightsync.lora.LoRAAdapter, "
            f"got {type(model).__name__}"
        )
    if adapter_name not in configs:
        raise ValueError(f"the PEFT model has no adapter {adapter_name!r} (it has {sorted(configs)})")
    from peft import get_peft_model_state_dict

    config = _json_safe(configs[adapter_name].to_dict())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"adapter {adapter_name!r} is {config.get('peft_type')}, not LoRA")
    tensors = {n: t.detach() for n, t in get_peft_model_state_dict(model, adapter_name=adapter_name).items()}
    return LoRAAdapter(tensors, config)


def base_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights under a PEFT model, in checkpoint (Hugging Face) names: a
    LoRA layer's ``base_layer`` under its module's own name, the adapters' tensors left out.
    A plain model yields its state dict."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, tensor in base.state_dict().items():
        if LORA_MARK in name:
            continue
        yield name.replace(".base_layer.", "."), tensor.detach()


def base_difference(trainer: str, tensor: torch.Tensor) -> str | None:
    """Why a checkpoint's ``tensor`` does not hold the values of the trainer's tensor whose
    ``weightsync.verify.named_digests`` entry is ``trainer``, or None when it does.

    Values, exactly, not bytes: a checkpoint stored in another dtype than the trainer holds
    (bf16 on disk, float32 in the trainer, or the reverse) is cast to the trainer's dtype, and
    counts only if the cast is exact (cast back, it is the checkpoint's bytes again) and its
    bytes then are the trainer's. So float32 weights loaded from a bf16 checkpoint are that
    checkpoint, and a tensor one ulp off (in either dtype) is not. NaN payloads and the sign
    of zero count as they are stored: a difference there is refused too."""
    from weightsync.verify import tensor_digest

    try:
        dtype_name, shape, digest = trainer.split("|")
    except ValueError:
        return f"the trainer's digest {trainer!r} is not dtype|shape|digest"
    if shape != str(tuple(tensor.shape)):
        return f"shape {shape} on the trainer, {tuple(tensor.shape)} in the checkpoint"
    dtype = getattr(torch, dtype_name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        return f"the trainer's dtype {dtype_name} is unknown here"
    held = tensor
    if tensor.dtype != dtype:
        held = tensor.to(dtype)
        if not _same_bytes(held.to(tensor.dtype), tensor):
            return (
                f"values differ: the checkpoint's {tensor.dtype} values are not all exact in the "
                f"trainer's {dtype}"
            )
    if tensor_digest(held) != digest:
        return f"values differ (trainer {dtype}, checkpoint {tensor.dtype})"
    return None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bitwise, not ==: NaN != NaN and -0.0 == 0.0 would each hide or invent a difference
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )
