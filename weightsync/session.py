"""The control plane: rendezvous, handshake, acknowledgements, deadlines and metrics.

The sender (trainer rank 0) listens on one TCP address; each receiver connects and says
hello with its rank. Messages are msgpack maps in length-prefixed frames: no pickle, a size
limit, and every read and write bounded by a deadline. Shared by every bucket engine.

Per sync::

    sender -> receiver   sync   {version, protocol, bucket_bytes, plan_hash, [plan], engine}
    receiver -> sender   ready | error {message}
    sender -> receiver   go | abort {message}
    (bucket bytes move through the engine; in streaming mode each bucket is announced first)
    receiver -> sender   done   {ok, message, tensors, bytes}
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

log = logging.getLogger("weightsync.session")

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20  # a plan of a 1T-parameter model is a few MB
_HEADER = struct.Struct("!I")


class SyncError(RuntimeError):
    """A sync failed; the message names the peer, the version and, where known, the tensor."""


class SyncTimeout(SyncError, TimeoutError):
    """A peer did not answer within the deadline."""


class PeerLost(SyncError):
    """A peer closed its connection (or its process died)."""


class HandshakeError(SyncError):
    """The two sides disagree on protocol, version, plan or bucket size."""


class RemoteFailure(SyncError):
    """A receiver took part in the whole sync but reported that it failed (a sink error,
    say). The connections stay usable: the next sync can go ahead on them."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; port 0 asks the OS for a free one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not of the form host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


