"""Sharded sync (M x N): layouts (which box of each global tensor a rank holds or needs,
from DTensor placements or declared), the route planner that turns both sides' layouts into
fragments, each sent once by one trainer rank to one receiver rank, the fragments as tensors
(packed from local shards, landed in kept slices), and the route's agreement in a session's
handshake (``agreement``), which backend ``sharded`` (``weightsync.engines.sharded``) runs.
"""

from weightsync.sharding.agreement import ShardSource
from weightsync.sharding.fragments import (
    LocalShard,
    RankPlan,
    declared_shards,
    fragment_tensors,
    global_specs,
    layout_of,
    local_shards,
    pair_plan,
    receiver_plan,
    trainer_plan,
)
from weightsync.sharding.layout import (
    Box,
    Layout,
    Placement,
    Replicate,
    Shard,
    box_of_dtensor,
    boxes_of_placements,
    chunk,
    placements_of,
)
from weightsync.sharding.route import (
    ROUTE_FORMAT,
    Fragment,
    Route,
    RouteError,
    nic_bytes,
    plan_route,
    route_hash,
    whole_needs,
)

__all__ = [
    "ShardSource",
    "ROUTE_FORMAT",
    "Box",
    "Fragment",
    "LocalShard",
    "RankPlan",
    "Layout",
    "Placement",
    "Replicate",
    "Route",
    "RouteError",
    "Shard",
    "box_of_dtensor",
    "boxes_of_placements",
    "chunk",
    "declared_shards",
    "fragment_tensors",
    "global_specs",
    "layout_of",
    "local_shards",
    "nic_bytes",
    "pair_plan",
    "placements_of",
    "plan_route",
    "receiver_plan",
    "route_hash",
    "trainer_plan",
    "whole_needs",
]
