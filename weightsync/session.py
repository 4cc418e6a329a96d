"""The control plane: rendezvous, handshake, acknowledgements, deadlines and metrics.

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
import queue
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import msgpack

from weightsync import auth
from weightsync.config import SECRET_ENV
from weightsync.errors import (HandshakeError, PeerLost, ProtocolError, RemoteFailure, SyncError,  # noqa: F401
                               Rerouted, SyncTimeout, VerificationError, in_context)  # re-exported: the session raises them
from weightsync.stats import SyncStats  # re-exported: ``weightsync.session.SyncStats`` is public

if TYPE_CHECKING:
    from weightsync.config import EngineConfig

log = logging.getLogger("weightsync.session")

PROTOCOL_VERSION = 6  # 3: the welcome names the sender's session; 4: warm-up; 5: reroute (drop_lost_receivers); 6: its answer
MAX_FRAME_BYTES = 64 << 20  # from the sender: a plan of a 1T-parameter model is a few MB
RECEIVER_MAX_FRAME_BYTES = 1 << 20  # from a receiver: only replies
HELLO_MAX_BYTES = 4096  # anything before authentication
HELLO_TIMEOUT_S = 10.0
ROLES = ("receiver", "trainer")  # who may say hello: rollout receivers, other trainer ranks
MAX_PENDING_HELLOS = 64
_HEADER = struct.Struct("!I")


MAX_GROUP_SIZE = 1 << 16  # ranks in one data-plane group (a transport may allocate per rank)


def engine_problem(info: Any) -> str | None:
    """The session's part of an engine description: this receiver's group rank and the
    group's size (the rest belongs to the transport). What is wrong with it, or None."""
    if not isinstance(info, dict):
        return "the sync message carries no engine description"
    for key in ("rank", "world_size", "senders"):
        value = info.get(key, 1 if key == "senders" else None)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_GROUP_SIZE:
            return f"engine {key}={value!r:.100}: expected an integer from 0 to {MAX_GROUP_SIZE}"
    if not 1 <= info["rank"] < info["world_size"]:
        return f"engine rank={info['rank']} is not a receiver's rank in a group of world_size={info['world_size']}"
    return None


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


