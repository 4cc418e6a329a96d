"""The control plane shared by every transport: framed msgpack channels and their deadlines,
the sender's control server and a receiver's connect, authentication, and the re-route
exchange of ``drop_lost_receivers``. The errors of a sync (``weightsync.errors``) and
``SyncStats`` are re-exported here, where earlier releases defined them.
"""

from weightsync.errors import (
    HandshakeError,
    PeerLost,
    ProtocolError,
    RemoteFailure,
    Rerouted,
    SyncError,
    SyncTimeout,
    VerificationError,
)
from weightsync.session.auth import NONCE_BYTES, mac, new_nonce, reachable_from_other_hosts, verify
from weightsync.session.channel import (
    HELLO_MAX_BYTES,
    HELLO_TIMEOUT_S,
    MAX_FRAME_BYTES,
    MAX_PENDING_HELLOS,
    PROTOCOL_VERSION,
    RECEIVER_MAX_FRAME_BYTES,
    ROLES,
    Channel,
    Deadline,
    parse_address,
)
from weightsync.session.control import ControlServer, PartlyConnected, connect
from weightsync.session.reroute import answer, await_word, tell
from weightsync.stats import SyncStats

__all__ = [
    "Channel",
    "ControlServer",
    "Deadline",
    "HELLO_MAX_BYTES",
    "HELLO_TIMEOUT_S",
    "HandshakeError",
    "MAX_FRAME_BYTES",
    "MAX_PENDING_HELLOS",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "PartlyConnected",
    "PeerLost",
    "ProtocolError",
    "RECEIVER_MAX_FRAME_BYTES",
    "ROLES",
    "RemoteFailure",
    "Rerouted",
    "SyncError",
    "SyncStats",
    "SyncTimeout",
    "VerificationError",
    "answer",
    "await_word",
    "connect",
    "mac",
    "new_nonce",
    "parse_address",
    "reachable_from_other_hosts",
    "tell",
    "verify",
]
