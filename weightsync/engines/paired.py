"""Backend ``paired``: every trainer rank feeds a different replica; replicas pass it on.

M trainer ranks send to N receivers (rollout replicas). The plan's buckets are dealt into
M shares of nearly equal bytes (each bucket, in plan order, to the share with the fewest
bytes so far: every rank computes the same deal without a word). Trainer rank s sends
share s to replica d(s) = (s + 1) mod N, a cyclic derangement: where trainer and rollout
processes share device indices, no trainer rank feeds the replica on its own device. Each
share then travels the ring of replicas d(s) -> d(s)+1 -> ... (N - 1 hops), each replica
forwarding a bucket as soon as it holds it. So every byte crosses each link at most once:
a trainer rank's link carries 1/M of the model, a replica's inbound link the whole model
and its outbound link (N-1)/N of it, and all M trainer links work at once, where a
broadcast from rank 0 puts the whole model on one trainer link.

Transport: persistent two-rank process groups (NCCL / HCCL / Gloo, chosen as for
``nccl``), one per link: trainer rank -> its replica, and replica -> next replica. Each
group carries bytes one way only, as broadcasts from its rank 0, so both ends issue its
operations in the same (plan) order, which collectives need; Gloo's point-to-point calls
would not do: their completion cannot be polled, so a dead peer could not be noticed
while waiting. Groups are kept across syncs and rebuilt only when membership changes or
a transfer failed. Tensors are
never split over buckets (``splits_tensors``): every bucket holds complete named tensors,
so a replica can apply it on its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.engines.base import Join
from weightsync.engines.nccl import CollectiveEngine
from weightsync.plan import Bucket


def partner(share: int, replicas: int) -> int:
    """The replica trainer rank ``share`` sends to: a cyclic derangement of the indices
    (with one replica there is no choice)."""
    return (share + 1) % replicas


class Deal:
    """Deals buckets, in plan order, into ``shares`` shares of nearly equal bytes."""

    def __init__(self, shares: int) -> None:
        self.loads = [0] * shares

    def __call__(self, bucket: Bucket) -> int:
        share = min(range(len(self.loads)), key=self.loads.__getitem__)  # lowest on ties
        self.loads[share] += bucket.nbytes
        return share


class PairedEngine(CollectiveEngine):
    name = "paired"
    all_ranks_send = True
    splits_tensors = False

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        self._trainers = 1
        self._replicas = 0
        self._deal: Deal | None = None  # the deal of the sync in progress (both sides)

    # ------------------------------------------------------------------ layout
    def _trainer_rank(self, share: int) -> int:
        return 0 if share == 0 else self._replicas + share

    @property
    def _share(self) -> int:
        """This trainer rank's share (trainer ranks only)."""
        return 0 if self.rank == 0 else self.rank - self._replicas

    def _links(self) -> list[tuple[int, int]]:
        """Every link of the layout as (from, to) engine ranks, in one order all ranks
        agree on. Ranks join their links' groups in this order, so the lowest link not
        yet built always has both its ends waiting for it: no deadlock."""
        links = {(self._trainer_rank(s), partner(s, self._replicas) + 1) for s in range(self._trainers)}
        if self._replicas > 1:
            links |= {(j + 1, (j + 1) % self._replicas + 1) for j in range(self._replicas)}
        return sorted(links)

    def _send_op(self, to: int | None, tensor: torch.Tensor) -> dist.Work:
        assert to is not None, "paired sends to one rank"
        return self._groups[(self.rank, to)].broadcast(tensor, 0)

    def _recv_op(self, source: int, tensor: torch.Tensor) -> dist.Work:
        return self._groups[(source, self.rank)].broadcast(tensor, 0)

    # ------------------------------------------------------------------ groups
    def _joined(self) -> bool:
        return bool(self._groups)

    def _arrange(self, join: Join) -> None:
        """The layout of ``join``'s group: how many trainer ranks and replicas (pure)."""
        self._trainers = join.senders
        self._replicas = join.world_size - self._trainers
        if self._trainers < 1 or self._replicas < 1:
            raise RuntimeError(f"paired: {self._trainers} trainer rank(s) and {self._replicas} receiver(s) cannot pair")

    def start(self, join: Join) -> None:
        """The per-sync state (both sides): the sync's record, buffers, a fresh deal."""
        super().start(join)
        self._deal = Deal(join.senders)  # every sync deals from the first bucket again

    def connect(self, join: Join, info: dict[str, Any]) -> None:
        self.start(join)
        key = (info["host"], info["port"], info["group"], join.world_size, join.senders)
        if self._groups and key == self._group_key:
            return
        self._drop_group()
        self._arrange(join)
        store = self._rendezvous(join, info)
        for a, b in self._links():
            if join.rank in (a, b):
                self._groups[(a, b)] = platform.new_process_group(
                    self.library, dist.PrefixStore(f"link/{a}-{b}", store), (a, b).index(join.rank), 2,
                    self.config.timeout_s, bind_host=join.local_host,
                )
        self._group_key = key

    def _take_groups(self) -> list[dist.ProcessGroup]:
        groups = list(self._groups.values())
        self._groups.clear()
        self._group_key = None
        return groups

    # ------------------------------------------------------------------ data
    def sends(self, bucket: Bucket) -> bool:
        assert self._deal is not None, "connect() first"
        return self._deal(bucket) == self._share

    def _post_send(self, payload: torch.Tensor) -> dist.Work:
        # ``send_buckets`` (inherited) sends what ``sends`` picked, to this rank's replica
        return self._send_op(partner(self._share, self._replicas) + 1, payload)

    def _route(self, bucket: Bucket) -> tuple[int, int | None]:
        """A bucket of share s comes straight from trainer rank s to replica d(s), then
        around the ring of replicas; the last replica of the ring keeps it."""
        assert self._deal is not None, "connect() first"
        share = self._deal(bucket)
        me, n = self.rank - 1, self._replicas
        hop = (me - partner(share, n)) % n  # 0: straight from the trainer rank
        source = self._trainer_rank(share) if hop == 0 else (me - 1) % n + 1
        forward = (me + 1) % n + 1 if hop < n - 1 else None
        return source, forward
