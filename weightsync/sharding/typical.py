"""Typical layouts, declared over any model's specs: an FSDP2-like trainer and
tensor-parallel replicas (``weightsync bench --backend sharded`` syncs them,
``weightsync estimate`` predicts them).

Trainer rank t of M holds ``Shard(0)`` of every tensor (what ``fully_shard`` gives). Rank
r of a replica of T ranks keeps what a Megatron/vLLM-style tensor-parallel model keeps:
output rows (``Shard(0)``) of the column-parallel projections, the embedding and the LM
head, input columns (``Shard(1)``) of the row-parallel ``o_proj`` and ``down_proj``, and
every 1-D tensor (norms, biases) whole. An MoE's expert stacks (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj``) are kept as expert parallelism keeps them: rank r of
T a contiguous block of whole experts (``Shard(0)``). In the checkpoint form (one tensor per
expert's matrix, ``...experts.{e}.gate_proj.weight``) a trainer rank holds whole the experts
its ``Shard(0)`` of the stack holds, and a replica of ``ep`` expert-parallel ranks keeps the
experts vLLM's linear placement gives each rank (``weightsync.sharding.experts``), every
other tensor as its tensor-parallel rank keeps it (whole without tensor parallelism: the
attention data-parallel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.experts import Slots, expert_boxes, expert_of
from weightsync.sharding.fragments import LocalShard, declared_shards, region
from weightsync.sharding.layout import Box, Placement, Replicate, Shard, boxes_of_placements, chunk

_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def _experts(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """The MoE layers and the experts per layer that per-expert tensors of ``specs`` name."""
    found = [where for s in specs if (where := expert_of(s.name)) is not None]
    return sorted({layer for layer, _ in found}), 1 + max((e for _, e in found), default=-1)


def trainer_boxes(specs: Sequence[TensorSpec], trainers: int, rank: int) -> dict[str, Box]:
    """Trainer rank ``rank``'s box of every tensor: ``Shard(0)`` over the trainer ranks (an
    expert's matrix whole on the rank whose share of the stack holds it, empty elsewhere)."""
    _, experts = _experts(specs)
    start, count = chunk(experts, trainers, rank)
    out = {}
    for s in specs:
        where = expert_of(s.name)
        if where is None:
            out[s.name] = boxes_of_placements(s.shape, (trainers,), (rank,), [Shard(0)])
        elif start <= where[1] < start + count:
            out[s.name] = Box.whole(s.shape)
        else:
            out[s.name] = Box(tuple(0 for _ in s.shape), tuple(0 for _ in s.shape))
    return out


def _replica_placement(spec: TensorSpec) -> Placement:
    if len(spec.shape) < 2:
        return Replicate()
    return Shard(1) if spec.name.endswith(_ROW_PARALLEL) else Shard(0)


def replica_boxes(specs: Sequence[TensorSpec], tp: int, rank: int, ep: int = 1) -> dict[str, Box]:
    """Rank ``rank`` of a replica (tensor-parallel rank ``rank % tp``, expert-parallel rank
    ``rank % ep``): the box of every tensor it keeps; an expert's matrix only where its
    slots hold it."""
    if ep > 1:
        layers, experts = _experts(specs)
        mine = expert_boxes(specs, Slots.linear(layers, experts, ep, rank % ep))
    out = {}
    for s in specs:
        if ep > 1 and expert_of(s.name) is not None:
            if s.name in mine:
                out[s.name] = mine[s.name]
            continue
        out[s.name] = boxes_of_placements(s.shape, (tp,), (rank % tp,), [_replica_placement(s)])
    return out


def held(state: Mapping[str, torch.Tensor], boxes: Mapping[str, Box]) -> dict[str, LocalShard]:
    """A trainer rank's shards: views of its boxes of ``state`` (the bench makes each
    version whole on every trainer rank, so all ranks hold the same bytes; only the boxes
    are sent)."""
    return declared_shards(
        {n: (tuple(state[n].shape), box, region(state[n], box)) for n, box in boxes.items()}
    )


def kept(specs: Sequence[TensorSpec], boxes: Mapping[str, Box], device: str = "cpu") -> dict[str, LocalShard]:
    """A receiver rank's slices, allocated (zeros) in the shape of its boxes."""
    shapes = {s.name: s for s in specs}
    return declared_shards(
        {
            n: (shapes[n].shape, box, torch.zeros(box.lengths, dtype=shapes[n].torch_dtype, device=device))
            for n, box in boxes.items()
        }
    )


def box_bytes(specs: Sequence[TensorSpec], boxes: Mapping[str, Box]) -> int:
    return sum(boxes[s.name].numel * s.torch_dtype.itemsize for s in specs if s.name in boxes)