class PartlyConnected(SyncTimeout):
    """Not every member connected within the deadline. ``connected``: the channels of those
    that did, keyed as ``ControlServer.accept`` keys them; the caller keeps them, so a
    receiver that connected stays connected when another never comes."""

    def __init__(self, message: str, *, ranks: list[int], connected: dict[Any, Channel]) -> None:
        super().__init__(message, ranks=ranks)
        self.connected = connected


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
        for name, value in (("TCP_KEEPIDLE", interval), ("TCP_KEEPINTVL", interval),
                            ("TCP_KEEPCNT", max(1, round(grace_s / interval))), ("TCP_USER_TIMEOUT", int(grace_s * 1000))):
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
            return self.sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO"), 64)
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
            raise ProtocolError(f"{self.peer} sent a {size}-byte frame (limit {self.max_frame}) {deadline.what}")
        try:
            # Plain data only: extension types are refused, so nothing but msgpack's own
            # types (None, bool, int, float, str, bytes, list, dict) can come out of it.
            msg = msgpack.unpackb(self._read(size, deadline), raw=False, strict_map_key=True, ext_hook=_no_ext)
        except Exception as e:  # msgpack raises a variety of errors on hostile input
            raise ProtocolError(f"{self.peer} sent a malformed message {deadline.what}: {type(e).__name__}: {e}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"{self.peer} sent a message without a type {deadline.what}")
        wanted = (expect,) if isinstance(expect, str) else expect
        if wanted is None or msg["type"] in wanted:
            return msg
        if msg["type"] == "reroute":
            raise Rerouted.said(self.peer, msg)
        if msg["type"] in ("error", "abort"):
            raise HandshakeError(f"{self.peer} reported: {msg.get('message', '(no message)')}")
        raise ProtocolError(f"{self.peer} sent {msg['type']!r} where {' or '.join(wanted)} was expected {deadline.what}")

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
                msg = msgpack.unpackb(bytes(self._inbox[at + _HEADER.size:end]), raw=False, ext_hook=_no_ext)
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
        if self.error is not None and self.error.errno not in (errno.ECONNRESET, errno.EPIPE):  # not a plain close
            return f"connection to {self.peer} lost {what}: {self.error.strerror or self.error}"
        return f"{self.peer} disconnected {what}"

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class ControlServer:
    """The sender's listening socket; receivers connect to it and say hello.

    Every connection is greeted in its own thread (challenge, hello, authentication), so a
    stranger that connects and stays silent delays nobody; frames before authentication
    are limited to ``HELLO_MAX_BYTES``.
    """

    def __init__(self, address: str) -> None:
        #: this sender's session: receivers tell a restarted trainer's session from the old one
        self.session = auth.new_nonce().hex()[:32]
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

    def accept(self, ranks: set[Any], config: EngineConfig, seconds: float | None = None) -> dict[Any, Channel]:
        """Accept peers until every member of ``ranks`` said hello, or the deadline passes
        (``seconds``, default ``timeout_s``).

        A member is a receiver's rank (an int) or ``("trainer", i)`` for trainer rank ``i``
        of a backend where every trainer rank sends (``paired``); the result is keyed alike.
        """
        ranks = {_member(m) for m in ranks}
        deadline = Deadline(seconds or config.timeout_s, f"for receivers to connect to {self.address}")
        secret = config.secret()
        results: queue.Queue = queue.Queue()
        stop = threading.Event()
        joined: dict[int, Channel] = {}
        greeting = 0
        try:
            while len(joined) < len(ranks):
                while greeting and not results.empty():
                    greeting -= 1
                    item = results.get()
                    if item is not None:
                        self._welcome(item, ranks, joined, secret, self.session)
                        for ch in joined.values():
                            if ch.grace_s is None:
                                ch.probe(config.heartbeat_grace)
                if len(joined) == len(ranks):
                    break
                if time.monotonic() >= deadline.end:
                    missing = sorted(ranks - set(joined))
                    connected, joined = _keyed(joined), {}  # handed over, not closed
                    raise PartlyConnected(
                        f"{_describe(missing)} never connected to {self.address} within "
                        f"{deadline.seconds:.1f} s ({len(ranks) - len(missing)} of {len(ranks)} connected)",
                        ranks=[r for role, r in missing if role == "receiver"], connected=connected,
                    )
                try:  # short waits: greetings finished meanwhile are welcomed promptly
                    self.sock.settimeout(min(0.05, max(0.001, deadline.end - time.monotonic())))
                    conn, peer = self.sock.accept()
                except TimeoutError:
                    continue
                if greeting >= MAX_PENDING_HELLOS:
                    log.warning("refused %s:%s: %d connections are already saying hello", peer[0], peer[1], greeting)
                    conn.close()
                    continue
                greeting += 1
                threading.Thread(
                    target=_greet, args=(conn, peer, config.backend, secret, results, stop),
                    name="weightsync-hello", daemon=True,
                ).start()
        except BaseException:
            for ch in joined.values():
                ch.close()
            raise
        finally:
            stop.set()  # greetings still under way close their own connections
            while not results.empty():
                item = results.get()
                if item is not None:
                    item[0].close()
        return _keyed(joined)

    @staticmethod
    def _welcome(item: tuple, ranks: set[tuple[str, int]], joined: dict, secret: bytes | None, session: str) -> None:
        channel, member, server_nonce, client_nonce = item
        problem = None
        if member not in ranks:
            problem = f"{_describe([member])} is not expected (expected: {_describe(sorted(ranks))})"
        elif member in joined:
            problem = f"{_describe([member])} is already connected"
        deadline = Deadline(HELLO_TIMEOUT_S, "sending the welcome")
        try:
            if problem:
                log.warning("rejected %s: %s", channel.peer, problem)
                channel.send({"type": "error", "message": f"rejected by sender: {problem}"}, deadline)
                channel.close()
                return
            welcome: dict[str, Any] = {"type": "welcome", "protocol": PROTOCOL_VERSION, "session": session}
            if secret is not None:
                welcome["mac"] = auth.mac(secret, "welcome", server_nonce, client_nonce, *member, session)
            channel.send(welcome, deadline)
        except SyncError as e:
            log.warning("dropped %s: %s", channel.peer, e)
            channel.close()
            return
        channel.max_frame = RECEIVER_MAX_FRAME_BYTES  # peers only ever send small replies
        joined[member] = channel
        log.debug("%s connected", channel.peer)

    def close(self) -> None:
        self.sock.close()


def _greet(conn: socket.socket, peer: tuple, backend: str, secret: bytes | None, results: queue.Queue,
           stop: threading.Event) -> None:
    """Challenge one new connection and check its hello; put ``(channel, rank, nonces)``
    on ``results`` for the accepting thread, or None if it was rejected."""
    channel = Channel(conn, f"connection from {peer[0]}:{peer[1]}", max_frame=HELLO_MAX_BYTES)
    try:
        deadline = Deadline(HELLO_TIMEOUT_S, "for its hello")
        server_nonce = auth.new_nonce()
        channel.send({"type": "challenge", "protocol": PROTOCOL_VERSION, "nonce": server_nonce}, deadline)
        hello = channel.recv(deadline, expect="hello")
        rank, client_nonce, role = hello.get("rank"), hello.get("nonce"), hello.get("role", "receiver")
        problem = None
        if role not in ROLES:
            problem = f"role {role!r} is not one of {ROLES}"
        elif hello.get("protocol") != PROTOCOL_VERSION:
            problem = f"protocol version {hello.get('protocol')!r} != sender's {PROTOCOL_VERSION}"
        elif hello.get("backend") != backend:
            problem = f"backend {hello.get('backend')!r} != sender's {backend!r}"
        elif not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            problem = f"rank {rank!r} is not a {role} rank"
        elif not isinstance(client_nonce, bytes) or len(client_nonce) != auth.NONCE_BYTES:
            problem = "its hello carries no valid nonce"
        elif secret is not None and not auth.verify(
            secret, hello.get("mac"), "hello", server_nonce, client_nonce, role, rank, backend
        ):
            problem = "authentication failed (missing or wrong shared secret)"
        if problem:
            log.warning("rejected %s: %s", channel.peer, problem)
            channel.send({"type": "error", "message": f"rejected by sender: {problem}"}, deadline)
            channel.close()
            results.put(None)
            return
        pid = hello.get("pid")
        channel.peer = f"{role} rank {rank} (pid {pid if isinstance(pid, int) else '?'}, {peer[0]}:{peer[1]})"
    except SyncError as e:
        log.warning("dropped %s during its hello: %s", channel.peer, e)
        channel.close()
        results.put(None)
        return
    if stop.is_set():
        channel.close()
        results.put(None)
        return
    results.put((channel, (role, rank), server_nonce, client_nonce))


def _member(m: Any) -> tuple[str, int]:
    return ("receiver", m) if isinstance(m, int) else tuple(m)


def _keyed(joined: dict[tuple[str, int], Channel]) -> dict[Any, Channel]:
    """``accept``'s keys: a receiver's rank, or ``(role, rank)`` for a trainer rank."""
    return {(rank if role == "receiver" else (role, rank)): ch for (role, rank), ch in joined.items()}


def _describe(members: list[tuple[str, int]]) -> str:
    return ", ".join(f"{role} rank {rank}" for role, rank in members)


def connect(
    address: str, rank: int, config: EngineConfig, role: str = "receiver", reach_s: float | None = None
) -> Channel:
    """Connect to the sender, answer its challenge and check that it holds the shared
    secret too, if one is set. Reaching the sender is retried until it listens, for
    ``reach_s`` seconds (default: the whole ``timeout_s``, which bounds the handshake too).
    ``role``: ``"receiver"``, or ``"trainer"`` for a trainer rank > 0 of a backend where
    every trainer rank sends. The channel's ``session`` names the sender's session."""
    host, port = parse_address(address)
    timeout_s = config.timeout_s
    deadline = Deadline(timeout_s, f"connecting {role} rank {rank} to the sender at {address}")
    reach = Deadline(min(timeout_s, reach_s if reach_s is not None else timeout_s), deadline.what)
    last: Exception | None = None
    while True:
        try:
            left = reach.left()
        except SyncTimeout:
            raise SyncTimeout(
                f"{role} rank {rank} could not reach the sender at {address} within {reach.seconds:.1f} s: {last}"
            ) from None
        try:
            sock = socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:
            last = e
            time.sleep(min(0.05, max(0.0, reach.end - time.monotonic())))
            continue
        channel = Channel(sock, f"sender at {address}", max_frame=HELLO_MAX_BYTES)
        try:
            challenge = channel.recv(deadline, expect="challenge")
            break
        except PeerLost as e:
            # Hung up on before a challenge: the sender is greeting MAX_PENDING_HELLOS
            # connections already (strangers, say). Try again while it may be reached.
            channel.close()
            last = e
            time.sleep(min(0.1, max(0.0, reach.end - time.monotonic())))
        except BaseException:
            channel.close()
            raise
    try:
        server_nonce = challenge.get("nonce")
        if challenge.get("protocol") != PROTOCOL_VERSION:
            raise HandshakeError(f"protocol version: sender {challenge.get('protocol')!r}, receiver {PROTOCOL_VERSION}")
        if not isinstance(server_nonce, bytes) or len(server_nonce) != auth.NONCE_BYTES:
            raise HandshakeError(f"the sender at {address} sent no valid challenge")
        secret = config.secret()
        client_nonce = auth.new_nonce()
        hello: dict[str, Any] = {
            "type": "hello", "protocol": PROTOCOL_VERSION, "rank": rank, "role": role, "backend": config.backend,
            "pid": os.getpid(), "nonce": client_nonce,
        }
        if secret is not None:
            hello["mac"] = auth.mac(secret, "hello", server_nonce, client_nonce, role, rank, config.backend)
        channel.send(hello, deadline)
        welcome = channel.recv(deadline, expect="welcome")
        session = welcome.get("session")
        if not isinstance(session, str) or not 0 < len(session) <= 64:
            raise HandshakeError(f"the sender at {address} named no valid session")
        if secret is not None and not auth.verify(
            secret, welcome.get("mac"), "welcome", server_nonce, client_nonce, role, rank, session
        ):
            raise HandshakeError(
                f"the sender at {address} failed authentication: it does not hold the shared secret "
                f"(auth_secret or ${SECRET_ENV})"
            )
    except BaseException:
        channel.close()
        raise
    channel.max_frame = MAX_FRAME_BYTES  # the authenticated sender may send whole plans
    channel.session = session
    channel.probe(config.heartbeat_grace)
    return channel
