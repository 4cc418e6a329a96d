"""The cluster a prediction is for: hosts and their links, where each rank runs.

A ``Cluster`` places M trainer ranks and R replicas of T tensor-parallel ranks on hosts.
Each host has ``devices`` slots, ``nics`` NICs of ``nic_bps`` each (a rank uses NIC
``slot % nics`` of its host: one NIC per GPU on a GPU server, one per host on the emulated
cluster) and an intra-host link of ``intra_bps`` (NVLink, or memory) between its ranks.
Two ways to describe one:

- ``Cluster.of_flags``: the flags of ``weightsync bench --hosts`` (each rank on a host of
  its own, trainer ranks on hosts 0..M-1, receiver ranks dealt over the others), so a
  prediction and a measured row describe the same cluster;
- ``Cluster.from_yaml``: a file (docs/estimate.md)::

      device: gpu                # gpu (NCCL pipelines a broadcast) or cpu (Gloo)
      bucket_mb: 1024
      dtype: bfloat16
      hosts:
        - {name: train, count: 2, devices: 8, nics: 8, nic: 400gbit, intra: 900GBps}
        - {name: infer, count: 2, devices: 8, nics: 8, nic: 400gbit, intra: 900GBps}
      trainer: {host: train, ranks: 16}
      replicas: {host: infer, count: 2, tp: 8}    # ep: 8 for expert-parallel replicas

Trainer ranks and receiver ranks may share a host group (colocated: the bytes between a
trainer rank and a receiver rank of one host cross its intra-host link).

Everything here is plain data: no process, no socket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | float) -> float:
    """A link rate in bits per second: ``1gbit``, ``10Gbit``, ``500mbit``, or a number."""
    if isinstance(text, int | float):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(/s)?\s*", text.lower())
    if not m or (m.group(3) not in (None, "bit")):
        raise ValueError(
            f"link rate {text!r}: expected a number of bits per second such as 1gbit, 400mbit, 25gbit"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


def rate(text: str | float) -> float:
    """Bits per second from ``400gbit``, ``25Gbit``, or from bytes per second: ``900GBps``
    (a capital B and ``ps``: NVLink and memory are quoted in bytes)."""
    if isinstance(text, str) and text.strip().endswith("Bps"):
        return parse_rate(text.strip()[:-3].lower() + "bit") * 8
    return parse_rate(text)


@dataclass(frozen=True)
class Host:
    name: str
    devices: int
    nics: int
    nic_bps: float
    intra_bps: float


@dataclass(frozen=True)
class Cluster:
    """Hosts, and the host and slot of every trainer rank and receiver rank."""

    hosts: tuple[Host, ...]
    trainers: tuple[tuple[int, int], ...]  # trainer rank -> (host, slot)
    receivers: tuple[tuple[int, int], ...]  # receiver rank (replica r, rank k: r * ranks + k) -> (host, slot)
    tp: int
    bucket_bytes: int
    dtype: str = "bfloat16"
    device: str = "cpu"
    #: expert-parallel ranks per replica (each keeps the experts vLLM's linear placement
    #: gives it; with ``tp`` 1 every rank keeps the other tensors whole)
    ep: int = 1

    def __post_init__(self) -> None:
        if self.ep > 1 and self.tp not in (1, self.ep):
            raise ValueError(
                f"tp {self.tp} with ep {self.ep}: a replica's experts span its tensor-parallel ranks"
            )

    @property
    def ranks(self) -> int:
        """Ranks per replica."""
        return max(self.tp, self.ep)

    @property
    def rates(self) -> list[float]:
        """Each host's NIC rate, bits/s."""
        return [h.nic_bps for h in self.hosts]

    def host_of(self, key: int) -> int:
        """The host of a bench process by its result key: 0 trainer rank 0, 1..N the
        receiver ranks, N+t trainer rank t."""
        receivers = len(self.receivers)
        if key == 0 or key > receivers:
            return self.trainers[0 if key == 0 else key - receivers][0]
        return self.receivers[key - 1][0]

    @property
    def replicas(self) -> int:
        return len(self.receivers) // self.ranks

    def nic(self, where: tuple[int, int]) -> tuple[int, int]:
        """The NIC a rank at (host, slot) sends and receives through."""
        host, slot = where
        return host, slot % self.hosts[host].nics

    @classmethod
    def of_flags(
        cls,
        hosts: int,
        trainers: int,
        receivers: int,
        link: str,
        trainer_link: str | None = None,
        tp: int = 1,
        bucket_mb: int = 64,
        dtype: str = "bfloat16",
        ep: int = 1,
    ) -> Cluster:
        """``weightsync bench --hosts``' cluster: trainer rank t on host t, the ``receivers``
        replicas of ``max(tp, ep)`` ranks dealt round-robin over the other hosts, one NIC each."""
        ranks = receivers * max(tp, ep)
        if hosts < trainers + 1:
            raise ValueError(
                f"--hosts {hosts}: {trainers} trainer host(s) and at least one receiver host are needed"
            )
        trainer_bps, link_bps = parse_rate(trainer_link or link), parse_rate(link)
        intra = 8 * 10e9  # ranks sharing a host share its memory (the bench deals them so only when it must)
        table = tuple(
            Host(f"host{h}", 1 << 10, 1, trainer_bps if h < trainers else link_bps, intra)
            for h in range(hosts)
        )
        slots: dict[int, int] = {}

        def place(host: int) -> tuple[int, int]:
            slots[host] = slots.get(host, -1) + 1
            return host, slots[host]

        trainer_at = tuple(place(t) for t in range(trainers))
        receiver_at = tuple(place(trainers + q % (hosts - trainers)) for q in range(ranks))
        return cls(table, trainer_at, receiver_at, tp, bucket_mb << 20, dtype, "cpu", ep)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cluster file is a map (docs/estimate.md)")
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "cluster") -> Cluster:
        hosts: list[Host] = []
        groups: dict[str, list[int]] = {}
        for group in data.get("hosts") or []:
            name = str(group["name"])
            for _ in range(int(group.get("count", 1))):
                groups.setdefault(name, []).append(len(hosts))
                devices = int(group.get("devices", 1))
                hosts.append(
                    Host(
                        f"{name}{len(groups[name]) - 1}",
                        devices,
                        int(group.get("nics", 1)),
                        rate(group.get("nic", "1gbit")),
                        rate(group.get("intra", "100GBps")),
                    )
                )
        if not hosts:
            raise ValueError(f"{where}: no hosts")

        def deal(group: str, count: int, what: str) -> list[tuple[int, int]]:
            if group not in groups:
                raise ValueError(
                    f"{where}: {what} on host group {group!r}, which is not among {sorted(groups)}"
                )
            slots = [(h, s) for h in groups[group] for s in range(hosts[h].devices)]
            if count > len(slots):
                raise ValueError(f"{where}: {count} {what} do not fit the {len(slots)} devices of {group!r}")
            return slots[:count]

        trainer = data.get("trainer") or {}
        replicas = data.get("replicas") or {}
        tp, ep = int(replicas.get("tp", 1)), int(replicas.get("ep", 1))
        names = list(groups)
        trainer_at = deal(str(trainer.get("host", names[0])), int(trainer.get("ranks", 1)), "trainer ranks")
        receiver_at = deal(
            str(replicas.get("host", names[-1])),
            int(replicas.get("count", 1)) * max(tp, ep),
            "receiver ranks",
        )
        return cls(
            tuple(hosts),
            tuple(trainer_at),
            tuple(receiver_at),
            tp,
            int(data.get("bucket_mb", 1024)) << 20,
            str(data.get("dtype", "bfloat16")),
            str(data.get("device", "gpu")),
            ep,
        )
