"""Backend ``ipc``: receivers on the trainer's host read the trainer's own tensors.

No bucket is staged: each receiver maps the memory of the trainer's tensors once and copies
every sync's bytes straight out of it (the one copy a same-host sync cannot avoid; ``shm``
adds a second, into its ring).

- **Host memory.** The trainer's tensors must live in memory another process can map:
  ``share_tensors(module_or_state_dict)`` (``engines.shared_tensors``) moves each storage
  into an anonymous ``memfd``, and its registry tells the sender, per sync, which shared
  region a tensor lives in now. Receivers get a read-only descriptor (``/proc/self/fd``
  reopened ``O_RDONLY``) over the Unix socket (``SCM_RIGHTS``) and map it ``PROT_READ``: a
  receiver cannot write into the trainer's tensors, even by mistake.
- **Device memory (CUDA).** Each storage's CUDA IPC handle (torch's ``_share_cuda_``
  fields, msgpacked: ``platform.share_device_buffer``), opened once per receiver. The sender
  synchronizes its device once per sync, before it announces the buckets (not once per
  bucket); each receiver once, before it says it is done.
- **Kept, re-opened, dropped.** A receiver keeps its mappings across syncs. The sender
  looks every bucket's tensor up by its storage's address and size at every sync, so a
  re-allocated parameter is a new region, mapped when first used; a mapping that a sync did
  not use is dropped at its end; all go when the connection does.
- **Staging.** A bucket that is not a view of shared memory (small tensors packed into one
  bucket, a tensor made for the sync such as a cast or a DTensor's ``full_tensor()``, a
  storage outside the registry) goes through a ring of two slots as in ``shm``, in the same
  sync; ``SyncStats.staged_bytes`` counts it, ``shared_bytes`` the rest.
- **Promises.** ``send_buckets`` returns only when every receiver said it finished reading
  (the trainer must not write its tensors before ``send`` returns); every wait has the
  deadline; a receiver that dies closes its socket and is named at once.

The control socket is admitted as ``shm``'s (``engines.same_host``: this host, this user,
the sync's 128-bit token), a Unix socket in the abstract namespace (``SOCK_SEQPACKET``: one
message a record, descriptors attached to it); messages are msgpack, never pickle.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from weightsync import platform
from weightsync.engines import ring
from weightsync.engines.base import Join, Landing, NextBucket, Producer, Transport
from weightsync.engines.ring import DONE, SLOTS, PeerError, Signals
from weightsync.engines.same_host import admit_receivers, host_id, join_sender, listen
from weightsync.engines.shared_tensors import new_region_id, shared_region
from weightsync.plan import Bucket
from weightsync.stats import SyncStats

log = logging.getLogger("weightsync.engines.ipc")

#: largest message the sender sends in one record (an ``unmap`` list is cut to fit)
MAX_RECORD = 1 << 16
_UNMAP_CHUNK = 4096  # region ids per unmap message
_STAGE_ALIGN = 4096  # staged buckets start on a page in the ring (any dtype's alignment)


def _read_only_fd(fd: int) -> int:
    """A new read-only descriptor of the same memory: what a receiver maps cannot write."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _map_read_only(fd: int, nbytes: int, offset: int) -> tuple[mmap.mmap, torch.Tensor]:
    memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)
    with warnings.catch_warnings():  # torch warns that it cannot enforce read-only tensors
        warnings.simplefilter("ignore", UserWarning)
        return memory, torch.frombuffer(memory, dtype=torch.uint8)


# ---------------------------------------------------------------------------- the engine


@dataclass
class _Peer:
    """A receiver as the sender sees it: its signals, the regions it has mapped, and how
    many of this sync's staged buckets it said it is done with."""

    signals: Signals
    mapped: set[int] = field(default_factory=set)
    acked: int = 0

    def send(self, message: list, fds: list[int] | None = None) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        try:
            if fds:
                socket.send_fds(self.signals.sock, [data], fds)
            else:
                self.signals.sock.sendall(data)
        except OSError as e:
            raise PeerError(f"{self.signals.peer} closed its connection ({e})", self.signals.label) from e


