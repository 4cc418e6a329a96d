"""``weightsync.sharding.reads``: the box of a checkpoint tensor a loader reads, found on a
stand-in without bytes, checked against the same loader run on real data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.plan import TensorSpec
from weightsync.sharding.fragments import region
from weightsync.sharding.layout import Box
from weightsync.sharding.reads import dry_run


def read_values(load, shape) -> set[int]:
    """The elements ``load`` copies out of a real tensor whose values are their indices."""
    source = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    seen: set[int] = set()
    copy = torch.Tensor.copy_

    def spy(dest, src, *args, **kwargs):
        if src.dtype == torch.float64:
            seen.update(int(v) for v in src.reshape(-1).tolist())
        return copy(dest, src, *args, **kwargs)

    torch.Tensor.copy_ = spy
    try:
        load(source)
    finally:
        torch.Tensor.copy_ = copy
    return seen


def box_values(box: Box, shape) -> set[int]:
    whole = torch.arange(torch.Size(shape).numel()).view(shape)
    return set(region(whole, box).reshape(-1).tolist())


# One step of a loader: a view op with arguments drawn for the tensor it gets.
@st.composite
def view_chain(draw, shape):
    ops = []
    dims = list(shape)
    for _ in range(draw(st.integers(0, 3))):
        if not dims:
            break
        d = draw(st.integers(0, len(dims) - 1))
        kind = draw(st.sampled_from(["narrow", "select", "transpose", "chunk", "slice"]))
        if kind == "narrow":
            start = draw(st.integers(0, dims[d] - 1))
            n = draw(st.integers(1, dims[d] - start))
            ops.append(lambda t, d=d, s=start, n=n: t.narrow(d, s, n))
            dims[d] = n
        elif kind == "select" and len(dims) > 1:
            i = draw(st.integers(0, dims[d] - 1))
            ops.append(lambda t, d=d, i=i: t.select(d, i))
            dims.pop(d)
        elif kind == "transpose" and len(dims) > 1:
            e = draw(st.integers(0, len(dims) - 1))
            ops.append(lambda t, d=d, e=e: t.transpose(d, e))
            dims[d], dims[e] = dims[e], dims[d]
        elif kind == "chunk":
            parts = draw(st.integers(1, dims[d]))
            chunks = torch.empty(dims).chunk(parts, d)
            k = draw(st.integers(0, len(chunks) - 1))
            ops.append(lambda t, d=d, p=parts, k=k: t.chunk(p, d)[k])
            dims[d] = chunks[k].shape[d]
        elif kind == "slice":
            start = draw(st.integers(0, dims[d] - 1))
            stop = draw(st.integers(start + 1, dims[d]))
            ops.append(lambda t, d=d, a=start, b=stop: t[(slice(None),) * d + (slice(a, b),)])
            dims[d] = stop - start
    return ops, dims


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_box_found_without_data_is_exactly_what_the_loader_reads(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3), label="shape"))
    ops, dims = data.draw(view_chain(shape), label="ops")

    def load(t):
        for op in ops:
            t = op(t)
        torch.empty(dims, dtype=t.dtype).copy_(t)

    box, why = dry_run(TensorSpec("w", shape, "float64"), load)
    assert why is None, why
    assert box_values(box, shape) == read_values(load, shape)


def _col(t):  # column parallel, rank 1 of 2: output rows
    torch.empty(4, 6).copy_(t.narrow(0, 4, 4))


def _vocab(t):  # a vocabulary shard copied into a padded parameter, the padding zeroed
    p = torch.empty(5, 6)
    part = t.narrow(0, 4, 4)
    p[: part.shape[0]].data.copy_(part)
    p[part.shape[0] :].data.fill_(0)


def _two_reads(t):  # a fused parameter loaded from two boxes of one tensor: their hull
    torch.empty(1, 6).copy_(t[1:2])
    torch.empty(1, 6).copy_(t[5:6])


@pytest.mark.parametrize(
    "load, box",
    [
        (_col, Box((4, 0), (4, 6))),
        (lambda t: torch.empty(8, 3).copy_(t[:, 3:]), Box((0, 3), (8, 3))),
        (lambda t: torch.empty(6, 4).copy_(t.t()[:, 4:].contiguous()), Box((4, 0), (4, 6))),
        (lambda t: torch.empty(6).copy_(t.select(0, 5)), Box((5, 0), (1, 6))),
        (lambda t: torch.empty(4, 6, dtype=torch.half).copy_(t.to(torch.half)[4:]), Box((4, 0), (4, 6))),
        (_vocab, Box((4, 0), (4, 6))),
        (_two_reads, Box((1, 0), (5, 6))),
    ],
)
def test_view_ops_before_a_copy_give_the_box_read(load, box):
    assert dry_run(TensorSpec("w", (8, 6), "float32"), load) == (box, None)


@pytest.mark.parametrize(
    "load, why",
    [
        (lambda t: torch.empty(1).fill_(t.sum().item()), "sum"),
        (lambda t: torch.empty(16, 6).copy_(torch.cat([t, t])), "cat"),
        (lambda t: torch.empty(8, 6).copy_(t * 2), "mul"),
        (lambda t: torch.empty(4, 6).copy_(t[::2]), "stride"),
        (lambda t: t.copy_(torch.zeros(8, 6)), "copy into"),
        (lambda t: None, "read nothing"),
        (lambda t: torch.empty(48).copy_(t.t().reshape(-1)), "reshape"),
    ],
)
def test_what_no_box_describes_takes_the_tensor_whole(load, why):
    box, reason = dry_run(TensorSpec("w", (8, 6), "float32"), load)
    assert box == Box.whole((8, 6))
    assert reason is not None and why in reason, reason
