"""A routed receiver's memory: the slices it keeps (``FragmentSink``), or, where it declared
nothing, its fragments put back together into whole tensors (``Reassembly``).

Both stand beside the route stage that lands them (``weightsync.receiver.sharded_route``):
the route agreed in the handshake (``weightsync.sharding.agreement``) names each fragment
and the box it covers; these say where it lands.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.agreement import Part
from weightsync.sharding.fragments import LocalShard, fragment_name, layout_of, local_shards, region
from weightsync.sharding.layout import Box, Layout
from weightsync.sharding.pieces import checkpoint_shards
from weightsync.sinks import ModuleSink
from weightsync.wire.checkpoint import is_converted
from weightsync.wire.forms import Form, declared_forms, is_tagged, wire_name


class FragmentSink(ModuleSink):
    """A sharded receiver's sink: the slices of a module (its DTensors' local shards, its
    plain tensors whole) that this rank keeps. ``layout`` is what it declares; once the
    route is agreed (``bind``), its targets are the views each routed fragment lands in,
    by fragment name, so the session checks and lands fragments as it does whole tensors.

    A tensor held in a quantized form (``P`` in FP8 beside ``P_scale_inv``: ``forms``, as a
    ``ModuleSink`` declares them, or read off the slices) is declared as that form's entries
    (``P@<tag>``, ``P_scale_inv@<tag>``): the trainer ranks quantize their shards for it
    (``weightsync.quant.sharded``).

    A transformers model whose checkpoint form differs from its own (an MoE's fused experts)
    declares the form the trainer offers: the checkpoint's pieces of its slices
    (``weightsync.sharding.pieces``, the default form a trainer sends) or its own tensors."""

    def __init__(
        self, module: torch.nn.Module | Mapping[str, torch.Tensor], forms: Mapping[str, Form] | None = None
    ) -> None:
        self.module = module
        declared = (
            isinstance(module, Mapping) and module and all(isinstance(v, LocalShard) for v in module.values())
        )
        # declared shards (``declared_shards``) as they are; else a module's or state dict's
        shards = dict(module) if declared else local_shards(module)
        if forms is None:
            forms = declared_forms({n: s.tensor for n, s in shards.items()})
        for name, form in forms.items():
            if name not in shards or form.scale_name not in shards:
                continue  # a form of a checkpoint piece, not of this module's own tensors
            for held in (name, form.scale_name):
                shard = shards.pop(held)
                wire = wire_name(held, form)
                shards[wire] = LocalShard(dataclasses.replace(shard.spec, name=wire), shard.box, shard.tensor)
        self.shards = self._own_form = shards
        #: the checkpoint form of its slices, where it differs from its own (None: the same)
        self._checkpoint = (
            checkpoint_shards(module, shards) if not declared and not forms and is_converted(module) else None
        )
        if self._checkpoint is not None:
            self.shards = self._checkpoint
        self.targets = {}
        self._own, self._pieces = [], {}  # fragments land as they are: no checkpoint pieces
        self._loaded = set()
        self._unrouted: list[str] = []

    def layout(self, host: str, specs: Sequence[TensorSpec] | None = None) -> Layout:
        """What this rank keeps, in the form of the offered ``specs`` (None: as last time)."""
        if self._checkpoint is not None and specs is not None:
            names = {s.name for s in specs}
            own = any(n in names and n not in self._checkpoint for n in self._own_form)
            self.shards = self._own_form if own else self._checkpoint
        return layout_of(self.shards, host)

    def bind(self, part: Part) -> None:
        """Land ``part``'s fragments: each in the view of the slice it covers."""
        targets = {}
        routed = set()
        for f in part.route.for_dest(part.index):
            name = part.route.specs[f.tensor].name
            shard = self.shards[name]
            targets[fragment_name(part.route, f)] = region(shard.tensor, f.box.within(shard.box))
            routed.add(name)
        self.targets = targets
        self._own = list(targets)
        self._loaded = set()
        self._unrouted = [n for n, s in self.shards.items() if n not in routed and s.box.numel]

    def missing(self) -> list[str]:
        """Kept tensors the sync did not carry (no trainer rank has them), and fragments
        that did not land."""
        return self._unrouted + super().missing()


class Reassembly:
    """A receiver that declared nothing: its fragments put back together into whole
    tensors, each handed out once its last fragment landed."""

    def __init__(self, part: Part) -> None:
        route = part.route
        self._where: dict[str, tuple[TensorSpec, Box]] = {}
        self._left: dict[str, int] = {}
        for f in route.for_dest(part.index):
            spec = route.specs[f.tensor]
            self._where[fragment_name(route, f)] = (spec, f.box)
            self._left[spec.name] = self._left.get(spec.name, 0) + 1
        self._wholes: dict[str, torch.Tensor] = {}
        #: tensors without elements: no fragment carries them, yet they are the model's
        self.empty = [
            (s.name, torch.empty(s.shape, dtype=s.torch_dtype))
            for s in route.specs
            if not math.prod(s.shape) and not is_tagged(s.name)
        ]

    def put(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Copy one fragment into its tensor; the tensor, when this was its last fragment."""
        spec, box = self._where[name]
        whole = self._wholes.get(spec.name)
        if whole is None:
            whole = self._wholes[spec.name] = torch.empty(
                spec.shape, dtype=spec.torch_dtype, device=tensor.device
            )
        region(whole, box).copy_(tensor.view(box.lengths))
        self._left[spec.name] -= 1
        if self._left[spec.name]:
            return None
        return spec.name, self._wholes.pop(spec.name)
