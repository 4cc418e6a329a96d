"""``weightsync.lora.base_difference``: the trainer's base weights held against a checkpoint
by value, whatever dtype each side keeps them in (tests/test_vllm_lora.py and
tests/test_demo.py run it inside real vLLM replicas)."""

from __future__ import annotations

import pytest
import torch

from weightsync.lora import base_difference
from weightsync.verify import named_digests


def _digest(t: torch.Tensor) -> str:
    return named_digests([("w", t)])["w"]


def _one_ulp_up(t: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    t = t.clone()
    t[index] = torch.nextafter(t[index], torch.tensor(float("inf"), dtype=t.dtype))
    return t


@pytest.fixture
def bf16_exact() -> torch.Tensor:
    """float32 values every one of which bf16 holds exactly."""
    return torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()


@pytest.mark.parametrize(
    ("trainer_dtype", "checkpoint_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_the_same_values_in_another_dtype_are_the_same_base(bf16_exact, trainer_dtype, checkpoint_dtype):
    values = bf16_exact if checkpoint_dtype != torch.float16 else bf16_exact.half().float()
    assert base_difference(_digest(values.to(trainer_dtype)), values.to(checkpoint_dtype)) is None


@pytest.mark.parametrize(
    ("trainer_dtype", "checkpoint_dtype", "moved"),
    [
        # the checkpoint one ulp off, in its own dtype
        (torch.float32, torch.bfloat16, "checkpoint"),
        (torch.bfloat16, torch.float32, "checkpoint"),  # no longer exact in bf16
        # the trainer one ulp off, in its own dtype
        (torch.float32, torch.bfloat16, "trainer"),  # float32's ulp: below bf16's
        (torch.bfloat16, torch.float32, "trainer"),
        (torch.float32, torch.float32, "trainer"),
    ],
)
def test_one_ulp_either_side_is_a_different_base(bf16_exact, trainer_dtype, checkpoint_dtype, moved):
    trainer, checkpoint = bf16_exact.to(trainer_dtype), bf16_exact.to(checkpoint_dtype)
    if moved == "trainer":
        trainer = _one_ulp_up(trainer, (5, 7))
    else:
        checkpoint = _one_ulp_up(checkpoint, (5, 7))
    why = base_difference(_digest(trainer), checkpoint)
    assert why is not None and why.startswith("values differ"), why


def test_values_bf16_cannot_hold_are_not_a_bf16_trainers_base():
    """A float32 checkpoint of random values against a trainer that holds them rounded to bf16."""
    checkpoint = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    why = base_difference(_digest(checkpoint.to(torch.bfloat16)), checkpoint)
    assert why is not None and "not all exact in the trainer's torch.bfloat16" in why, why


def test_a_shape_or_a_sign_of_zero_that_differs_is_refused(bf16_exact):
    assert "shape (48, 64) on the trainer, (64, 48)" in base_difference(_digest(bf16_exact.t()), bf16_exact)
    zeros = torch.zeros(4)
    assert base_difference(_digest(-zeros), zeros.to(torch.bfloat16)) is not None
    assert base_difference("torch.float32|(4,)", zeros) is not None  # not a digest: refused, not raised
