"""Slot rings and their signals: shared by the transports that put buckets into memory a
peer reads (``shm``: one shared ring; ``mooncake``: a ring per process, written by the
upstream neighbour).

A ring holds ``SLOTS`` bucket-sized slots, so one bucket is written while the previous
one is read. Who may touch a slot is said by fixed 32-byte signal frames on a socket of
our own per link, ``(kind, weight version, bucket sequence number, byte count)``: READY
("the first n bytes of bucket k are in your slot", downstream), DONE ("I am done with
bucket k", upstream) and FAIL ("receiver r is lost", upstream, in the byte count field).
A bucket may be announced in pieces (``mooncake`` writes it in pieces of ``CHUNK_BYTES``):
then bucket k has several READY frames, their byte counts growing, the last one the
bucket's size; ``shm`` sends one. A slot is rewritten only after DONE for the bucket it
held. A wait checks kind, version and sequence number, so nothing left over from an
earlier version (or another bucket) can satisfy a wait in a later one, and every wait is
bounded by the deadline and calls ``watch``.

Set-up messages are small length-prefixed msgpack maps. A joining peer's first message
must carry the 128-bit token its sender minted for the ring (it travels over the
authenticated control channel); ``accept_peers`` reads first messages of all connections
at once, so a silent or hostile connection delays nobody, and drops strangers with a log.
"""

from __future__ import annotations

import hmac
import logging
import select
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import torch

log = logging.getLogger("weightsync.engines.ring")

#: bucket slots per ring: one being written while one is read (and forwarded)
SLOTS = 2
#: bytes per write on a chain's link (``nccl``'s chain, ``paired``, ``mooncake``): a hop
#: holds a piece back, not a bucket (64 MiB at 1 Gbit/s is half a second a hop). Measured
#: on 4 emulated hosts at 1 Gbit/s, 267 MB: the nccl chain 0.875x the link ceiling with
#: 4 MiB pieces, 0.944x with 1 MiB; each call's latency stays small beside a piece.
CHUNK_BYTES = 1 << 20
_SIGNAL = struct.Struct("<B7xqqq")  # (kind, weight version, bucket sequence number, byte count)
READY, DONE, FAIL = 1, 2, 3  # FAIL: the byte count field holds the lost receiver's rank
_KINDS = {READY: "ready", DONE: "done", FAIL: "fail"}
MAX_MESSAGE = 4096  # set-up messages are small; nothing larger is read from a stranger
POLL_S = 0.2  # how often a wait looks at ``watch``

Watch = Callable[[], None] | None


class PeerError(ConnectionError):
    """A neighbour went away, broke protocol, or a write to it failed.

    ``lost``: the receiver rank known to be gone, if any (passed up a chain)."""

    def __init__(self, message: str, lost: int | None = None) -> None:
        super().__init__(message)
        self.lost = lost


def slot(ring: torch.Tensor, capacity: int, k: int) -> torch.Tensor:
    """Slot of bucket number ``k`` in a ring of ``SLOTS`` slots of ``capacity`` bytes."""
    start = (k % SLOTS) * capacity
    return ring[start : start + capacity]


def pack_message(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def unpack_message(body: bytes) -> dict[str, Any]:
    def no_ext(code: int, data: bytes) -> Any:
        raise ValueError(f"msgpack extension type {code} is not accepted")

    obj = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=no_ext)
    if not isinstance(obj, dict):
        raise ValueError("a set-up message must be a map")
    return obj


def int_field(msg: dict[str, Any], key: str) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not an integer")
    return value


