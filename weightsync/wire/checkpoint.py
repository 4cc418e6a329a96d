"""A transformers model's weights in their checkpoint form, as views of the model's own.

transformers 5 holds some weights in another form in memory than in its checkpoints: an
MoE's experts fused into stacks (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) where ``save_pretrained`` writes, and vLLM's and
SGLang's loaders read, one matrix per expert (``mlp.experts.{e}.gate_proj.weight``, ...).
transformers ships the mapping between the two (its weight converters, reversed by
``save_pretrained`` through ``revert_weight_conversion``); this module runs that mapping
rather than a table of ours, so a family transformers converts is converted the same way.

Two uses, one function (``checkpoint_views``):

- the trainer sends the checkpoint form (``CheckpointSource``): every piece is a view of a
  stack (no copy of a whole expert stack), materialized one layer at a time when the
  model's tensors are DTensors (FSDP2);
- a receiver holding the fused form lands the checkpoint form into views of its own stacks
  (``ModuleSink``), so a plain PyTorch receiver and a vLLM worker take the same wire.

The pieces are exactly ``save_pretrained``'s tensors (names, shapes, bytes; gate/up order);
``tests/test_wire/checkpoint.py`` checks it on two MoE families.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

#: the forms a trainer sends a transformers model in
FORMS = ("checkpoint", "module")

# Conversions never cross a decoder layer: a layer's tensors are converted together.
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


class _Uncopied(torch.Tensor):
    """A tensor whose ``contiguous()`` is itself, for the conversion pass only.

    transformers' ``Chunk`` makes each half of a stack contiguous (a copy of the stack) before
    splitting it into experts; the pieces it ends with are contiguous slices of the stack
    anyway, so with this the pass ends with views instead, holding the same values."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def is_transformers(model: Any) -> bool:
    """Whether ``model`` is a transformers model (transformers is looked up, never imported,
    here: a model can only be one once it was imported)."""
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, module.PreTrainedModel)


def is_converted(model: Any) -> bool:
    """Whether ``model`` is a transformers model whose checkpoint form differs from its
    in-memory form."""
    if not is_transformers(model):
        return False
    state = meta_like(model.state_dict())
    converted = checkpoint_views(model, state)
    return {n: t.shape for n, t in converted.items()} != {n: t.shape for n, t in state.items()}


def meta_like(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shape-and-dtype stand-ins (a DTensor's global shape) to convert without the bytes."""
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}


def layer_groups(names: list[str]) -> list[list[str]]:
    """``names`` grouped by decoder layer (the rest in one group each), in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        match = _LAYER.match(name)
        groups.setdefault(match.group(1) if match else name, []).append(name)
    return list(groups.values())


def checkpoint_pieces(
    model: Any, tensors: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, str | None]]:
    """``tensors`` (some or all of ``model``'s, in its in-memory names; plain tensors or
    ``meta_like``'s stand-ins) in checkpoint form, in transformers' order: each piece with
    the name of the input it is a view of (None: a copy, where the conversion concatenates)."""
    from transformers.core_model_loading import revert_weight_conversion

    plain = {n: t.detach() for n, t in tensors.items()}
    names = {id(t): n for n, t in plain.items()}
    out = revert_weight_conversion(model, {n: t.as_subclass(_Uncopied) for n, t in plain.items()})
    # A piece's root: views know their base (a meta stand-in has no memory to compare).
    return {
        name: (p.as_subclass(torch.Tensor), names.get(id(p._base)))  # noqa: SLF001 -- torch 2.13: a view's base
        for name, p in out.items()
    }


def checkpoint_views(model: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``checkpoint_pieces`` without their owners."""
    return {name: piece for name, (piece, _) in checkpoint_pieces(model, tensors).items()}


def converted_items(
    model: Any, state: Mapping[str, torch.Tensor], materialize: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """``state`` in checkpoint form, one decoder layer at a time: ``materialize`` turns each
    tensor into a plain one (a DTensor's ``full_tensor()``, a collective every trainer rank
    runs in the same order)."""
    for group in layer_groups(list(state)):
        yield from checkpoint_views(model, {n: materialize(state[n]) for n in group}).items()
