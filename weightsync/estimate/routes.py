"""Who sends how many bytes to whom in one sync: the route each backend's own code takes.

Nothing here is a separate formula for a backend: ``nccl``'s chain and ``paired``'s shares
are walked through the engines' own ``arrange`` / ``pieces`` / ``hop`` (each receiver
rank asking, piece by piece in plan order, where the piece comes from, as it does in a
sync), ``sharded``'s fragments and chains come from the planner (``plan_route``) over the
layouts a sync would declare (``weightsync.sharding.typical``: FSDP2 trainer ranks,
tensor-parallel replicas), and the plan is ``make_plan``'s. What is modelled rather than
walked: Gloo's broadcast (rank 0 sends each receiver the model), NCCL's (a pipelined ring:
walked as the chain), ``mooncake``'s chain (sender, then receivers in rank order, as its
docstring says) and ``shm`` (each receiver copies the model out of one host's memory).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join
from weightsync.estimate.cluster import Cluster
from weightsync.plan import Plan, TensorSpec, make_plan
from weightsync.sharding.layout import Layout
from weightsync.sharding.route import plan_route
from weightsync.sharding.typical import replica_boxes, trainer_boxes

#: a rank: ("trainer", t) or ("receiver", q)
Key = tuple[str, int]
#: bytes per (from, to) pair of ranks in one sync
Flows = dict[tuple[Key, Key], int]

BACKENDS = ("nccl", "paired", "mooncake", "sharded", "shm")


def _group_key(rank: int, receivers: int) -> Key:
    """A data-plane group rank as a rank of the cluster (engines.base.Join's numbering)."""
    if rank == 0:
        return ("trainer", 0)
    if rank <= receivers:
        return ("receiver", rank - 1)
    return ("trainer", rank - receivers)


def _walk(backend: str, topology: str, cluster: Cluster, plan: Plan, senders: int) -> Flows:
    """Every receiver rank's pieces, asked of the engine in plan order: where each comes from."""
    from weightsync.engines.registry import get_engine

    engine = get_engine(backend)(EngineConfig(backend=backend), torch.device("cpu"))
    receivers = len(cluster.receivers)
    flows: Flows = defaultdict(int)
    try:
        for rank in range(1, receivers + 1):
            join = Join(
                version=0, rank=rank, world_size=receivers + senders, senders=senders, capacity=1, name=""
            )
            engine.start(join)
            engine.arrange(join, topology)
            for bucket in plan.buckets:
                meta = torch.empty(bucket.nbytes, dtype=torch.uint8, device="meta")
                for piece, share in engine.pieces(bucket, meta):
                    source, _ = engine.hop(bucket, share)
                    flows[(_group_key(source, receivers), ("receiver", rank - 1))] += piece.numel()
    finally:
        engine.close()
    return dict(flows)


def _one_host(cluster: Cluster) -> bool:
    return len({h for h, _ in (*cluster.trainers, *cluster.receivers)}) == 1


def route_of(backend: str, cluster: Cluster) -> str:
    """The route ``backend`` takes on ``cluster`` (as the real sync chooses it)."""
    if backend == "nccl":
        if cluster.device == "gpu":
            return "ring"  # NCCL pipelines its broadcast
        return "broadcast" if _one_host(cluster) else "chain"  # topology=auto
    return {"paired": "chain", "mooncake": "chain", "sharded": "pairs", "shm": "memory"}[backend]


def flows_of(backend: str, cluster: Cluster, specs: Sequence[TensorSpec]) -> tuple[Flows, int]:
    """The bytes between ranks of one sync of ``specs`` by ``backend``, and the longest
    chain of forwards (hops a piece waits behind, for the pipeline's fill)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: the estimate knows {', '.join(BACKENDS)}")
    receivers = len(cluster.receivers)
    model = sum(s.nbytes for s in specs)
    route = route_of(backend, cluster)
    if backend == "sharded":
        return _sharded(cluster, specs)
    plan = make_plan(list(specs), cluster.bucket_bytes)
    if backend == "shm":
        if not _one_host(cluster):
            raise ValueError("shm: every rank must be on one host")
        return {(("trainer", 0), ("receiver", q)): model for q in range(receivers)}, 0
    if backend == "mooncake" or route == "ring":
        chain = [("trainer", 0), *(("receiver", q) for q in range(receivers))]
        return {(a, b): plan_bytes(plan) for a, b in zip(chain, chain[1:])}, receivers - 1
    if route == "broadcast":  # Gloo: rank 0 sends every receiver the model
        return {(("trainer", 0), ("receiver", q)): plan_bytes(plan) for q in range(receivers)}, 0
    senders = len(cluster.trainers) if backend == "paired" else 1
    return _walk(backend, "chain", cluster, plan, senders), receivers - 1


def plan_bytes(plan: Plan) -> int:
    return sum(b.nbytes for b in plan.buckets)


def layer_unit(specs: Sequence[TensorSpec]) -> tuple[list[TensorSpec], list[TensorSpec], int]:
    """A decoder's tensors as (the ones outside its layers, layer 0's, the number of layers)
    when every layer has layer 0's shapes (then every layer's route is layer 0's, and a
    route of 256 x 256 ranks over thousands of tensors need not be planned in full);
    otherwise (every tensor, none, 0)."""
    layers: dict[int, list[TensorSpec]] = defaultdict(list)
    outside: list[TensorSpec] = []
    for spec in specs:
        parts = spec.name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit():
            layers[int(parts[2])].append(spec)
        else:
            outside.append(spec)
    if len(layers) < 2:
        return list(specs), [], 0

    def shape(layer: list[TensorSpec]) -> list[tuple]:
        return [(s.name.split(".", 3)[3], s.shape, s.dtype) for s in layer]

    first = layers[min(layers)]
    if any(shape(layer) != shape(first) for layer in layers.values()):
        return list(specs), [], 0
    return outside, first, len(layers)


def _sharded(cluster: Cluster, specs: Sequence[TensorSpec]) -> tuple[Flows, int]:
    """The planner's route over FSDP2 trainer shards and tensor-parallel replica slices
    (for a decoder: its first layer's route, times its layers, plus the rest's)."""
    outside, layer, count = layer_unit(specs)
    flows: Flows = defaultdict(int)
    depth = 0
    for part, times in ((outside, 1), (layer, count)):
        if not part:
            continue
        part_flows, part_depth = _sharded_route(cluster, part)
        depth = max(depth, part_depth)
        for pair, n in part_flows.items():
            flows[pair] += n * times
    return dict(flows), depth


def _sharded_route(cluster: Cluster, specs: Sequence[TensorSpec]) -> tuple[Flows, int]:
    trainers = len(cluster.trainers)

    def nic(where: tuple[int, int]) -> str:
        host, index = cluster.nic(where)
        return f"{host}/{index}"

    holders = [Layout(trainer_boxes(specs, trainers, t), nic(cluster.trainers[t])) for t in range(trainers)]
    needs = [
        Layout(replica_boxes(specs, cluster.tp, q % cluster.ranks, cluster.ep), nic(cluster.receivers[q]))
        for q in range(len(cluster.receivers))
    ]
    route = plan_route(list(specs), holders, needs)
    flows: Flows = defaultdict(int)
    for f in route.fragments:
        flows[(("trainer", f.source), ("receiver", f.dest))] += f.nbytes
    taken = route.received_bytes()
    for chain in route.chains:
        for a, b in zip(chain, chain[1:]):
            flows[(("receiver", a), ("receiver", b))] += taken.get(a, 0)
    depth = max((len(c) - 1 for c in route.chains), default=0)
    return dict(flows), depth
