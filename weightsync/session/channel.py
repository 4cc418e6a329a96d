"""The control plane's channels and protocol: framed msgpack messages, each read and write
bounded by a deadline, and the exchange of a session (below). The sender's control server
and a receiver's connect are ``weightsync.session.control``.

The sender (trainer rank 0) listens on one TCP address; each receiver connects and says
hello with its rank. Messages are msgpack maps in length-prefixed frames: no pickle, a size
limit, and every read and write bounded by a deadline. Shared by every bucket engine.

Joining::

    sender -> receiver   challenge {protocol, nonce}
    receiver -> sender   hello     {protocol, rank, role, backend, pid, nonce, [mac]}
    sender -> receiver   welcome   {protocol, session, [mac]} | error {message}

Per sync::

    sender -> receiver   sync   {version, protocol, bucket_bytes, plan_hash, [plan], engine} | cancel {version, message}
    receiver -> sender   ready | error {message}
    sender -> receiver   go | abort {message}
    (bucket bytes move through the engine; in streaming mode each bucket is announced first)
    receiver -> sender   done   {ok, message, tensors, bytes}
    sender -> receiver   reroute {version, lost}   (``drop_lost_receivers``, a receiver lost:
                         each other one answers done, and those that failed get the sync again)
    sender -> receiver   closing          (between syncs: this session ends)

A sender drops every connection after a sync that failed anywhere; a receiver waiting for
the next sync then connects again (within its deadline).

Every ``Sender`` is a session of its own, named by a random ``session`` id in its welcome
(covered by the welcome's MAC when a secret is set). A receiver told ``closing`` joins a
new sender listening on the same address at once (a restarted trainer), and fails at once
when none does; it never takes one session's goodbye or state (its agreed plan) for
another's.

A backend where every trainer rank sends (``paired``): trainer ranks > 0 connect like
receivers (role ``trainer``), get the same sync/go, send their share of the buckets, answer
``sent {ok, message, checksums}``, and finally get ``result {ok, message}``.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

import msgpack

from weightsync.errors import (
    HandshakeError,
    PeerLost,
    ProtocolError,
    Rerouted,
    SyncTimeout,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("weightsync.session")

PROTOCOL_VERSION = 6  # 3: the welcome names the sender's session; 4: warm-up; 5: reroute (drop_lost_receivers); 6: its answer
MAX_FRAME_BYTES = 64 << 20  # from the sender: a plan of a 1T-parameter model is a few MB
RECEIVER_MAX_FRAME_BYTES = 1 << 20  # from a receiver: only replies
HELLO_MAX_BYTES = 4096  # anything before authentication
HELLO_TIMEOUT_S = 10.0
ROLES = ("receiver", "trainer")  # who may say hello: rollout receivers, other trainer ranks
MAX_PENDING_HELLOS = 64
_HEADER = struct.Struct("!I")


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted")


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


_TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (Linux's include/net/tcp_states.h)


class Channel:
    """One framed msgpack connection to a named peer."""

    def __init__(self, sock: socket.socket, peer: str, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.peer = peer
        #: the largest frame accepted from this peer: nothing larger is ever allocated
        self.max_frame = max_frame
        #: the sender's session this connection belongs to (receivers and trainer ranks)
        self.session: str | None = None
        #: the heartbeat grace set by ``probe``; None: not probed
        self.grace_s: float | None = None
        #: the peer answered no heartbeat within the grace (the connection is then dead)
        self.silent = False
        #: the socket error that ended the connection, if one did (``is_dead``)
        self.error: OSError | None = None
        self._inbox = bytearray()  # bytes read ahead by ``void_until``, before the socket's
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def probe(self, grace_s: float) -> None:
        """Heartbeats on this connection, both ways while either side probes: TCP keepalive
        every ``grace_s / 4`` s once it is idle, and the connection is dropped (the peer
        counted as lost) when nothing it sent was acknowledged for ``grace_s``, idle or
        not. The peer's kernel answers, so a process busy or holding the GIL is never taken
        for a lost one; a cut link, a host cut off or a frozen machine is."""
        interval = max(1, int(grace_s / 4))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", interval),
            ("TCP_KEEPINTVL", interval),
            ("TCP_KEEPCNT", max(1, round(grace_s / interval))),
            ("TCP_USER_TIMEOUT", int(grace_s * 1000)),
        ):
            if hasattr(socket, name):  # Linux; elsewhere the OS's keepalive defaults stay
                self.sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        self.grace_s, self._interval_s = grace_s, interval

    def _lost(self, e: OSError, what: str) -> PeerLost:
        if e.errno == errno.ETIMEDOUT:  # the kernel gave up: no heartbeat or data was acknowledged
            self.silent = True
            return PeerLost(f"{self.peer} went silent {what}: {self.silence()}")
        return PeerLost(f"connection to {self.peer} lost {what}: {e}")

    def unheard_s(self) -> float | None:
        """Seconds since the peer's kernel last answered on this connection (data or a
        heartbeat's acknowledgement), from Linux's ``TCP_INFO``; None where unknown."""
        info = self._tcp_info()  # struct tcp_info: 8 bytes of u8 fields, 9 u32s, then last_data_sent,
        if info is None or len(info) < 60:  # last_ack_sent, last_data_recv, last_ack_recv (ms ago)
            return None
        _, _, data_ms, ack_ms = struct.unpack_from("4I", info, 44)
        return min(data_ms, ack_ms) / 1000

    def _tcp_info(self) -> bytes | None:  # Linux's struct tcp_info; its state is the first byte
        try:
            return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64)
        except (AttributeError, OSError):
            return None

    def seems_silent(self) -> bool:
        """True if a probed peer has let heartbeats go unanswered (two of them), before the
        kernel's full grace has run out: what another failure can be blamed on."""
        unheard = self.unheard_s() if self.grace_s is not None else None
        self.silent = self.silent or (unheard is not None and unheard > 2 * self._interval_s + 0.5)
        return self.silent

    def silence(self) -> str:
        """How a silent peer was found out, for error messages."""
        grace = f"{self.grace_s:.1f} s" if self.grace_s is not None else "the OS's keepalive time"
        return f"no heartbeat answered for {grace} (heartbeat_grace_s; a host cut off, a dead link or a frozen machine)"

    def send(self, msg: dict[str, Any], deadline: Deadline) -> None:
        payload = msgpack.packb(msg, use_bin_type=True)
        try:
            self.sock.settimeout(deadline.left())
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)
        except OSError as e:
            if isinstance(e, TimeoutError) and e.errno is None:  # our own deadline
                raise SyncTimeout(f"timed out sending to {self.peer} {deadline.what}") from None
            raise self._lost(e, deadline.what) from None

    def _read(self, n: int, deadline: Deadline) -> bytes:
        chunks = self._inbox[:n]
        del self._inbox[:n]
        while len(chunks) < n:
            try:
                self.sock.settimeout(deadline.left())
                data = self.sock.recv(min(n - len(chunks), 1 << 20))
            except OSError as e:
                if isinstance(e, TimeoutError) and e.errno is None:  # our own deadline
                    raise SyncTimeout(
                        f"timed out after {deadline.seconds:.1f} s waiting for {self.peer} {deadline.what}"
                    ) from None
                raise self._lost(e, deadline.what) from None
            if not data:
                raise PeerLost(f"{self.peer} closed the connection {deadline.what}")
            chunks += data
        return bytes(chunks)

    def recv(self, deadline: Deadline, expect: str | tuple[str, ...] | None = None) -> dict[str, Any]:
        """Read one message; an ``error`` message from the peer raises ``HandshakeError``."""
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if size > self.max_frame:
            raise ProtocolError(
                f"{self.peer} sent a {size}-byte frame (limit {self.max_frame}) {deadline.what}"
            )
        try:
            # Plain data only: extension types are refused, so nothing but msgpack's own
            # types (None, bool, int, float, str, bytes, list, dict) can come out of it.
            msg = msgpack.unpackb(
                self._read(size, deadline), raw=False, strict_map_key=True, ext_hook=_no_ext
            )
        except Exception as e:  # msgpack raises a variety of errors on hostile input
            raise ProtocolError(
                f"{self.peer} sent a malformed message {deadline.what}: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"{self.peer} sent a message without a type {deadline.what}")
        wanted = (expect,) if isinstance(expect, str) else expect
        if wanted is None or msg["type"] in wanted:
            return msg
        if msg["type"] == "reroute":
            raise Rerouted.said(self.peer, msg)
        if msg["type"] in ("error", "abort"):
            raise HandshakeError(f"{self.peer} reported: {msg.get('message', '(no message)')}")
        raise ProtocolError(
            f"{self.peer} sent {msg['type']!r} where {' or '.join(wanted)} was expected {deadline.what}"
        )

    def void_until(self, kind: str) -> dict[str, Any] | None:
        """Without blocking: if a message of type ``kind`` has arrived, drop it and every
        message before it unread (it voids them: a ``reroute`` ends the attempt they belong
        to) and return it; else None, keeping what was read ahead for ``recv``."""
        try:
            while select.select([self.sock], [], [], 0)[0] and len(self._inbox) < self.max_frame:
                data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
                if not data:
                    break
                self._inbox += data
        except OSError:  # ``is_dead`` reports it
            pass
        at = 0
        while at + _HEADER.size <= len(self._inbox):
            (size,) = _HEADER.unpack_from(self._inbox, at)
            end = at + _HEADER.size + size
            if size > self.max_frame or end > len(self._inbox):
                return None  # not all here yet (an oversized one: ``recv`` refuses it)
            try:
                msg = msgpack.unpackb(
                    bytes(self._inbox[at + _HEADER.size : end]), raw=False, ext_hook=_no_ext
                )
            except Exception:
                return None  # malformed: ``recv`` says so
            if isinstance(msg, dict) and msg.get("type") == kind:
                del self._inbox[:end]
                return msg
            at = end
        return None

    def is_dead(self, behind: bool = False) -> bool:
        """True if the peer has closed the connection, or went silent (``silent`` is then
        set); checked without blocking. ``behind``: also behind messages not read yet (a
        watch during a transfer; between syncs they are read first, a goodbye say)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            if self.sock.recv(1, socket.MSG_PEEK) == b"":
                return True
            # Data waits unread (a streamed sync's announcements, say): a close or an error
            # behind it shows only in the connection's state, not in a read.
            if not behind or not (info := self._tcp_info()) or info[0] == _TCP_ESTABLISHED:
                return False
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
            return True
        except OSError as e:
            self.silent = self.silent or e.errno == errno.ETIMEDOUT
            self.error = e
            return True

    def gone(self, what: str) -> str:
        """A dead peer, for an error: silent (and how found), unreachable (link down), closed."""
        if self.silent:
            return f"{self.peer} went silent {what}: {self.silence()}"
        if self.error is not None and self.error.errno not in (
            errno.ECONNRESET,
            errno.EPIPE,
        ):  # not a plain close
            return f"connection to {self.peer} lost {what}: {self.error.strerror or self.error}"
        return f"{self.peer} disconnected {what}"

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
