"""Backend ``shm``: trainer and rollout processes on one host share the bucket memory.

The sender writes each bucket once into a ring of slots (``engines.ring``) that every
receiver has mapped; all receivers read a slot at the same time while the sender fills
the other one. Host memory is an anonymous ``memfd`` handed to receivers over a Unix
socket (``SCM_RIGHTS``), so it has no name in ``/dev/shm`` and the kernel frees it when the
last process holding it exits, however it exits. On CUDA the slots are device memory
shared through CUDA IPC handles (``platform.share_device_buffer``).

The same Unix socket (abstract namespace: no file either, reachable from this host only)
carries the ring's signals. A joining process must be on this host, be this user
(``SO_PEERCRED``) and carry the ring's token (``engines.same_host``, shared with ``ipc``);
strangers are dropped without delaying the others. A peer that
dies closes its socket, so the other side fails at once rather than at its deadline.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import torch

from weightsync import platform
from weightsync.engines import ring
from weightsync.engines.base import Join, Landing, NextBucket, Producer, Transport
from weightsync.engines.ring import DONE, READY, SLOTS, PeerError, Signals
from weightsync.engines.same_host import admit_receivers, host_id, join_sender, listen
from weightsync.plan import Bucket

log = logging.getLogger("weightsync.engines.shm")

# Kept for callers that caught the old name.
ShmPeerError = PeerError


class ShmEngine(Transport):
    name = "shm"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self._capacity = 0  # bytes per slot
        self._generation = 0
        self._token = ""
        self._key: tuple | None = None  # the ring this process is joined to
        self._listener: socket.socket | None = None
        self._socket_name = ""
        self._memory: mmap.mmap | None = None
        self._fd: int | None = None
        self._device_handle: dict | None = None
        self._ring: torch.Tensor | None = None  # SLOTS * capacity bytes
        self._peers: list[Signals] = []  # sender: one per receiver; receiver: the sender
        self._version = 0  # of the sync in progress: tags every signal

    # ------------------------------------------------------------------ set-up
    def prepare(self, join: Join) -> dict[str, Any]:
        capacity = min(max(join.capacity, 1), self.config.bucket_bytes)
        if capacity > self._capacity:
            self._drop()  # receivers join the new, larger ring at this sync's connect
            self._capacity = capacity
        if self._ring is None:
            self._create_ring(join.world_size)
        info: dict[str, Any] = {
            "socket": self._socket_name,
            "token": self._token,
            "generation": self._generation,
            "slot_bytes": self._capacity,
            "host_id": host_id(),
        }
        if self._device_handle is not None:
            info["device_buffer"] = self._device_handle
        return info

    def _create_ring(self, world_size: int) -> None:
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
        self._token = secrets.token_hex(16)  # 128 bits: proves a connection is ours
        self._listener, self._socket_name = listen(self.name, socket.SOCK_STREAM, world_size)
        log.debug(
            "shm ring %s: %d slots of %d bytes on %s", self._socket_name, SLOTS, self._capacity, self.device
        )

    def connect(self, join: Join, info: dict[str, Any]) -> None:
        self._version = join.version
        for peer in self._peers:
            peer.watch = join.watch
        key = (info["socket"], info["generation"])
        if self._key == key:
            return
        try:
            if join.rank == 0:
                self._accept_receivers(join)
            else:
                self._join(join, info)
        except BaseException:
            self._drop()  # close what was opened: the others fail at once, not at their deadline
            raise
        self._key = key

    def _accept_receivers(self, join: Join) -> None:
        assert self._listener is not None
        fds = [self._fd] if self._fd is not None else []

        def welcome(sock: socket.socket) -> None:  # the slot size, and the ring's memory on the host
            socket.send_fds(sock, [ring.pack_message({"slot_bytes": self._capacity})], fds)

        self._peers = admit_receivers(
            self.name, self._listener, join, self._token, self._generation, self.config.timeout_s, welcome
        )
        self._listener = None  # closed: everyone joined, nobody else may attach to this ring

    def _join(self, join: Join, info: dict[str, Any]) -> None:
        self._drop()
        sock, msg, fds = join_sender(
            self.name, join, info, socket.SOCK_STREAM, self.config.timeout_s, 4 + ring.MAX_MESSAGE
        )
        try:
            capacity = ring.int_field(ring.unpack_message(msg[4:]), "slot_bytes")
            if capacity != int(info["slot_bytes"]):
                raise PeerError(
                    f"shm: the sender offers slots of {capacity} bytes, its handshake said {info['slot_bytes']}"
                )
            self._capacity = capacity
            size = SLOTS * capacity
            if "device_buffer" in info:
                self._ring = platform.open_device_buffer(info["device_buffer"], self.device)
            else:
                if len(fds) != 1:
                    raise PeerError(f"shm: expected the ring's file descriptor, got {len(fds)}")
                self._memory = mmap.mmap(
                    fds[0], size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                )
                self._ring = torch.frombuffer(self._memory, dtype=torch.uint8)
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)  # the mapping keeps the memory alive
        self._peers = [Signals(sock, "the sender (shm)", None, self.config.timeout_s, join.watch)]

    def _slot(self, k: int) -> torch.Tensor:
        assert self._ring is not None
        return ring.slot(self._ring, self._capacity, k)

    # ------------------------------------------------------------------ data
    def send_buckets(self, produce: Producer) -> int:
        assert self._peers, "connect() first"
        version = self._version
        sent = 0
        k = 0
        try:
            while True:
                if k >= SLOTS:  # the slot's previous bucket must be read by everyone
                    for peer in self._peers:
                        peer.wait(DONE, version, k - SLOTS)
                slot = self._slot(k)
                produced = produce(slot)
                if produced is None:
                    break
                bucket, payload = produced
                if bucket.nbytes and payload.data_ptr() != slot.data_ptr():
                    platform.copy_bytes(
                        slot[: bucket.nbytes], payload
                    )  # a bucket sent from its source tensor
                platform.synchronize(self.device)
                for peer in self._peers:
                    peer.send(READY, version, k, bucket.nbytes)
                sent += bucket.nbytes
                k += 1
            for seq in range(max(0, k - SLOTS + 1), k):  # the last buckets still being read
                for peer in self._peers:
                    peer.wait(DONE, version, seq)
        except BaseException:
            self._drop()  # receivers see their socket close and fail at once
            raise
        return sent

    def recv_buckets(
        self, next_bucket: NextBucket, landing: Landing | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        # ``landing`` is not used: the bytes are already in memory every receiver reads.
        assert self._peers, "connect() first"
        version = self._version
        sender = self._peers[0]
        k = 0
        while (bucket := next_bucket()) is not None:
            if bucket.nbytes > self._capacity:  # the plan and the ring disagree: never read past a slot
                raise PeerError(f"bucket {k} has {bucket.nbytes} bytes, the sender's slots {self._capacity}")
            nbytes = sender.wait(READY, version, k)
            if nbytes != bucket.nbytes:
                raise PeerError(
                    f"the sender wrote {nbytes} bytes for bucket {k}, the plan says {bucket.nbytes}"
                )
            yield bucket, self._slot(k)[:nbytes]
            platform.synchronize(self.device)  # our reads of the slot are complete
            sender.send(DONE, version, k, 0)
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
