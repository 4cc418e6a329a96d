"""The sender's control server and a receiver's connect: who may join a session (the
challenge, hello and welcome of ``channel``'s protocol), the members' channels, and the
deadline of joining."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from weightsync.config.keys import SECRET_ENV
from weightsync.errors import (
    HandshakeError,
    PeerLost,
    SyncError,
    SyncTimeout,
)
from weightsync.session import auth

if TYPE_CHECKING:
    from weightsync.config.engine import EngineConfig

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

log = logging.getLogger("weightsync.session")


class PartlyConnected(SyncTimeout):
    """Not every member connected within the deadline. ``connected``: the channels of those
    that did, keyed as ``ControlServer.accept`` keys them; the caller keeps them, so a
    receiver that connected stays connected when another never comes."""

    def __init__(self, message: str, *, ranks: list[int], connected: dict[Any, Channel]) -> None:
        super().__init__(message, ranks=ranks)
        self.connected = connected


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

    def accept(
        self, ranks: set[Any], config: EngineConfig, seconds: float | None = None
    ) -> dict[Any, Channel]:
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
                        ranks=[r for role, r in missing if role == "receiver"],
                        connected=connected,
                    )
                try:  # short waits: greetings finished meanwhile are welcomed promptly
                    self.sock.settimeout(min(0.05, max(0.001, deadline.end - time.monotonic())))
                    conn, peer = self.sock.accept()
                except TimeoutError:
                    continue
                if greeting >= MAX_PENDING_HELLOS:
                    log.warning(
                        "refused %s:%s: %d connections are already saying hello", peer[0], peer[1], greeting
                    )
                    conn.close()
                    continue
                greeting += 1
                threading.Thread(
                    target=_greet,
                    args=(conn, peer, config.backend, secret, results, stop),
                    name="weightsync-hello",
                    daemon=True,
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
    def _welcome(
        item: tuple, ranks: set[tuple[str, int]], joined: dict, secret: bytes | None, session: str
    ) -> None:
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


def _greet(
    conn: socket.socket,
    peer: tuple,
    backend: str,
    secret: bytes | None,
    results: queue.Queue,
    stop: threading.Event,
) -> None:
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
            raise HandshakeError(
                f"protocol version: sender {challenge.get('protocol')!r}, receiver {PROTOCOL_VERSION}"
            )
        if not isinstance(server_nonce, bytes) or len(server_nonce) != auth.NONCE_BYTES:
            raise HandshakeError(f"the sender at {address} sent no valid challenge")
        secret = config.secret()
        client_nonce = auth.new_nonce()
        hello: dict[str, Any] = {
            "type": "hello",
            "protocol": PROTOCOL_VERSION,
            "rank": rank,
            "role": role,
            "backend": config.backend,
            "pid": os.getpid(),
            "nonce": client_nonce,
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
