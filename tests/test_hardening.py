"""Hardening against the people around a sync: a sender reachable from other hosts without
a secret says so; ``shm`` admits only this user's processes, on both ends (a real process
of another user, root needed); the vLLM entry points refuse configuration from the remote
caller that would import code or use a path on the replica."""

import functools
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import weightsync.sender.sender as sender_module
from weightsync import EngineConfig, Sender
from weightsync.config.keys import SECRET_ENV
from weightsync.engines import ring
from weightsync.engines.base import Join
from weightsync.engines.ring import PeerError
from weightsync.engines.same_host import host_id
from weightsync.engines.shm import ShmEngine
from weightsync.integrations.replicas.receiver import (
    REMOTE_CONFIG_ENV,
    ReplicaReceiver,
    check_remote_overrides,
)
from weightsync.session.auth import reachable_from_other_hosts

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- exposure
@pytest.mark.parametrize(
    "host,reachable",
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("::1", False),
        ("::ffff:127.0.0.1", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.1.2.3", True),
        ("192.168.0.7", True),
        ("fe80::1%eth0", True),
        ("2001:db8::5", True),
        ("trainer-0.cluster.local", True),
    ],
)
def test_which_control_addresses_other_hosts_can_reach(host, reachable):
    assert reachable_from_other_hosts(host) is reachable


def test_a_sender_reachable_from_other_hosts_without_a_secret_warns_naming_the_risk_and_the_variable(
    monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="weightsync")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = EngineConfig.from_overrides(["backend=nccl"])

    def warnings():
        found = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        caplog.clear()
        return found

    with Sender(config, "127.0.0.1:0", 1):  # loopback: nobody else can reach it
        pass
    assert warnings() == []
    # Bound where other hosts reach it (what the socket reports for a wildcard or a NIC;
    # the test itself stays on loopback).
    for bound in ("0.0.0.0", "10.1.2.3"):
        monkeypatch.setattr(
            sender_module,
            "reachable_from_other_hosts",
            lambda host, bound=bound: reachable_from_other_hosts(bound),
        )
        with Sender(config, "127.0.0.1:0", 1) as sender:
            pass
        [message] = warnings()
        assert f"control socket listens on {sender.address}, which other hosts can reach" in message
        assert "no shared secret is set: anyone who reaches it can join as a receiver" in message
        assert "Set WEIGHTSYNC_SECRET (or auth_secret)" in message
    with Sender(EngineConfig.from_overrides(["backend=nccl", "auth_secret=s3cret"]), "127.0.0.1:0", 1):
        pass
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    with Sender(config, "127.0.0.1:0", 1):
        pass
    assert warnings() == []


# ---------------------------------------------------------------------------- shm: this user only
NOBODY = 65534


