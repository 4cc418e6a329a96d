"""Hostile input on the control plane, fuzzed with hypothesis over real sockets: clear errors,
bounded memory, no crash, nothing executed; and no pickle anywhere on a network path."""

import ast
import pathlib
import socket
import struct
import threading

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync import EngineConfig, Receiver, SyncError
from weightsync.session import PROTOCOL_VERSION, Channel, ControlServer, Deadline

pytestmark = [pytest.mark.timeout(300)]

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "weightsync"

# msgpack-able values of every kind, nested
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


stranger_payloads = st.one_of(
    st.binary(max_size=300),  # raw garbage
    values.map(frame),  # a well-framed message of any shape
    st.dictionaries(st.text(max_size=8), values, max_size=6).map(lambda d: frame({"type": "hello", **d})),
    st.integers(4097, 2**32 - 1).map(lambda n: struct.pack("!I", n)),  # an oversized frame header
    st.binary(min_size=1, max_size=50).map(lambda b: struct.pack("!I", len(b) + 100) + b),  # truncated
)


@pytest.fixture(scope="module")
def server():
    srv = ControlServer("127.0.0.1:0")
    config = EngineConfig.from_overrides(["backend=nccl", "timeout_s=120"])
    result: dict = {}

    def run():
        try:
            result["joined"] = srv.accept({0}, config)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield srv, config, thread, result
    srv.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=stranger_payloads)
def test_strangers_sending_anything_are_turned_away_and_the_server_keeps_accepting(server, payload):
    srv, _config, thread, _result = server
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        ch = Channel(s, "server")
        challenge = ch.recv(Deadline(10, "for the challenge"), expect="challenge")
        assert challenge["protocol"] == PROTOCOL_VERSION and len(challenge["nonce"]) == 32
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)  # a truncated frame ends here
        except OSError:
            pass  # the server already hung up on what it read so far
        try:
            reply = ch.recv(Deadline(15, "for the verdict"))
            assert reply["type"] == "error", reply  # turned away with a reason, never welcomed
        except SyncError:
            pass  # or simply hung up on
    assert thread.is_alive()


def test_after_the_fuzzing_a_real_receiver_still_joins(server):
    srv, config, thread, result = server
    receiver = Receiver(config, srv.address, 0)
    receiver.connect()
    thread.join(timeout=30)
    assert "error" not in result and list(result["joined"]) == [0]
    result["joined"][0].close()
    receiver.close()


# ---------------------------------------------------------------------------- receiver side
class FakeSender:
    """Speaks the join protocol correctly, then sends whatever the test wants."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def serve_once(self, frames: list[bytes]) -> None:
        conn, _ = self.listener.accept()
        with conn:
            ch = Channel(conn, "receiver")
            d = Deadline(10, "fake sender")
            ch.send({"type": "challenge", "protocol": PROTOCOL_VERSION, "nonce": b"n" * 32}, d)
            ch.recv(d, expect="hello")
            ch.send({"type": "welcome", "protocol": PROTOCOL_VERSION}, d)
            try:
                for f in frames:
                    conn.sendall(f)
                while ch.recv(d):  # read whatever the receiver answers until it hangs up
                    pass
            except (SyncError, OSError):
                pass


sync_messages = st.fixed_dictionaries(
    {"type": st.just("sync")},
    optional={
        "protocol": st.one_of(st.just(PROTOCOL_VERSION), values),
        "version": st.one_of(st.integers(-5, 10), values),
        "bucket_bytes": st.one_of(st.just(1 << 20), values),
        "plan_hash": values,
        "plan": st.one_of(values, st.fixed_dictionaries({"format": st.just(2), "bucket_bytes": st.just(1 << 20),
                                                         "tensors": st.lists(values, max_size=4)})),
        "force": values,
        "verify": st.one_of(st.just("off"), values),
        "engine": st.one_of(values, st.dictionaries(st.text(max_size=8), values, max_size=4)),
    },
)


@settings(max_examples=40, deadline=None)
@given(frames=st.lists(st.one_of(sync_messages.map(frame), stranger_payloads), min_size=1, max_size=3))
def test_a_hostile_sender_only_ever_causes_a_clear_sync_error(frames):
    fake = FakeSender()
    server = threading.Thread(target=fake.serve_once, args=(frames,), daemon=True)
    server.start()
    config = EngineConfig.from_overrides(["backend=nccl", "timeout_s=1.5", "update_weights_bucket_megabytes=1"])
    with Receiver(config, fake.address, 0) as receiver:
        with pytest.raises(SyncError):  # HandshakeError, ProtocolError, PeerLost, SyncTimeout...
            for _ in receiver.receive():
                pass
        assert receiver.version is None
    server.join(timeout=15)
    fake.listener.close()


# ---------------------------------------------------------------------------- no pickle
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def test_no_pickle_on_any_network_path():
    """Nothing in the package imports a pickle-like module or calls ``torch.load``; the
    integrations and the data plane use msgpack and raw bytes only."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if FORBIDDEN_MODULES & set(names):
                offenders.append(f"{path.name}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", None) == "torch":
                offenders.append(f"{path.name}:{node.lineno} calls torch.load")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("unpackb", "Unpacker"):
                kwargs = {k.arg for k in node.keywords}
                if "ext_hook" not in kwargs and path.name != "test":
                    offenders.append(f"{path.name}:{node.lineno} unpacks msgpack without refusing extension types")
    assert offenders == []
