"""Trainer-side producers of named tensors.

A source tells its tensor specs up front when it can (``specs()``; needed to agree on a
plan once) and yields ``(name, tensor)`` in that same order. Every trainer rank iterates
its source, because materializing a sharded tensor (``DTensor.full_tensor()``) is a
collective among trainer ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from weightsync.plan import TensorSpec, dtype_name
from weightsync.wire.checkpoint import (
    FORMS,
    checkpoint_views,
    converted_items,
    is_converted,
    layer_groups,
    meta_like,
)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor. Importing ``torch.distributed.tensor`` costs about a
    second per process, which every receiver and CLI call would pay; a tensor can only be a
    DTensor once its module was imported, so that is looked up, never imported, here."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _wire_cast(tensor: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    # Only multi-byte floating tensors are cast (fp32 master weights -> bf16, say); integer,
    # bool and fp8 tensors keep their dtype.
    if wire_dtype is not None and tensor.is_floating_point() and tensor.dtype.itemsize > 1:
        return tensor.to(wire_dtype)
    return tensor


def _wire_dtype(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    if wire_dtype is not None and dtype.is_floating_point and dtype.itemsize > 1:
        return wire_dtype
    return dtype


class WeightSource:
    """Base class: named tensors to send. Subclasses override ``tensors`` and maybe ``specs``."""

    def specs(self) -> list[TensorSpec] | None:
        """Name, shape and dtype of every tensor, in iteration order; None if unknown
        before iterating (the sender then announces each bucket as it fills it)."""
        return None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    #: True if ``tensors()`` can be called more than once.
    reiterable: bool = True
    #: True if each tensor ``tensors()`` yields stays valid after the next one is requested
    #: (a stage may then work on the next tensor while the last is sent)
    keeps_tensors: bool = False


class StateDictSource(WeightSource):
    """A mapping name -> tensor (a state dict). DTensors are materialized one at a time."""

    keeps_tensors = True  # the mapping's own tensors, or new ones (materialized, cast)

    def __init__(self, state: Mapping[str, torch.Tensor], wire_dtype: torch.dtype | None = None) -> None:
        self.state = state
        self.wire_dtype = wire_dtype

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, tuple(t.shape), dtype_name(_wire_dtype(t.dtype, self.wire_dtype)))
            for name, t in self.state.items()
        ]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.state.items():
            if is_dtensor(t):
                t = t.full_tensor()  # a collective: every trainer rank must get here
            yield name, _wire_cast(t.detach(), self.wire_dtype)


class ModuleSource(StateDictSource):
    """An ``nn.Module``'s parameters and persistent buffers (its state dict).

    Tied weights (one parameter under two names) are sent once, under the first name; the
    receiving sink knows the tie from its own module.
    """

    def __init__(self, module: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> None:
        state: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            state[name] = t
        super().__init__(state, wire_dtype)


class CheckpointSource(ModuleSource):
    """A transformers model in its checkpoint form (``weightsync.wire.checkpoint``): the
    names and layouts ``save_pretrained`` writes and inference engines load, each piece a
    view of the model's own tensor (an MoE's experts one matrix each, not fused stacks)."""

    def __init__(self, module: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(module, wire_dtype)
        self.model = module

    def specs(self) -> list[TensorSpec]:
        meta = meta_like(self.state)
        return [
            TensorSpec(name, tuple(t.shape), dtype_name(_wire_dtype(t.dtype, self.wire_dtype)))
            for group in layer_groups(list(meta))
            for name, t in checkpoint_views(self.model, {n: meta[n] for n in group}).items()
        ]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in converted_items(self.model, self.state, _plain):
            yield name, _wire_cast(t, self.wire_dtype)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t  # a collective: every trainer rank gets here


class IteratorSource(WeightSource):
    """An iterable of ``(name, tensor)`` whose specs are not known before iterating."""

    reiterable = False

    def __init__(
        self, items: Iterable[tuple[str, torch.Tensor]], wire_dtype: torch.dtype | None = None
    ) -> None:
        self.items = items
        self.wire_dtype = wire_dtype
        self._used = False

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._used and iter(self.items) is self.items:
            raise RuntimeError("this iterator source was already consumed; pass a new iterator per sync")
        self._used = True
        for name, t in self.items:
            if is_dtensor(t):
                t = t.full_tensor()
            yield name, _wire_cast(t.detach(), self.wire_dtype)


class _WireCast(WeightSource):
    """Any source, with multi-byte floating tensors cast to ``wire_dtype``."""

    def __init__(self, inner: WeightSource, wire_dtype: torch.dtype) -> None:
        self.inner = inner
        self.wire_dtype = wire_dtype
        self.reiterable = inner.reiterable
        self.keeps_tensors = inner.keeps_tensors

    def specs(self) -> list[TensorSpec] | None:
        specs = self.inner.specs()
        if specs is None:
            return None
        return [
            TensorSpec(s.name, s.shape, dtype_name(_wire_dtype(s.torch_dtype, self.wire_dtype)))
            for s in specs
        ]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.inner.tensors():
            yield name, _wire_cast(t, self.wire_dtype)


#: the names a transformers model is sent under by default: its checkpoint's, which engines load
DEFAULT_FORM = "checkpoint"


def as_source(obj: Any, wire_dtype: torch.dtype | None = None, form: str = DEFAULT_FORM) -> WeightSource:
    """Wrap an ``nn.Module``, a state dict, an iterable of ``(name, tensor)`` or a
    ``WeightSource`` as a source; ``wire_dtype`` casts floating tensors for the wire.

    ``form``: a transformers model whose checkpoint form differs from its in-memory form (an
    MoE's fused experts) is sent in checkpoint form (what engines load; every receiver takes
    it) unless ``form="module"`` (the in-memory names, for receivers that take them)."""
    if form not in FORMS:
        raise ValueError(f"form {form!r}: expected one of {', '.join(FORMS)}")
    if isinstance(obj, WeightSource):
        return _WireCast(obj, wire_dtype) if wire_dtype is not None else obj
    if isinstance(obj, torch.nn.Module):
        if form == "checkpoint" and is_converted(obj):
            return CheckpointSource(obj, wire_dtype)
        return ModuleSource(obj, wire_dtype)
    if isinstance(obj, Mapping):
        return StateDictSource(obj, wire_dtype)
    if isinstance(obj, Iterable):
        return IteratorSource(obj, wire_dtype)
    raise TypeError(
        f"cannot send a {type(obj).__name__}: pass an nn.Module, a state dict, an iterable of "
        "(name, tensor) or a weightsync.sources.WeightSource"
    )