@functools.cache
def python_for_another_user() -> str | None:
    """An interpreter that uid ``NOBODY`` may run (this venv's may sit under /root)."""
    if os.geteuid() != 0:
        return None
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            done = subprocess.run(
                [candidate, "-c", "import os; print(os.getuid())"],
                user=NOBODY,
                cwd="/",
                env={"PATH": "/usr/bin:/bin"},
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == str(NOBODY):
            return candidate
    return None


def as_another_user(script: str, *args: str) -> subprocess.Popen:
    python = python_for_another_user()
    if python is None:
        pytest.skip("needs root and a Python that another user may run, to act as another user")
    return subprocess.Popen(
        [python, "-c", script, *args],
        user=NOBODY,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


SHM_CONFIG = ["backend=shm", "update_weights_bucket_megabytes=1", "timeout_s=30"]

# Joins a ring with its real token, generation and a free rank: all it lacks is the uid.
JOINING_STRANGER = r"""
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\0" + sys.argv[1])
sock.sendall(bytes.fromhex(sys.argv[2]))
sock.settimeout(30)
try:
    print("hung up" if sock.recv(1) == b"" else "answered", flush=True)
except OSError as e:
    print("error", e, flush=True)
"""


def test_shm_sender_turns_away_a_process_of_another_user_holding_the_token(caplog):
    caplog.set_level(logging.WARNING, logger="weightsync.engines.ring")
    config = EngineConfig.from_overrides(SHM_CONFIG)
    sender, receiver = ShmEngine(config, torch.device("cpu")), ShmEngine(config, torch.device("cpu"))
    join = Join(version=1, rank=0, world_size=2, senders=1, capacity=1 << 20, name="trainer rank 0")
    info = sender.prepare(join)
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            sender.connect(join, info)
        except BaseException as e:  # reported below
            errors.append(e)

    accepting = threading.Thread(target=accept, daemon=True)
    accepting.start()
    try:
        first = ring.pack_message(
            {"token": info["token"], "generation": info["generation"], "rank": 1, "label": 0}
        )
        stranger = as_another_user(JOINING_STRANGER, info["socket"], first.hex())
        out, err = stranger.communicate(timeout=60)
        assert out.strip() == "hung up", (out, err)  # refused, not handed the ring
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"process of uid {NOBODY} is not this user ({os.getuid()})" in m for m in messages), (
            messages
        )
        # The rank it claimed is still free: the real receiver joins it.
        receiver.connect(
            Join(
                version=1,
                rank=1,
                world_size=2,
                senders=1,
                capacity=1 << 20,
                name="receiver rank 0",
                receiver_rank=0,
            ),
            info,
        )
        accepting.join(30)
        assert not accepting.is_alive() and not errors, errors
        assert len(sender._peers) == 1 and receiver._ring is not None
    finally:
        sender.close()
        receiver.close()


# Listens like a sender's ring socket and answers a join as the sender would (slot size and
# the ring's memory), from another user's process.
IMPOSTOR_SENDER = r"""
import os, socket, sys
name, reply, size = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind("\0" + name)
listener.listen(1)
print("listening", flush=True)
listener.settimeout(30)
conn, _ = listener.accept()
conn.recv(4096)
fd = os.memfd_create("impostor-ring")
os.ftruncate(fd, size)
socket.send_fds(conn, [reply], [fd])
conn.settimeout(30)
try:
    print("hung up" if conn.recv(1) == b"" else "answered", flush=True)
except OSError as e:
    print("error", e, flush=True)
"""


def test_shm_receiver_refuses_a_ring_offered_by_a_process_of_another_user():
    slot = 1 << 20
    name = f"weightsync-test-impostor-{os.getpid()}"
    impostor = as_another_user(
        IMPOSTOR_SENDER, name, ring.pack_message({"slot_bytes": slot}).hex(), str(ring.SLOTS * slot)
    )
    receiver = ShmEngine(EngineConfig.from_overrides(SHM_CONFIG), torch.device("cpu"))
    try:
        assert impostor.stdout.readline().strip() == "listening"
        info = {"socket": name, "token": "0" * 32, "generation": 1, "slot_bytes": slot, "host_id": host_id()}
        join = Join(
            version=1, rank=1, world_size=2, senders=1, capacity=slot, name="receiver rank 0", receiver_rank=0
        )
        with pytest.raises(PeerError, match="shm: the sender's socket belongs to another user"):
            receiver.connect(join, info)
        assert receiver._ring is None and not receiver._peers  # nothing of it mapped or kept
        out, err = impostor.communicate(timeout=60)
        assert out.strip() == "hung up", (out, err)
    finally:
        receiver.close()
        if impostor.poll() is None:
            impostor.kill()
            impostor.wait(10)


# ---------------------------------------------------------------------------- vLLM: remote configuration
PLUGIN = "weightsync_remote_plugin_probe"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module that would run code on import (it only records that it ran)."""
    (tmp_path / f"{PLUGIN}.py").write_text("import os\nos.environ['WEIGHTSYNC_PROBE_IMPORTED'] = '1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("WEIGHTSYNC_PROBE_IMPORTED", raising=False)
    yield PLUGIN
    sys.modules.pop(PLUGIN, None)


@pytest.mark.parametrize("form", ["list", "full key", "dict"])
def test_the_replica_refuses_a_remote_custom_backend_module_without_importing_it(plugin, monkeypatch, form):
    monkeypatch.delenv(REMOTE_CONFIG_ENV, raising=False)
    overrides = {
        "list": ["backend=nccl", f"custom_backend_module={plugin}"],
        "full key": [
            "backend=nccl",
            f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={plugin}",
        ],
        "dict": {"backend": "nccl", "custom_backend_module": plugin},
    }[form]
    replica = ReplicaReceiver()
    with pytest.raises(
        PermissionError,
        match=rf"custom_backend_module='{plugin}' came from the remote caller .* "
        rf"names a module this replica would import; .* sets {REMOTE_CONFIG_ENV}=1",
    ):
        replica.open("127.0.0.1:1", 0, overrides)
    assert (
        replica.receiver is None
        and plugin not in sys.modules
        and "WEIGHTSYNC_PROBE_IMPORTED" not in os.environ
    )
    # The replica's own environment may allow it.
    monkeypatch.setenv(REMOTE_CONFIG_ENV, "1")
    try:
        assert replica.open("127.0.0.1:1", 0, overrides)["rank"] == 0
        assert os.environ.get("WEIGHTSYNC_PROBE_IMPORTED") == "1"
    finally:
        replica.close()


def test_the_replica_refuses_a_remote_disk_path(tmp_path, monkeypatch):
    monkeypatch.delenv(REMOTE_CONFIG_ENV, raising=False)
    replica = ReplicaReceiver()
    for overrides in (
        ["backend=disk", f"engine_kwargs.disk.path={tmp_path}"],
        {"backend": "disk", "engine_kwargs": {"disk": {"path": str(tmp_path)}}},
    ):
        with pytest.raises(
            PermissionError,
            match=rf"engine_kwargs.disk.path='{tmp_path}' came from the remote caller "
            rf"\(weightsync_init / init_weight_transfer_engine\) and names a directory",
        ):
            replica.open("unused:0", 0, overrides)
    assert replica.receiver is None and list(tmp_path.iterdir()) == []
    monkeypatch.setenv(REMOTE_CONFIG_ENV, "1")
    try:
        replica.open("unused:0", 0, ["backend=disk", f"engine_kwargs.disk.path={tmp_path}"])
        assert replica.receiver is not None
    finally:
        replica.close()


def test_what_the_trainer_side_sends_by_default_passes(monkeypatch):
    monkeypatch.delenv(REMOTE_CONFIG_ENV, raising=False)
    # VLLMRollout sends every key, these two at their defaults; a later value counts.
    config = EngineConfig.from_overrides(["backend=nccl", "update_weights_bucket_megabytes=1"])
    check_remote_overrides([f"{k}={'null' if v is None else v}" for k, v in config.to_flat().items()])
    check_remote_overrides(
        ["custom_backend_module=x", "custom_backend_module=null", "engine_kwargs.disk.path="]
    )
    check_remote_overrides({"backend": "nccl", "engine_kwargs": {"disk": {"path": ""}}})
    with pytest.raises(PermissionError):  # only "1" in the replica's environment allows it
        monkeypatch.setenv(REMOTE_CONFIG_ENV, "yes please")
        check_remote_overrides(["custom_backend_module=os"])


class _RecordingReplica:
    """A replica (``replicas.replica.Replica``) that records what the trainer side asks of
    it; its ``weightsync_init`` joins as an engine's worker would (``ReplicaReceiver``, in
    this process), taking the secret from the environment."""

    name = "recording"
    capabilities: frozenset[str] = frozenset()
    pause_modes = ("keep",)

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.state = ReplicaReceiver()

    def workers(self) -> int:
        return 1

    def call(self, method, *args, timeout=None):
        self.calls.append((method, args))
        if method == "weightsync_init":
            return [self.state.open(*args)]
        return [{"version": None, "mixed": False}]


def test_vllm_rollout_never_sends_the_secret_to_its_replicas(monkeypatch):
    from weightsync.integrations.vllm_rollout import VLLMRollout

    monkeypatch.setenv(SECRET_ENV, "s3cret-value")  # the replica's own environment
    replica = _RecordingReplica()
    config = EngineConfig.from_overrides(["backend=nccl", "auth_secret=s3cret-value", "timeout_s=5"])
    try:
        with VLLMRollout([replica], config):
            assert replica.state.status()["warm_up_s"] > 0  # it joined with the secret of its environment
    finally:
        replica.state.close()
    (method, (address, first_rank, overrides, warm_up)), *_ = replica.calls
    assert method == "weightsync_init" and first_rank == 0 and warm_up is True
    assert not any(o.startswith("auth_secret=") for o in overrides), overrides  # not "<set>", not the secret
    assert "backend=nccl" in overrides
