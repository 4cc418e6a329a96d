"""Sharded sync (M x N), as data: layouts (which box of each global tensor a rank holds or
needs, from DTensor placements or declared) and the route planner that turns both sides'
layouts into fragments, each sent once by one trainer rank to one receiver rank.
"""

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
    "ROUTE_FORMAT",
    "Box",
    "Fragment",
    "Layout",
    "Placement",
    "Replicate",
    "Route",
    "RouteError",
    "Shard",
    "box_of_dtensor",
    "boxes_of_placements",
    "chunk",
    "nic_bytes",
    "placements_of",
    "plan_route",
    "route_hash",
    "whole_needs",
]
