"""Layouts as data: which box of each global tensor a rank holds or needs.

A ``Box`` is a start and a length per dimension of a global tensor. A trainer rank's layout
says which box of each tensor it holds (its local shard); a receiver rank's layout says
which box it needs (the slice it keeps). A rank that holds or needs a whole tensor has the
whole box; a plain, unsharded model is the special case where every box is whole.

Boxes come from DTensor placements (``boxes_of_placements``: ``Shard(d)``, uneven last
chunks included, and ``Replicate``, over any number of mesh axes, as torch splits them), from
a live DTensor (``box_of_dtensor``), or are declared (Megatron-style local shards: the global
shape and the box per tensor). Everything here is a pure function of plain values: no
process group, no device, no tensor data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.plan import TensorSpec


@dataclass(frozen=True, order=True)
class Box:
    """A box of a global tensor: ``starts[d]`` and ``lengths[d]`` per dimension."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.lengths):
            raise ValueError(f"a box needs as many starts as lengths: {self.starts} vs {self.lengths}")
        if any(s < 0 for s in self.starts) or any(n < 0 for n in self.lengths):
            raise ValueError(f"a box has no negative starts or lengths: {self.starts}, {self.lengths}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(int(n) for n in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.starts, self.lengths))

    def intersect(self, other: Box) -> Box | None:
        """The box both cover, or None when they share no element."""
        starts = tuple(max(a, b) for a, b in zip(self.starts, other.starts))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))

    def contains(self, other: Box) -> bool:
        return all(
            s <= o and o + n <= s + m
            for s, m, o, n in zip(self.starts, self.lengths, other.starts, other.lengths)
        )

    def within(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it)."""
        return Box(tuple(s - o for s, o in zip(self.starts, outer.starts)), self.lengths)

    def to_wire(self) -> list[list[int]]:
        return [list(self.starts), list(self.lengths)]

    @classmethod
    def from_wire(cls, data: Any) -> Box:
        if not (isinstance(data, list) and len(data) == 2 and all(isinstance(p, list) for p in data)):
            raise ValueError(f"a box on the wire is [starts, lengths], got {data!r:.100}")
        values = [*data[0], *data[1]]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"a box's starts and lengths are integers, got {data!r:.100}")
        return cls(tuple(data[0]), tuple(data[1]))


@dataclass(frozen=True)
class Shard:
    """Split tensor dimension ``dim`` over a mesh axis (torch's ``Shard(dim)``)."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank along a mesh axis holds the same bytes (torch's ``Replicate()``)."""


Placement = Shard | Replicate


def chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``length`` elements are split into
    ``parts`` as ``torch.chunk`` splits them (and DTensor's ``Shard``): chunks of
    ``ceil(length / parts)``, the last ones shorter or empty."""
    size = -(-length // parts) if parts else 0
    start = min(index * size, length)
    return start, min(size, length - start)


def boxes_of_placements(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Box:
    """The box of a tensor of global ``shape`` that the rank at ``coordinate`` of a mesh of
    ``mesh_shape`` holds under ``placements`` (one per mesh axis). Two axes that shard the same
    dimension split it in mesh order, the later axis within the earlier one's chunk."""
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(
            f"a mesh of shape {tuple(mesh_shape)} needs a coordinate and a placement per axis, "
            f"got {tuple(coordinate)} and {list(placements)}"
        )
    starts, lengths = [0] * len(shape), [int(n) for n in shape]
    for size, at, placement in zip(mesh_shape, coordinate, placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise ValueError(f"placement {placement!r} cannot be sent as it is (only Shard and Replicate)")
        d = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
        if not 0 <= d < len(shape):
            raise ValueError(f"Shard({placement.dim}) of a tensor with {len(shape)} dimensions")
        offset, lengths[d] = chunk(lengths[d], size, at)
        starts[d] += offset
    return Box(tuple(starts), tuple(lengths))


def placements_of(dtensor_placements: Iterable[Any]) -> list[Placement]:
    """torch's placements as ours; a ``Partial`` (a sum not yet reduced) is refused."""
    out: list[Placement] = []
    for p in dtensor_placements:
        if p.is_shard():
            out.append(Shard(p.dim))
        elif p.is_replicate():
            out.append(Replicate())
        else:
            raise ValueError(f"placement {p!r} holds a partial value: reduce it before a sync")
    return out


def box_of_dtensor(tensor: Any) -> Box:
    """The box of its global tensor that this rank's local shard of ``tensor`` (a DTensor) is."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not in the DTensor's mesh: it holds no shard")
    return boxes_of_placements(
        tuple(tensor.shape), tuple(mesh.shape), coordinate, placements_of(tensor.placements)
    )


@dataclass(frozen=True)
class Layout:
    """What one rank holds (a trainer rank) or needs (a receiver rank): a box per tensor
    name. ``host``: the rank's host, whose NIC its bytes cross (ranks of one host share it)."""

    boxes: Mapping[str, Box]
    host: str = ""

    @classmethod
    def whole(cls, specs: Iterable[TensorSpec], host: str = "") -> Layout:
        """Every tensor whole: a plain model, or a receiver that declares nothing."""
        return cls({s.name: Box.whole(s.shape) for s in specs}, host)

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "boxes": {name: box.to_wire() for name, box in sorted(self.boxes.items())}}

    @classmethod
    def from_wire(cls, data: Any) -> Layout:
        if not isinstance(data, dict) or not isinstance(data.get("boxes"), dict):
            raise ValueError("a layout on the wire is a map with boxes")
        host = data.get("host", "")
        if not isinstance(host, str):
            raise ValueError("a layout's host is a string")
        return cls({str(name): Box.from_wire(box) for name, box in data["boxes"].items()}, host)
