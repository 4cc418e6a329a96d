"""Typical layouts, declared over any model's specs: an FSDP2-like trainer and
tensor-parallel replicas (``weightsync bench --backend sharded`` syncs them,
``weightsync estimate`` predicts them).

Trainer rank t of M holds ``Shard(0)`` of every tensor (what ``fully_shard`` gives). Rank
r of a replica of T ranks keeps what a Megatron/vLLM-style tensor-parallel model keeps:
output rows (``Shard(0)``) of the column-parallel projections, the embedding and the LM
head, input columns (``Shard(1)``) of the row-parallel ``o_proj`` and ``down_proj``, and
every 1-D tensor (norms, biases) whole. An MoE's expert stacks (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj``) are kept as expert parallelism keeps them: rank r of
T a contiguous block of whole experts (``Shard(0)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.fragments import LocalShard, declared_shards, region
from weightsync.sharding.layout import Box, Placement, Replicate, Shard, boxes_of_placements

_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def trainer_boxes(specs: Sequence[TensorSpec], trainers: int, rank: int) -> dict[str, Box]:
    """Trainer rank ``rank``'s box of every tensor: ``Shard(0)`` over the trainer ranks."""
    return {s.name: boxes_of_placements(s.shape, (trainers,), (rank,), [Shard(0)]) for s in specs}


def _replica_placement(spec: TensorSpec) -> Placement:
    if len(spec.shape) < 2:
        return Replicate()
    return Shard(1) if spec.name.endswith(_ROW_PARALLEL) else Shard(0)


def replica_boxes(specs: Sequence[TensorSpec], tp: int, rank: int) -> dict[str, Box]:
    """Tensor-parallel rank ``rank`` of ``tp``: the box of every tensor it keeps."""
    return {s.name: boxes_of_placements(s.shape, (tp,), (rank,), [_replica_placement(s)]) for s in specs}


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
    return sum(boxes[s.name].numel * s.torch_dtype.itemsize for s in specs)
