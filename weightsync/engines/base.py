"""The engine interface: an engine moves bucket bytes, and knows nothing of models.

Roles: rank 0 of an engine's group is the sender; receivers are ranks 1..N. Per sync the
session calls, in order:

- ``begin(version)`` on every rank once the version is known;
- sender: ``info = prepare(host)``; the session sends ``info`` to every receiver in the
  handshake; then ``connect(info)`` on every rank (may block until all ranks joined);
- ``send_buckets(produce)`` on the sender and ``recv_buckets(next_bucket)`` on receivers;
- ``finish()`` on every rank (success or failure), and ``close()`` once at the end.

An engine with ``all_ranks_send`` (``paired``) has several senders: trainer rank 0 is rank
0, receivers are 1..N, trainer ranks 1..M-1 are N+1..N+M-1; each trainer rank's
``send_buckets`` gets only the buckets for which its ``sends(bucket)`` is True.

A ``sessionless`` engine skips all of this: ``Sender`` and ``Receiver`` hand the whole
version to it (see ``naive`` and ``disk``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from weightsync.config import EngineConfig
from weightsync.plan import Bucket

# Given a free bucket buffer, returns the next bucket and a uint8 tensor holding its bytes,
# or None when there are no more buckets. The bytes are usually the buffer's prefix, filled
# by the producer; a bucket that is one contiguous range of one source tensor comes as a
# view of that tensor instead (no packing copy). Engines only read it.
Producer = Callable[[torch.Tensor], "tuple[Bucket, torch.Tensor] | None"]
# Returns the description of the next bucket to receive, or None when the sync is complete.
NextBucket = Callable[[], "Bucket | None"]
# Given a bucket, returns memory the bucket's bytes may be written to directly (a range of
# the model's own parameter), or None to receive it into a transfer buffer.
Landing = Callable[[Bucket], "torch.Tensor | None"]


class EngineUnavailable(RuntimeError):
    """A backend is unknown or its module (or a dependency of it) cannot be imported."""


class Engine(ABC):
    """Base class of transfer backends. One instance per process and session."""

    name: ClassVar[str]
    #: A colocated engine hands tensors over inside one process (no buckets, no session).
    colocated: ClassVar[bool] = False
    #: Every trainer rank sends a share of the buckets, not rank 0 alone.
    all_ranks_send: ClassVar[bool] = False
    #: A tensor larger than a bucket may travel in pieces over several buckets; if False,
    #: such a tensor is an error at plan time.
    splits_tensors: ClassVar[bool] = True
    #: A sessionless engine needs no control session (no listening socket, no handshake):
    #: it agrees with receivers through its own medium, as ``naive`` (one process) and
    #: ``disk`` (a shared directory) do. Colocated engines are sessionless.
    sessionless: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, device: torch.device, rank: int, world_size: int | None) -> None:
        """``world_size``: sender and receivers together; a receiver does not know it
        before the handshake (None) and takes it from ``connect``'s info."""
        self.config = config
        self.device = device
        self.rank = rank
        self.world_size = world_size
        #: the local address of this process's control connection; data-plane sockets
        #: bind to it, so bytes travel on the interface the user chose (set by the session)
        self.local_host: str | None = None
        #: receivers: the sender's address as reached over the control connection
        self.sender_host: str | None = None
        #: called now and then while the engine waits on its transport; raises to abandon
        #: the wait (set by the session: it raises when a peer's control connection closed)
        self.watch: Callable[[], None] | None = None
        #: trainer ranks that send (``all_ranks_send`` engines; set by the session)
        self.num_senders = 1
        #: the weight version of the sync in progress (set by ``begin``)
        self.version: int | None = None

    def begin(self, version: int) -> None:
        """A sync of weight ``version`` starts (called on every rank before ``connect``):
        engines that tag their signals with the version read ``self.version``."""
        self.version = version

    def prepare(self, host: str) -> dict[str, Any]:
        """Sender only: set up what receivers need to join; return it (msgpack-safe)."""
        return {}

    @abstractmethod
    def connect(self, info: dict[str, Any]) -> None:
        """Join the data plane described by ``info`` (no-op if already joined to it)."""

    def sends(self, bucket: Bucket) -> bool:
        """Sender side: whether this rank sends ``bucket``. Called for every bucket of the
        plan, in plan order, before ``send_buckets`` produces it."""
        return True

    @abstractmethod
    def send_buckets(self, produce: Producer) -> int:
        """Sender: call ``produce(buffer)`` until it returns None, moving each bucket's
        bytes to every receiver. Returns, with the bytes sent, when every bucket is off
        the wire (so buffers and source tensors may be reused)."""

    @abstractmethod
    def recv_buckets(
        self, next_bucket: NextBucket, landing: Landing | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        """Receiver: yield each bucket with a uint8 buffer holding its bytes. The buffer is
        valid until the next item is requested. An engine that can write bytes anywhere
        may receive a bucket straight into ``landing(bucket)`` (then yielded as the buffer);
        others ignore it."""

    def finish(self, ok: bool) -> None:
        """End of one sync on this rank. ``ok`` is False when the transfer itself failed
        (its state is unknown); sender and receivers call it alike, so they agree on
        whether the next sync joins a new group."""

    def reset(self) -> None:
        """Sender only: membership changed, the next ``prepare`` starts a new group."""

    def reserve(self, nbytes: int) -> None:
        """Make the transfer buffers hold buckets of ``nbytes`` (at most the configured
        bucket size): called once the plan is known, so a model smaller than a bucket
        does not cost two full buckets of memory."""

    def close(self) -> None:
        """Release everything."""
