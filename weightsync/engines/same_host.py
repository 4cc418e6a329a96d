"""Same-host admission: who may join a sync over the Unix socket of ``shm`` and ``ipc``.

Both backends hand receivers memory (descriptors, device handles) over one Unix socket in
the abstract namespace: no file to leave behind, reachable from this host only. What that
socket admits is decided here, once for both:

- **This host.** A receiver joins only when its ``host_id`` (hostname and the kernel's boot
  id) is the one the sender announced in the handshake: processes of one kernel can map
  each other's memory, processes on another host cannot.
- **This user.** Each end reads the other's uid from the socket (``SO_PEERCRED``) and
  refuses any other: a process of another user never gets a descriptor, and a receiver
  never maps memory a process of another user offers.
- **This sync.** A joining receiver's first message carries the sync's 128-bit token (it
  travelled over the authenticated control channel), the listener's generation and a free
  receiver rank; ``ring.accept_peers`` reads all first messages at once, so a stranger
  delays nobody and is dropped with a log line.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

from weightsync.engines import ring
from weightsync.engines.base import Join
from weightsync.engines.ring import PeerError, Signals


def host_id() -> str:
    """Identifies this host's kernel instance: processes with equal ids can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def listen(backend: str, kind: int, world_size: int) -> tuple[socket.socket, str]:
    """A listening Unix socket of ``kind`` (``SOCK_STREAM``, ``SOCK_SEQPACKET``) under a
    fresh name in the abstract namespace; returns it and its name (what receivers connect to)."""
    name = f"weightsync-{backend}-{os.getpid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, kind)
    listener.bind("\0" + name)  # abstract: no file, this host only
    listener.listen(max(8, world_size))
    return listener, name


def admit_receivers(
    backend: str,
    listener: socket.socket,
    join: Join,
    token: str,
    generation: int,
    timeout_s: float,
    welcome: Callable[[socket.socket], None],
) -> list[Signals]:
    """The sender's side: accept the ``join.world_size - 1`` receivers of this sync (this
    user, ``token``, ``generation``, each a free receiver rank), then close ``listener`` so
    nobody else may attach. ``welcome`` sends each its first answer (what it maps). Returns
    their signal connections in rank order."""
    count = join.world_size - 1

    def check(msg: dict[str, Any], sock: socket.socket, taken: dict) -> int:
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise ValueError(f"process of uid {uid} is not this user ({os.getuid()})")
        if ring.int_field(msg, "generation") != generation:
            raise ValueError(f"generation {msg.get('generation')} is not the current one")
        rank = ring.int_field(msg, "rank")
        if not 1 <= rank <= count or rank in taken:
            raise ValueError(f"rank {rank} is not a free receiver rank of this session")
        return rank

    peers = ring.accept_peers(listener, count, token, check, timeout_s, join.watch, f"{backend} receiver(s)")
    listener.close()
    signals = []
    try:
        for rank, (sock, msg, _) in sorted(peers.items()):
            welcome(sock)
            label = msg.get("label") if isinstance(msg.get("label"), int) else rank - 1
            signals.append(Signals(sock, f"receiver rank {label} ({backend})", label, timeout_s, join.watch))
    except OSError as e:
        for sock, _, _ in peers.values():
            sock.close()
        raise PeerError(f"{backend}: a receiver left while it joined ({e})") from e
    return signals


def join_sender(
    backend: str, join: Join, info: dict[str, Any], kind: int, timeout_s: float, reply_bytes: int
) -> tuple[socket.socket, bytes, list[int]]:
    """A receiver's side: check that the sender (as its handshake ``info`` says) runs on
    this host, connect to its socket, introduce this receiver, and read the sender's first
    answer (at most ``reply_bytes``, and at most one descriptor with it) from a socket that
    must belong to this user. Returns ``(socket, answer, descriptors)``; the caller checks
    the answer, closes the descriptors, and closes the socket if it refuses the answer."""
    if info.get("host_id") != host_id():
        raise RuntimeError(
            f"backend {backend!r} needs every receiver on the sender's host: the sender runs on "
            f"{info.get('host_id')}, {join.name} on {host_id()}; use backend 'nccl' across hosts"
        )
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + str(info["socket"]))
        first = {
            "token": str(info["token"]),
            "generation": int(info["generation"]),
            "rank": join.rank,
            "label": join.receiver_rank,
        }
        sock.sendall(ring.pack_message(first))
        answer, fds, _flags, _addr = socket.recv_fds(sock, reply_bytes, 1)
    except OSError as e:
        sock.close()
        raise PeerError(f"{backend}: could not join the sender's socket {info['socket']!r}: {e}") from e
    try:
        if not answer:
            raise PeerError(f"{backend}: the sender closed its socket during set-up")
        if peer_uid(sock) != os.getuid():
            raise PeerError(f"{backend}: the sender's socket belongs to another user")
    except BaseException:
        sock.close()
        for fd in fds:
            os.close(fd)
        raise
    return sock, answer, fds
