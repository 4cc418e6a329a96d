"""The data-plane rendezvous: a small key-value store hosted by the group's rank 0.

Gloo, NCCL and HCCL build a group by meeting in a ``torch.distributed.Store``: each rank
publishes its address (NCCL: rank 0 its unique id) under a key and waits for the others'.
torch's ``TCPStore`` listens on every interface, authenticates nobody and (torch 2.13)
lists its keys to whoever asks, so the sender hosts this store instead:

- it listens on the interface of the session's control socket (on every interface only
  when the control address is a wildcard: the user's choice);
- a connection's first frame must carry the group's token: 128 random bits that the
  sender mints for each new group and hands to peers only in the session's handshake
  (authenticated by the shared secret, when one is set), compared in constant time.
  Anything else is logged and hung up on. A new group's token retires the previous one,
  its connections and its keys;
- frames are the control channel's (``session.Channel``): length-prefixed msgpack maps,
  at most 4 KiB before the token and ``MAX_FRAME_BYTES`` after, every read and write
  bounded by a deadline; the store holds at most ``MAX_STORE_BYTES``;
- every connection is served by its own thread, so a silent stranger or a long wait holds
  up nobody; a wait is bounded (``timeout_s``) and served in short slices, between which
  the waiting rank consults the session's ``watch`` (a peer's control connection closed);
- the operations are those torch's process groups use: set, get, add, wait, check,
  compare_set, delete_key. None lists or counts keys.

Rank 0 uses the same key space in process (``StoreServer.store``); other ranks connect
(``connect``). Both are ``torch.distributed.Store`` subclasses, so they go wherever torch
expects a store (``PrefixStore``, ``ProcessGroupGloo``, ``ProcessGroupNCCL``). torch calls
the Python methods of such a store only while the Python object lives: whoever builds a
group keeps a reference to its store for as long as the group lives.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from weightsync.errors import HandshakeError, PeerLost, ProtocolError, SyncError, SyncTimeout
from weightsync.session.channel import HELLO_MAX_BYTES, HELLO_TIMEOUT_S, Channel, Deadline

log = logging.getLogger("weightsync.engines.rendezvous")

TOKEN_BYTES = 16  # 128 bits
#: largest frame from a peer that presented the token (values are an address per rank, or
#: NCCL's 128-byte unique id: far smaller)
MAX_FRAME_BYTES = 16 << 20
MAX_KEY_CHARS = 4096
#: keys and values held at once, over all keys
MAX_STORE_BYTES = 256 << 20
#: connections that have not presented the token yet; more are hung up on at once
MAX_PENDING = 64
#: a wait is served in slices of at most this many seconds; between them the waiting
#: rank calls ``watch`` and sends the wait again
WAIT_SLICE_S = 0.5
OPS = ("set", "get", "add", "wait", "check", "compare_set", "delete_key")

Watch = Callable[[], None] | None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Keys:
    """The key space of one group; every operation under one lock."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._size = 0
        self._cond = threading.Condition()

    def _put(self, key: str, value: bytes) -> None:
        old = self._data.get(key)
        size = self._size + len(key) + len(value) - (len(key) + len(old) if old is not None else 0)
        if size > MAX_STORE_BYTES:
            raise ValueError(f"the rendezvous store would hold more than {MAX_STORE_BYTES} bytes")
        self._data[key] = value
        self._size = size
        self._cond.notify_all()

    def _present(self, keys: list[str], wait_s: float) -> bool:
        return self._cond.wait_for(lambda: all(k in self._data for k in keys), wait_s)

    def apply(self, op: str, msg: dict[str, Any], wait_s: float) -> dict[str, Any]:
        """Carry out one request; the reply (``ok``)."""
        with self._cond:
            if op == "set":
                self._put(_key(msg), _value(msg, "value"))
                return {"type": "ok"}
            if op == "get":
                key = _key(msg)
                found = self._present([key], wait_s)
                return {"type": "ok", "found": found, "value": self._data[key] if found else b""}
            if op == "add":
                key, amount = _key(msg), msg.get("amount")
                if not isinstance(amount, int) or isinstance(amount, bool):
                    raise ValueError(f"add: amount {amount!r} is not an integer")
                try:
                    total = int(self._data.get(key, b"0")) + amount
                except ValueError:
                    raise ValueError(f"add: key {key!r} does not hold an integer") from None
                self._put(key, str(total).encode())
                return {"type": "ok", "value": total}
            if op == "wait":
                return {"type": "ok", "found": self._present(_keys(msg), wait_s)}
            if op == "check":
                return {"type": "ok", "value": all(k in self._data for k in _keys(msg))}
            if op == "compare_set":
                # torch's semantics (TCPStore): set ``desired`` if the key holds ``expected``,
                # or is absent and ``expected`` is empty; answer the value it then holds (an
                # absent key with a non-empty ``expected``: ``expected``).
                key, expected, desired = _key(msg), _value(msg, "expected"), _value(msg, "desired")
                current = self._data.get(key)
                if (current is None and expected == b"") or (current is not None and current == expected):
                    self._put(key, desired)
                    return {"type": "ok", "value": desired}
                return {"type": "ok", "value": expected if current is None else current}
            if op == "delete_key":
                key = _key(msg)
                old = self._data.pop(key, None)
                if old is not None:
                    self._size -= len(key) + len(old)
                return {"type": "ok", "value": old is not None}
        raise ValueError(f"unknown operation {op!r} (known: {', '.join(OPS)})")

    def clear(self) -> None:
        with self._cond:
            self._data.clear()
            self._size = 0
            self._cond.notify_all()


