"""The sender's dense route stage: every receiver takes every tensor whole, by one plan.

The route stage is the first of the sender's stages (``weightsync.stages``): it makes the
trainer's object a ``WeightSource`` and, before any peer is waited for, the plan every
receiver takes, refusing what the backend cannot carry (``carriable``). ``DenseSend`` serves
every transport but ``sharded`` (``weightsync.sender.sharded_route.ShardedSend``: each rank
sends or keeps its part of a route agreed in the handshake).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.errors import SyncError
from weightsync.plan import Plan, make_plan
from weightsync.sources import WeightSource, as_source
from weightsync.stages import SendStage


class DenseSend(SendStage):
    """Every receiver takes every tensor whole, by one plan (every transport but
    ``sharded``). ``all_send``: every trainer rank sends a share of it (``paired``)."""

    def __init__(self, config: EngineConfig, engine_cls: type, all_send: bool) -> None:
        self._config, self._engine_cls, self._all_send = config, engine_cls, all_send

    def source(self, obj: Any, wire_dtype: torch.dtype | None, form: str) -> WeightSource:
        return as_source(obj, wire_dtype, form)

    def plan(self, src: WeightSource, plan: Plan | None) -> Plan | None:
        specs = src.specs()
        plan = make_plan(specs, self._config.bucket_bytes) if specs is not None else None
        carriable(plan, self._config, self._engine_cls, self._all_send)
        return plan


def carriable(plan: Plan | None, config: EngineConfig, engine_cls: type, all_send: bool) -> None:
    """Refuse, before anything is sent, what the backend cannot carry: a bare iterator
    where every trainer rank sends (``all_send``), a tensor larger than a bucket where the
    backend never splits one."""
    if all_send and plan is None:
        raise SyncError(
            f"backend {config.backend!r} needs a source that announces its tensors up front "
            "(a module or a state dict, the same on every trainer rank), not a bare iterator"
        )
    if plan is None or engine_cls.splits_tensors:
        return
    bucket = config.bucket_bytes
    for spec in plan.tensors:
        if spec.nbytes > bucket:
            raise SyncError(
                f"backend {config.backend!r} never splits a tensor, and tensor {spec.name!r} "
                f"({spec.nbytes / 2**20:.1f} MiB) is larger than a bucket ({bucket / 2**20:g} MiB): "
                f"set update_weights_bucket_megabytes to at least {math.ceil(spec.nbytes / 2**20)}"
            )
