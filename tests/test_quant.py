"""Quantized forms: FP8 blocks exact against vLLM's quantizer, and receivers holding FP8
and bf16 in one sync over real transports (docs/quantized.md)."""

import time

import pytest
import quant_workers as qw
import torch
import workers
from procs import CTX, collect, free_port, start, stop

from weightsync import EngineConfig, HandshakeError, Sender
from weightsync.quant import quantize_blocks
from weightsync.sharding.fragments import region

pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.vllm
@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_equals_vllms_quantizer_bit_for_bit(ue8m0):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(0)
    for shape in [(256, 384), (200, 130), (1, 5), (129, 128), (300, 77)]:
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x = (torch.randn(shape, generator=g) * 3).to(dtype)
            x[:1, :3] = 0  # a block with zeros, and (1, 5) all but zero: the amax floor
            want_q, want_s = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue8m0)
            q, s = quantize_blocks(x, (128, 128), ue8m0)
            assert q.dtype == torch.float8_e4m3fn and torch.equal(
                q.view(torch.uint8), want_q.view(torch.uint8)
            )
            assert s.dtype == torch.float32 and torch.equal(s, want_s), (shape, dtype)
    stack = torch.randn(3, 200, 130, generator=g).to(torch.bfloat16)
    q, s = quantize_blocks(stack, ue8m0=ue8m0)
    assert s.shape == (3, 2, 2)
    for e in range(3):  # a stack: expert by expert
        want_q, want_s = per_block_cast_to_fp8(stack[e], [128, 128], use_ue8m0=ue8m0)
        assert torch.equal(q[e].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[e], want_s)
    zeros = torch.zeros(130, 130)
    assert torch.equal(quantize_blocks(zeros)[1], per_block_cast_to_fp8(zeros, [128, 128])[1])


