"""Where an expert-parallel engine keeps its experts: a rank's expert slots, as data.

Under expert parallelism each rank of a replica holds some physical slots of every MoE
layer, each slot one logical expert: a contiguous run or every ``ep``-th expert (vLLM's
``determine_expert_map``, linear or round robin), or, under a load balancer (vLLM's EPLB),
each layer its own map of physical slots to logical experts, popular experts in several
slots (redundant), sometimes two on one rank. ``Slots`` is one rank's map; it comes from
the engine's own objects (its expert map, its EPLB physical -> logical table), never from a
table of ours.

In the checkpoint form (``weightsync.wire.checkpoint``) each expert's matrices are tensors
of their own (``...layers.{L}...experts.{e}.gate_proj.weight``), so a rank's need is a whole
box of every matrix of the experts its slots hold and none of the others
(``expert_boxes``): the route (``weightsync.sharding.route``) then sends each expert once to
each rank that holds it, from the trainer rank that holds it, and nothing to the rest.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box
from weightsync.wire.checkpoint import checkpoint_pieces

# vLLM's and SGLang's loaders find an expert the same way: its id after ``.experts.``
_EXPERT = re.compile(r"\.layers\.(\d+)\..*\.experts\.(\d+)\.")


def expert_of(name: str) -> tuple[int, int] | None:
    """``(layer, expert)`` of a checkpoint tensor that is one expert's, else None (a
    router, a shared expert, a fused stack)."""
    match = _EXPERT.search(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class Slots:
    """One rank's expert slots: for each MoE layer, the logical expert each of its slots
    holds (slot order is the engine's local order), of ``experts`` logical experts."""

    layers: Mapping[int, tuple[int, ...]]
    experts: int

    @classmethod
    def of_expert_map(cls, layers: Iterable[int], expert_map: Sequence[int]) -> Slots:
        """From an engine's global -> local map (vLLM's ``determine_expert_map``: the local
        slot of each logical expert, -1 where another rank holds it), the same in every layer."""
        slots = sorted((local, e) for e, local in enumerate(expert_map) if local >= 0)
        if [local for local, _ in slots] != list(range(len(slots))):
            raise ValueError(f"an expert map whose local slots are not 0..n-1: {list(expert_map)}")
        held = tuple(e for _, e in slots)
        return cls({int(layer): held for layer in layers}, len(expert_map))

    @classmethod
    def linear(cls, layers: Iterable[int], experts: int, ep: int, rank: int) -> Slots:
        """Rank ``rank`` of ``ep`` under a contiguous placement, as vLLM lays experts out
        without a load balancer (``determine_expert_map``, ``linear``: runs of
        ``experts // ep``, the first ``experts % ep`` ranks one more): for the bench and
        the estimate, which start no engine to ask (``tests/test_experts.py`` holds it
        against vLLM's function)."""
        base, extra = divmod(experts, ep)
        start = rank * base + min(rank, extra)
        held = tuple(range(start, start + base + (rank < extra)))
        return cls({int(layer): held for layer in layers}, experts)

    @classmethod
    def of_physical(
        cls, physical_to_logical: Mapping[int, Sequence[int]], rank: int, ranks: int, experts: int
    ) -> Slots:
        """From a load balancer's physical -> logical table (vLLM EPLB's ``phy2log``: per
        layer, the logical expert of each physical slot), whose slots are split evenly over
        ``ranks`` in order: rank ``rank``'s share of every layer."""
        out = {}
        for layer, row in physical_to_logical.items():
            if len(row) % ranks:
                raise ValueError(f"layer {layer}: {len(row)} physical slots do not split over {ranks} ranks")
            per = len(row) // ranks
            out[int(layer)] = tuple(int(e) for e in row[rank * per : (rank + 1) * per])
        return cls(out, experts)

    def holds(self, layer: int, expert: int) -> bool:
        return expert in self.layers.get(layer, ())

    def changed(self, now: Slots) -> str | None:
        """What differs in ``now`` (the first layer and slot whose expert changed), or None."""
        for layer in sorted(set(self.layers) | set(now.layers)):
            before, after = self.layers.get(layer, ()), now.layers.get(layer, ())
            for slot in range(max(len(before), len(after))):
                a = before[slot] if slot < len(before) else None
                b = after[slot] if slot < len(after) else None
                if a != b:
                    return f"layer {layer} slot {slot} held expert {a} and holds expert {b} now"
        return None

    def to_wire(self) -> dict[str, Any]:
        return {"experts": self.experts, "layers": {str(k): list(v) for k, v in sorted(self.layers.items())}}


def expert_boxes(specs: Sequence[TensorSpec], slots: Slots) -> dict[str, Box]:
    """The whole box of every expert matrix among ``specs`` that ``slots`` hold; raises
    ValueError naming a tensor of an expert or a layer the engine does not have."""
    out: dict[str, Box] = {}
    for spec in specs:
        where = expert_of(spec.name)
        if where is None:
            continue
        layer, expert = where
        if layer not in slots.layers or not 0 <= expert < slots.experts:
            have = f"{slots.experts} experts" + ("" if layer in slots.layers else f", no MoE layer {layer}")
            raise ValueError(
                f"tensor {spec.name!r} is of layer {layer}, expert {expert}: the engine has {have}"
            )
        if slots.holds(layer, expert):
            out[spec.name] = Box.whole(spec.shape)
    return out


def slot_views(model: Any, stacks: Mapping[str, torch.Tensor], slots: Slots) -> dict[str, list[torch.Tensor]]:
    """A rank holding its slots as transformers holds experts (fused stacks of ``model``'s
    names, one row per local slot, in slot order): by checkpoint name, the view of every
    slot that holds that matrix (transformers' own conversion names slot ``s``'s matrices
    as expert ``s``'s; each is renamed after the logical expert the slot holds)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, (piece, root) in checkpoint_pieces(model, stacks).items():
        where = expert_of(name)
        if where is None or root is None:
            raise ValueError(f"{name!r} is not one slot's matrix of an expert stack")
        layer, slot = where
        held = slots.layers.get(layer, ())
        if slot >= len(held):
            raise ValueError(f"layer {layer} stacks more slots than the map's {len(held)}")
        logical = re.sub(r"\.experts\.\d+\.", f".experts.{held[slot]}.", name, count=1)
        out.setdefault(logical, []).append(piece)
    return out
