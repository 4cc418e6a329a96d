"""The receiver's stages, made in one place: a new stage is a new file and one line here.

Their order is the sender's (``weightsync.sender.stages``): the route (which entries this
receiver takes, by which plan), the forms it holds (its declaration, its own entries), the
delta against the base it holds. The contract is ``weightsync.stages.ReceiveStage``.
"""

from __future__ import annotations

from weightsync.config.engine import EngineConfig
from weightsync.delta.receive_stage import DeltaReceive
from weightsync.engines.base import Transport
from weightsync.quant.receive_stage import QuantReceive
from weightsync.receiver.route_stage import DenseReceive
from weightsync.receiver.sharded_route import ShardedReceive
from weightsync.stages import ReceiveStages


def receive_stages(config: EngineConfig, rank: int, engine_cls: type) -> ReceiveStages:
    """The stages of every sync of receiver ``rank`` over ``engine_cls``."""
    sharded = issubclass(engine_cls, Transport) and engine_cls.sharded
    route = ShardedReceive(config.bucket_bytes) if sharded else DenseReceive()
    return ReceiveStages((route, QuantReceive(), DeltaReceive(config.delta, rank)))
