"""Platform resolution: one function maps the configured collective to the platform's library."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from weightsync import platform


def test_collective_backend_per_platform_and_logged_once(caplog):
    platform.collective_backend.cache_clear()
    with caplog.at_level(logging.INFO, logger="weightsync.platform"):
        assert platform.collective_backend("nccl", "cuda") == "nccl"
        assert platform.collective_backend("nccl", "npu") == "hccl"
        assert platform.collective_backend("nccl", "cpu") == "gloo"
        assert platform.collective_backend("nccl", "cpu") == "gloo"
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("backend 'nccl' on platform cpu is served by gloo") == 1
    assert "backend 'nccl' on platform npu is served by hccl" in lines


def test_cpu_machine_resolves_to_cpu_and_gloo():
    assert platform.current_platform().kind == "cpu"
    assert platform.local_device() == torch.device("cpu")
    assert platform.local_device("cpu") == torch.device("cpu")
    assert platform.collective_backend("nccl") == "gloo"


def test_synchronize_waits_on_the_accelerator_of_the_device_and_never_on_cpu(monkeypatch):
    """Buffers are handed out only after ``synchronize``: on an accelerator it must wait on
    that device's queue, on CPU (where nothing is queued) it must not touch any module."""
    waited = []

    class Accelerator:
        def __init__(self, kind):
            self.kind = kind

        def synchronize(self, device):
            waited.append((self.kind, device))

    monkeypatch.setattr(platform, "_accelerator_module", Accelerator)
    platform.synchronize(torch.device("cpu"))
    assert waited == []
    npu = SimpleNamespace(type="npu", index=0)  # torch knows the npu type only with torch_npu
    platform.synchronize(torch.device("cuda", 1))
    platform.synchronize(npu)
    assert waited == [("cuda", torch.device("cuda", 1)), ("npu", npu)]


def test_device_memory_bounds_what_a_receiver_accepts():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert platform.device_memory_bytes(torch.device("cpu")) == physical > 0


def test_mooncake_protocol_follows_the_buffer_device(caplog):
    with caplog.at_level(logging.INFO, logger="weightsync.platform"):
        assert platform.mooncake_protocol("cpu") == "tcp"
        assert platform.mooncake_protocol("cuda") == "rdma"
        assert platform.mooncake_protocol("npu") == "ascend_direct"
        assert platform.mooncake_protocol("auto") == "tcp"  # this CPU machine
    assert "backend 'mooncake' with device npu uses Mooncake protocol ascend_direct" in [
        r.getMessage() for r in caplog.records
    ]
    with pytest.raises(ValueError, match="engine_kwargs.mooncake.device='tpu'"):
        platform.mooncake_protocol("tpu")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_copy_bytes_equals_torch_copy_bit_for_bit(dtype):
    """The data path's byte copy (one memmove between contiguous host tensors) leaves what
    ``copy_`` would: every bit, for every size (empty, odd, larger than a page)."""
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 4099, 1 << 20):
        src = torch.randint(
            0, 256, (n * torch.tensor([], dtype=dtype).element_size(),), dtype=torch.uint8, generator=g
        ).view(dtype)
        dst = torch.zeros_like(src)
        platform.copy_bytes(dst, src)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), n


def test_copy_bytes_converts_and_strides_as_torch_does():
    """Anything but a same-dtype, same-size contiguous host copy is torch's: a float16 source
    into a bfloat16 destination is converted (not its bits moved), a strided one gathered."""
    src = torch.linspace(-2, 2, 64, dtype=torch.float16)
    dst = torch.empty(64, dtype=torch.bfloat16)
    platform.copy_bytes(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))
    wide = torch.arange(128, dtype=torch.float32)
    dst = torch.empty(64, dtype=torch.float32)
    platform.copy_bytes(dst, wide[::2])
    assert torch.equal(dst, wide[::2])


def _environ_of_child(queue, names) -> None:
    queue.put({n: os.environ.get(n) for n in names})


@pytest.mark.timeout(60)
def test_each_started_process_has_the_callers_environment_of_the_moment_it_starts(monkeypatch):
    """``start_process``: a child forked from the fork server (which took the environment of
    when it started) gets the caller's environment as it is now: a variable set since is
    there, one removed since is not, one changed has its new value."""
    from procs import CTX, start, stop

    names = ["WEIGHTSYNC_TEST_SET", "WEIGHTSYNC_TEST_REMOVED", "WEIGHTSYNC_TEST_CHANGED"]
    q = CTX.Queue()
    monkeypatch.delenv(names[0], raising=False)
    monkeypatch.setenv(names[1], "before")
    monkeypatch.setenv(names[2], "before")
    procs = [start(_environ_of_child, q, names)]  # the fork server runs from here on, at the latest
    try:
        assert q.get(timeout=30) == {names[0]: None, names[1]: "before", names[2]: "before"}
        monkeypatch.setenv(names[0], "now")
        monkeypatch.delenv(names[1])
        monkeypatch.setenv(names[2], "after")
        procs.append(start(_environ_of_child, q, names))
        assert q.get(timeout=30) == {names[0]: "now", names[1]: None, names[2]: "after"}
    finally:
        stop(procs)
