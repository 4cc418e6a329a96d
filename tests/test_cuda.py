"""The CUDA paths between processes: ``nccl`` over NCCL, ``shm`` over CUDA IPC, ``paired``
and ``sharded`` over NCCL pairs, with every process's tensors and transfer buffers on
``cuda:0`` (all the processes share the one GPU).

Marked ``cuda``: they run on a GPU machine through ``make gpu-check`` (``weightsync
gpu-check``), which reports each test as a check; ``make test`` deselects them and says so.
The trainer runs in a process of its own, like the receivers, so that a device collective
left hanging dies with its process and not with pytest's.

Several NCCL ranks on one GPU need NCCL >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (set
here unless set). Where gpu-check's probe found that NCCL refuses them, the ``nccl``,
``paired`` and ``sharded`` tests report ``blocked:`` with its reason.
``WEIGHTSYNC_TEST_DEVICE=cpu`` runs the same tests on the CPU (Gloo, host shared memory):
gpu-check's rehearsal, to test them without a GPU.
"""

import os
import signal

import pytest
import workers
from procs import CTX, collect, start

from weightsync import platform
from weightsync.gpucheck.driver import NCCL_BLOCKED_ENV, SHARED_GPU_NCCL_ENV, TEST_DEVICE_ENV

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]

DEVICE = os.environ.get(TEST_DEVICE_ENV, workers.CUDA)
ON_HOST = DEVICE == "cpu"  # the rehearsal: the same tests on the CPU
#: the trainer's weights on the device (functions in tests/workers.py, by name)
WEIGHTS = "make_weights" if ON_HOST else "cuda_weights"
BIG_WEIGHTS = "big_weights" if ON_HOST else "cuda_big_weights"
START_S = 60  # a fresh process imports torch and creates its CUDA context

for _key, _value in SHARED_GPU_NCCL_ENV.items():
    os.environ.setdefault(_key, _value)  # the child processes inherit them


@pytest.fixture(autouse=True, scope="module")
def _a_cuda_device():
    if not ON_HOST and platform.current_platform().kind != "cuda":
        pytest.fail(
            "no CUDA device: the tests marked cuda run on a GPU machine through `make gpu-check`; "
            "`make test` deselects them"
        )


def needs_multi_rank_nccl(backend):
    """nccl, paired and sharded put several NCCL ranks on one GPU: blocked where gpu-check's
    probe found that NCCL refuses them (the reason travels in the environment)."""
    reason = os.environ.get(NCCL_BLOCKED_ENV)
    if backend in ("nccl", "paired", "sharded") and reason:
        pytest.skip(f"blocked: {reason}")


def config(backend, bucket_mb=1, timeout=60, *extra):
    return [
        f"backend={backend}",
        f"update_weights_bucket_megabytes={bucket_mb}",
        f"timeout_s={timeout}",
        *extra,
    ]


def start_trainer(overrides, num_receivers, versions, weights=WEIGHTS, num_trainers=1):
    """The trainer (rank 0) in its own process; (process, its report queue, its address)."""
    q = CTX.Queue()
    proc = start(
        workers.run_device_sender, overrides, num_receivers, versions, q, DEVICE, weights, 0, num_trainers
    )
    report = get(q, START_S, "the trainer to listen")
    assert report[0] == "listening", report
    return proc, q, report[1]


def get(q, timeout, what):
    try:
        return q.get(timeout=timeout)
    except Exception:  # queue.Empty: name what did not come
        raise AssertionError(f"no report of {what} within {timeout} s (a process hung or died?)") from None


def sent(q, version, timeout=90):
    report = get(q, timeout, f"version {version} sent")
    assert report[:2] == ("sent", version), report
    return report[2]


def finish(procs, grace=5.0):
    """Stop the children this test started (a hung one is killed: its GPU work goes with it)."""
    for p in procs:
        p.join(timeout=grace)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def receivers(address, overrides, versions, n, q):
    return [
        start(workers.run_receiver, address, r, overrides, versions, q, None, False, False, None, DEVICE)
        for r in range(n)
    ]


def digests(weights):
    return {n: workers.digest(t.contiguous()) for n, t in weights.items()}


# ---------------------------------------------------------------------------- in this process
def test_platform_resolves_the_gpu():
    import torch

    if ON_HOST:  # the rehearsal: the same questions, the CPU's answers
        assert (platform.current_platform().kind, platform.local_device()) == ("cpu", torch.device("cpu"))
        assert platform.collective_backend("nccl") == "gloo" and platform.device_report()["devices"] == []
        return
    assert platform.current_platform().kind == "cuda"
    assert platform.local_device().type == "cuda"
    assert platform.local_device("cuda:0") == torch.device("cuda:0")
    assert platform.collective_backend("nccl") == "nccl"
    report = platform.device_report()
    assert report["devices"] and report["devices"][0]["memory_gib"] > 0 and report["nccl"]
    t = torch.arange(1 << 20, device="cuda:0")
    platform.synchronize(t.device)
    handle = platform.share_device_buffer(t.view(torch.uint8))
    assert handle["kind"] == "cuda_ipc" and handle["nbytes"] == t.numel() * t.element_size()


