"""Rollout-side consumers of received tensors.

``ModuleSink`` loads tensors in place into an ``nn.Module`` (or a mapping of named tensors)
by name, strictly: a name the
model lacks, a shape or dtype mismatch is an error naming the tensor. With a plan agreed up
front the whole sync is checked before the first byte is written, so a metadata mismatch
never leaves the model half-updated.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType

import torch

from weightsync.plan import TensorSpec, dtype_name
from weightsync.wire.checkpoint import checkpoint_pieces, is_converted
from weightsync.wire.forms import Form, declared_forms, wire_name


class SinkError(ValueError):
    """A received tensor does not fit the model; the message names it."""


class ModuleSink:
    """Copies received tensors into a module's parameters and persistent buffers (or into
    the tensors of a mapping, by name).

    A transformers model whose checkpoint form differs from its in-memory one (an MoE's
    fused experts) takes either: its own names, or the checkpoint form's, landed in views
    of its own tensors (``weightsync.wire.checkpoint``).

    A module holding FP8 tensors with their scales (``X.weight`` in ``float8_e4m3fn`` beside
    ``X.weight_scale_inv``) declares those forms (``forms``; ``ue8m0``: its scales are powers
    of two, for every tensor or by name) and takes them quantized by the trainer
    (``weightsync.quant``)."""

    #: a subclass that makes its own targets (``FragmentSink``) holds no quantized forms
    forms: Mapping[str, Form] = MappingProxyType({})
    skipped: AbstractSet[str] = frozenset()

    def __init__(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        ue8m0: bool | Mapping[str, bool] = False,
    ) -> None:
        self.module = module
        self.targets: dict[str, torch.Tensor] = (
            dict(module.state_dict(keep_vars=True)) if isinstance(module, torch.nn.Module) else dict(module)
        )
        self._own = list(self.targets)  # the module's own names (not its checkpoint pieces)
        self._pieces: dict[str, list[torch.Tensor]] = {}  # own name -> checkpoint views of it
        if is_converted(module):
            own = {n: t.data for n, t in self.targets.items()}
            for name, (piece, base) in checkpoint_pieces(module, own).items():
                if name not in self.targets and base is not None:  # a copy could not land in place
                    self.targets[name] = piece
                    self._pieces.setdefault(base, []).append(piece)
        #: the quantized forms this module holds (tensor name -> form), each landed from its
        #: wire entries (``P@<tag>``, ``P_scale_inv@<tag>``)
        self.forms = declared_forms(self.targets, ue8m0)
        for name, form in self.forms.items():
            self.targets[wire_name(name, form)] = self.targets[name]
            self.targets[wire_name(form.scale_name, form)] = self.targets[form.scale_name]
        #: the sync's entries that are not for this module (other forms', ...): set per sync
        self.skipped = set()
        self._loaded: set[int] = set()  # ids of target tensors written (tied names share one)

    def _problem(self, name: str, shape: tuple[int, ...], dtype: str) -> str | None:
        if name in self.skipped:
            return None
        target = self.targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(self.targets), n=1)
            hint = f"; closest model name: {close[0]!r}" if close else ""
            return f"tensor {name!r} is not in the model{hint}"
        if tuple(target.shape) != tuple(shape):
            return f"tensor {name!r}: shape {tuple(shape)} received, model has {tuple(target.shape)}"
        if dtype_name(target.dtype) != dtype:
            return f"tensor {name!r}: dtype {dtype} received, model has {dtype_name(target.dtype)}"
        return None

    def check(self, specs: Sequence[TensorSpec]) -> None:
        """Check a whole plan against the model before anything is written."""
        problems = [p for s in specs if (p := self._problem(s.name, s.shape, s.dtype))]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise SinkError(problems[0] + more)

    def destination(self, spec: TensorSpec) -> torch.Tensor | None:
        """Where a tensor that arrives in pieces may be merged directly: the model's own
        tensor, if it matches and is contiguous (else None: merged elsewhere, then loaded)."""
        target = self.targets.get(spec.name)
        if (
            target is None
            or spec.name in self.skipped
            or self._problem(spec.name, spec.shape, spec.dtype)
            or not target.is_contiguous()
        ):
            return None
        return target.data

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor into the model (in place, so references to it stay valid)."""
        if name in self.skipped:
            return
        problem = self._problem(name, tuple(tensor.shape), dtype_name(tensor.dtype))
        if problem:
            raise SinkError(problem)
        target = self.targets[name]
        if not _same_memory(tensor, target):  # already merged in place by the receiver
            with torch.no_grad():
                target.copy_(tensor)
        self._loaded.add(id(target))

    def missing(self) -> list[str]:
        """Model names the sync did not carry (tied names count as carried with their twin; a
        fused tensor as carried when every checkpoint piece of it was)."""
        return [
            n
            for n in self._own
            if id(self.targets[n]) not in self._loaded
            and not (n in self._pieces and all(id(p) in self._loaded for p in self._pieces[n]))
        ]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )
