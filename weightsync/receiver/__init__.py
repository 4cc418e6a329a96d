"""The receive side: ``Receiver`` (joining a session or taking a publication), its link
to the sender, the data plane's walk (``Transfer``) and how a sync ends (``Outcome``),
its route stage (the dense plan, or a sharded route's part), what it admits, taking a
publisher's version, and the vLLM worker's prefetch pipeline with its landing memory.
"""

from weightsync.receiver.admission import (
    MAX_GROUP_SIZE,
    agreed_plan,
    engine_problem,
    plan_reader,
    session_problem,
    stream_reader,
    sync_problem,
    warmup_problem,
    wire_plan,
)
from weightsync.receiver.landing import (
    LANDED_AHEAD,
    LOOKAHEAD,
    LandingPool,
    PooledAssembler,
    following_landings,
    landing_sizes,
)
from weightsync.receiver.link import SenderLink
from weightsync.receiver.outcome import Outcome
from weightsync.receiver.prefetch import PipelineResult, receive_into
from weightsync.receiver.publication import take
from weightsync.receiver.receiver import Receiver
from weightsync.receiver.route_stage import DenseReceive
from weightsync.receiver.sharded_route import ShardedReceive
from weightsync.receiver.stages import receive_stages
from weightsync.receiver.transfer import Transfer

__all__ = [
    "DenseReceive",
    "Outcome",
    "SenderLink",
    "ShardedReceive",
    "Transfer",
    "LANDED_AHEAD",
    "LOOKAHEAD",
    "LandingPool",
    "MAX_GROUP_SIZE",
    "PipelineResult",
    "PooledAssembler",
    "Receiver",
    "agreed_plan",
    "engine_problem",
    "following_landings",
    "landing_sizes",
    "plan_reader",
    "receive_into",
    "receive_stages",
    "session_problem",
    "stream_reader",
    "sync_problem",
    "take",
    "warmup_problem",
    "wire_plan",
]
