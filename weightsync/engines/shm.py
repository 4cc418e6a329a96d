"""Backend ``shm``: trainer and rollout processes on one host share the bucket memory.

The sender writes each bucket once into a ring of two slots that every receiver has
mapped; all receivers read a slot at the same time while the sender fills the other one.
Host memory is an anonymous ``memfd`` handed to receivers over a Unix socket
(``SCM_RIGHTS``), so it has no name in ``/dev/shm`` and the kernel frees it when the last
process holding it exits, however it exits. On CUDA the slots are device memory shared
through CUDA IPC handles (``platform.share_device_buffer``).

The same Unix socket (abstract namespace: no file either) carries the ring's signals as
fixed 16-byte frames: the sender's "bucket k is in its slot" and each receiver's "I am done
with bucket k". A peer that dies closes its socket, so the other side fails at once rather
than at its deadline.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import torch

from weightsync import platform
from weightsync.engines.base import Engine, Landing, NextBucket, Producer
from weightsync.plan import Bucket

log = logging.getLogger("weightsync.engines.shm")

SLOTS = 2
_FRAME = struct.Struct("<qq")  # (sequence number, byte count)
_HELLO = b"weightsync-shm/1"


def host_id() -> str:
    """Identifies this host's kernel instance: processes with equal ids can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class ShmPeerError(ConnectionError):
    """The process at the other end of the ring's socket went away or broke protocol."""