def test_delta_codec_on_the_device_writes_the_hosts_bytes_and_applies_them_exactly():
    """The torch codec where the tensors live: on the device, every kind's payload is byte
    for byte the host's, applying it there reproduces the version, and a corrupt payload is
    refused with the target untouched."""
    import torch

    from weightsync import delta

    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.complex128, torch.uint8]
    for dtype in dtypes:
        for density in (0.0, 0.001, 0.03, 0.4, 1.0):
            raw = torch.randint(0, 256, (70001 * dtype.itemsize,), dtype=torch.uint8, generator=gen)
            new = raw.clone()
            pick = (torch.rand(70001, generator=gen) < density).repeat_interleave(dtype.itemsize)
            new[pick & (torch.rand(new.shape, generator=gen) < 0.6)] ^= 1
            base_h, new_h = raw.view(dtype), new.view(dtype)
            base_d, new_d = base_h.to(DEVICE), new_h.to(DEVICE)
            for kinds in (None, [delta.Kind.INDEX], [delta.Kind.BITMASK], [delta.Kind.GAPS]):
                on_host, on_dev = (
                    delta.encode(base_h, new_h, kinds=kinds),
                    delta.encode(base_d, new_d, kinds=kinds),
                )
                assert (on_dev.kind, on_dev.sizes) == (on_host.kind, on_host.sizes), (dtype, density, kinds)
                if on_dev.payload is None:
                    continue
                assert on_dev.payload.device == base_d.device
                assert torch.equal(on_dev.payload.cpu(), on_host.payload), (dtype, density, kinds)
                target = base_d.clone()
                delta.apply(target, on_dev.kind, on_dev.payload)
                assert torch.equal(target.cpu().view(torch.uint8), new), (dtype, density, kinds)
                if on_dev.kind != delta.Kind.EMPTY:
                    target = base_d.clone()
                    with pytest.raises(ValueError, match="delta payload"):
                        delta.apply(target, on_dev.kind, on_dev.payload[:-8])
                    assert torch.equal(target.cpu().view(torch.uint8), raw)


def test_block_fp8_quantizer_on_the_device_makes_the_hosts_bytes_and_scales():
    """The trainer-side quantizer where the trainer's tensors live (``weightsync.quant``):
    CUDA tensors in, the same FP8 bytes and scales out as on the CPU (which
    tests/test_quant.py holds to vLLM's per_block_cast_to_fp8), for plain and UE8M0 scales,
    shapes that are not multiples of 128 and an expert stack."""
    import torch

    from weightsync.quant import quantize_blocks

    gen = torch.Generator().manual_seed(0)
    for shape in [(2816, 1024), (200, 130), (1, 5), (3, 96, 130)]:
        for dtype in (torch.bfloat16, torch.float32):
            host = (torch.randn(shape, generator=gen) * 3).to(dtype)
            for ue8m0 in (False, True):
                q_h, s_h = quantize_blocks(host, ue8m0=ue8m0)
                q_d, s_d = quantize_blocks(host.to(DEVICE), ue8m0=ue8m0)
                assert q_d.device == torch.device(DEVICE) or ON_HOST
                assert torch.equal(q_d.cpu().view(torch.uint8), q_h.view(torch.uint8)), (shape, dtype, ue8m0)
                assert torch.equal(s_d.cpu(), s_h), (shape, dtype, ue8m0)


# ---------------------------------------------------------------------------- bit-exact
@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_three_versions_reach_three_receivers_on_one_gpu_bit_exact(backend):
    """1 MiB buckets under a 1.4 MB tensor (split over buckets), a non-contiguous tensor,
    bf16, fp16, fp8, bool, empty and scalar tensors: every byte of 3 versions."""
    needs_multi_rank_nccl(backend)
    versions, n = [1, 2, 3], 3
    overrides = config(backend)
    trainer, tq, address = start_trainer(overrides, n, versions)
    rq = CTX.Queue()
    procs = receivers(address, overrides, versions, n, rq)
    try:
        for v in versions:
            stats = sent(tq, v)
            assert stats["tensors"] == 9 and stats["buckets"] >= 2
            assert stats["plan_sent_to"] == (n if v == 1 else 0)  # the plan travels once
            for rank, version, got, held in collect(rq, n, timeout=60):
                assert version == v, got
                assert held == v
                assert got == workers.expected_digests(v), f"receiver {rank} differs at version {v}"
    finally:
        finish([trainer, *procs])