def read_message(sock: socket.socket, peer: str, timeout_s: float, watch: Watch) -> dict[str, Any]:
    """One length-prefixed msgpack message, waiting at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    buf = bytearray()
    need = 4
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no set-up message from {peer} within {timeout_s} s")
        sock.settimeout(min(POLL_S, left))
        try:
            chunk = sock.recv(need - len(buf))
        except TimeoutError:
            if watch is not None:
                watch()
            continue
        except OSError as e:
            raise PeerError(f"{peer} closed its connection ({e})") from e
        if not chunk:
            raise PeerError(f"{peer} closed its connection during set-up")
        buf += chunk
        if need == 4 and len(buf) == 4:
            need = 4 + int.from_bytes(buf, "big")
            if need > 4 + MAX_MESSAGE:
                raise PeerError(f"{peer} sent a {need - 4}-byte set-up message")
    try:
        return unpack_message(bytes(buf[4:]))
    except (ValueError, msgpack.UnpackException) as e:
        raise PeerError(f"{peer} sent a malformed set-up message ({e})") from e


# Checks a joining peer's first message (and its socket); returns its rank in the ring or
# chain, or raises ValueError saying why it is not welcome.
Check = Callable[[dict[str, Any], socket.socket, dict], int]


def accept_peers(
    listener: socket.socket, count: int, token: str, check: Check, timeout_s: float, watch: Watch, what: str
) -> dict[int, tuple[socket.socket, dict[str, Any], str]]:
    """Accept ``count`` connections whose first message carries ``token`` and passes
    ``check``. All first messages are read at once: strangers are logged and closed, and a
    silent one delays nobody. Returns ``{rank: (socket, message, address)}``."""
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, None)
    pending: dict[socket.socket, bytearray] = {}
    accepted: dict[int, tuple[socket.socket, dict[str, Any], str]] = {}
    try:
        while len(accepted) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{count - len(accepted)} {what} did not connect within {timeout_s} s")
            for key, _ in sel.select(min(POLL_S, left)):
                if key.data is None:
                    try:
                        sock, addr = listener.accept()
                    except BlockingIOError:
                        continue
                    sock.setblocking(False)
                    pending[sock] = bytearray()
                    where = addr[0] if isinstance(addr, tuple) else "this host"
                    sel.register(sock, selectors.EVENT_READ, where)
                    continue
                sock = key.fileobj  # type: ignore[assignment]
                buf = pending[sock]
                try:
                    chunk = sock.recv(MAX_MESSAGE + 4 - len(buf))
                    if not chunk:
                        raise ValueError("it closed before introducing itself")
                    buf += chunk
                    if len(buf) < 4:
                        continue
                    size = int.from_bytes(buf[:4], "big")
                    if size > MAX_MESSAGE:
                        raise ValueError(f"its first message has {size} bytes")
                    if len(buf) < 4 + size:
                        continue
                    msg = unpack_message(bytes(buf[4 : 4 + size]))
                    if not hmac.compare_digest(str(msg.get("token", "")).encode(), token.encode()):
                        raise ValueError("wrong session token")
                    rank = check(msg, sock, accepted)
                except (OSError, ValueError, TypeError, msgpack.UnpackException) as e:
                    log.warning("rejected a connection from %s joining %s: %s", key.data, what, e)
                    sel.unregister(sock)
                    del pending[sock]
                    sock.close()
                    continue
                sel.unregister(sock)
                del pending[sock]
                sock.setblocking(True)
                accepted[rank] = (sock, msg, key.data)
            if watch is not None:
                watch()
    except BaseException:
        for sock, _, _ in accepted.values():
            sock.close()
        raise
    finally:
        for sock in pending:
            sock.close()
        sel.close()
    return accepted


class Signals:
    """One neighbour's signal connection: fixed frames, every wait bounded in time."""

    def __init__(
        self, sock: socket.socket, peer: str, label: int | None, timeout_s: float, watch: Watch
    ) -> None:
        """``label``: the peer's receiver rank (what FAIL reports), None for the sender."""
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.peer = peer
        self.label = label
        self.timeout_s = timeout_s
        self.watch = watch
        self._buf = bytearray()

    def send(self, kind: int, version: int, seq: int, nbytes: int) -> None:
        try:
            self.sock.sendall(_SIGNAL.pack(kind, version, seq, nbytes))
        except OSError as e:
            raise PeerError(f"{self.peer} closed its connection ({e})", self.label) from e

    def readable(self, timeout_s: float) -> bool:
        """Whether a frame (or a part of one, or the peer's close) waits to be read, after
        at most ``timeout_s``; reads nothing."""
        if len(self._buf) >= _SIGNAL.size:
            return True
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout_s)
        except (OSError, ValueError):  # a closed socket: the next wait says so
            return True
        return bool(ready)

    def wait(self, kind: int, version: int, seq: int) -> int:
        """The byte count of the next frame, which must be ``(kind, version, seq)``."""
        deadline = time.monotonic() + self.timeout_s
        while len(self._buf) < _SIGNAL.size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no {_KINDS[kind]} signal for bucket {seq} of version {version} from {self.peer} "
                    f"within {self.timeout_s} s"
                )
            self.sock.settimeout(min(POLL_S, left))
            try:
                chunk = self.sock.recv(_SIGNAL.size - len(self._buf))
            except TimeoutError:
                if self.watch is not None:
                    self.watch()
                continue
            except OSError as e:
                raise PeerError(f"{self.peer} closed its connection ({e})", self.label) from e
            if not chunk:
                raise PeerError(f"{self.peer} closed its connection", self.label)
            self._buf += chunk
        got_kind, got_version, got_seq, nbytes = _SIGNAL.unpack(self._buf[: _SIGNAL.size])
        del self._buf[: _SIGNAL.size]
        if got_kind == FAIL:
            raise PeerError(
                f"receiver rank {nbytes} closed its connection, as {self.peer} reports "
                f"(bucket {got_seq} of version {got_version})",
                nbytes,
            )
        if (got_kind, got_version, got_seq) != (kind, version, seq):
            raise PeerError(
                f"{self.peer} sent {_KINDS.get(got_kind, got_kind)} for bucket {got_seq} of version "
                f"{got_version} where {_KINDS[kind]} for bucket {seq} of version {version} was due"
            )
        return nbytes

    def close(self) -> None:
        self.sock.close()