class Deadline:
    """A point in time by which ``what`` must have happened."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise SyncTimeout(f"timed out after {self.seconds:.1f} s {self.what}")
        return remaining


class Channel:
    """One framed msgpack connection to a named peer."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, msg: dict[str, Any], deadline: Deadline) -> None:
        payload = msgpack.packb(msg, use_bin_type=True)
        try:
            self.sock.settimeout(deadline.left())
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)
        except socket.timeout:
            raise SyncTimeout(f"timed out sending to {self.peer} {deadline.what}") from None
        except OSError as e:
            raise PeerLost(f"connection to {self.peer} lost {deadline.what}: {e}") from None

    def _read(self, n: int, deadline: Deadline) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            try:
                self.sock.settimeout(deadline.left())
                data = self.sock.recv(min(n - len(chunks), 1 << 20))
            except socket.timeout:
                raise SyncTimeout(
                    f"timed out after {deadline.seconds:.1f} s waiting for {self.peer} {deadline.what}"
                ) from None
            except OSError as e:
                raise PeerLost(f"connection to {self.peer} lost {deadline.what}: {e}") from None
            if not data:
                raise PeerLost(f"{self.peer} closed the connection {deadline.what}")
            chunks += data
        return bytes(chunks)

    def recv(self, deadline: Deadline, expect: str | tuple[str, ...] | None = None) -> dict[str, Any]:
        """Read one message; an ``error`` message from the peer raises ``HandshakeError``."""
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if size > MAX_FRAME_BYTES:
            raise SyncError(f"{self.peer} sent a {size}-byte frame (limit {MAX_FRAME_BYTES}) {deadline.what}")
        try:
            msg = msgpack.unpackb(self._read(size, deadline), raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as e:
            raise SyncError(f"{self.peer} sent a malformed message {deadline.what}: {e}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise SyncError(f"{self.peer} sent a message without a type {deadline.what}")
        wanted = (expect,) if isinstance(expect, str) else expect
        if wanted is None or msg["type"] in wanted:
            return msg
        if msg["type"] in ("error", "abort"):
            raise HandshakeError(f"{self.peer} reported: {msg.get('message', '(no message)')}")
        raise SyncError(f"{self.peer} sent {msg['type']!r} where {' or '.join(wanted)} was expected {deadline.what}")

    def is_dead(self) -> bool:
        """True if the peer has closed the connection (checked without blocking)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ControlServer:
    """The sender's listening socket; receivers connect to it and say hello."""

    def __init__(self, address: str) -> None:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise SyncError(f"cannot listen on {address}: {e}") from None
        self.sock.listen(128)
        self.host = host
        self.port = self.sock.getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def accept(self, ranks: set[int], num_receivers: int, timeout_s: float, backend: str) -> dict[int, Channel]:
        """Accept receivers until every rank in ``ranks`` said hello, or the deadline passes."""
        deadline = Deadline(timeout_s, f"for receivers to connect to {self.address}")
        joined: dict[int, Channel] = {}
        while len(joined) < len(ranks):
            try:
                self.sock.settimeout(deadline.left())
                conn, peer = self.sock.accept()
            except (socket.timeout, SyncTimeout):
                missing = sorted(ranks - set(joined))
                for ch in joined.values():
                    ch.close()
                raise SyncTimeout(
                    f"receiver rank(s) {missing} never connected to {self.address} within "
                    f"{timeout_s:.1f} s ({len(ranks) - len(missing)} of {len(ranks)} connected)"
                ) from None
            channel = Channel(conn, f"connection from {peer[0]}:{peer[1]}")
            try:
                hello = channel.recv(Deadline(min(10.0, deadline.left()), "for its hello"), expect="hello")
                rank = hello.get("rank")
                problem = None
                if hello.get("protocol") != PROTOCOL_VERSION:
                    problem = f"protocol version {hello.get('protocol')!r} != sender's {PROTOCOL_VERSION}"
                elif hello.get("backend") != backend:
                    problem = f"backend {hello.get('backend')!r} != sender's {backend!r}"
                elif not isinstance(rank, int) or not 0 <= rank < num_receivers:
                    problem = f"rank {rank!r} is outside 0..{num_receivers - 1}"
                elif rank in joined:
                    problem = f"rank {rank} is already connected"
                elif rank not in ranks:
                    problem = f"rank {rank} is not expected now"
                if problem:
                    log.warning("rejected %s: %s", channel.peer, problem)
                    channel.send({"type": "error", "message": f"rejected by sender: {problem}"}, deadline)
                    channel.close()
                    continue
                channel.peer = f"receiver rank {rank} (pid {hello.get('pid')}, {peer[0]}:{peer[1]})"
                channel.send({"type": "welcome", "protocol": PROTOCOL_VERSION}, deadline)
                joined[rank] = channel
                log.debug("%s connected", channel.peer)
            except SyncError as e:
                log.warning("dropped %s during hello: %s", channel.peer, e)
                channel.close()
        return joined

    def close(self) -> None:
        self.sock.close()


def connect(address: str, rank: int, backend: str, timeout_s: float) -> Channel:
    """Receiver side: connect to the sender (retrying until it listens) and say hello."""
    host, port = parse_address(address)
    deadline = Deadline(timeout_s, f"connecting receiver rank {rank} to the sender at {address}")
    last: Exception | None = None
    while True:
        try:
            left = deadline.left()
        except SyncTimeout:
            raise SyncTimeout(
                f"receiver rank {rank} could not reach the sender at {address} within {timeout_s:.1f} s: {last}"
            ) from None
        try:
            sock = socket.create_connection((host, port), timeout=min(left, 5.0))
            break
        except OSError as e:
            last = e
            time.sleep(min(0.05, max(0.0, deadline.end - time.monotonic())))
    channel = Channel(sock, f"sender at {address}")
    channel.send({"type": "hello", "protocol": PROTOCOL_VERSION, "rank": rank, "backend": backend, "pid": os.getpid()}, deadline)
    channel.recv(deadline, expect="welcome")
    return channel


@dataclass
class SyncStats:
    """What one sync moved and how long it took."""

    version: int
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    receivers: int = 0
    #: handshake plus joining the data-plane group (seconds)
    handshake_s: float = 0.0
    #: moving the buckets (seconds)
    transfer_s: float = 0.0
    #: the whole sync, from the handshake to the last acknowledgement (seconds)
    seconds: float = 0.0
    #: receivers that got the full plan in this sync's handshake (others got only its hash)
    plan_sent_to: int = 0
    #: model names the sync did not carry (``Receiver.load_into`` only)
    missing: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Payload GB/s (10^9 bytes per second) over the whole sync."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}