def _key(msg: dict[str, Any]) -> str:
    key = msg.get("key")
    if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
        raise ValueError(f"key {str(key)[:64]!r} is not a string of at most {MAX_KEY_CHARS} characters")
    return key


def _keys(msg: dict[str, Any]) -> list[str]:
    keys = msg.get("keys")
    if not isinstance(keys, list) or not keys or len(keys) > 4096:
        raise ValueError("keys must be a non-empty list")
    return [_key({"key": k}) for k in keys]


def _value(msg: dict[str, Any], field: str) -> bytes:
    value = msg.get(field)
    if not isinstance(value, bytes):
        raise ValueError(f"{field} is not bytes")
    return value


def _slice(value: Any) -> float:
    """A requested wait, in seconds, within ``[0, WAIT_SLICE_S]`` (anything odd: 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    try:
        seconds = float(value)
    except OverflowError:
        return WAIT_SLICE_S
    return min(seconds, WAIT_SLICE_S) if seconds > 0 else 0.0


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _seconds(timeout: Any, default: float) -> float:
    """torch's timeout (a timedelta; zero means "none") as seconds, within ``default``."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)):
        seconds = float(timeout)
    else:
        seconds = 0.0
    return min(seconds, default) if seconds > 0 else default


class _Store(dist.Store):
    """What torch calls; subclasses carry a request to the key space (``_request``)."""

    def __init__(self, timeout_s: float, watch: Watch) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        #: consulted between the slices of a wait; raises to abandon it
        self.watch = watch

    def _request(self, op: str, msg: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        raise NotImplementedError

    def _wait(self, op: str, msg: dict[str, Any], keys: list[str], timeout: Any) -> dict[str, Any]:
        seconds = _seconds(timeout, self.timeout_s)
        end = time.monotonic() + seconds
        while True:
            reply = self._request(op, msg, max(0.0, min(WAIT_SLICE_S, end - time.monotonic())))
            if reply.get("found"):
                return reply
            if time.monotonic() >= end:
                raise SyncTimeout(
                    f"timed out after {seconds:.1f} s in the data-plane rendezvous waiting for "
                    f"{', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} (a rank did not join the group)"
                )
            if self.watch is not None:
                self.watch()

    # ------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: Any) -> None:
        self._request("set", {"key": key, "value": _as_bytes(value)})

    def get(self, key: str) -> bytes:
        return self._wait("get", {"key": key}, [key], None)["value"]

    def add(self, key: str, amount: int) -> int:
        return int(self._request("add", {"key": key, "amount": int(amount)})["value"])

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self._wait("wait", {"keys": list(keys)}, list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._request("check", {"keys": list(keys)})["value"])

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        msg = {"key": key, "expected": _as_bytes(expected_value), "desired": _as_bytes(desired_value)}
        return self._request("compare_set", msg)["value"]

    def delete_key(self, key: str) -> bool:
        return bool(self._request("delete_key", {"key": key})["value"])


class _LocalStore(_Store):
    """Rank 0's view: the server's key space, in process."""

    def __init__(self, keys: _Keys, timeout_s: float, watch: Watch) -> None:
        super().__init__(timeout_s, watch)
        self._keys = keys

    def _request(self, op: str, msg: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        try:
            return self._keys.apply(op, msg, wait_s)
        except (ValueError, TypeError) as e:  # as a client would see it
            raise RuntimeError(f"the data-plane rendezvous store refused {op}: {e}") from None


class StoreClient(_Store):
    """Another rank's view: requests over TCP to the server, a connection per concurrent
    caller (torch may call from several threads), kept for the next request."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float, watch: Watch = None) -> None:
        super().__init__(timeout_s, watch)
        self.address = _address(host, port)
        self._host, self._port, self._token = host, port, token
        self._lock = threading.Lock()
        self._idle: list[Channel] = []
        self._closed = False
        self._idle.append(self._open())  # an unreachable or refusing store fails here, at once

    def _open(self) -> Channel:
        deadline = Deadline(self.timeout_s, f"joining the data-plane rendezvous store at {self.address}")
        try:
            sock = socket.create_connection((self._host, self._port), timeout=min(deadline.left(), 30.0))
        except OSError as e:
            raise PeerLost(f"cannot reach the data-plane rendezvous store at {self.address}: {e}") from None
        channel = Channel(
            sock, f"the data-plane rendezvous store at {self.address}", max_frame=HELLO_MAX_BYTES
        )
        try:
            channel.send({"type": "hello", "token": self._token}, deadline)
            channel.recv(deadline, expect="welcome")
        except HandshakeError as e:  # not a refusal of a version: the data plane failed
            channel.close()
            raise SyncError(
                f"the data-plane rendezvous store at {self.address} turned this rank away: {e}"
            ) from None
        except BaseException:
            channel.close()
            raise
        channel.max_frame = MAX_FRAME_BYTES
        return channel

    def _request(self, op: str, msg: dict[str, Any], wait_s: float = 0.0) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise PeerLost(
                    f"the connection to the data-plane rendezvous store at {self.address} was closed"
                )
            channel = self._idle.pop() if self._idle else None
        if channel is None:
            channel = self._open()
        deadline = Deadline(wait_s + self.timeout_s, f"for the rendezvous store's answer to {op}")
        try:
            channel.send({**msg, "type": op, "wait_s": wait_s}, deadline)
            reply = channel.recv(deadline, expect=("ok", "error"))
        except BaseException:
            channel.close()
            raise
        with self._lock:
            if self._closed:
                channel.close()
            else:
                self._idle.append(channel)
        if reply["type"] == "error":
            raise RuntimeError(
                f"the data-plane rendezvous store at {self.address} refused {op}: {reply.get('message')}"
            )
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for channel in idle:
            channel.close()


def connect(host: str, port: int, token: str, timeout_s: float, watch: Watch = None) -> StoreClient:
    """A store client of the group whose token is ``token``, hosted at ``host:port``."""
    return StoreClient(host, port, token, timeout_s, watch)


def _listen(host: str | None) -> tuple[socket.socket, str]:
    if host is None or host in ("", "::", "0.0.0.0"):
        # The control socket listens on a wildcard address: the user chose every interface.
        if host != "0.0.0.0" and socket.has_dualstack_ipv6():
            return socket.create_server(
                ("::", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128
            ), "::"
        return socket.create_server(("0.0.0.0", 0), backlog=128), "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise SyncError(f"the data-plane rendezvous store cannot listen on {host}: {e}") from None
    return sock, host


class StoreServer:
    """Rank 0's store: listens on ``host`` (None: every interface), serves the group whose
    token ``new_group`` minted last. One per process that hosts groups, kept across them."""

    def __init__(self, host: str | None, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._keys = _Keys()
        self._lock = threading.Lock()
        self._token = ""
        self._members: set[socket.socket] = set()  # connections that presented the token
        self._pending = 0
        self._closed = False
        self.sock, self.host = _listen(host)
        self.port: int = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="weightsync-rendezvous", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return _address(self.host, self.port)

    def new_group(self) -> str:
        """Start a new group: a new token (returned, for the handshake), no keys; the
        previous group's connections are hung up on."""
        token = secrets.token_hex(TOKEN_BYTES)
        with self._lock:
            self._token = token
            old, self._members = self._members, set()
        for sock in old:
            _hang_up(sock)
        self._keys.clear()
        return token

    def store(self, watch: Watch = None) -> dist.Store:
        """Rank 0's own view of the current key space."""
        return _LocalStore(self._keys, self.timeout_s, watch)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._token = ""
            old, self._members = self._members, set()
        _hang_up(self.sock)
        self.sock.close()
        for sock in old:
            _hang_up(sock)
        self._keys.clear()

    # ------------------------------------------------------------------ serving
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # out of file descriptors, say: try again shortly
                continue
            where = _address(addr[0], addr[1])
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                crowded = self._pending >= MAX_PENDING
                if not crowded:
                    self._pending += 1
            if crowded:
                log.warning(
                    "rendezvous store: refused %s: %d connections have not presented a token yet",
                    where,
                    MAX_PENDING,
                )
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, where), name="weightsync-rendezvous-peer", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, where: str) -> None:
        channel = Channel(conn, f"connection from {where}", max_frame=HELLO_MAX_BYTES)
        pending = True
        try:
            hello = channel.recv(Deadline(HELLO_TIMEOUT_S, "for its rendezvous token"), expect="hello")
            token = hello.get("token")
            with self._lock:
                self._pending -= 1
                pending = False
                welcome = (
                    bool(self._token)
                    and isinstance(token, str)
                    and hmac.compare_digest(token.encode(), self._token.encode())
                )
                if welcome:
                    self._members.add(conn)
            if not welcome:
                log.warning("rendezvous store: rejected %s: wrong or missing group token", where)
                channel.send(
                    {"type": "error", "message": "wrong or missing group token"}, Deadline(1.0, "refusing it")
                )
                return
            channel.send({"type": "welcome"}, Deadline(HELLO_TIMEOUT_S, "welcoming it"))
            channel.max_frame = MAX_FRAME_BYTES
            channel.peer = f"rendezvous peer {where}"
            while self._next_request(conn):
                msg = channel.recv(Deadline(self.timeout_s, "for the rest of its request"))
                op = msg["type"]
                try:
                    reply = self._keys.apply(op, msg, _slice(msg.get("wait_s")))
                except (ValueError, TypeError) as e:
                    reply = {"type": "error", "message": str(e)}
                channel.send(reply, Deadline(self.timeout_s, f"answering {op}"))
        except ProtocolError as e:
            log.warning("rendezvous store: dropped %s: %s", where, e)
        except SyncError as e:  # it went away, or stayed silent past its deadline
            log.debug("rendezvous store: %s: %s", where, e)
        finally:
            with self._lock:
                if pending:
                    self._pending -= 1
                self._members.discard(conn)
            channel.close()

    def _next_request(self, conn: socket.socket) -> bool:
        """Wait (without a deadline: a group lives long) until a request arrives; False
        once the connection is no longer a member (a new group, the server closed)."""
        while True:
            with self._lock:
                if conn not in self._members:
                    return False
            try:
                readable, _, _ = select.select([conn], [], [], 1.0)
            except (OSError, ValueError):
                return False
            if readable:
                return True


def _hang_up(sock: socket.socket) -> None:
    """Wake whoever waits on ``sock`` (its own thread closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def serve(host: str | None, timeout_s: float) -> StoreServer:
    """Start a rendezvous store on ``host`` (None: every interface), on a free port."""
    return StoreServer(host, timeout_s)
