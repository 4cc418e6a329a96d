"""Backend ``sharded``: every trainer rank sends its own shards, each receiver rank takes
only the slices it keeps, every (trainer rank, receiver rank) pair at once (M x N).

The session agrees the route first (``weightsync.sharding.agreement``: every rank's layout,
the route's hash, each rank's own plan: its buckets grouped by peer), so this transport
only moves buckets along the links the route names (``Join.links``), each bucket over the
link of its group's peer (``Join.peer_of``). A link is a two-rank process group of
``nccl``'s kind (NCCL / HCCL / Gloo, built from the sender's authenticated rendezvous),
carrying bytes one way as broadcasts from its trainer end in pieces of ``CHUNK_BYTES``:
both ends issue its operations in the same order (their pair's plan), and completion can
be polled, so a dead peer is noticed while waiting. Ranks join their links in one global
order of pairs, and move their buckets in one global order (``weightsync.sharding.fragments``:
a round pairs each rank with at most one peer; bucket k of every pair before bucket k + 1 of
any), so every pair of a round runs at once and no blocking operation waits on a circle.
Receiver ranks that keep the same slices (the same rank of several replicas) form a chain
(``Route.chains``): the first takes the fragments from the trainer ranks and each passes
every piece on to the next as it arrives, so each trainer byte leaves its NIC once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weightsync.engines.base import Join
from weightsync.engines.nccl import CollectiveEngine
from weightsync.plan import Bucket

PAIRS = "pairs"


class ShardedEngine(CollectiveEngine):
    name = "sharded"
    all_ranks_send = True
    sharded = True
    reroutes = False  # every trainer rank would have to send its part again in step: not built
    topologies = (PAIRS,)

    def _topology(self, join: Join) -> str:
        return PAIRS

    def arrange(self, join: Join, topology: str) -> None:
        super().arrange(join, topology)
        self._chain = True  # two-rank groups, one per link
        if join.peer_of is None:
            raise RuntimeError(
                f"{self.name}: {join.name} joined without its route (run the same weightsync everywhere)"
            )

    def _links(self) -> list[tuple[int, int]]:
        assert self._join is not None
        return list(self._join.links)

    def _share_of(self, nbytes: int) -> int:
        return self._share  # every bucket of a rank's plan is its own

    def _peer(self, bucket: Bucket) -> int:
        assert self._join is not None and self._join.peer_of is not None
        return self._join.peer_of(bucket.index)

    def _post_send(self, bucket: Bucket, piece: torch.Tensor) -> dist.Work:
        return self._send_op(self._peer(bucket), piece)

    def _route(self, bucket: Bucket, share: int) -> tuple[int, int | None]:
        assert self._join is not None
        return self._peer(bucket), self._join.forward