@pytest.mark.parametrize("backend", ["paired", "sharded"])
def test_two_trainer_ranks_to_three_replicas_on_one_gpu_bit_exact(backend):
    """2 trainer ranks, 3 replicas, two-rank NCCL groups kept across versions (2 MiB
    buckets: paired never splits a tensor). ``paired``: a ring of replicas; ``sharded``: both
    ranks hold every whole tensor (as verl hands them) and the route splits the sends
    between them, the replicas (who declare nothing) in a chain."""
    needs_multi_rank_nccl(backend)
    versions, n, trainers = [1, 2, 3], 3, 2
    overrides = config(backend, bucket_mb=2)
    trainer, tq, address = start_trainer(overrides, n, versions, num_trainers=trainers)
    rq, sq = CTX.Queue(), CTX.Queue()
    weights = workers.make_weights if ON_HOST else workers.cuda_weights
    procs = [
        start(workers.run_paired_trainer, address, 1, trainers, overrides, n, versions, sq, weights, DEVICE)
    ]
    procs += receivers(address, overrides, versions, n, rq)
    try:
        model = sum(t.numel() * t.element_size() for t in workers.make_weights(1).values())
        for v in versions:
            stats = sent(tq, v)
            if backend == "paired":
                assert stats["tensors"] == 9
            else:  # the bytes every receiver took, each tensor once
                assert stats["bytes"] == n * model
            share = get(sq, 60, f"trainer rank 1's share of version {v}")
            assert share[1] == v, share
            assert 0 < share[2] < stats["bytes"]  # each rank sent a share, rank 0 counts them all
            for rank, version, got, held in collect(rq, n, timeout=60):
                assert (version, held) == (v, v), got
                assert got == workers.expected_digests(v), f"receiver {rank} differs at version {v}"
    finally:
        finish([trainer, *procs])


@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_host_tensors_through_device_buckets_with_crc32(backend):
    """A trainer holding its weights in host memory (offloaded) packs them into buckets on
    the GPU; both sides checksum the device buckets (crc32 through a host copy)."""
    needs_multi_rank_nccl(backend)
    versions, n = [1, 2], 2
    overrides = config(backend, 1, 60, "verify=crc32")
    trainer, tq, address = start_trainer(overrides, n, versions, weights="make_weights")
    rq = CTX.Queue()
    procs = receivers(address, overrides, versions, n, rq)
    try:
        for v in versions:
            sent(tq, v)
            for rank, version, got, held in collect(rq, n, timeout=60):
                assert (version, held) == (v, v), got
                assert got == workers.expected_digests(v), f"receiver {rank} differs at version {v}"
    finally:
        finish([trainer, *procs])


# ---------------------------------------------------------------------------- a killed receiver
@pytest.mark.parametrize("backend", ["nccl", "shm", "paired"])
def test_receiver_killed_mid_sync_fails_it_within_the_deadline_then_survivors_sync(backend):
    """SIGKILL a receiver after 3 tensors of version 1 (57 MB to go): the trainer's sync
    fails within ``timeout_s`` naming rank 0 (a device collective to a dead peer must not
    hang), every survivor fails it too, and version 2 reaches the survivors bit-exact."""
    needs_multi_rank_nccl(backend)
    timeout = 30
    overrides = config(backend, 2 if backend == "paired" else 1, timeout)
    trainer, tq, address = start_trainer(overrides, 3, [1, 2], weights=BIG_WEIGHTS)
    rq = CTX.Queue()
    victim = start(workers.run_resilient_receiver, address, 0, overrides, [1], rq, (1, 3), DEVICE)
    survivors = [
        start(workers.run_resilient_receiver, address, r, overrides, [1, 2], rq, None, DEVICE) for r in (1, 2)
    ]
    try:
        report = get(tq, START_S + timeout, "the failed version 1")
        assert report[:2] == ("failed", 1), report
        _, _, message, ranks, seconds = report
        assert ranks == [0] and "receiver rank 0" in message, message
        assert seconds < timeout, (
            f"the sync failed after {seconds:.1f} s, past its deadline of {timeout} s: {message}"
        )
        victim.join(timeout=10)
        assert victim.exitcode == -signal.SIGKILL
        stats = sent(tq, 2, timeout=timeout + 60)  # rank 0 dropped, the same trainer goes on
        assert stats["tensors"] == len(workers.big_weights(2))
        reports = collect(rq, 4, timeout=60)
        failed = [r for r in reports if r[1] == "error"]
        done = [r for r in reports if r[1] != "error"]
        expected = digests(workers.big_weights(2))
        for rank, status, message, held, attempted, torn in failed:
            assert (held, attempted) == (None, 1), message  # nobody holds the failed version
        if backend != "paired":  # paired: a replica may have had all of version 1 before the failure
            assert len(failed) == 2, reports
        assert sorted(r[0] for r in done if r[1] == 2) == [1, 2], reports
        for rank, version, got, held in done:
            assert version == held and got == (expected if version == 2 else digests(workers.big_weights(1)))
    finally:
        finish([trainer, victim, *survivors])
