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
from weightsync.plan import PLAN_FORMAT
from weightsync.session.channel import PROTOCOL_VERSION, Channel, Deadline
from weightsync.session.control import ControlServer

pytestmark = [pytest.mark.timeout(300)]

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "weightsync"

# msgpack-able values of every kind, nested
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
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
        self.replies: list[dict] = []

    def serve_once(self, frames: list[bytes]) -> None:
        conn, _ = self.listener.accept()
        with conn:
            ch = Channel(conn, "receiver")
            d = Deadline(10, "fake sender")
            ch.send({"type": "challenge", "protocol": PROTOCOL_VERSION, "nonce": b"n" * 32}, d)
            ch.recv(d, expect="hello")
            ch.send({"type": "welcome", "protocol": PROTOCOL_VERSION, "session": "fake" * 8}, d)
            try:
                for f in frames:
                    conn.sendall(f)
                while True:  # read whatever the receiver answers until it hangs up
                    self.replies.append(ch.recv(d))
            except (SyncError, OSError):
                pass


sync_messages = st.fixed_dictionaries(
    {"type": st.just("sync")},
    optional={
        "protocol": st.one_of(st.just(PROTOCOL_VERSION), values),
        "version": st.one_of(st.integers(-5, 10), values),
        "bucket_bytes": st.one_of(st.just(1 << 20), values),
        "plan_hash": values,
        "plan": st.one_of(
            values,
            st.fixed_dictionaries(
                {
                    "format": st.just(PLAN_FORMAT),
                    "bucket_bytes": st.just(1 << 20),
                    "tensors": st.lists(values, max_size=4),
                }
            ),
        ),
        "force": values,
        "verify": st.one_of(st.just("off"), values),
        "engine": st.one_of(values, st.dictionaries(st.text(max_size=8), values, max_size=4)),
    },
)


@settings(max_examples=40, deadline=None)
@given(
    tagged=st.lists(
        st.one_of(
            sync_messages.map(lambda m: ("sync", frame(m))), stranger_payloads.map(lambda b: ("raw", b))
        ),
        min_size=1,
        max_size=3,
    )
)
def test_a_hostile_sender_only_ever_causes_a_clear_sync_error(tagged):
    frames = [f for _, f in tagged]
    fake = FakeSender()
    server = threading.Thread(target=fake.serve_once, args=(frames,), daemon=True)
    server.start()
    config = EngineConfig.from_overrides(
        ["backend=nccl", "timeout_s=1.5", "update_weights_bucket_megabytes=1"]
    )
    with Receiver(config, fake.address, 0) as receiver:
        with pytest.raises(SyncError):  # HandshakeError, ProtocolError, PeerLost, SyncTimeout...
            for _ in receiver.receive():
                pass
        assert receiver.version is None
    server.join(timeout=15)
    fake.listener.close()
    if tagged[0][0] == "sync":  # the fuzz got past the join: the receiver judged the sync message
        assert fake.replies and fake.replies[0]["type"] in ("ready", "error"), fake.replies


# ---------------------------------------------------------------------------- no pickle
# Modules whose purpose is to rebuild arbitrary Python objects (or run code) from bytes.
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
# Callables that unpickle, evaluate or construct arbitrary objects, by their full name.
FORBIDDEN_NAMES = {
    "torch.load",
    "torch.serialization.load",
    "torch.jit.load",
    "numpy.load",
    "multiprocessing.reduction.ForkingPickler",
    "yaml.unsafe_load",
    "yaml.full_load",
    "eval",
    "exec",
    "compile",
    "__import__",
    "builtins.eval",
    "builtins.exec",
    "builtins.compile",
    "builtins.__import__",
}
MSGPACK_DECODERS = {"msgpack.unpackb", "msgpack.unpack", "msgpack.loads", "msgpack.load", "msgpack.Unpacker"}
IMPORTERS = {"importlib.import_module", "__import__", "builtins.__import__"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader"}


def offenses(source: str, filename: str) -> list[str]:
    """Everything in one module that could turn bytes into code or arbitrary objects: a
    pickle-like module (imported by any name), a forbidden callable however it is reached
    (``torch.load``, ``import torch as T; T.load``, ``from torch import load``,
    ``getattr(torch, "load")``, ``eval``, ``exec``...), a dynamic import of a pickle-like
    module, a msgpack decoder that does not refuse extension types, or ``yaml.load`` without
    the safe loader."""
    tree = ast.parse(source, filename=filename)
    aliases: dict[str, str] = {}  # local name -> the full name it is bound to
    found = []

    def where(node):
        return f"{filename}:{getattr(node, 'lineno', '?')}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"{where(node)} imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where(node)} imports from {node.module}")
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if f"{node.module}.{a.name}" in FORBIDDEN_NAMES:
                    found.append(f"{where(node)} imports {node.module}.{a.name}")

    def full_name(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id, expr.id)
        if isinstance(expr, ast.Attribute):
            base = full_name(expr.value)
            return f"{base}.{expr.attr}" if base else None
        return None

    def constant(expr) -> str | None:
        return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Name | ast.Attribute) and isinstance(getattr(node, "ctx", None), ast.Load):
            name = full_name(node)
            if name in FORBIDDEN_NAMES or (name and name.split(".")[0] in FORBIDDEN_MODULES):
                found.append(f"{where(node)} uses {name}")
        if not isinstance(node, ast.Call):
            continue
        func = full_name(node.func)
        kwargs = {k.arg: k.value for k in node.keywords}
        if func == "getattr" and len(node.args) >= 2 and constant(node.args[1]) is not None:
            name = f"{full_name(node.args[0])}.{constant(node.args[1])}"
            if name in FORBIDDEN_NAMES:
                found.append(f"{where(node)} uses {name} through getattr")
        if func in IMPORTERS and node.args and (mod := constant(node.args[0])) is not None:
            if mod.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where(node)} imports {mod} dynamically")
        if func in MSGPACK_DECODERS:
            hook = kwargs.get("ext_hook")
            if (
                hook is None
                or (isinstance(hook, ast.Constant) and hook.value is None)
                or full_name(hook) == "msgpack.ExtType"
            ):
                found.append(f"{where(node)} calls {func} without refusing extension types (ext_hook)")
        if func == "yaml.load" and full_name(kwargs.get("Loader")) not in SAFE_YAML_LOADERS:
            found.append(f"{where(node)} calls yaml.load without yaml.SafeLoader")
    return found


