"""The sender's stages, made in one place: a new stage is a new file and one line here.

Their order is the order a sync's wire entries are made in: the route (where bytes go and
the plan), then the forms receivers declared (quantized blocks), then the delta against
the base a receiver holds. The contract is ``weightsync.stages.SendStage``.
"""

from __future__ import annotations

from weightsync.config.engine import EngineConfig
from weightsync.delta.send_stage import DeltaSend
from weightsync.engines.base import Transport
from weightsync.quant.send_stage import QuantSend, refusal
from weightsync.sender.route_stage import DenseSend
from weightsync.sender.sharded_route import ShardedSend
from weightsync.stages import SendStages


def send_stages(config: EngineConfig, engine_cls: type, all_send: bool) -> SendStages:
    """The stages of every sync of a sender over ``engine_cls`` (``all_send``: every trainer
    rank sends a share of a dense plan)."""
    sharded = issubclass(engine_cls, Transport) and engine_cls.sharded
    route = (
        ShardedSend(config.timeout_s, config.bucket_bytes)
        if sharded
        else DenseSend(config, engine_cls, all_send)
    )
    return SendStages(
        (
            route,
            QuantSend(refusal(config.backend, sharded, all_send)),
            DeltaSend(config.delta, config.bucket_bytes),
        )
    )
