"""An emulated cluster on one machine: hosts as network namespaces with shaped NICs.

A tool of the bench and the tests, not a layer of the library (no engine knows it exists).
``Cluster(hosts, rates)`` makes, as root with iproute2:

- a switch: a namespace of its own holding a bridge, so nothing is added to the machine's
  own namespace (its interfaces and routes are never touched);
- per host a namespace with one NIC, ``eth0``, on a private /24 that exists only inside
  these namespaces (``10.213.0.0/24``: host i is ``10.213.0.(i+1)``), wired to a bridge
  port by a veth pair;
- per host a rate: a ``tbf`` qdisc on its NIC shapes what it sends, one on its bridge port
  what it receives (egress and ingress, each host its own rate);
- ``cut(i)`` / ``heal(i)``: the bridge port down / up (no RST or FIN reaches anyone, as
  when a switch port or a NIC fails);
- ``counters()``: each NIC's bytes sent and received;
- ``enter(host)``: moves the calling process into a host (call it first thing in a child
  process: threads started afterwards follow it); ``popen(i, argv)`` starts a command there.

Names carry the creating process's PID (``wsc<pid>-...``): at start, namespaces of a
process that no longer runs are deleted (an earlier run that crashed); at exit, the
context manager (and an ``atexit`` hook, for an exit without it) kills every process still
running inside the namespaces it made (``processes()``: all of them are its users', started
there or moved there) and then deletes those namespaces.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.estimate.cluster import parse_rate  # noqa: F401 (the rates this cluster's NICs take)

SUBNET = "10.213.0"  # a private /24, only ever inside namespaces made here
PREFIX = "wsc"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_CLONE_NEWNET = 0x40000000


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no iproute2, no netns)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _namespaces() -> list[str]:
    done = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of emulated clusters whose creating process is gone."""
    removed = []
    for name in _namespaces():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def check_available() -> None:
    """Raise ``ClusterUnavailable`` saying what is missing."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("an emulated cluster needs root (network namespaces and tc): run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(
                f"an emulated cluster needs iproute2's `{tool}` (apt-get install iproute2)"
            )


def enter(netns: str) -> None:
    """Move the calling thread (and the threads it starts later) into namespace ``netns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {netns!r} failed")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str
    rate_bps: float  # egress and ingress of its NIC


class Cluster:
    """``hosts`` namespaces on one bridge; ``rates``: each host's NIC rate in bits/s (one
    number for all, or one per host; None: unshaped)."""

    def __init__(self, hosts: int, rates: float | Sequence[float | None] | None = None) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts={hosts}: an emulated cluster has 1 to 250 hosts")
        per_host = list(rates) if isinstance(rates, Sequence) else [rates] * hosts
        if len(per_host) != hosts:
            raise ValueError(f"{len(per_host)} rates for {hosts} hosts")
        tag = f"{PREFIX}{os.getpid()}-{id(self) % 10000:04d}"
        self.switch = f"{tag}-sw"
        self.hosts = [Host(i, f"{tag}-h{i}", f"{SUBNET}.{i + 1}", r or 0.0) for i, r in enumerate(per_host)]
        self._made: list[str] = []

    # ------------------------------------------------------------------ life
    def __enter__(self) -> Cluster:
        check_available()
        remove_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, netns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", netns, *argv, check=check)

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        self._ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.switch, "ip", "link", "set", "br0", "up")
        for h in self.hosts:
            _run("ip", "netns", "add", h.netns)
            self._made.append(h.netns)
            port = f"p{h.index}"
            self._ns(
                self.switch,
                "ip",
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                h.netns,
            )
            self._ns(self.switch, "ip", "link", "set", port, "master", "br0", "up")
            self._ns(h.netns, "ip", "addr", "add", f"{h.address}/24", "dev", "eth0")
            self._ns(h.netns, "ip", "link", "set", "eth0", "up")
            self._ns(h.netns, "ip", "link", "set", "lo", "up")
            if h.rate_bps:
                self._shape(h.netns, "eth0", h.rate_bps)  # what the host sends
                self._shape(self.switch, port, h.rate_bps)  # what the host receives

    def _shape(self, netns: str, dev: str, rate_bps: float) -> None:
        # A token bucket: the burst holds a few ms of traffic and at least a few of the
        # 64 KiB segments veth passes whole (GSO), so the rate holds from 100 Mbit/s up.
        burst = max(256 * 1024, int(rate_bps / 8 * 0.004))
        self._ns(
            netns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{int(rate_bps)}bit",
            "burst",
            str(burst),
            "latency",
            "50ms",
        )

    def close(self) -> None:
        """Kill what still runs inside the namespaces this cluster made, then delete them
        (their veths and qdiscs go with them)."""
        self.kill_processes()
        while self._made:
            _run("ip", "netns", "del", self._made.pop(), check=False)
        atexit.unregister(self.close)

    def processes(self) -> dict[str, list[int]]:
        """The PIDs of the processes inside each namespace this cluster made (``ip netns
        pids``; this process itself never, wherever its threads are)."""
        out = {}
        for netns in self._made:
            done = _run("ip", "netns", "pids", netns, check=False)
            out[netns] = [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]
        return out

    def kill_processes(self, wait_s: float = 10.0) -> int:
        """SIGKILL every process inside this cluster's namespaces, until none is left (a
        killed one takes a moment to go) or ``wait_s`` passed; how many were killed."""
        killed: set[int] = set()
        end = time.monotonic() + wait_s
        while True:
            pids = [p for found in self.processes().values() for p in found]
            if not pids or time.monotonic() > end:
                return len(killed)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    # ------------------------------------------------------------------ use
    def cut(self, host: int) -> None:
        """Cut ``host`` off: its bridge port goes down, nothing tells its peers."""
        self._ns(self.switch, "ip", "link", "set", f"p{host}", "down")

    def heal(self, host: int) -> None:
        """Bring ``host`` back. Neighbour entries that failed while it was away are
        forgotten everywhere, as a host announcing itself when its link comes back makes
        happen (otherwise the kernels answer "no route to host" for a while)."""
        self._ns(self.switch, "ip", "link", "set", f"p{host}", "up")
        for h in self.hosts:
            self._ns(h.netns, "ip", "neigh", "flush", "dev", "eth0", check=False)

    def counters(self) -> list[dict[str, int]]:
        """Each host's NIC: ``{"tx_bytes", "rx_bytes"}`` since the cluster was made."""
        out = []
        for h in self.hosts:
            link = json.loads(self._ns(h.netns, "ip", "-s", "-j", "link", "show", "eth0").stdout)[0]
            stats = link.get("stats64", link.get("stats", {}))
            out.append({"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])})
        return out

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host``."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host].netns, *argv], **kwargs)
