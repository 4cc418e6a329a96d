"""weightsync: move model weights from an RL trainer to its inference fleet.

Bit-exact, versioned, through pluggable backends (``naive``, ``nccl``/HCCL/Gloo, ...).

    from weightsync import EngineConfig, Sender, Receiver
"""

from weightsync.config.backends import register_engine
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import ConfigError
from weightsync.engines.base import Engine, EngineUnavailable, Join, Offer, Publisher, Transport
from weightsync.engines.shared_tensors import share_tensors
from weightsync.errors import (
    HandshakeError,
    PeerLost,
    ProtocolError,
    RemoteFailure,
    SourceFailed,
    SyncError,
    SyncTimeout,
    VerificationError,
)
from weightsync.plan import Plan, TensorSpec, make_plan
from weightsync.receiver.receiver import Receiver
from weightsync.receiver.sharded_sink import FragmentSink
from weightsync.sender.sender import Sender
from weightsync.sinks import ModuleSink, SinkError
from weightsync.sources import WeightSource, as_source
from weightsync.state import VersionState
from weightsync.stats import SyncStats

__version__ = "0.1.0"

__all__ = [
    "FragmentSink",
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
    "share_tensors",
]
