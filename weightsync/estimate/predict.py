"""Seconds and NIC bytes of one sync, predicted from its route (``routes.flows_of``).

Bytes between ranks on different hosts cross the sender's NIC (out) and the receiver's (in),
each direction its own resource; bytes between ranks of one host cross its intra-host link
(NVLink, or memory). The prediction is the busiest resource's time (its bytes over its rate,
the wire's rate times the payload share TCP or RDMA leaves: ``wire_efficiency``), plus the
pipeline's fill (a piece per hop of the longest chain) and a sync's fixed cost (handshake,
acknowledgements: ``sync_overhead_s``). The ceiling it is measured against is what the
bench divides by: the fewest bytes each NIC must carry once, whatever the route (the model
out of the sending trainer ranks' NICs together and into each receiver's; for ``sharded``
each rank's own shard or slices), over its nominal rate.

``Calibration`` holds the per-machine figures; ``calibrate()`` measures this machine's
(memory copies), the rest are documented defaults (docs/estimate.md).
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from weightsync.engines.ring import CHUNK_BYTES
from weightsync.estimate.cluster import Cluster
from weightsync.estimate.routes import flows_of, layer_unit, route_of
from weightsync.plan import TensorSpec
from weightsync.sharding.typical import box_bytes, replica_boxes, trainer_boxes


@dataclass
class Calibration:
    """Per-machine costs the prediction adds to the wire's."""

    #: payload over nominal rate on a NIC (TCP on 1 Gbit/s here: 114-119 MB/s of 125)
    wire_efficiency: float = 0.95
    #: a sync's fixed seconds beyond its wire time and pipeline fill: handshake and
    #: acknowledgements (0.00-0.03 s measured on the emulated cluster: BENCHMARKS.md)
    sync_overhead_s: float = 0.03
    #: bytes per second one process copies in memory (``shm``, one host's ranks)
    memcpy_bps: float = 8e9
    #: where the figures come from
    source: str = "defaults (docs/estimate.md)"

    @classmethod
    def load(cls, path: str | Path | None) -> Calibration:
        if path is None or not Path(path).exists():
            return cls()
        data = json.loads(Path(path).read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def calibrate(nbytes: int = 256 << 20, repeats: int = 5) -> Calibration:
    """This machine's memory copy rate (the median of ``repeats`` copies of ``nbytes``)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return Calibration(
        memcpy_bps=nbytes / statistics.median(seconds[1:]), source=f"measured on {socket.gethostname()}"
    )


@dataclass
class Estimate:
    """One backend's predicted sync on a cluster; ``to_dict`` is its ``--json`` form."""

    backend: str
    route: str
    bytes: int
    seconds: float
    ceiling_s: float
    bottleneck: str
    #: per NIC ("host/nic"): bytes out and in per sync
    nic_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per host: bytes between its own ranks
    intra_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 4)
        out["ceiling_s"] = round(self.ceiling_s, 4)
        out["ratio_to_ceiling"] = round(self.ceiling_s / self.seconds, 3) if self.seconds else None
        return out


def _where(cluster: Cluster, key: tuple[str, int]) -> tuple[int, int]:
    side, index = key
    return (cluster.trainers if side == "trainer" else cluster.receivers)[index]


def predict(
    cluster: Cluster, specs: Sequence[TensorSpec], backend: str, calibration: Calibration | None = None
) -> Estimate:
    """The predicted sync of ``specs`` by ``backend`` on ``cluster``."""
    cal = calibration or Calibration()
    flows, depth = flows_of(backend, cluster, specs)
    out: dict[tuple[int, int], int] = defaultdict(int)
    into: dict[tuple[int, int], int] = defaultdict(int)
    intra: dict[int, int] = defaultdict(int)
    for (a, b), n in flows.items():
        wa, wb = _where(cluster, a), _where(cluster, b)
        if wa[0] == wb[0]:
            intra[wa[0]] += n
        else:
            out[cluster.nic(wa)] += n
            into[cluster.nic(wb)] += n
    times: list[tuple[float, str]] = [(0.0, "nothing")]
    for (host, nic), n in out.items():
        times.append(
            (
                n * 8 / (cluster.hosts[host].nic_bps * cal.wire_efficiency),
                f"{cluster.hosts[host].name} NIC {nic} out",
            )
        )
    for (host, nic), n in into.items():
        times.append(
            (
                n * 8 / (cluster.hosts[host].nic_bps * cal.wire_efficiency),
                f"{cluster.hosts[host].name} NIC {nic} in",
            )
        )
    for host, n in intra.items():
        bps = cluster.hosts[host].intra_bps if cluster.device == "gpu" else cal.memcpy_bps * 8
        times.append((n * 8 / bps, f"{cluster.hosts[host].name} intra-host"))
    wire, bottleneck = max(times)
    slowest = min(h.nic_bps for h in cluster.hosts)
    fill = depth * min(CHUNK_BYTES, cluster.bucket_bytes) * 8 / (slowest * cal.wire_efficiency)
    model = sum(s.nbytes for s in specs)
    nic_bytes = {
        f"{cluster.hosts[h].name}/{i}": {"tx": out.get((h, i), 0), "rx": into.get((h, i), 0)}
        for h, i in sorted(set(out) | set(into))
    }
    return Estimate(
        backend,
        route_of(backend, cluster),
        model,
        wire + fill + cal.sync_overhead_s,
        ceiling_s(cluster, specs, backend),
        bottleneck,
        nic_bytes,
        {cluster.hosts[h].name: n for h, n in sorted(intra.items())},
    )


def ceiling_s(cluster: Cluster, specs: Sequence[TensorSpec], backend: str) -> float:
    """The physical limit of a sync: the fewest bytes each NIC must carry once, whatever the
    route, over its nominal rate (the bench's link ceiling)."""
    model = sum(s.nbytes for s in specs)
    need: dict[tuple[int, int], int] = defaultdict(int)  # NIC -> bytes into it at least
    send: dict[tuple[int, int], int] = defaultdict(int)  # NIC -> bytes out of it at least
    trainers = len(cluster.trainers)
    outside, layer, count = layer_unit(specs)

    def own(boxes_of) -> int:  # a rank's bytes: every layer has layer 0's
        return box_bytes(outside, boxes_of(outside)) + count * box_bytes(layer, boxes_of(layer))

    if backend == "sharded":
        for t, where in enumerate(cluster.trainers):
            send[cluster.nic(where)] += own(lambda part, t=t: trainer_boxes(part, trainers, t))
        for q, where in enumerate(cluster.receivers):
            need[cluster.nic(where)] += own(
                lambda part, q=q: replica_boxes(part, cluster.tp, q % cluster.ranks, cluster.ep)
            )
    else:
        senders = cluster.trainers if backend == "paired" else cluster.trainers[:1]
        for where in senders:
            send[cluster.nic(where)] += model // len(senders)
        for where in cluster.receivers:
            need[cluster.nic(where)] += model
    limits = [0.0]
    for (host, _), n in (*send.items(), *need.items()):
        limits.append(n * 8 / cluster.hosts[host].nic_bps)
    return max(limits)
