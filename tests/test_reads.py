"""``weightsync.sharding.reads``: the box of a checkpoint tensor a loader reads, found on a
stand-in without bytes, checked against the same loader run on real data."""

from __future__ import annotations

import glob
import os

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
        kind = draw(st.sampled_from(["narrow", "select", "transpose", "chunk", "split", "slice"]))
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
        elif kind == "split":  # by sizes that add up to the dimension
            cuts = sorted(draw(st.sets(st.integers(1, dims[d] - 1), max_size=3))) if dims[d] > 1 else []
            sizes = [b - a for a, b in zip([0, *cuts], [*cuts, dims[d]])]
            k = draw(st.integers(0, len(sizes) - 1))
            ops.append(lambda t, d=d, s=sizes, k=k: t.split(s, d)[k])
            dims[d] = sizes[k]
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


def _fused_split(t):  # a fused q/k/v tensor: vLLM's loaders take a shard's part by split
    q, k, v = t.split([4, 2, 2], 0)
    torch.empty(2, 6).copy_(k)


def _heads_view(t):  # rows viewed as (heads, head_dim, columns), one head taken: view, then select
    torch.empty(2, 6).copy_(t.view(4, 2, 6)[3])


def _columns_view(t):  # each row's columns viewed as two halves, the second taken
    torch.empty(8, 3).copy_(t.view(8, 2, 3)[:, 1])


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
        (_fused_split, Box((4, 0), (2, 6))),
        (lambda t: torch.empty(8, 2).copy_(t.split(2, 1)[1]), Box((0, 2), (8, 2))),
        (_heads_view, Box((6, 0), (2, 6))),
        (_columns_view, Box((0, 3), (8, 3))),
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
        (lambda t: torch.empty(2, 6).copy_(t.view(2, 24)[:, :6]), "stride 24"),  # rows 0 and 4
    ],
)
def test_what_no_box_describes_takes_the_tensor_whole(load, why):
    box, reason = dry_run(TensorSpec("w", (8, 6), "float32"), load)
    assert box == Box.whole((8, 6))
    assert reason is not None and why in reason, reason


def _ident(port: int) -> str:
    return f"weightsync-test-reads-{port}"


def _fused_reads(rank: int, port: int, queue) -> None:
    """TP rank ``rank`` of 2 (vLLM's own process groups over Gloo): for a checkpoint that
    stores q, k and v fused (Phi-3's ``qkv_proj``: 4 query heads, 2 k/v heads of 32) and
    gate and up fused (``gate_up_proj``), vLLM's own weight loaders, run on a stand-in and
    on real data; puts ``(rank, {name: (box, why, rows read)})``, or the error."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

        torch.set_num_threads(1)
        os.environ["VLLM_DIST_IDENT"] = _ident(port)  # as vLLM's CPU worker names its shared memory
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=2,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(tensor_model_parallel_size=2)
            layers = {
                "qkv_proj.weight": QKVParallelLinear(64, 32, 4, 2, bias=False, params_dtype=torch.float32),
                "gate_up_proj.weight": MergedColumnParallelLinear(
                    64, [96, 96], bias=False, params_dtype=torch.float32
                ),
            }
            out = {}
            for name, layer in layers.items():
                shape = (sum(layer.output_sizes) if hasattr(layer, "output_sizes") else 256, 64)
                load = lambda t, layer=layer: layer.weight_loader(layer.weight, t)  # noqa: E731 (no shard id: fused on disk)
                box, why = dry_run(TensorSpec(name, shape, "float64"), load)
                rows = sorted({v // shape[1] for v in read_values(load, shape)})
                out[name] = (shape, box, why, rows)
        queue.put((rank, out))
    except Exception as e:
        import traceback

        queue.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


@pytest.mark.vllm
@pytest.mark.timeout(180)
def test_a_tensor_fused_in_the_checkpoint_is_read_as_the_hull_of_its_parts_by_vllms_own_loaders():
    """Phi-3 stores ``qkv_proj`` and ``gate_up_proj`` fused: vLLM's loader splits the fused
    tensor into its parts and narrows each to this TP rank. The dry run on vLLM's own
    loaders (2 real TP ranks) finds the box covering every row each rank reads, and nothing
    it does not: rank 0 reads q rows 0-63, k rows 128-159 and v rows 192-223 of qkv_proj;
    rank 1 q 64-127, k 160-191, v 224-255 (each its own k/v head)."""
    from procs import CTX, collect, free_port, start, stop

    queue, port = CTX.Queue(), free_port()
    procs = [start(_fused_reads, rank, port, queue) for rank in range(2)]
    try:
        got = dict(collect(queue, 2, timeout=150))
    finally:
        stop(procs)
        for leftover in glob.glob(f"/dev/shm/{glob.escape(_ident(port))}-*"):  # vLLM's groups' memory
            os.unlink(leftover)
    assert all(isinstance(v, dict) for v in got.values()), got
    expected_rows = {
        "qkv_proj.weight": [
            [*range(0, 64), *range(128, 160), *range(192, 224)],
            [*range(64, 128), *range(160, 192), *range(224, 256)],
        ],
        "gate_up_proj.weight": [[*range(0, 48), *range(96, 144)], [*range(48, 96), *range(144, 192)]],
    }
    for rank in (0, 1):
        for name, (shape, box, why, rows) in got[rank].items():
            assert why is None, (rank, name, why)
            assert rows == expected_rows[name][rank], (rank, name)  # vLLM's loader, on real data
            hull = Box((rows[0], 0), (rows[-1] + 1 - rows[0], shape[1]))
            assert box == hull, (rank, name, box, hull)
