"""RL-like weight versions for the delta benchmark: AdamW on fp32 masters, cast for rollout.

An RL trainer keeps fp32 master weights and sends a low-precision (bf16) copy to its
rollout workers. One optimizer step at a small learning rate moves each master weight by
about ``lr``, which changes the bf16 value only where it crosses a rounding boundary: a few
percent of the elements per step. ``AdamWUpdates`` reproduces that (real ``torch.optim.AdamW``
on random gradients), so a delta codec can be measured on realistic change patterns;
``changed_fraction`` measures the density of a change.

Gradients are random, not learned: ``grad_correlation`` (0 to <1) makes each step's gradient
an AR(1) continuation of the last (some persistent direction, as in real training) instead
of fresh noise. Adam's first step moves every weight by exactly ``lr`` (the update is
``sign(g)`` after bias correction); later steps with uncorrelated noise move less, so the
density falls over the first ~10 steps before it settles.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from weightsync.plan import TensorSpec, as_bytes

ModelLike = Iterable[TensorSpec] | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _named(model: ModelLike) -> list[tuple[str, TensorSpec, torch.Tensor | None]]:
    items = list(model.items()) if isinstance(model, Mapping) else list(model)
    out = []
    for item in items:
        if isinstance(item, TensorSpec):
            out.append((item.name, item, None))
        else:
            name, tensor = item
            out.append((name, TensorSpec.of(name, tensor), tensor))
    return out


class AdamWUpdates:
    """A trainer's fp32 masters under ``torch.optim.AdamW`` and their rollout copy.

    ``model``: tensor specs (weights are initialized like a fresh LLM: normal(0, 0.02) for
    matrices and biases, ones for norms, i.e. any 1-D tensor whose name contains "norm"),
    or named tensors (a mapping or (name, tensor) pairs: their values start the masters).
    Floating tensors are trained; others (integer buffers) stay as they are.

    ``tensors`` is the rollout copy in the model's own dtype (bf16 for ``llm_specs(...,
    "bfloat16")``): one persistent dict, rewritten in place by every ``step()``. Memory:
    about 16 bytes per parameter for the masters, gradients and the two Adam moments, plus
    the rollout copy.
    """

    def __init__(
        self,
        model: ModelLike,
        lr: float = 1e-6,
        seed: int = 0,
        *,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_correlation: float = 0.0,
    ) -> None:
        if not 0.0 <= grad_correlation < 1.0:
            raise ValueError(f"grad_correlation must be in [0, 1), got {grad_correlation}")
        self.generator = torch.Generator().manual_seed(seed)
        self.grad_correlation = grad_correlation
        self.version = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.masters: dict[str, torch.nn.Parameter] = {}
        for name, spec, value in _named(model):
            dtype = spec.torch_dtype
            if value is not None:
                rollout = value.detach().to("cpu", copy=True).contiguous()
            else:
                rollout = torch.empty(spec.shape, dtype=dtype)
            self.tensors[name] = rollout
            if not (dtype.is_floating_point and dtype.itemsize >= 2):
                if value is None:
                    rollout.zero_()
                continue  # not trainable: integer buffers, bool masks, fp8 stays fixed
            master = torch.empty(spec.shape, dtype=torch.float32)
            if value is not None:
                master.copy_(value.detach())
            elif rollout.dim() == 1 and "norm" in name:
                master.fill_(1.0)
            else:
                master.normal_(0.0, 0.02, generator=self.generator)
            rollout.copy_(master)
            param = torch.nn.Parameter(master)
            param.grad = torch.zeros_like(master)
            self.masters[name] = param
        self.optimizer = _adamw(list(self.masters.values()), lr, betas, weight_decay)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def step(self) -> dict[str, torch.Tensor]:
        """One AdamW step on fresh random gradients; returns ``tensors``, updated in place
        (round to nearest even from the fp32 masters)."""
        rho = self.grad_correlation
        fresh = math.sqrt(1.0 - rho * rho)
        with torch.no_grad():
            for p in self.masters.values():
                if rho:
                    noise = torch.empty_like(p).normal_(0.0, 1e-3, generator=self.generator)
                    p.grad.mul_(rho).add_(noise, alpha=fresh)
                else:
                    p.grad.normal_(0.0, 1e-3, generator=self.generator)
            self.optimizer.step()
            for name, p in self.masters.items():
                self.tensors[name].copy_(p)
        self.version += 1
        return self.tensors

    @property
    def rollout_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _adamw(params: list[torch.nn.Parameter], lr: float, betas, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, fused on the CPU when this torch has it (one pass over the four arrays), else
    foreach (a few multi-tensor passes)."""
    if not params:
        params = [torch.nn.Parameter(torch.zeros(0))]
    try:
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, foreach=True)


def changed_elements(before: torch.Tensor, after: torch.Tensor) -> int:
    """How many elements differ in their bits (not by float compare: -0.0 vs 0.0 and NaN
    payloads count as they are stored)."""
    if before.shape != after.shape or before.dtype != after.dtype:
        raise ValueError(
            f"cannot compare {tuple(before.shape)} {before.dtype} with {tuple(after.shape)} {after.dtype}"
        )
    e = before.element_size()
    a, b = as_bytes(before), as_bytes(after)
    if e in _INT_OF_SIZE:
        return int(torch.count_nonzero(a.view(_INT_OF_SIZE[e]) != b.view(_INT_OF_SIZE[e])))
    return int(torch.count_nonzero((a.view(-1, e) != b.view(-1, e)).any(1)))


def changed_fraction(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> float:
    """The density of a change: the fraction of all elements (over every tensor of ``after``)
    whose bits differ from ``before``."""
    changed = total = 0
    for name, new in after.items():
        changed += changed_elements(before[name], new)
        total += new.numel()
    return changed / total if total else 0.0


def clone_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of every tensor (the previous version, to measure against)."""
    return {name: t.clone() for name, t in state.items()}
