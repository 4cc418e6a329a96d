"""A rank's shards in the checkpoint form (``backend=sharded``, ``form="checkpoint"``).

transformers holds an MoE's experts fused in stacks; its checkpoint, and the engines'
loaders, have one matrix per expert (``weightsync.wire.checkpoint``). Each such matrix is a
box of a stack (expert ``e``'s gate is ``gate_up_proj[e, :I, :]``), so what a rank holds of
a stack (an FSDP2 shard: whole experts under ``Shard(0)``, rows of each under ``Shard(1)``)
is, for each checkpoint piece, the part of the piece's box that its own box covers: a box
of the piece, read as a view of the rank's local tensor. transformers' conversion runs once
per decoder layer on meta stand-ins of the global shapes (no bytes, no collective); no table
of families.

Every rank lists every piece (the route's specs must be the same on every rank), holding
an empty box of those its shard does not reach. A piece that the conversion makes by
concatenating is no box of one tensor: refused, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.fragments import LocalShard, region
from weightsync.sharding.layout import Box
from weightsync.sharding.reads import Unreducible, view_box
from weightsync.wire.checkpoint import checkpoint_pieces, layer_groups


def _piece(name: str, piece: torch.Tensor, base: torch.Tensor, shard: LocalShard) -> LocalShard:
    """What ``shard`` (of the tensor ``base`` stands in for) holds of ``piece``, a view of ``base``."""
    try:
        where, dims = view_box(piece, base)
    except Unreducible as e:
        raise ValueError(f"checkpoint tensor {name!r} is no box of {shard.spec.name!r} ({e})") from e
    spec = TensorSpec(name, tuple(piece.shape), shard.spec.dtype)
    held = shard.box.intersect(where)
    if held is None:
        empty = Box(tuple(0 for _ in piece.shape), tuple(0 for _ in piece.shape))
        return LocalShard(spec, empty, shard.tensor.new_empty(empty.lengths))
    box = Box(
        tuple(0 if d is None else held.starts[d] - where.starts[d] for d in dims),
        tuple(1 if d is None else held.lengths[d] for d in dims),
    )
    # the held part with the piece's dimensions in the piece's order (the others are one
    # element long: squeezed away), a view of the rank's own memory
    mapped = [d for d in dims if d is not None]
    rest = [d for d in range(base.dim()) if d not in mapped]
    local = region(shard.tensor, held.within(shard.box)).permute(*mapped, *rest)
    return LocalShard(spec, box, local.reshape(box.lengths))


def checkpoint_shards(model: Any, shards: Mapping[str, LocalShard]) -> dict[str, LocalShard]:
    """``shards`` (a rank's, in ``model``'s own names) as the checkpoint's tensors, in
    transformers' order; a piece this rank holds nothing of has an empty box."""
    meta = {n: torch.empty(s.spec.shape, dtype=s.spec.torch_dtype, device="meta") for n, s in shards.items()}
    out: dict[str, LocalShard] = {}
    for group in layer_groups(list(meta)):
        for name, (piece, root) in checkpoint_pieces(model, {n: meta[n] for n in group}).items():
            if root is None and name in shards and tuple(piece.shape) == shards[name].spec.shape:
                out[name] = shards[name]  # not converted: the tensor as it is
            elif root is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} is made by concatenating tensors of the model: no rank holds "
                    "it as a box of its shards (send form='module')"
                )
            else:
                out[name] = _piece(name, piece, meta[root], shards[root])
    return out
