"""The two engine contracts. An engine moves bytes or versions, and knows nothing of models.

A backend belongs to one of two families:

- a **Transport** moves bucket bytes inside a control session (``nccl``, ``shm``,
  ``paired``, ``mooncake``). The session (``Sender`` / ``Receiver``) agrees on version
  and plan with every peer, then drives the transport, then gathers acknowledgements;
- a **Publisher** hands a whole version over through its own medium, without a session
  (``naive``: inside one process; ``disk``: a shared directory). It agrees with receivers
  through that medium and reports the outcome itself.

``Sender`` and ``Receiver`` know only these two contracts, never a concrete engine. A
third-party backend is one module with a subclass of either, registered by name
(``weightsync.register_engine``, imported through ``custom_backend_module``).

Transport, per sync (the session calls, in order):

1. sender (trainer rank 0): ``info = prepare(join)``; the session sends ``info`` to every
   peer in the handshake;
2. every rank: ``connect(join, info)`` (may block until all ranks joined; a no-op when the
   group of the previous sync is still the one ``info`` describes);
3. ``send_buckets(produce)`` on ranks that send, ``recv_buckets(next_bucket, landing)``
   on receivers;
   (then ``account(stats)`` on the sender);
4. ``finish(ok)`` on every rank, success or failure; ``close()`` once at the end.

Everything a transport needs from the session comes in the ``Join`` record of that sync;
a transport never reads the session's state, and the session never sets a transport's
attributes.

A transport with ``all_ranks_send`` (``paired``) has several senders: trainer rank 0 is
rank 0, receivers are 1..N, trainer ranks 1..M-1 are N+1..N+M-1; each trainer rank's
``send_buckets`` gets only the buckets for which its ``sends(bucket)`` is True.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weightsync.config.engine import EngineConfig
from weightsync.plan import Bucket, TensorSpec
from weightsync.sources import WeightSource
from weightsync.stats import SyncStats

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


@dataclass(frozen=True)
class Join:
    """What the session tells a transport about one sync, on one rank.

    A new record comes with every sync; a transport may keep it for that sync only.
    """

    #: the weight version of this sync (transports that tag their signals use it)
    version: int
    #: this process's place in the sync's data-plane group: 0 is trainer rank 0 (which
    #: hosts the group), receivers are 1..N, further trainer ranks follow (``paired``)
    rank: int
    #: ranks in the group: receivers plus trainer ranks that send
    world_size: int
    #: trainer ranks that send (1 unless the transport has ``all_ranks_send``)
    senders: int
    #: bytes of the largest bucket of this sync (buffers never need to be larger)
    capacity: int
    #: how errors and logs name this process ("receiver rank 2", "trainer rank 0")
    name: str
    #: this process's receiver rank (None on trainer ranks): what peers report as lost
    receiver_rank: int | None = None
    #: the local address of this process's control connection; data-plane sockets bind to
    #: it, so bytes travel on the interface the user chose (None: no specific interface)
    local_host: str | None = None
    #: receivers and trainer ranks > 0: the sender's address as reached over the control
    #: connection (None on the sender)
    sender_host: str | None = None
    #: trainer rank 0: the address each receiver's control connection came from, by
    #: receiver rank (empty elsewhere): where the receivers are, for a transport's route
    peer_hosts: tuple[str, ...] = ()
    #: called now and then while the transport waits; raises to abandon the wait (the
    #: session raises when a peer's control connection closed)
    watch: Callable[[], None] | None = None
    #: ``sharded``: the route's (trainer rank, receiver rank) pairs as group ranks, in the
    #: one order every rank joins them in (empty for the other transports)
    links: tuple[tuple[int, int], ...] = ()
    #: ``sharded``: the group rank at the other end of the link a bucket of this rank's
    #: plan travels (by bucket index); None for the other transports
    peer_of: Callable[[int], int] | None = None
    #: ``sharded``: the group rank this receiver passes every bucket on to (the same rank
    #: of the next replica in its chain), or None
    forward: int | None = None

    def check(self) -> None:
        """Call ``watch`` if there is one."""
        if self.watch is not None:
            self.watch()


class Transport(ABC):
    """A backend that moves bucket bytes inside a session. One instance per process."""

    name: ClassVar[str]
    #: Every trainer rank sends a share of the buckets, not rank 0 alone.
    all_ranks_send: ClassVar[bool] = False
    #: A tensor larger than a bucket may travel in pieces over several buckets; if False,
    #: such a tensor is an error at plan time.
    splits_tensors: ClassVar[bool] = True
    #: After a receiver is lost mid-sync, a new data plane of the others can take the same
    #: version again at once (``drop_lost_receivers``): whatever of the failed one may still
    #: write into a receiver's memory writes that version's bytes (``settle``).
    reroutes: ClassVar[bool] = False
    #: Each rank sends or takes only its own part of the route (``sharded``): the session
    #: agrees the ranks' layouts and each rank's own plan in the handshake
    #: (``weightsync.sharding.agreement``) and hands the links over in ``Join``.
    sharded: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def prepare(self, join: Join) -> dict[str, Any]:
        """Trainer rank 0 only: set up what the other ranks need to join; return it
        (msgpack-safe). Called every sync before the handshake."""
        return {}

    @abstractmethod
    def connect(self, join: Join, info: dict[str, Any]) -> None:
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
        valid until the next item is requested. A transport that can write bytes anywhere
        may receive a bucket straight into ``landing(bucket)`` (then yielded as the buffer);
        others ignore it. Closing the generator early abandons the transfer."""

    def lends(self, bucket: Bucket) -> bool:
        """Receiver, for the bucket just yielded: whether its buffer stays unchanged until
        this sync's acknowledgement (``ipc``: the trainer's own memory, which it may not
        write before ``send`` returns), so a loader that is done before the receiver answers
        may read its tensors in place instead of a copy."""
        return False

    def account(self, stats: SyncStats) -> None:
        """Sender, after ``send_buckets``: add this transport's own figures of the sync to
        ``stats`` (``ipc``: the bytes read from the trainer's memory and those staged)."""

    def settle(self, version: int, retake: bool) -> None:
        """Receiver, before it answers the sync of ``version`` (``retake``: the version of
        its failed attempt, re-routed): let what a failed sync left pending end first, so no
        late write lands in the model, bounded to leave the sync its ``timeout_s``."""

    def finish(self, ok: bool) -> None:
        """End of one sync on this rank. ``ok`` is False when the transfer itself failed
        (its state is unknown); sender and receivers call it alike, so they agree on
        whether the next sync joins a new group."""

    def reset(self) -> None:
        """Membership or session changed: the next ``prepare`` / ``connect`` starts or
        joins a new group."""

    def close(self) -> None:
        """Release everything."""