class _Signals:
    """One peer's end of the ring's socket: fixed frames, every read bounded in time."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        sock.settimeout(timeout_s)

    def send(self, seq: int, nbytes: int) -> None:
        try:
            self.sock.sendall(_FRAME.pack(seq, nbytes))
        except OSError as e:
            raise ShmPeerError(f"{self.peer} is gone ({e})") from e

    def recv(self, expect_seq: int) -> int:
        buf = bytearray(_FRAME.size)
        view = memoryview(buf)
        got = 0
        try:
            while got < len(buf):
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise ShmPeerError(f"{self.peer} closed its connection")
                got += n
        except TimeoutError as e:
            raise TimeoutError(f"no signal from {self.peer} within {self.sock.gettimeout()} s") from e
        except OSError as e:
            if isinstance(e, ShmPeerError):
                raise
            raise ShmPeerError(f"{self.peer} is gone ({e})") from e
        seq, nbytes = _FRAME.unpack(buf)
        if seq != expect_seq:
            raise ShmPeerError(f"{self.peer} signalled bucket {seq} where bucket {expect_seq} was due")
        return nbytes

    def close(self) -> None:
        self.sock.close()


class ShmEngine(Engine):
    name = "shm"

    def __init__(self, config, device, rank, world_size) -> None:
        super().__init__(config, device, rank, world_size)
        self._capacity = 0  # bytes per slot
        self._generation = 0
        self._key: tuple | None = None  # the ring this process is joined to
        self._listener: socket.socket | None = None
        self._socket_name = ""
        self._memory: mmap.mmap | None = None
        self._fd: int | None = None
        self._device_handle: dict | None = None
        self._ring: torch.Tensor | None = None  # SLOTS * capacity bytes
        self._peers: list[_Signals] = []  # sender: one per receiver; receiver: the sender

    # ------------------------------------------------------------------ set-up
    def reserve(self, nbytes: int) -> None:
        nbytes = min(max(nbytes, 1), self.config.bucket_bytes)
        if self.rank == 0 and nbytes > self._capacity:
            self._drop()  # receivers join the new, larger ring at the next connect
            self._capacity = nbytes

    def prepare(self, host: str) -> dict[str, Any]:
        if self._ring is None:
            self._create_ring()
        info: dict[str, Any] = {
            "socket": self._socket_name,
            "generation": self._generation,
            "slot_bytes": self._capacity,
            "host_id": host_id(),
            "world_size": self.world_size,
        }
        if self._device_handle is not None:
            info["device_buffer"] = self._device_handle
        return info

    def _create_ring(self) -> None:
        if self._capacity == 0:
            self._capacity = self.config.bucket_bytes
        size = SLOTS * self._capacity
        if self.device.type == "cpu":
            self._fd = os.memfd_create("weightsync-shm", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, size)
            self._memory = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self._ring = torch.frombuffer(self._memory, dtype=torch.uint8)
        else:
            self._ring = torch.zeros(size, dtype=torch.uint8, device=self.device)
            self._device_handle = platform.share_device_buffer(self._ring)
        self._generation += 1
        # Abstract Unix socket: no file to leave behind, reachable only from this host.
        self._socket_name = f"weightsync-shm-{os.getpid()}-{secrets.token_hex(8)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self._socket_name)
        listener.listen(max(1, (self.world_size or 2) - 1))
        self._listener = listener
        log.debug("shm ring %s: %d slots of %d bytes on %s", self._socket_name, SLOTS, self._capacity, self.device)

    def connect(self, info: dict[str, Any]) -> None:
        key = (info["socket"], info["generation"])
        if self._key == key:
            return
        if self.rank == 0:
            self._accept_receivers(int(info["world_size"]) - 1)
        else:
            self._join(info)
        self._key = key

    def _accept_receivers(self, count: int) -> None:
        assert self._listener is not None
        deadline = time.monotonic() + self.config.timeout_s
        peers: dict[int, _Signals] = {}
        while len(peers) < count:
            self._listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                raise TimeoutError(
                    f"shm: {count - len(peers)} receiver(s) did not map the shared buckets within {self.config.timeout_s} s"
                ) from None
            try:
                rank = self._greet(sock, taken=peers)
            except (OSError, ValueError) as e:
                log.warning("shm: rejected a connection on the ring's socket: %s", e)
                sock.close()
                continue
            peers[rank] = _Signals(sock, f"receiver rank {rank - 1} (shm)", self.config.timeout_s)
        self._peers = [peers[r] for r in sorted(peers)]
        # Everyone joined: nobody else may attach to this ring.
        self._listener.close()
        self._listener = None

    def _greet(self, sock: socket.socket, taken) -> int:
        """Check a joining process (same user, our protocol), hand it the memory; its rank."""
        sock.settimeout(self.config.timeout_s)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise ValueError(f"process of uid {uid} is not this user ({os.getuid()})")
        hello = sock.recv(len(_HELLO) + 8)
        if len(hello) != len(_HELLO) + 8 or not hello.startswith(_HELLO):
            raise ValueError("not a weightsync shm receiver")
        rank = struct.unpack("<q", hello[len(_HELLO):])[0]
        if not 1 <= rank < (self.world_size or 0) or rank in taken:
            raise ValueError(f"rank {rank} is not a receiver rank of this session")
        fds = [self._fd] if self._fd is not None else []
        socket.send_fds(sock, [_FRAME.pack(rank, self._capacity)], fds)
        return rank

    def _join(self, info: dict[str, Any]) -> None:
        if info.get("host_id") != host_id():
            raise RuntimeError(
                f"backend 'shm' needs every receiver on the sender's host: the sender runs on "
                f"{info.get('host_id')}, receiver rank {self.rank - 1} on {host_id()}; use backend 'nccl' across hosts"
            )
        self._drop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.config.timeout_s)
        try:
            sock.connect("\0" + info["socket"])
            sock.sendall(_HELLO + struct.pack("<q", self.rank))
            msg, fds, _flags, _addr = socket.recv_fds(sock, _FRAME.size, 1)
        except OSError as e:
            sock.close()
            raise ShmPeerError(f"shm: could not join the sender's ring {info['socket']!r}: {e}") from e
        if len(msg) != _FRAME.size:
            sock.close()
            for fd in fds:
                os.close(fd)
            raise ShmPeerError("shm: the sender closed the ring's socket during set-up")
        _rank, capacity = _FRAME.unpack(msg)
        self._capacity = capacity
        size = SLOTS * capacity
        if "device_buffer" in info:
            self._ring = platform.open_device_buffer(info["device_buffer"], self.device)
        else:
            if len(fds) != 1:
                raise ShmPeerError(f"shm: expected the ring's file descriptor, got {len(fds)}")
            try:
                self._memory = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fds[0])  # the mapping keeps the memory alive
            self._ring = torch.frombuffer(self._memory, dtype=torch.uint8)
        self._peers = [_Signals(sock, "the sender (shm)", self.config.timeout_s)]

    def _slot(self, k: int) -> torch.Tensor:
        assert self._ring is not None
        start = (k % SLOTS) * self._capacity
        return self._ring[start : start + self._capacity]

    # ------------------------------------------------------------------ data
    def send_buckets(self, produce: Producer) -> int:
        assert self._peers, "connect() first"
        sent = 0
        k = 0
        try:
            while True:
                if k >= SLOTS:  # the slot's previous bucket must be read by everyone
                    for peer in self._peers:
                        peer.recv(k - SLOTS)
                slot = self._slot(k)
                produced = produce(slot)
                if produced is None:
                    break
                bucket, payload = produced
                if bucket.nbytes and payload.data_ptr() != slot.data_ptr():
                    slot[: bucket.nbytes].copy_(payload)  # a bucket sent from its source tensor
                platform.synchronize(self.device)
                for peer in self._peers:
                    peer.send(k, bucket.nbytes)
                sent += bucket.nbytes
                k += 1
            for seq in range(max(0, k - SLOTS + 1), k):  # the last buckets still being read
                for peer in self._peers:
                    peer.recv(seq)
        except BaseException:
            self._drop()  # receivers see their socket close and fail at once
            raise
        return sent

    def recv_buckets(self, next_bucket: NextBucket, landing: Landing | None = None) -> Iterator[tuple[Bucket, torch.Tensor]]:
        # ``landing`` is not used: the bytes are already in memory every receiver reads.
        assert self._peers, "connect() first"
        sender = self._peers[0]
        k = 0
        while (bucket := next_bucket()) is not None:
            nbytes = sender.recv(k)
            if nbytes != bucket.nbytes:
                raise ShmPeerError(f"the sender wrote {nbytes} bytes for bucket {k}, the plan says {bucket.nbytes}")
            yield bucket, self._slot(k)[:nbytes]
            platform.synchronize(self.device)  # our reads of the slot are complete
            sender.send(k, 0)
            k += 1

    def reset(self) -> None:
        self._drop()

    def finish(self, ok: bool) -> None:
        if not ok:  # the ring's state is unknown: the next sync sets up a new one
            self._drop()

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        """Leave the ring: close sockets and unmap (the kernel frees the memory once no
        process maps it)."""
        for peer in self._peers:
            peer.close()
        self._peers = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._key = None
        self._ring = None
        self._device_handle = None
        if self._memory is not None:
            try:
                self._memory.close()
            except BufferError:
                pass  # a consumer still holds a view; the mapping goes with the last one
            self._memory = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
