"""weightsync: move model weights from an RL trainer to its inference fleet.

Bit-exact, versioned, through pluggable backends (``naive``, ``nccl``/HCCL/Gloo, ...).

    from weightsync import EngineConfig, Sender, Receiver
"""

from weightsync.config import ConfigError, EngineConfig
from weightsync.engines import EngineUnavailable, register_engine
from weightsync.engines.base import Engine, Join, Offer, Publisher, Transport
from weightsync.packer import SourceFailed
from weightsync.plan import Plan, TensorSpec, make_plan
from weightsync.session import (
    HandshakeError,
    PeerLost,
    ProtocolError,
    RemoteFailure,
    SyncError,
    SyncTimeout,
    VerificationError,
)
from weightsync.receiver import Receiver
from weightsync.sender import Sender
from weightsync.sinks import ModuleSink, SinkError
from weightsync.sources import WeightSource, as_source
from weightsync.stats import SyncStats
from weightsync.state import VersionState

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineUnavailable",
    "HandshakeError",
    "Join",
    "Offer",
    "Publisher",
    "Transport",
    "VersionState",
    "ModuleSink",
    "PeerLost",
    "Plan",
    "ProtocolError",
    "Receiver",
    "RemoteFailure",
    "Sender",
    "SinkError",
    "SourceFailed",
    "SyncError",
    "SyncStats",
    "SyncTimeout",
    "TensorSpec",
    "VerificationError",
    "WeightSource",
    "as_source",
    "make_plan",
    "register_engine",
]