class Offer(ABC):
    """One published version as a receiver finds it, before reading it."""

    #: the version offered
    version: int
    #: the publisher sent it with ``force`` (a deliberate rollback)
    force: bool = False
    #: its tensors, when known before reading (checked against a model first)
    specs: Sequence[TensorSpec] | None = None
    #: how many units (shards, ...) it is read in, for the stats
    parts: int = 0

    def refusal(self, config: EngineConfig) -> str | None:
        """Why a receiver configured with ``config`` must not take it (beyond the version
        rules every receiver applies), or None."""
        return None

    @abstractmethod
    def tensors(self, device: torch.device, owned: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the version. ``owned``: the caller keeps them (else they may be
        the publisher's own memory, valid until the next item is requested)."""

    def ack(self, state: str, message: str | None = None) -> None:
        """Tell the publisher how this receiver is doing: ``reading``, ``ok``, ``failed``
        or ``refused`` (with a message)."""


class Publisher(ABC):
    """A backend that hands whole versions over without a session. One instance per
    process; the same class serves the sending and the receiving side."""

    name: ClassVar[str]
    #: Every trainer rank hands its tensors to the receivers of its own process (``naive``);
    #: otherwise trainer rank 0 publishes and other trainer ranks drain their source.
    colocated: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, device: torch.device, address: str) -> None:
        self.config = config
        self.device = device
        self.address = address

    @abstractmethod
    def publish(self, source: WeightSource, version: int, receivers: Sequence[int], force: bool) -> SyncStats:
        """Sender: hand ``version`` over to ``receivers``; return when they took it (or at
        once, where the medium has no acknowledgements). Raises ``SyncError`` naming the
        receivers that failed, refused, died or did not answer in time."""

    @abstractmethod
    def offer(self, rank: int, version: int | None) -> Offer:
        """Receiver ``rank``: wait (``timeout_s``) for a publication of ``version`` (None:
        the newest) that this receiver has not read yet."""

    def close(self) -> None:
        """Release everything (a sender's publication may go with it)."""


#: Either family: what the registry holds.
Engine = Transport | Publisher
