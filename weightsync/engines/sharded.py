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
bucket k of every pair before bucket k + 1 of any, scheduled by both ends' NICs), so no
blocking operation waits on a circle.
Receiver ranks that keep the same slices (the same rank of several replicas) form a chain
(``Route.chains``): the first takes the fragments from the trainer ranks and each passes
every piece on to the next as it arrives, so each trainer byte leaves its NIC once.

With ``engine_kwargs.sharded.links=mooncake`` a link is a pair of Mooncake ends instead
(``weightsync.engines.mooncake_links``): the same operations in the same order, each piece a
one-sided write into the receiving rank's registered bucket buffers. Pieces then always land
in those buffers (no ``landing`` in the model's own tensors: a late write of a failed sync
must never reach them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync.config.keys import SHARDED_LINKS
from weightsync.engines.base import EngineUnavailable, Join, Landing, NextBucket
from weightsync.engines.nccl import CollectiveEngine
from weightsync.plan import Bucket

PAIRS = "pairs"
_MOONCAKE_BUFFERS = 4  # a receiver's bucket buffers over mooncake links (see _buffer_count)


class ShardedEngine(CollectiveEngine):
    name = "sharded"
    all_ranks_send = True
    sharded = True
    reroutes = False  # every trainer rank would have to send its part again in step: not built
    topologies = (PAIRS,)

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self._mooncake: Any = None  # MooncakeLinks while the links are Mooncake's
        self._use_links(config.engine_kwargs.sharded.links)

    def _use_links(self, kind: str) -> None:
        """Carry the links over ``kind`` from the next group on (trainer rank 0 names it in
        its handshake; the other ranks follow, as ``nccl``'s receivers follow its topology)."""
        if kind == self._link_kind:
            return
        self._drop_group()
        if self._mooncake is not None:
            self._mooncake.shutdown()
            self._mooncake = None
        self._buffers = None  # the next sync allocates (and registers) its own
        if kind == "mooncake":
            try:  # only where asked for: it needs Mooncake Transfer Engine
                from weightsync.engines.mooncake_links import MooncakeLinks
            except ImportError as e:
                raise EngineUnavailable(f"engine_kwargs.sharded.links=mooncake: {e}") from e
            self._mooncake = MooncakeLinks(self.config, self.device)

    def _topology(self, join: Join) -> str:
        return PAIRS

    @property
    def _link_kind(self) -> str:
        return "collective" if self._mooncake is None else "mooncake"

    def prepare(self, join: Join) -> dict[str, Any]:
        return {**super().prepare(join), "links": self._link_kind}

    def connect(self, join: Join, info: dict[str, Any]) -> None:
        theirs = info.get("links", "collective")
        if theirs not in SHARDED_LINKS:
            raise RuntimeError(
                f"{self.name}: trainer rank 0 names links {theirs!r}, not one of {', '.join(SHARDED_LINKS)}: "
                "run the same weightsync on every rank"
            )
        self._use_links(theirs)  # trainer rank 0's choice, whatever this rank's configuration says
        super().connect(join, info)

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

    def _recv_window(self) -> int:
        # A rank that passes its buckets on takes them one at a time, in its plan's order.
        # With several posted, the trainer ranks of the next buckets send at once and share
        # its NIC, so the bucket due next (the only one it can forward) arrives slower: the
        # next rank's link then idles, and it cannot catch up later, being as fast as its
        # NIC. Measured on 8 emulated hosts (4 trainer ranks to 2 replicas of 2 ranks, 1 Gbit/s):
        # 0.66x the M x N link ceiling with 8 buckets posted, 0.74x with 2, 0.88x with 1; the
        # next posted as the current one ends (``POST_EARLY``) keeps the link busy between
        # buckets (2 trainer ranks: 0.89x with 1 alone, 0.92x so).
        assert self._join is not None
        return 1 if self._join.forward is not None else super()._recv_window()

    def _post_send(self, bucket: Bucket, piece: torch.Tensor) -> dist.Work:
        return self._send_op(self._peer(bucket), piece)

    def hop(self, bucket: Bucket, share: int) -> tuple[int, int | None]:
        assert self._join is not None
        return self._peer(bucket), self._join.forward

    # ------------------------------------------------------------------ mooncake links
    def _open_groups(self, join: Join, store: dist.Store, info: dict[str, Any]) -> None:
        if self._mooncake is None:
            super()._open_groups(join, store, info)
            return
        self._groups.update(self._mooncake.open(join, store, info["token"], self._links()))

    def _buffer_count(self) -> int:
        # Over mooncake every bucket a receiver takes lands in a buffer (none in the model's
        # own tensors) and holds it until consumed and passed on: with two, a trainer rank
        # waited for a free one at every bucket (0.75x the link ceiling on 6 hosts, 0.91x
        # over Gloo pairs, which land most buckets in the model).
        if self._mooncake is not None and self._join is not None and self._join.receiver_rank is not None:
            return _MOONCAKE_BUFFERS
        return super()._buffer_count()

    def _drop_group(self, failed: bool = False) -> None:
        if self._mooncake is None:
            super()._drop_group(failed)
            return
        self._mooncake.close(self._take_groups(), failed)

    def _reserve(self, nbytes: int) -> None:
        super()._reserve(nbytes)
        if self._mooncake is not None and self._join is not None:
            self._mooncake.buffers(self._join, self._buffers)

    def recv_buckets(
        self, next_bucket: NextBucket, landing: Landing | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        return super().recv_buckets(next_bucket, landing if self._mooncake is None else None)

    def finish(self, ok: bool) -> None:
        if self._mooncake is not None and not ok:
            self._mooncake.abandon_buffers()  # before the engine lets go of them
        super().finish(ok)

    def close(self) -> None:
        super().close()
        if self._mooncake is not None:
            self._mooncake.shutdown()
