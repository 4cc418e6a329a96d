"""A routed receiver's memory: the slices it keeps (``FragmentSink``), or, where it declared
nothing, its fragments put back together into whole tensors (``Reassembly``).

Both stand beside the route stage that lands them (``weightsync.receiver.sharded_route``):
the route agreed in the handshake (``weightsync.sharding.agreement``) names each fragment
and the box it covers; these say where it lands.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch

from weightsync.plan import TensorSpec, dtype_name
from weightsync.sharding.agreement import Part
from weightsync.sharding.experts import Slots, expert_boxes, expert_of
from weightsync.sharding.fragments import LocalShard, fragment_name, layout_of, local_shards, region
from weightsync.sharding.layout import Box, Layout
from weightsync.sharding.pieces import checkpoint_shards
from weightsync.sinks import ModuleSink, SinkError
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


class ExpertSink(FragmentSink):
    """A rank of an expert-parallel replica (``weightsync.sharding.experts``): ``dense``,
    what it keeps of every other tensor (declared shards), and the experts its slots hold,
    asked of the engine at every handshake: ``slots()``, its current map, and
    ``views(slots)``, by checkpoint name the memory of every slot that holds that matrix, in
    slot order. Each expert's matrices arrive once and land in every slot holding them (a
    load balancer may put one expert in two slots of a rank).

    A map that changed after this rank answered (a rebalance between its answer and the
    bytes) fails the version before any byte of an expert lands, naming the layer, the slot
    and the expert: bytes never land in a slot that now holds another expert. The next
    handshake declares the new map."""

    def __init__(
        self,
        dense: Mapping[str, LocalShard],
        slots: Callable[[], Slots],
        views: Callable[[Slots], Mapping[str, Sequence[torch.Tensor]]],
    ) -> None:
        super().__init__(dict(dense))
        self._dense = dict(dense)
        self._slots, self._views = slots, views
        self._declared: Slots | None = None
        self._others: dict[str, list[torch.Tensor]] = {}  # checkpoint name -> its other slots
        self._copies: dict[str, list[torch.Tensor]] = {}  # fragment name -> its regions there

    def layout(self, host: str, specs: Sequence[TensorSpec] | None = None) -> Layout:
        slots = self._slots()
        views = self._views(slots)
        if specs is not None:
            wanted = set(expert_boxes(specs, slots))  # raises for an expert the engine lacks
            if wanted != set(views):
                odd = sorted(wanted ^ set(views))[:3]
                raise ValueError(f"the engine's slot views disagree with its expert map on {odd}")
        shards = dict(self._dense)
        self._others = {}
        for name, held in views.items():
            first = held[0]
            spec = TensorSpec(name, tuple(first.shape), dtype_name(first.dtype))
            shards[name] = LocalShard(spec, Box.whole(spec.shape), first)
            self._others[name] = list(held[1:])
        self.shards, self._declared = shards, slots
        return layout_of(shards, host)

    def bind(self, part: Part) -> None:
        super().bind(part)
        self._copies = {}
        for f in part.route.for_dest(part.index):
            name = part.route.specs[f.tensor].name
            for other in self._others.get(name, ()):
                self._copies.setdefault(fragment_name(part.route, f), []).append(region(other, f.box))

    def destination(self, spec: TensorSpec) -> torch.Tensor | None:
        # an expert's bytes are copied in by ``load``, after the map is checked
        return None if expert_of(spec.name.partition("@")[0]) else super().destination(spec)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        where = expert_of(name.partition("@")[0])
        if where is not None and self._declared is not None:
            changed = self._declared.changed(self._slots())
            if changed:
                raise SinkError(
                    f"expert {where[1]} of layer {where[0]} not landed: the engine's expert map changed after "
                    f"this rank answered ({changed}); the next sync routes by the new map"
                )
        super().load(name, tensor)
        for other in self._copies.get(name, ()):
            with torch.no_grad():
                other.copy_(self.targets[name])