class IpcEngine(Transport):
    name = "ipc"

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self._generation = 0
        self._token = ""
        self._key: tuple | None = None
        self._listener: socket.socket | None = None
        self._socket_name = ""
        self._peers: list[_Peer] = []  # sender: one per receiver
        self._sender: Signals | None = None  # receiver: the sender
        self._version = 0
        # sender: the staging ring (a region like the others) and device regions by handle
        self._ring: torch.Tensor | None = None
        self._ring_id = 0
        self._ring_slot = 0
        self._ring_memory: mmap.mmap | None = None
        self._ring_fd: int | None = None
        self._device_ids: dict[tuple, int] = {}
        self._handles: dict[tuple[int, int], dict] = {}  # this sync's device handles, by storage
        self._capacity = 1  # bytes of the largest bucket of the sync in progress
        self._shared_bytes = 0
        self._staged_bytes = 0
        # receiver: region id -> (mapping or None on a device, uint8 tensor over it)
        self._maps: dict[int, tuple[mmap.mmap | None, torch.Tensor]] = {}
        self._lent: set[int] = set()  # receiver: this sync's buckets read from the trainer's memory

    # ------------------------------------------------------------------ set-up
    def prepare(self, join: Join) -> dict[str, Any]:
        if self._listener is None and not self._peers:
            self._listen(join.world_size)
        return {
            "socket": self._socket_name,
            "token": self._token,
            "generation": self._generation,
            "host_id": host_id(),
        }

    def _listen(self, world_size: int) -> None:
        self._generation += 1
        self._token = secrets.token_hex(16)  # 128 bits: proves a connection is ours
        self._listener, self._socket_name = listen(self.name, socket.SOCK_SEQPACKET, world_size)

    def connect(self, join: Join, info: dict[str, Any]) -> None:
        self._version = join.version
        for peer in self._peers:
            peer.signals.watch = join.watch
        if self._sender is not None:
            self._sender.watch = join.watch
        self._capacity = min(max(join.capacity, 1), self.config.bucket_bytes)
        key = (info["socket"], info["generation"])
        if self._key == key:
            return
        try:
            if join.rank == 0:
                self._accept_receivers(join)
            else:
                self._join(join, info)
        except BaseException:
            self._drop()
            raise
        self._key = key

    def _accept_receivers(self, join: Join) -> None:
        assert self._listener is not None

        def welcome(sock: socket.socket) -> None:
            sock.sendall(msgpack.packb(["welcome", self._generation]))

        signals = admit_receivers(
            self.name, self._listener, join, self._token, self._generation, self.config.timeout_s, welcome
        )
        self._listener = None  # closed: everyone joined, nobody else may attach
        self._peers = [_Peer(s) for s in signals]

    def _join(self, join: Join, info: dict[str, Any]) -> None:
        self._drop()
        sock, reply, fds = join_sender(
            self.name, join, info, socket.SOCK_SEQPACKET, self.config.timeout_s, MAX_RECORD
        )
        try:
            if _unpack(reply) != ["welcome", int(info["generation"])]:
                raise PeerError("ipc: the sender's welcome is not the one its handshake announced")
        except BaseException:
            sock.close()
            raise
        finally:
            for fd in fds:  # a welcome carries none
                os.close(fd)
        self._sender = Signals(sock, "the sender (ipc)", None, self.config.timeout_s, join.watch)

    # ------------------------------------------------------------------ sender
    def _ring_for(self, capacity: int) -> torch.Tensor:
        """The staging ring, grown to slots of ``capacity`` bytes (a new region: receivers
        map it when a staged bucket first names it)."""
        if self._ring is not None and self._ring_slot >= capacity:
            return self._ring
        self._drop_ring()
        size = SLOTS * capacity
        if self.device.type == "cpu":
            # pages are touched only by what is staged: a sync of shared tensors costs none
            self._ring_fd = os.memfd_create("weightsync-ipc-ring", os.MFD_CLOEXEC)
            os.ftruncate(self._ring_fd, size)
            self._ring_memory = mmap.mmap(self._ring_fd, size, flags=mmap.MAP_SHARED)
            self._ring = torch.frombuffer(self._ring_memory, dtype=torch.uint8)
        else:
            self._ring = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._ring_id, self._ring_slot = new_region_id(), capacity
        return self._ring

    def _region(self, payload: torch.Tensor) -> tuple[int, int, int, Any] | None:
        """Where ``payload``'s bytes live in memory receivers can map: (region id, offset,
        region bytes, what a receiver maps it by: (descriptor, offset in it) for host memory, a
        device handle, or the device ring), or None."""
        if self._ring is not None and payload.untyped_storage().data_ptr() == self._ring.data_ptr():
            offset = payload.data_ptr() - self._ring.data_ptr()
            how = (self._ring_fd, 0) if self._ring_fd is not None else self._ring
            return self._ring_id, offset, self._ring.numel(), how
        if payload.device.type == "cpu":
            found = shared_region(payload)
            if found is None:
                return None
            region, offset = found
            return region.id, offset, region.nbytes, (region.arena.fd, region.offset)
        if payload.device.type != "cuda":
            return None
        storage = payload.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=payload.device).set_(storage)
        handle = self._handles.get((storage.data_ptr(), flat.numel()))
        if handle is None:
            try:
                handle = self._handles[(storage.data_ptr(), flat.numel())] = platform.share_device_buffer(
                    flat
                )
            except RuntimeError as e:  # memory CUDA IPC cannot share (expandable segments): staged
                log.debug("ipc: staging a tensor CUDA IPC cannot share: %s", e)
                return None
        fields = handle["fields"]
        key = (fields[1], fields[3], fields[2])  # the allocation's handle, offset in it, size
        region_id = self._device_ids.setdefault(key, new_region_id())
        return region_id, payload.data_ptr() - storage.data_ptr(), flat.numel(), handle

    def _announce(self, peer: _Peer, region_id: int, nbytes: int, how: Any) -> None:
        """Tell ``peer`` how to map region ``region_id``, unless it has already."""
        if region_id in peer.mapped:
            return
        if isinstance(how, tuple):  # host memory: (descriptor, offset), handed over read-only
            fd = _read_only_fd(how[0])
            try:
                peer.send(["map", region_id, nbytes, how[1]], [fd])
            finally:
                os.close(fd)
        else:
            if isinstance(how, torch.Tensor):  # the ring on a device
                how = platform.share_device_buffer(how)
            peer.send(["map", region_id, nbytes, how])
        peer.mapped.add(region_id)

    def send_buckets(self, produce: Producer) -> int:
        assert self._peers, "connect() first"
        version = self._version
        on_device = self.device.type != "cpu"
        sent = k = 0
        staged: list[
            tuple[int, int, int]
        ] = []  # this sync's staged buckets: (number, start, end) in the ring
        head = 0  # where the ring's next staged bucket goes
        used: set[int] = set()
        held: list[torch.Tensor] = []  # what receivers read stays alive until they are done
        pending: list[list] = []  # announcements waiting for the device to finish writing
        self._shared_bytes = self._staged_bytes = 0
        self._handles.clear()
        for peer in self._peers:
            peer.acked = 0
        try:
            while True:
                ring_ = self._ring_for(self._capacity)
                # a bucket's room in the ring, free of staged buckets a receiver still reads:
                # staged buckets are packed one after another (small ones are the rule), so
                # the sender waits for the receivers only when the ring comes round
                start = head if head + self._ring_slot <= ring_.numel() else 0
                end = start + self._ring_slot
                self._wait_staged(
                    staged,
                    max((i for i, (_, a, b) in enumerate(staged) if a < end and b > start), default=-1),
                    version,
                )
                slot = ring_[start:end]
                produced = produce(slot)
                if produced is None:
                    break
                bucket, payload = produced
                where = self._region(payload) if bucket.nbytes else None
                copied = where is not None and where[0] == self._ring_id
                if bucket.nbytes and (where is None or copied):
                    if payload.data_ptr() != slot.data_ptr():  # a tensor made for the sync: staged
                        platform.copy_bytes(slot[: bucket.nbytes], payload)
                    where = self._region(slot)
                    assert where is not None
                    staged.append((k, start, start + bucket.nbytes))
                    head = start + -(-bucket.nbytes // _STAGE_ALIGN) * _STAGE_ALIGN
                    self._staged_bytes += bucket.nbytes
                    if on_device:
                        platform.synchronize(self.device)
                else:
                    self._shared_bytes += bucket.nbytes
                    held.append(payload)
                if where is None:  # an empty bucket: nothing to read
                    message = ["ref", k, 0, 0, 0, False]
                else:
                    region_id, offset, nbytes, how = where
                    used.add(region_id)
                    for peer in self._peers:
                        self._announce(peer, region_id, nbytes, how)
                    message = [
                        "ref",
                        k,
                        region_id,
                        offset,
                        bucket.nbytes,
                        bool(staged and staged[-1][0] == k),
                    ]
                pending.append(message)
                if not on_device or message[5]:  # on a device: one synchronize for the rest, at the end
                    self._flush(pending)
                sent += bucket.nbytes
                k += 1
            if pending:
                platform.synchronize(self.device)  # the trainer's kernels wrote what receivers read
                self._flush(pending)
            for peer in self._peers:
                stale = sorted(peer.mapped - used - {self._ring_id})
                for i in range(0, len(stale), _UNMAP_CHUNK):
                    peer.send(["unmap", stale[i : i + _UNMAP_CHUNK]])
                peer.mapped -= set(stale)
                peer.send(["end", k])
            self._wait_staged(staged, len(staged) - 1, version)
            for peer in self._peers:  # every receiver finished reading the trainer's memory
                peer.signals.wait(DONE, version, k)
        except BaseException:
            self._drop()  # receivers see their socket close and fail at once
            raise
        finally:
            held.clear()
        return sent

    def _flush(self, pending: list[list]) -> None:
        for message in pending:
            for peer in self._peers:
                peer.send(message)
        pending.clear()

    def _wait_staged(self, staged: list[tuple[int, int, int]], upto: int, version: int) -> None:
        """Wait until every receiver is done with the ``upto``-th staged bucket of this sync
        (and those before it)."""
        for peer in self._peers:
            while peer.acked <= upto:
                peer.signals.wait(DONE, version, staged[peer.acked][0])
                peer.acked += 1

    def account(self, stats: SyncStats) -> None:
        stats.shared_bytes = self._shared_bytes
        stats.staged_bytes = self._staged_bytes

    # ------------------------------------------------------------------ receiver
    def _next_message(self) -> list:
        """The sender's next record (mapping any region it announces first)."""
        sender = self._sender
        assert sender is not None
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing from {sender.peer} within {self.config.timeout_s} s")
            sender.sock.settimeout(min(ring.POLL_S, left))
            try:
                data, fds, _flags, _addr = socket.recv_fds(sender.sock, MAX_RECORD, 1)
            except TimeoutError:
                if sender.watch is not None:
                    sender.watch()
                continue
            except OSError as e:
                raise PeerError(f"{sender.peer} closed its connection ({e})") from e
            try:
                if not data:
                    raise PeerError(f"{sender.peer} closed its connection")
                message = _unpack(data)
                if message[0] == "map":
                    self._map(message, fds)
                    continue
                if message[0] == "unmap":
                    for region_id in message[1]:
                        self._maps.pop(region_id, None)
                    continue
                return message
            finally:
                for fd in fds:
                    os.close(fd)  # a mapping keeps its memory

    def _map(self, message: list, fds: list[int]) -> None:
        _, region_id, nbytes, where = message
        if not isinstance(region_id, int) or not isinstance(nbytes, int) or nbytes <= 0:
            raise PeerError(f"ipc: the sender announced a malformed region {message[1:3]!r}")
        if isinstance(where, int):  # host memory: the offset in the descriptor that came with it
            if len(fds) != 1:
                raise PeerError(f"ipc: region {region_id} came with {len(fds)} descriptors, not one")
            if where < 0 or where % mmap.PAGESIZE or os.fstat(fds[0]).st_size < where + nbytes:
                raise PeerError(f"ipc: region {region_id} ({nbytes} bytes at {where}) is not in its memory")
            self._maps[region_id] = _map_read_only(fds[0], nbytes, where)
        elif not isinstance(where, dict):
            raise PeerError(f"ipc: region {region_id} came without a way to map it")
        else:
            self._maps[region_id] = (None, platform.open_device_buffer(where, self.device))

    def recv_buckets(
        self, next_bucket: NextBucket, landing: Landing | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        # ``landing`` is not used: the bytes are in the trainer's memory, read from there
        assert self._sender is not None, "connect() first"
        version, sender = self._version, self._sender
        self._lent.clear()
        k = 0
        while (bucket := next_bucket()) is not None:
            message = self._next_message()
            kind, seq, region_id, offset, nbytes, staged = _fields(message, "ref", 6)
            if seq != k or nbytes != bucket.nbytes:
                raise PeerError(
                    f"the sender announced {nbytes} bytes for bucket {seq} where the plan has "
                    f"{bucket.nbytes} for bucket {k}"
                )
            if nbytes:
                view = self._maps.get(region_id)
                if view is None or not 0 <= offset <= view[1].numel() - nbytes:
                    raise PeerError(f"ipc: bucket {k} lies outside region {region_id} as mapped here")
                if not staged:
                    self._lent.add(k)
                yield bucket, view[1][offset : offset + nbytes]
            else:
                yield bucket, torch.empty(0, dtype=torch.uint8, device=self.device)
            if staged:  # the sender may rewrite that slot once everyone is done with it
                platform.synchronize(self.device)
                sender.send(DONE, version, k, 0)
            k += 1
        _, count = _fields(self._next_message(), "end", 2)
        if count != k:
            raise PeerError(f"the sender sent {count} buckets, the plan {k}")
        platform.synchronize(self.device)  # our reads of the trainer's memory are complete
        sender.send(DONE, version, k, 0)

    def lends(self, bucket: Bucket) -> bool:
        # a staged bucket's slot is rewritten once every receiver is done with it; the
        # trainer's own memory is not written before every receiver acknowledged
        return bucket.index in self._lent

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self._drop()

    def finish(self, ok: bool) -> None:
        if not ok:  # the state of the connections is unknown: the next sync sets up anew
            self._drop()

    def close(self) -> None:
        self._drop()
        self._drop_ring()

    def _drop_ring(self) -> None:
        self._ring = None
        if self._ring_memory is not None:
            try:
                self._ring_memory.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the last one
            self._ring_memory = None
        if self._ring_fd is not None:
            os.close(self._ring_fd)
            self._ring_fd = None

    def _drop(self) -> None:
        """Leave: close the sockets and drop every mapping (the kernel frees the memory
        once no process maps it)."""
        for peer in self._peers:
            peer.signals.close()
        self._peers = []
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._key = None
        self._maps.clear()
        self._device_ids.clear()


def _unpack(data: bytes) -> list:
    def no_ext(code: int, payload: bytes) -> Any:
        raise ValueError(f"msgpack extension type {code} is not accepted")

    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=no_ext)
    except (ValueError, msgpack.UnpackException) as e:
        raise PeerError(f"ipc: a malformed message from the sender ({e})") from e
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise PeerError(f"ipc: a malformed message from the sender: {message!r:.100}")
    return message


def _fields(message: list, kind: str, count: int) -> list:
    if message[0] != kind or len(message) != count:
        raise PeerError(f"ipc: the sender sent {message!r:.100} where {kind!r} was due")
    if not all(isinstance(v, int) for v in message[1:]):
        raise PeerError(f"ipc: a malformed {kind!r} message: {message!r:.100}")
    return message
