"""``weightsync bench --hosts``: where each process of a row runs on an emulated cluster,
and the physical limit of a push over its links.

Trainer rank t runs on host t; receivers are dealt round-robin over the other hosts.
The link ceiling is the time the bytes need through the narrowest NICs on their way: the
trainer hosts' NICs together carry the model once (``model / sum of their rates``), and
every receiver host's NIC takes the model once per receiver on it (``model * receivers
there / its rate``); the ceiling is the larger of the two. For one trainer host that is
the model once through the trainer's NIC; for ``paired`` with M trainer hosts it is the
model spread over the M trainer NICs, unless the receivers' NICs are narrower.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.bench.cluster import parse_rate

#: backends that move bytes between hosts (``shm`` needs one host's memory, ``disk`` a
#: directory both sides see, ``naive`` one process)
CROSS_HOST = ("nccl", "mooncake", "paired", "sharded")


@dataclass(frozen=True)
class Placement:
    """Hosts and rates of one bench run on an emulated cluster."""

    hosts: int
    trainers: int
    receivers: int
    link_bps: float
    trainer_link_bps: float

    @classmethod
    def of(cls, hosts: int, trainers: int, receivers: int, link: str, trainer_link: str | None) -> Placement:
        if hosts < trainers + 1:
            raise ValueError(
                f"--hosts {hosts}: {trainers} trainer host(s) and at least one receiver host are needed"
            )
        return cls(hosts, trainers, receivers, parse_rate(link), parse_rate(trainer_link or link))

    @property
    def rates(self) -> list[float]:
        """Each host's NIC rate, bits/s."""
        return [self.trainer_link_bps if h < self.trainers else self.link_bps for h in range(self.hosts)]

    def receiver_host(self, rank: int) -> int:
        return self.trainers + rank % (self.hosts - self.trainers)

    def host_of(self, key: int) -> int:
        """The host of a bench process by its result key: 0 trainer rank 0, 1..N the
        receivers, N+t trainer rank t."""
        if key == 0:
            return 0
        if key <= self.receivers:
            return self.receiver_host(key - 1)
        return key - self.receivers

    def sharded_ceiling_s(self, shard_bytes: int, slice_bytes: int) -> float:
        """The M x N ceiling: the largest trainer shard through a trainer NIC, or the
        largest set of slices through a receiver host's NIC (times the ranks there)."""
        per_host: dict[int, int] = {}
        for r in range(self.receivers):
            per_host[self.receiver_host(r)] = per_host.get(self.receiver_host(r), 0) + 1
        inbound = max(slice_bytes * 8 * k / self.rates[h] for h, k in per_host.items())
        return max(shard_bytes * 8 / self.trainer_link_bps, inbound)

    def ceiling_s(self, nbytes: int, trainers: int) -> float:
        """The link ceiling of pushing ``nbytes`` from ``trainers`` trainer hosts."""
        out = nbytes * 8 / (self.trainer_link_bps * trainers)
        per_host: dict[int, int] = {}
        for r in range(self.receivers):
            per_host[self.receiver_host(r)] = per_host.get(self.receiver_host(r), 0) + 1
        inbound = max(nbytes * 8 * k / self.rates[h] for h, k in per_host.items())
        return max(out, inbound)
