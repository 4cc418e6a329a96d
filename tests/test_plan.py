"""The plan: split/merge round trips, layout invariants, serialization, stable hash."""

import json

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.plan import (
    ALIGNMENT,
    Assembler,
    Plan,
    PlanBuilder,
    TensorSpec,
    as_bytes,
    direct_bytes,
    dtype_name,
    make_plan,
    pack_pieces,
    packed_lag_bytes,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


def random_tensor(shape, dtype, gen):
    raw = torch.randint(
        0, 256, (max(1, torch.Size(shape).numel() * dtype.itemsize),), dtype=torch.uint8, generator=gen
    )
    if dtype == torch.bool:
        return (raw[: torch.Size(shape).numel()] % 2).bool().reshape(shape)
    n = torch.Size(shape).numel() * dtype.itemsize
    # Random bytes reinterpreted: covers NaN payloads and every bit pattern.
    return raw[:n].view(dtype).reshape(shape).clone() if n else torch.empty(shape, dtype=dtype)


def transfer(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Pack every bucket of the plan into a buffer and assemble it back, as the engines do."""
    plan = make_plan([TensorSpec.of(n, t) for n, t in tensors.items()], bucket_bytes)
    by_index = {i: as_bytes(t) for i, t in enumerate(tensors.values())}
    assembler = Assembler(plan.tensors, torch.device("cpu"))
    out = {}
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    for bucket in plan.buckets:
        assert bucket.nbytes <= bucket_bytes
        buffer.fill_(0xAB)  # stale bytes must never leak into a tensor
        pack_pieces(bucket, buffer, by_index)
        for name, t in assembler.unpack(bucket, buffer[: bucket.nbytes]):
            out[name] = t.clone()
    assert not assembler.incomplete
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


shapes = st.lists(st.integers(0, 37), min_size=0, max_size=3).map(tuple)
specs = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(specs=specs, bucket_bytes=st.integers(ALIGNMENT, 4096), seed=st.integers(0, 2**31))
def test_split_merge_round_trip_is_bit_exact(specs, bucket_bytes, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": random_tensor(shape, dtype, gen) for i, (shape, dtype) in enumerate(specs)}
    out = transfer(tensors, bucket_bytes)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert bit_equal(out[name], t), name


@settings(max_examples=150, deadline=None)
@given(specs=specs, bucket_bytes=st.integers(ALIGNMENT, 4096))
def test_layout_invariants(specs, bucket_bytes):
    plan = make_plan([TensorSpec(f"t{i}", s, dtype_name(d)) for i, (s, d) in enumerate(specs)], bucket_bytes)
    covered = {i: 0 for i in range(len(plan.tensors))}
    for k, bucket in enumerate(plan.buckets):
        assert bucket.index == k
        end = 0
        for p in bucket.pieces:
            assert p.bucket_offset >= end, "pieces overlap"
            if p.length:
                assert p.bucket_offset % ALIGNMENT == 0
            end = p.bucket_offset + p.length
            assert covered[p.tensor] == p.tensor_offset, "pieces of a tensor are in order and contiguous"
            covered[p.tensor] += p.length
        assert end == bucket.nbytes <= bucket_bytes
    assert all(covered[i] == s.nbytes for i, s in enumerate(plan.tensors))
    # A tensor that fits in a bucket is never split.
    for i, s in enumerate(plan.tensors):
        pieces = [p for b in plan.buckets for p in b.pieces if p.tensor == i]
        if s.nbytes <= bucket_bytes:
            assert len(pieces) == 1


def test_tensor_larger_than_bucket_spans_consecutive_buckets():
    plan = make_plan([TensorSpec("small", (10,), "float32"), TensorSpec("big", (1000,), "float32")], 1024)
    big = [(b.index, p) for b in plan.buckets for p in b.pieces if p.tensor == 1]
    assert len(big) == 4  # 4000 bytes: the rest of bucket 0, then 1024-byte pieces
    assert [i for i, _ in big] == [0, 1, 2, 3]
    assert sum(p.length for _, p in big) == 4000


def test_zero_element_scalar_and_non_contiguous():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=gen)
    tensors = {
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "transposed": base.t(),  # non-contiguous: made contiguous on send
        "strided": base[::3, 1::2],
        "fp8": torch.randn(33, generator=gen).to(torch.float8_e4m3fn),
        "flags": torch.rand(77, generator=gen) > 0.5,
    }
    assert not tensors["transposed"].is_contiguous()
    out = transfer(tensors, 256)
    for name, t in tensors.items():
        assert bit_equal(out[name], t.contiguous()), name


def test_plan_serializes_without_pickle_and_hash_is_stable():
    specs = [
        TensorSpec("a.weight", (4, 8), "bfloat16"),
        TensorSpec("b", (), "int64"),
        TensorSpec("c", (0,), "bool"),
    ]
    plan = make_plan(specs, 128)
    for codec in (lambda d: msgpack.unpackb(msgpack.packb(d)), lambda d: json.loads(json.dumps(d))):
        again = Plan.from_wire(codec(plan.to_wire()))
        assert again == plan and again.hash == plan.hash
    assert make_plan(list(specs), 128).hash == plan.hash
    assert make_plan(specs, 192).hash != plan.hash
    assert make_plan(specs[::-1], 128).hash != plan.hash
    # Fixed value: a change to the layout rule must bump PLAN_FORMAT, not silently change this.
    assert plan.hash == "3f96d02677d88540f0e29d980ccb8d8c709d0ff0a1ccd24b43a0113fcf5a973d"


def test_streaming_builder_matches_whole_plan():
    specs = [TensorSpec(f"t{i}", (i * 37 % 200,), "float16") for i in range(40)]
    builder = PlanBuilder(512)
    buckets = [b for s in specs for b in builder.add(s)] + builder.finish()
    assert tuple(buckets) == make_plan(specs, 512).buckets


def test_bad_specs_are_rejected_with_the_tensor_name():
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorSpec("w", (2,), "float99")
    with pytest.raises(ValueError, match="'w': bad shape"):
        TensorSpec("w", (-1,), "float32")
    with pytest.raises(ValueError, match="'x' appears twice"):
        make_plan([TensorSpec("x", (1,), "int8"), TensorSpec("x", (1,), "int8")], 64)


def test_large_tensors_travel_alone_and_small_ones_stay_packed():
    mib = 1 << 20
    specs = [
        TensorSpec("norm0", (256,), "float32"),
        TensorSpec("big", (3 * mib // 4 + 10,), "float32"),  # 3 MiB + 40 bytes: two 2 MiB buckets
        TensorSpec("norm1", (256,), "float32"),
        TensorSpec("mid", (mib // 4,), "float32"),  # exactly 1 MiB: the direct threshold
    ]
    plan = make_plan(specs, 2 * mib)
    assert direct_bytes(2 * mib) == mib
    alone = [b for b in plan.buckets if any(plan.tensors[p.tensor].name in ("big", "mid") for p in b.pieces)]
    # Every bucket of a large tensor holds one range of it, at offset 0, nothing else.
    assert all(len(b.pieces) == 1 and b.pieces[0].bucket_offset == 0 for b in alone)
    assert [b.nbytes for b in alone] == [2 * mib, mib + 40, mib]
    # The small ones are packed: norm0's bucket closed before "big", which alone is more
    # than an eighth of a bucket, could pass it.
    packed = [[plan.tensors[p.tensor].name for p in b.pieces] for b in plan.buckets if b not in alone]
    assert packed == [["norm0"], ["norm1"]]
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))


def test_a_packed_bucket_closes_before_an_eighth_of_a_bucket_of_large_tensors_passed_it():
    # Layer by layer, as a transformer's state dict: large matrices, then small tensors. An
    # engine that completes a layer when its last tensor arrives (vLLM's layerwise reload)
    # holds the layer's matrices until its norms come: they must follow closely, and must
    # not wait behind a huge tensor (an lm_head) either.
    mib = 1 << 20
    specs = []
    for layer in range(6):
        specs += [
            TensorSpec(f"l{layer}.q", (mib // 2,), "float32"),  # 2 MiB each: direct
            TensorSpec(f"l{layer}.o", (mib // 2,), "float32"),
            TensorSpec(f"l{layer}.norm", (64,), "float32"),
        ]
    specs += [TensorSpec("final_norm", (64,), "float32"), TensorSpec("lm_head", (9 * mib,), "float32")]
    plan = make_plan(specs, 32 * mib)  # lag: 4 MiB, two matrices
    assert packed_lag_bytes(32 * mib) == 4 * mib
    order = [plan.tensors[p.tensor].name for b in plan.buckets for p in b.pieces]
    # Every norm travels within 4 MiB (two matrices) of its own layer's matrices.
    for layer in range(6):
        assert 0 < order.index(f"l{layer}.norm") - order.index(f"l{layer}.o") <= 3
    packed = [[plan.tensors[p.tensor].name for p in b.pieces] for b in plan.buckets if len(b.pieces) > 1]
    # A packed bucket closes before the large tensor that would take 4 MiB past it, and
    # before the lm_head, which alone is larger.
    assert packed == [["l0.norm", "l1.norm"], ["l2.norm", "l3.norm"], ["l4.norm", "l5.norm", "final_norm"]], (
        packed
    )
    assert order.index("final_norm") < order.index("lm_head")
