"""Backend ``paired``: every trainer rank feeds a different replica; replicas pass it on.

M trainer ranks send to N receivers (rollout replicas). The pieces of the plan's buckets
(``CHUNK_BYTES`` each, in plan order) are dealt into M shares: each piece to the share
with the fewest bytes so far, so every rank computes the same deal without a word, the
shares differ by at most a piece, and every trainer link is busy at every point of the
plan (a deal of whole buckets left one link idle while the other sent a 64 MiB
embedding, and an lm_head at the end loaded one share with a bucket more). Every trainer
rank packs every bucket and sends its pieces of it. Trainer rank s sends share s to
replica d(s) = (s + 1) mod N, a cyclic derangement: where trainer and rollout processes
share device indices, no trainer rank feeds the replica on its own device. Each share
then travels the ring of replicas d(s) -> d(s)+1 -> ... (N - 1 hops), each replica
forwarding a piece as soon as it arrived. So every byte crosses each link at most once:
a trainer rank's link carries 1/M of the model, a replica's inbound link the whole model
and its outbound link (N-1)/N of it, and all M trainer links work at once, where a
broadcast from rank 0 puts the whole model on one trainer link.

Transport: the chain of ``nccl`` (``engine_kwargs.nccl.topology=chain``), with M shares:
persistent two-rank process groups (NCCL / HCCL / Gloo, chosen as for ``nccl``), one per
link, each carrying bytes one way as broadcasts from its rank 0, so both ends issue its
operations in the same (plan) order, which collectives need; Gloo's point-to-point calls
would not do: their completion cannot be polled, so a dead peer could not be noticed
while waiting. Groups are kept across syncs and rebuilt only when membership changes or
a transfer failed. Tensors are never split over buckets (``splits_tensors``): every
bucket holds complete named tensors, so a replica can apply it on its own.
"""

from __future__ import annotations

from weightsync.engines.base import Join
from weightsync.engines.nccl import CollectiveEngine


class Deal:
    """Deals pieces of ``nbytes`` each, in plan order, into ``shares`` shares of nearly
    equal bytes: each to the share with the fewest so far (the lowest on ties)."""

    def __init__(self, shares: int) -> None:
        self.loads = [0] * shares

    def __call__(self, nbytes: int) -> int:
        share = min(range(len(self.loads)), key=self.loads.__getitem__)
        self.loads[share] += nbytes
        return share


class PairedEngine(CollectiveEngine):
    name = "paired"
    all_ranks_send = True
    splits_tensors = False
    reroutes = False  # every trainer rank would have to send the version again in step: not built

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self._deal: Deal | None = None  # the deal of the sync in progress (both sides)

    def _topology(self, join: Join) -> str:
        return "chain"  # always: the pairs are the point

    def start(self, join: Join) -> None:
        """The per-sync state (both sides): the sync's record, buffers, a fresh deal."""
        super().start(join)
        self._deal = Deal(join.senders)  # every sync deals from the first piece again

    def _share_of(self, nbytes: int) -> int:
        assert self._deal is not None, "connect() first"
        return self._deal(nbytes)