@pytest.mark.vllm
@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_fp8_over_several_strips_equals_vllms_quantizer(ue8m0):
    """``quantize_blocks`` multiplies a strip of row blocks at a time (``fp8._STRIP``
    elements): shapes of 3 strips (the last one shorter), of 3 strips whose last row block
    is short (3000 rows: 23 blocks and 56 rows; 1000 columns: a short last column block), and
    a stack of 2 strips per expert, each expert's later strips with their own scales (values
    grow with the row, so a strip given another strip's scales shows)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.wire import fp8

    g = torch.Generator().manual_seed(1)
    for shape in [(2816, 1024), (3000, 1000), (4, 1024, 2048)]:
        rows = shape[-2]
        assert fp8._STRIP // (128 * shape[-1]) < -(-rows // 128)  # more than one strip
        ramp = torch.arange(1, rows + 1, dtype=torch.float32)[:, None] / 64
        x = (torch.randn(shape, generator=g) * ramp).to(torch.bfloat16)
        q, s = quantize_blocks(x, (128, 128), ue8m0)
        for i, m in enumerate(x.view(-1, *shape[-2:])):
            want_q, want_s = per_block_cast_to_fp8(m, [128, 128], use_ue8m0=ue8m0)
            got_q, got_s = (q[i], s[i]) if x.dim() == 3 else (q, s)
            assert torch.equal(got_s, want_s), (shape, i)
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), (shape, i)


def _cut(length, at):
    """``(start, length)`` pieces of ``range(length)`` cut at the points ``at``."""
    edges = [0, *at, length]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


@pytest.mark.vllm
@pytest.mark.parametrize("ue8m0", [False, True])
def test_boxes_cut_across_columns_quantize_as_vllm_quantizes_the_whole(ue8m0):
    """A tensor cut into boxes by columns (a ``Shard(1)`` trainer; a receiver's column slices
    of ``o_proj``/``down_proj``) and by rows and columns at once, cuts inside blocks: each box's
    block maxima (``box_amax``, from a column inside a block), the largest of them per block
    (what the trainer ranks agree), and each box quantized with those scales
    (``quantize_box``) give vLLM's quantizer's bytes and scales of the whole tensor, sliced."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from weightsync.wire.fp8 import box_amax, quantize_box, scales_of

    g = torch.Generator().manual_seed(2)
    cases = [  # shape, row cuts, column cuts
        ((200, 300), [], [150]),  # Shard(1) over 2 ranks: column 150 inside block 1
        ((256, 1000), [], [250, 500, 750]),  # 4 ranks, every cut inside a block
        ((300, 77), [100], [40]),  # rows and columns, both inside the first block
        ((3, 96, 260), [], [130]),  # a stack cut by columns, expert by expert
    ]
    for shape, row_cuts, col_cuts in cases:
        x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
        x[..., :5, -3:] *= 50  # a block whose maximum lies in the last box only
        pairs = [per_block_cast_to_fp8(m, [128, 128], use_ue8m0=ue8m0) for m in x.view(-1, *shape[-2:])]
        want_q = torch.stack([p[0] for p in pairs]).view(shape)
        want_s = torch.stack([p[1] for p in pairs]).view(*shape[:-2], *pairs[0][1].shape)
        boxes = [(r, c) for r in _cut(shape[-2], row_cuts) for c in _cut(shape[-1], col_cuts)]
        amax = torch.zeros(want_s.shape)
        for (r0, h), (c0, w) in boxes:
            part = box_amax(x[..., r0 : r0 + h, c0 : c0 + w], (r0, c0))
            at = amax[..., r0 // 128 : r0 // 128 + part.shape[-2], c0 // 128 : c0 // 128 + part.shape[-1]]
            at.copy_(torch.maximum(at, part))
        scales = scales_of(amax, ue8m0)
        assert torch.equal(scales, want_s), shape
        for (r0, h), (c0, w) in boxes:
            got = quantize_box(x[..., r0 : r0 + h, c0 : c0 + w], (r0, c0), scales)
            want = want_q[..., r0 : r0 + h, c0 : c0 + w]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (shape, r0, c0)


def reference(t, ue8m0):
    """vLLM's block quantizer, expert by expert for a stack."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    pairs = [per_block_cast_to_fp8(m, list(qw.BLOCK), use_ue8m0=ue8m0) for m in t.view(-1, *t.shape[-2:])]
    q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    return (q, s) if t.dim() == 3 else (q[0], s[0])


def expected(version, form, weights=qw.weights):
    """A receiver's tensors after ``version``: the trainer's bf16, and for an FP8 receiver
    vLLM's quantizer's bytes and scales of the quantized ones."""
    out = {}
    for name, t in weights(version).items():
        if form != "bf16" and name in qw.QUANTIZED:
            q, s = reference(t, ue8m0=form == "ue8m0")
            out[name], out[name + "_scale_inv"] = workers.digest(q), workers.digest(s)
        else:
            out[name] = workers.digest(t)
    return out


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_fp8_and_bf16_receivers_take_their_own_forms_from_one_sync(backend):
    forms = ["fp8", "bf16", "ue8m0"]
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=60"]
    versions = [1, 2, 3]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", len(forms)) as sender:
        procs = [
            start(qw.run_receiver, sender.address, r, overrides, versions, q, form)
            for r, form in enumerate(forms)
        ]
        try:
            sizes = []
            for v in versions:
                stats = sender.send(qw.weights(v), version=v)
                assert stats.quantized == 2 * len(qw.QUANTIZED)  # each form's tensors quantized once
                sizes.append(stats.bytes)
                reports = sorted(collect(q, len(forms)))
                for (rank, got_v, digests, missing, _), form in zip(reports, forms):
                    assert got_v == v, digests
                    assert missing == [], (form, missing)
                    assert digests == expected(v, form), f"receiver {rank} ({form}) differs at version {v}"
            bf16 = sum(t.numel() * 2 for t in qw.weights(1).values())
            quantized = sum(t.numel() for n, t in qw.weights(1).items() if n in qw.QUANTIZED)
            assert sizes[0] > bf16 + 2 * quantized  # bf16 for one, each FP8 form for the others
        finally:
            stop(procs)


@pytest.mark.slow
@pytest.mark.vllm
def test_only_fp8_receivers_halve_the_bytes_on_the_wire():
    overrides = ["backend=shm", "update_weights_bucket_megabytes=1", "timeout_s=60"]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(qw.run_receiver, sender.address, r, overrides, [1, 2], q, "fp8") for r in range(2)]
        try:
            for v in (1, 2):
                stats = sender.send(qw.weights(v), version=v)
                for _, got_v, digests, _, _ in collect(q, 2):
                    assert got_v == v and digests == expected(v, "fp8")
            held = qw.holding(fp8=True)  # only the FP8 form of the quantized tensors travels
            assert stats.bytes == sum(t.numel() * t.element_size() for t in held.values())
            full = sum(t.numel() * 2 for t in qw.weights(1).values())
            assert stats.bytes < 0.56 * full  # the embedding and the norm stay bf16
        finally:
            stop(procs)


@pytest.mark.slow
def test_a_form_the_trainer_cannot_make_is_refused_in_the_handshake_naming_tensor_and_form():
    overrides = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=30"]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [
            start(qw.run_receiver, sender.address, 0, overrides, [1], q, "bf16"),
            start(qw.run_receiver, sender.address, 1, overrides, [1], q, "bf16-scales"),
        ]
        try:
            with pytest.raises(HandshakeError) as caught:
                sender.send(qw.weights(1), version=1)
            message = str(caught.value)
            assert "receiver rank 1" in message and "'layers.0.proj.weight'" in message
            assert "bfloat16 scales" in message and "unknown scale layout 'bfloat16'" in message
            errors = collect(q, 2)
            assert all(e[1] == "error" and "proj.weight" in e[2] for e in errors), errors
        finally:
            stop(procs)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_delta_sync_carries_the_quantized_bytes_deltas():
    overrides = ["backend=shm", "update_weights_bucket_megabytes=1", "timeout_s=60", "delta=on"]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(qw.run_receiver, sender.address, r, overrides, [1, 2, 3], q, "fp8") for r in range(2)]
        try:
            for v in (1, 2, 3):
                stats = sender.send(qw.sparse_weights(v), version=v)
                for _, got_v, digests, _, base in collect(q, 2):
                    assert got_v == v and digests == expected(v, "fp8", qw.sparse_weights), v
                    assert base == (None if v == 1 else v - 1)  # deltas against the FP8 bytes held
                if v > 1:
                    assert stats.delta_base == v - 1 and stats.wire_bytes < stats.bytes / 4
        finally:
            stop(procs)


def sliced(version, part, parts):
    """A tensor-parallel FP8 rank's tensors after ``version``: its slices of vLLM's
    quantizer's bytes and scales, every other tensor the trainer's bf16."""
    out = {}
    boxes = qw.sliced_boxes(part, parts)
    for name, t in qw.weights(version).items():
        if name in boxes:
            q, s = reference(t, ue8m0=False)
            box, scales = boxes[name]
            out[name] = workers.digest(region(q, box).contiguous())
            out[name + "_scale_inv"] = workers.digest(region(s, scales).contiguous())
        else:
            out[name] = workers.digest(t)
    return out


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["nccl", "sharded"])
def test_fsdp2_rows_and_columns_cut_inside_a_block_get_one_scale_from_the_gathered_block(backend):
    """A 2-rank FSDP2 trainer whose ``Shard(0)`` cuts a 128-row block at row 100 (another at
    row 192) and whose ``Shard(2)`` cuts each expert's first block at column 65; an FP8 receiver, a UE8M0 one and a bf16 one in each sync, 3 versions: every
    block gets the scale of all its rows, as vLLM quantizing the whole tensor gives. Over a
    dense backend rank 0 quantizes the gathered tensor (``full_tensor``); over ``sharded``
    each rank quantizes its own rows (columns), the cut blocks' maxima agreed between the ranks
    (docs/quantized.md), the bf16 receiver takes the trainer's bytes in the same sync, and
    two tensor-parallel FP8 receiver ranks (rows cut at 128, the stack by experts) each
    take their slice of the bytes and of the scales."""
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=60"]
    q, addresses, rq = CTX.Queue(), CTX.Queue(), CTX.Queue()
    port, session = free_port(), f"127.0.0.1:{free_port()}"
    versions = [1, 2, 3]
    forms = ["fp8", "ue8m0", "bf16"]
    tp = 2 if backend == "sharded" else 0  # tensor-parallel FP8 ranks after those
    trainers = [
        start(qw.run_fsdp_trainer, r, port, addresses, overrides, versions, q, len(forms) + tp, session)
        for r in range(2)
    ]
    receivers = []
    try:
        address = addresses.get(timeout=90)
        receivers = [
            start(qw.run_receiver, address, i, overrides, versions, rq, f) for i, f in enumerate(forms)
        ]
        receivers += [
            start(qw.run_sliced_receiver, address, len(forms) + p, overrides, versions, rq, p, tp)
            for p in range(tp)
        ]
        for v in versions:
            reports = sorted(collect(q, 2), key=lambda r: r[0])
            assert [(r[1], r[2]) for r in reports] == [(v, 100), (v, 100)], reports  # rows 0-99 | 100-199
            # the forms quantized: dense, rank 0 alone; sharded, each rank its own rows
            made = 2 * len(qw.QUANTIZED)  # float32 and UE8M0 scales
            assert [r[3] for r in reports] == ([made, 0] if backend == "nccl" else [made, made]), reports
            for rank, got_v, digests, missing, _ in sorted(collect(rq, len(forms) + tp)):
                assert got_v == v and missing == [], (rank, got_v, missing)
                if rank < len(forms):
                    assert digests == expected(v, forms[rank]), (forms[rank], v)
                else:
                    assert digests == sliced(v, rank - len(forms), tp), (rank, v)
    finally:
        stop(trainers + receivers)


def test_a_streaming_receiver_skips_the_forms_and_its_errors_still_reach_the_session():
    """``receive()`` without forms takes only untagged entries; what its consumer throws in
    (the vLLM worker's loader error) reaches the session's generator, which drains and
    tells the sender, and stopping early closes it."""
    from weightsync.quant.receive_stage import untagged

    seen = []

    def session():
        try:
            yield "a", torch.zeros(1)
            yield "a@fp8-128x128", torch.zeros(1)
            yield "a_scale_inv@fp8-128x128", torch.zeros(1)
            yield "b", torch.zeros(1)
            yield "c", torch.zeros(1)
        except GeneratorExit:
            seen.append("closed")
            raise
        except ValueError as e:
            seen.append(f"thrown: {e}")
            raise

    items = untagged(session())
    assert next(items)[0] == "a" and next(items)[0] == "b"
    with pytest.raises(ValueError, match="loader failed"):
        items.throw(ValueError("loader failed"))
    assert seen == ["thrown: loader failed"]
    items = untagged(session())
    assert [n for n, _ in items] == ["a", "b", "c"]
    items = untagged(session())
    next(items)
    items.close()
    assert seen[-1] == "closed"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trainer_rank_silent_while_the_ranks_agree_the_scales_fails_the_sync_within_its_deadline():
    """Over ``sharded``, trainer rank 1 stops answering after the go of version 2 (alive, as
    the ranks agree the scales of their cut blocks): rank 0 does not wait in the collective
    for ever, its sync fails within ``timeout_s`` naming the agreement, and the receiver's
    sync of version 2 fails too."""
    overrides = ["backend=sharded", "update_weights_bucket_megabytes=1", "timeout_s=8"]
    q, addresses, rq = CTX.Queue(), CTX.Queue(), CTX.Queue()
    port, session = free_port(), f"127.0.0.1:{free_port()}"
    trainers = [
        start(qw.run_fsdp_trainer, r, port, addresses, overrides, [1, 2], q, 1, session, 2) for r in range(2)
    ]
    receivers = []
    try:
        address = addresses.get(timeout=90)
        receivers = [start(qw.run_receiver, address, 0, overrides, [1, 2], rq, "fp8")]
        assert sorted(r[:2] for r in collect(q, 2)) == [(0, 1), (1, 1)]
        ((_, v, digests, _, _),) = collect(rq, 1)
        assert v == 1 and digests == expected(1, "fp8")
        t0 = time.monotonic()
        ((rank, error, message, _),) = collect(q, 1, timeout=60)
        assert (rank, error) == (0, "error") and "agreeing the FP8 scales" in message, message
        assert time.monotonic() - t0 < 8 + 10, message  # timeout_s, and the handshake before it
        ((_, failed, why),) = collect(rq, 1, timeout=60)
        assert failed == "error", why
    finally:
        stop(trainers + receivers)
