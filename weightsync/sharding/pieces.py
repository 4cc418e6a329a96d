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

A large MoE has tens of thousands of pieces, and transformers' conversion of them takes
seconds (1.5 s for 48 layers of 128 experts here): it runs once per model and shapes
(``checkpoint_plan``), and a rank whose local tensors are the ones it cut last time gets
the same pieces back, so a steady job pays neither per sync.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.plan import TensorSpec
from weightsync.sharding.fragments import LocalShard, region
from weightsync.sharding.layout import Box
from weightsync.sharding.reads import Unreducible, view_box
from weightsync.wire.checkpoint import checkpoint_pieces, layer_groups


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor as a box of one of the model's own: ``root``'s box ``where``, the
    root dimension each of its dimensions runs along (None: one element long)."""

    spec: TensorSpec  # the checkpoint tensor
    root: str
    where: Box
    dims: tuple[int | None, ...]


#: a model's plan, by the global shapes it was made for (one entry per model: a new one
#: replaces it)
_PLANS: weakref.WeakKeyDictionary[Any, tuple[tuple, dict[str, Piece | None]]] = weakref.WeakKeyDictionary()
#: a model's last cut, by the local shards it was cut from
_CUTS: weakref.WeakKeyDictionary[Any, tuple[tuple, dict[str, LocalShard]]] = weakref.WeakKeyDictionary()


def checkpoint_plan(model: Any, specs: Mapping[str, TensorSpec]) -> dict[str, Piece | None]:
    """Each checkpoint tensor of ``model`` (whose own tensors have the global ``specs``) as a
    box of one of its own, in transformers' order; None: a tensor sent as it is."""
    key = tuple((n, s.shape, s.dtype) for n, s in specs.items())
    cached = _PLANS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    meta = {n: torch.empty(s.shape, dtype=s.torch_dtype, device="meta") for n, s in specs.items()}
    plan: dict[str, Piece | None] = {}
    for group in layer_groups(list(meta)):
        for name, (piece, root) in checkpoint_pieces(model, {n: meta[n] for n in group}).items():
            if root in (None, name) and name in specs and tuple(piece.shape) == specs[name].shape:
                plan[name] = None  # not converted: the tensor as it is
            elif root is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} is made by concatenating tensors of the model: no rank holds "
                    "it as a box of its shards (send form='module')"
                )
            else:
                try:
                    where, dims = view_box(piece, meta[root])
                except Unreducible as e:
                    raise ValueError(f"checkpoint tensor {name!r} is no box of {root!r} ({e})") from e
                plan[name] = Piece(TensorSpec(name, tuple(piece.shape), specs[root].dtype), root, where, dims)
    _PLANS[model] = (key, plan)
    return plan


def converts(plan: Mapping[str, Piece | None]) -> bool:
    """Whether a plan sends anything in another form than the model holds it."""
    return any(p is not None for p in plan.values())


def _cut(piece: Piece, shard: LocalShard) -> LocalShard:
    """What ``shard`` (of ``piece.root``) holds of ``piece``: a box of it, a view of its memory."""
    held = shard.box.intersect(piece.where)
    if held is None:
        empty = Box(tuple(0 for _ in piece.dims), tuple(0 for _ in piece.dims))
        return LocalShard(piece.spec, empty, shard.tensor.new_empty(empty.lengths))
    box = Box(
        tuple(0 if d is None else held.starts[d] - piece.where.starts[d] for d in piece.dims),
        tuple(1 if d is None else held.lengths[d] for d in piece.dims),
    )
    # the held part with the piece's dimensions in the piece's order (the others are one
    # element long: squeezed away)
    mapped = [d for d in piece.dims if d is not None]
    rest = [d for d in range(len(piece.where.starts)) if d not in mapped]
    local = region(shard.tensor, held.within(shard.box)).permute(*mapped, *rest)
    return LocalShard(piece.spec, box, local.reshape(box.lengths))


def checkpoint_shards(model: Any, shards: Mapping[str, LocalShard]) -> dict[str, LocalShard]:
    """``shards`` (a rank's, in ``model``'s own names) as the checkpoint's tensors, in
    transformers' order; a piece this rank holds nothing of has an empty box."""
    key = tuple(
        (n, s.box, s.tensor.data_ptr(), tuple(s.tensor.shape), s.tensor.stride()) for n, s in shards.items()
    )
    cached = _CUTS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = checkpoint_plan(model, {n: s.spec for n, s in shards.items()})
    out = {
        name: shards[name] if piece is None else _cut(piece, shards[piece.root])
        for name, piece in plan.items()
    }
    _CUTS[model] = (key, out)
    return out
