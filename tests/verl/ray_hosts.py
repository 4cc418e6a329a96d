"""A Ray cluster across the hosts of an emulated cluster (``weightsync.bench.cluster``), and
a Ray driver on one of them that runs the test's steps.

Every host is a network namespace with its own NIC and address: one ``ray start --block``
per host, inside it (``--node-ip-address`` = the host's address), the head on host 0. They
share one ``RAY_AUTH_TOKEN`` and each has its own ``--temp-dir`` (a session directory shared
by two nodes makes their sockets collide). Ray's workers are started by their node's
raylet, so they live in its namespace and reach the others only through the shaped NICs.

The driver is a spawned child that moves into host 0 first (the test's own process stays
in the machine's namespace, where it cuts and heals links): ``call(fn, *args)`` runs
``fn(state, *args)`` there (``fn`` a module-level function, ``state`` a dict kept between
calls) and returns its result or raises ``DriverError`` with the driver's traceback.

Teardown ends only what this started: the driver, each ``ray start`` (SIGTERM: it stops the
node's processes), then by PID whatever still runs in these hosts' namespaces (all of it is
this cluster's: the namespaces were made for it). What was still running before that sweep
is kept in ``unended``, for a test to check that Ray's own stop ended everything.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from weightsync.bench.cluster import Cluster, enter

CTX = mp.get_context("spawn")
RAY_PORT = 6379  # each host has its own port space


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "(ended)"


class DriverError(RuntimeError):
    """A step that failed in the driver; the message holds its traceback."""


def ray_env(token: str) -> dict[str, str]:
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        # Ray refuses worker nodes where this is 0 (tests/verl's conftest default, for one node)
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        # verl's own process group of the rollout workers (CheckpointEngineWorker) is Gloo
        # with torch's default device, which takes the address the hostname resolves to (a
        # loopback one here, as on many machines): its NIC instead. weightsync's groups bind
        # the address they advertise themselves (platform.new_process_group).
        "GLOO_SOCKET_IFNAME": "eth0",
        # A cut host must stay a live Ray node for the seconds a test keeps it cut: GCS would
        # declare it dead after 5 missed 3 s health checks and its raylet would exit at the heal.
        "RAY_health_check_failure_threshold": "40",
        # ``ray start --block`` on SIGTERM first drains its node, up to 30 s (asking the GCS,
        # which may be stopping too): these nodes serve nothing to drain, so it stops its
        # processes at once, and close can see whether that ended all of them.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }


def _serve(netns: str, env: dict[str, str], address: str, node_ip: str, nodes: int, conn) -> None:
    """The driver: joins the Ray cluster from inside ``netns``, then runs what it is sent."""
    enter(netns)
    os.environ.update(env)
    import ray

    import weightsync.integrations.verl  # noqa: F401  (registers backend "weightsync" in the driver)

    try:
        ray.init(address=address, _node_ip_address=node_ip, log_to_driver=False)
        end = time.monotonic() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < nodes:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{nodes} Ray nodes expected, alive: {[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]}"
                )
            time.sleep(0.5)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    state: dict = {}
    while (message := conn.recv()) is not None:
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(state, *args, **kwargs)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    ray.shutdown()


class RayHosts:
    """Ray nodes on ``cluster``'s hosts (``cpus[i]`` CPUs on host i) and a driver on host 0."""

    def __init__(self, cluster: Cluster, cpus: list[int]) -> None:
        self.cluster = cluster
        self.cpus = cpus
        # an address left by an earlier in-process Ray (another test module) is not this cluster's
        inherited = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env = {**inherited, **ray_env(secrets.token_hex(16))}
        self.head = f"{cluster.hosts[0].address}:{RAY_PORT}"
        self.nodes: list[subprocess.Popen] = []
        # after close: the processes still running in the hosts' namespaces (pid and command
        # line) and the hosts whose ``ray start`` had not exited, once every node was told to
        # stop and given 10 s, before anything was killed
        self.unended: dict[str, list[str]] = {}
        self.driver = None
        self.conn = None
        self.tmp: Path | None = None

    def __enter__(self) -> RayHosts:
        # short: Ray's AF_UNIX socket paths live under it (108 bytes at most)
        self.tmp = Path(tempfile.mkdtemp(prefix="wsray"))
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        for i, host in enumerate(self.cluster.hosts):
            where = (
                ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
                if i == 0
                else [f"--address={self.head}"]
            )
            argv = [
                ray,
                "start",
                "--block",
                *where,
                f"--node-ip-address={host.address}",
                f"--num-cpus={self.cpus[i]}",
                f"--temp-dir={self.tmp}/n{i}",
                "--disable-usage-stats",
            ]
            with open(self.tmp / f"node{i}.log", "wb") as log:
                # a worker node retries reaching the head's GCS while that starts
                self.nodes.append(
                    self.cluster.popen(i, argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
                )
        self.conn, child = CTX.Pipe()
        host = self.cluster.hosts[0]
        self.driver = CTX.Process(
            target=_serve,
            args=(host.netns, self.env, self.head, host.address, len(self.cluster.hosts), child),
            daemon=True,
        )
        self.driver.start()
        self._reply(180)  # every node alive

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the Ray driver did not answer in {timeout:.0f} s{self._tails()}")
        kind, value = self.conn.recv()
        if kind == "error":
            raise DriverError(value + self._tails())
        return value

    def _tails(self, lines: int = 8) -> str:
        """The end of each node's ``ray start`` output (close deletes the logs)."""
        out = []
        for i in range(len(self.nodes)):
            try:
                text = (self.tmp / f"node{i}.log").read_text(errors="replace").splitlines()[-lines:]
            except (OSError, TypeError):
                continue
            alive = "running" if self.nodes[i].poll() is None else f"exited {self.nodes[i].returncode}"
            out.append(f"\n--- ray start on host {i} ({alive}):\n" + "\n".join(text))
        return "".join(out)

    def submit(self, fn, *args, **kwargs) -> None:
        """Start ``fn(state, *args, **kwargs)`` in the driver; ``result`` waits for it."""
        self.conn.send((fn, args, kwargs))

    def result(self, timeout: float = 120):
        return self._reply(timeout)

    def call(self, fn, *args, timeout: float = 120, **kwargs):
        self.submit(fn, *args, **kwargs)
        return self.result(timeout)

    def close(self) -> None:
        if self.driver is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.driver.join(timeout=20)
            if self.driver.is_alive():
                self.driver.kill()
                self.driver.join(timeout=5)
            self.driver = None
        for node in self.nodes:
            if node.poll() is None:
                node.terminate()  # ray start --block stops its node's processes on SIGTERM
        # Without the drain (ray_env) a node stops its processes at once; what still runs
        # after 10 s is killed (by PID: everything in these namespaces is this cluster's)
        end = time.monotonic() + 10
        while any(node.poll() is None for node in self.nodes) and time.monotonic() < end:
            time.sleep(0.1)
        if self.nodes:  # what Ray's own stop left running, seen before the sweep below kills it
            self.unended = {
                netns: [f"{pid} {_cmdline(pid)}" for pid in pids]
                for netns, pids in self.leftovers().items()
                if pids
            }
            self.unended["ray start"] = [f"host {i}" for i, n in enumerate(self.nodes) if n.poll() is None]
        self.cluster.kill_processes(wait_s=10)  # until none is left (a killed one takes a moment)
        for node in self.nodes:
            node.wait(timeout=10)
        self.nodes.clear()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def leftovers(self) -> dict[str, list[int]]:
        """PIDs still running in each of the cluster's namespaces."""
        return self.cluster.processes()
