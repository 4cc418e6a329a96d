"""Backend ``nccl``: collective broadcast from the sender (rank 0) to every receiver.

Served by NCCL on CUDA, HCCL on Ascend and Gloo on CPU (``platform.collective_backend``).
The group is our own, built from a TCP store hosted by the sender; the caller's default
process group is never touched. Double-buffered: two bucket buffers per rank, so the
sender fills bucket k+1 while bucket k is on the wire, and a receiver hands out bucket k
while bucket k+1 arrives. Buckets that are one range of one tensor need no buffer: they
are broadcast from the trainer's tensor into the receiver's parameter, several in flight.
"""

from __future__ import annotations

import datetime
import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.engines.base import Engine, Landing, NextBucket, Producer
from weightsync.plan import Bucket

log = logging.getLogger("weightsync.engines.nccl")

# Broadcasts queued at once. Buckets sent from (or landing in) the model's own tensors need
# no buffer, so more than two can be in flight, hiding each call's latency.
WINDOW = 8


class CollectiveEngine(Engine):
    name = "nccl"

    def __init__(self, config, device, rank, world_size) -> None:
        super().__init__(config, device, rank, world_size)
        self.library = platform.collective_backend("nccl", device.type)
        self._kwargs = config.engine_kwargs.nccl
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._group_key: tuple | None = None
        self._generation = 0
        self._buffers: list[torch.Tensor] | None = None

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.timeout_s)

    # ------------------------------------------------------------------ group
    def prepare(self, host: str) -> dict[str, Any]:
        if self._store is None:
            # Port 0: the OS picks a free port; receivers learn it from the handshake.
            self._store = dist.TCPStore(
                host, 0, self.world_size, True, timeout=self._timeout, wait_for_workers=False
            )
        if self._group is None:
            self._generation += 1
        return {
            "host": host,
            "port": self._store.port,
            "group": f"{self._kwargs.group_name}/{self._generation}",
            "library": self.library,
            "world_size": self.world_size,
        }

    def connect(self, info: dict[str, Any]) -> None:
        if info.get("library") != self.library:
            raise RuntimeError(
                f"collective library mismatch: sender uses {info.get('library')!r}, "
                f"receiver rank {self.rank} uses {self.library!r} (are both on the same platform?)"
            )
        key = (info["host"], info["port"], info["group"])
        world_size = int(info["world_size"])
        if self._group is not None and key == self._group_key:
            return
        self._drop_group()
        store = self._store
        if self.rank != 0:
            host = self.sender_host or info["host"]  # the address that reached the sender
            store = dist.TCPStore(host, int(info["port"]), world_size, False, timeout=self._timeout)
            self._store = store
        prefixed = dist.PrefixStore(f"weightsync/{info['group']}", store)
        log.debug("rank %d joining group %s (%s)", self.rank, info["group"], self.library)
        self._group = platform.new_process_group(
            self.library, prefixed, self.rank, world_size, self.config.timeout_s, bind_host=self.local_host
        )
        self._group_key = key

    def _drop_group(self) -> None:
        group, self._group, self._group_key = self._group, None, None
        if group is not None and self.library != "gloo":
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def reserve(self, nbytes: int) -> None:
        nbytes = min(max(nbytes, 1), self.config.bucket_bytes)
        if self._buffers is None or self._buffers[0].numel() < nbytes:
            self._buffers = None  # free the old pair before allocating the new one
            # Touched (zeroed) now, during the handshake, not page by page mid-transfer.
            self._buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _bufs(self) -> list[torch.Tensor]:
        if self._buffers is None:
            self.reserve(self.config.bucket_bytes)
        return self._buffers

    # ------------------------------------------------------------------ data
    def send_buckets(self, produce: Producer) -> int:
        assert self._group is not None, "connect() first"
        bufs = self._bufs()
        # Broadcasts in flight, oldest first, with the buffer slot each one reads (None: it
        # reads the source tensor itself, which stays valid until the sync ends).
        in_flight: deque[tuple[dist.Work, int | None]] = deque()
        slot = 0
        sent = 0
        buckets = 0
        try:
            while True:
                # Never refill a buffer still on the wire; keep at most WINDOW calls queued.
                while in_flight and (len(in_flight) >= WINDOW or any(s == slot for _, s in in_flight)):
                    in_flight.popleft()[0].wait()
                produced = produce(bufs[slot])
                if produced is None:
                    break
                bucket, payload = produced
                packed = payload.data_ptr() == bufs[slot].data_ptr()
                if bucket.nbytes:
                    in_flight.append((self._group.broadcast(payload, 0), slot if packed else None))
                if packed:
                    slot = (slot + 1) % 2
                sent += bucket.nbytes
                buckets += 1
            while in_flight:
                in_flight.popleft()[0].wait()
        except BaseException:
            # Let go of the failed group now (our works hold it, and the traceback holds
            # this frame): its sockets close and receivers waiting on them fail at once
            # instead of at their timeout.
            in_flight.clear()
            self._drop_group()
            raise
        platform.synchronize(self.device)
        return sent

    def recv_buckets(self, next_bucket: NextBucket, landing: Landing | None = None) -> Iterator[tuple[Bucket, torch.Tensor]]:
        assert self._group is not None, "connect() first"
        bufs = self._bufs()
        free = [0, 1]  # buffer slots not holding a posted or handed-out bucket
        posted: deque[tuple[Bucket, int | None, torch.Tensor, dist.Work | None]] = deque()
        pending: Bucket | None = None
        ended = False

        def post_ahead() -> None:
            # Post receives in bucket order (the sender broadcasts in that order), up to
            # WINDOW ahead; a bucket that needs a buffer waits for a free slot.
            nonlocal pending, ended
            while not ended and len(posted) < WINDOW:
                if pending is None:
                    pending = next_bucket()
                    if pending is None:
                        ended = True
                        return
                target = landing(pending) if landing is not None else None
                slot = None
                if target is None:
                    if not free:
                        return
                    slot = free.pop(0)
                    target = bufs[slot][: pending.nbytes]
                work = self._group.broadcast(target, 0) if pending.nbytes else None
                posted.append((pending, slot, target, work))
                pending = None

        post_ahead()
        while posted:
            bucket, slot, target, work = posted.popleft()
            if work is not None:
                work.wait()
            yield bucket, target
            # The consumer asked for more: its views of this bucket are released.
            if slot is not None:
                free.append(slot)
            post_ahead()
        platform.synchronize(self.device)

    def reset(self) -> None:
        self._drop_group()

    def finish(self, ok: bool) -> None:
        # A failed collective leaves the group in an unknown state: build a new one next time.
        if not ok or self._kwargs.rebuild_group:
            self._drop_group()
        if self._kwargs.rebuild_group:
            self._buffers = None
            platform.empty_cache()

    def close(self) -> None:
        self._drop_group()
        self._buffers = None
        self._store = None
