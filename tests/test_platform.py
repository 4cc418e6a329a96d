"""Platform resolution: one function maps the configured collective to the platform's library."""

import logging

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
    platform.synchronize(torch.device("cpu"))  # a no-op, but callable everywhere


def test_mooncake_protocol_follows_the_buffer_device(caplog):
    with caplog.at_level(logging.INFO, logger="weightsync.platform"):
        assert platform.mooncake_protocol("cpu") == "tcp"
        assert platform.mooncake_protocol("cuda") == "rdma"
        assert platform.mooncake_protocol("npu") == "ascend_direct"
        assert platform.mooncake_protocol("auto") == "tcp"  # this CPU machine
    assert "backend 'mooncake' with device npu uses Mooncake protocol ascend_direct" in [r.getMessage() for r in caplog.records]
    with pytest.raises(ValueError, match="engine_kwargs.mooncake.device='tpu'"):
        platform.mooncake_protocol("tpu")