# Each of these must be caught: the scan is tested against what it promises to find.
UNSAFE = [
    "import pickle",
    "import cPickle as p",
    "from pickle import loads",
    "import dill",
    "import marshal",
    "from marshal import loads",
    "import shelve",
    "import joblib",
    "import cloudpickle",
    "import _pickle",
    "import torch\ntorch.load(f)",
    "import torch as T\nT.load(f)",
    "from torch import load\nload(f)",
    "from torch import load as L",
    "import torch\nloader = torch.load",
    "import torch.serialization\ntorch.serialization.load(f)",
    "import torch\ngetattr(torch, 'load')(f)",
    "import torch\ntorch.jit.load(f)",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "eval(s)",
    "exec(s)",
    "compile(s, 'f', 'exec')",
    "__import__('os')",
    "import builtins\nbuiltins.exec(s)",
    "import importlib\nimportlib.import_module('pickle')",
    "from importlib import import_module\nimport_module('marshal')",
    "import msgpack\nmsgpack.unpackb(b)",
    "import msgpack\nmsgpack.loads(b)",
    "import msgpack as m\nm.unpack(f)",
    "from msgpack import unpackb\nunpackb(b, raw=False)",
    "import msgpack\nmsgpack.Unpacker(f)",
    "from msgpack import Unpacker as U\nU(f)",
    "import msgpack\nmsgpack.unpackb(b, ext_hook=None)",
    "import msgpack\nmsgpack.unpackb(b, ext_hook=msgpack.ExtType)",
    "import yaml\nyaml.load(s, Loader=yaml.Loader)",
    "import yaml\nyaml.load(s)",
    "import yaml\nyaml.unsafe_load(s)",
    "from multiprocessing.reduction import ForkingPickler",
]
SAFE = [
    "import msgpack\nmsgpack.unpackb(b, raw=False, ext_hook=refuse)",
    "import re\nre.compile('x')",
    "import yaml\nyaml.safe_load(s)",
    "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
    "import torch\ntorch.frombuffer(b)",
    "import safetensors.torch\nsafetensors.torch.load_file(p)",
    "import torch\ntorch.compile(m)",
    "x.load(f)",
]


@pytest.mark.parametrize("source", UNSAFE)
def test_the_scan_finds_every_way_to_unpickle_or_run_code(source):
    assert offenses(source, "snippet.py"), f"not caught: {source!r}"


@pytest.mark.parametrize("source", SAFE)
def test_the_scan_lets_safe_decoding_pass(source):
    assert offenses(source, "snippet.py") == []


def test_no_pickle_on_any_network_path():
    """No module in the package imports a pickle-like module, calls ``torch.load`` (by any
    name), ``eval`` or ``exec``, or decodes msgpack without refusing extension types; the
    integrations and the data plane use msgpack and raw bytes only."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20 and PACKAGE / "session" / "channel.py" in files
    found = [o for path in files for o in offenses(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert found == []


def test_a_delta_header_from_the_wire_is_bounded_before_anything_is_built():
    from weightsync.delta.header import DeltaHeader
    from weightsync.plan import TensorSpec

    wire = [TensorSpec("w", (8,), "uint8")]
    huge = {"base": 1, "digest": "d", "model": [["w", [1 << 48], "bfloat16"]], "kinds": [1], "dense": False}
    with pytest.raises(ValueError, match="'w'"):  # half a PiB: refused by size, not allocated
        DeltaHeader.from_wire(huge, wire, max_tensor_bytes=1 << 30)
    many = {
        "base": 1,
        "digest": "d",
        "model": [["w", [8], "uint8"]] * 1000,
        "kinds": [1] * 1000,
        "dense": False,
    }
    with pytest.raises(ValueError, match="1000 tensors, the plan has 1 entries"):
        DeltaHeader.from_wire(many, wire)
