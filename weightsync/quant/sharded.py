"""Quantized forms over ``backend=sharded``: each trainer rank quantizes its own shard.

A sharded receiver declares its forms in its layout (``FragmentSink``): the boxes it keeps
of ``P@<tag>`` (the FP8 bytes) and ``P_scale_inv@<tag>`` (the scales) instead of ``P``. Every
trainer rank reads the tags its receivers' layouts name (``wanted``) and holds those entries
too (``FormedSource``): the FP8 bytes of ``P`` in ``P``'s own box, and the scales of the blocks
whose first element lies in that box (so the ranks' scale boxes never overlap, as the route
needs). The route is then planned as for any tensor: each FP8 byte and each scale goes
from the rank that holds it to the receivers that keep it, and bf16 receivers take ``P`` in
the same sync.

A block cut between two ranks' shards (FSDP2's ``Shard(0)`` rows at row 100 cut the block
of rows 0-127) still gets one scale, the one the whole block gives: after the go every
trainer rank takes the maxima of its part of each block (``fp8.box_amax``) and the ranks
agree the largest in one ``all_reduce(MAX)`` over the trainer's default process group (the
trainer ranks, as ``Sender`` counts them), then each quantizes its own rows with the agreed
scales (``fp8.quantize_box``): bit for bit what quantizing the gathered tensor gives. The
alternative, moving the cut block's rows to one rank first, costs a transfer per cut block
and a rank that waits for it; the maxima are 1/16384 of the FP8 bytes and one collective.
A rank's FP8 copy of its shard is made at once for the sync (half of its bf16 bytes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync.errors import SyncTimeout
from weightsync.plan import TensorSpec
from weightsync.sharding.agreement import ShardSource
from weightsync.sharding.fragments import LocalShard, region
from weightsync.sharding.layout import Box, Layout
from weightsync.wire.forms import FP8, SCALE_SUFFIX, TAG, Form, split_tag
from weightsync.wire.fp8 import box_amax, quantize_box, scale_shape, scales_of


def wanted(needs: Iterable[Any]) -> dict[str, frozenset[str]]:
    """The forms the receivers' layouts name: tensor name -> tags (a layout's ``P@<tag>``)."""
    tags: dict[str, set[str]] = {}
    for layout in needs:
        if not isinstance(layout, Layout):
            continue  # a receiver that declared nothing takes what the trainer holds
        for name in layout.boxes:
            parts = split_tag(name)
            if parts is not None and not parts[0].endswith(SCALE_SUFFIX):
                tags.setdefault(parts[0], set()).add(name.rsplit(TAG, 1)[1])
    return {name: frozenset(t) for name, t in tags.items()}


def scale_box(box: Box, block: tuple[int, int]) -> Box:
    """The scales a rank holding ``box`` of a tensor holds: of the blocks whose first element
    lies in the box (leading dimensions of a stack as they are)."""
    starts, lengths = list(box.starts[:-2]), list(box.lengths[:-2])
    for s, n, b in zip(box.starts[-2:], box.lengths[-2:], block):
        first, end = -(-s // b), -(-(s + n) // b) if n else -(-s // b)
        starts.append(first)
        lengths.append(max(0, end - first))
    return Box(tuple(starts), tuple(lengths))


class FormedSource(ShardSource):
    """A trainer rank's shards with the quantized entries ``tags`` names (tensor name ->
    tags), each beside its tensor in the source's order, filled by ``quantize`` after the go.
    ``trainers``: the trainer ranks that agree the scales of cut blocks, each waiting at most
    ``timeout_s`` for the others. Raises ``ValueError`` naming a tensor the trainer cannot
    quantize."""

    def __init__(
        self, src: ShardSource, tags: Mapping[str, frozenset[str]], trainers: int, timeout_s: float
    ) -> None:
        if trainers > 1 and not (dist.is_initialized() and dist.get_world_size() == trainers):
            raise ValueError(
                f"quantized forms over backend=sharded agree the scales of blocks cut between the {trainers} "
                "trainer ranks over the default process group, which must hold exactly those ranks "
                f"({'a world of ' + str(dist.get_world_size()) if dist.is_initialized() else 'not initialized'})"
            )
        self.base, self.tags, self.trainers, self.timeout_s = src, dict(tags), trainers, timeout_s
        self.seconds, self.quantized = 0.0, 0
        shards: dict[str, LocalShard] = {}
        self._work: list[tuple[LocalShard, LocalShard, LocalShard, tuple[int, int], bool]] = []
        for name, shard in src.shards.items():
            shards[name] = shard
            for tag in sorted(tags.get(name, ())):
                parts = split_tag(f"{name}{TAG}{tag}")
                assert parts is not None  # ``wanted`` read it so
                _, block, scale = parts
                scales = scale_shape(shard.spec.shape, block) if len(shard.spec.shape) in (2, 3) else ()
                problem = Form(block, scale, f"{name}{SCALE_SUFFIX}", scales).problem(shard.spec)
                if problem is not None:
                    raise ValueError(
                        f"a receiver keeps tensor {name!r} as {tag}, which this trainer cannot make: {problem}"
                    )
                spec, device = shard.spec, shard.tensor.device
                q = LocalShard(
                    TensorSpec(f"{name}{TAG}{tag}", spec.shape, FP8),
                    shard.box,
                    torch.empty(shard.box.lengths, dtype=torch.float8_e4m3fn, device=device),
                )
                box = scale_box(shard.box, block)
                s = LocalShard(
                    TensorSpec(f"{name}{SCALE_SUFFIX}{TAG}{tag}", scales, "float32"),
                    box,
                    torch.empty(box.lengths, dtype=torch.float32, device=device),
                )
                shards[q.spec.name], shards[s.spec.name] = q, s
                self._work.append((shard, q, s, block, scale == "ue8m0"))
        super().__init__(shards)

    def quantize(self) -> None:
        """Every rank at once, after the go: the block maxima of each rank's part, the
        largest agreed across the trainer ranks, then each rank's FP8 bytes and scales."""
        t0 = time.perf_counter()
        grids = []
        for shard, _, _, block, _ in self._work:
            grid = torch.zeros(
                scale_shape(shard.spec.shape, block), dtype=torch.float32, device=shard.tensor.device
            )
            part = box_amax(shard.tensor, shard.box.starts[-2:], block)
            at = Box(
                (*shard.box.starts[:-2], *(s // b for s, b in zip(shard.box.starts[-2:], block))),
                tuple(part.shape),
            )
            region(grid, at).copy_(part)
            grids.append(grid)
        if self.trainers > 1 and grids:
            flat = torch.cat([g.flatten() for g in grids])
            on = flat if dist.get_backend() != "gloo" else flat.cpu()
            work = dist.all_reduce(on, op=dist.ReduceOp.MAX, async_op=True)
            try:  # a trainer rank that failed after the go must not hang the others
                work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise SyncTimeout(
                    f"agreeing the FP8 scales of blocks cut between the {self.trainers} trainer ranks failed "
                    f"(a trainer rank gone? each waits timeout_s={self.timeout_s:g} s): {e}"
                ) from e
            flat = on.to(flat.device)
            for g, agreed in zip(grids, flat.split([g.numel() for g in grids])):
                g.copy_(agreed.view(g.shape))
        for (shard, q, s, block, ue8m0), grid in zip(self._work, grids):
            scales = scales_of(grid, ue8m0)
            s.tensor.copy_(region(scales, s.box))
            lead = scales[
                tuple(slice(a, a + n) for a, n in zip(shard.box.starts[:-2], shard.box.lengths[:-2]))
            ]
            q.tensor.copy_(quantize_box(shard.tensor, shard.box.starts[-2:], lead, block))
        self.seconds, self.quantized = time.perf_counter() - t0, len(self._work)
