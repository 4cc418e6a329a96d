"""Sizes from the wire are checked before memory is taken. Each decoder (``TensorSpec``,
``Bucket``, ``Plan``, the streamed plan) is fed huge, negative and inconsistent sizes by
hypothesis, directly and through a real receiver over real sockets: every refusal is a
ValueError / ProtocolError / HandshakeError naming the field, and the memory the process
took meanwhile stays under a small bound, as the kernel measures it (the high-water mark
of resident memory, reset before each case through /proc/self/clear_refs) and as torch
was asked for it (every ``torch.empty``, ``zeros``, ``new_empty``... request)."""

from __future__ import annotations

import math
import os
import secrets
import socket
import threading
import time

import msgpack
import pytest
import torch
import workers
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from weightsync import EngineConfig, HandshakeError, Receiver, Sender, SinkError
from weightsync import plan as plan_module
from weightsync.errors import ProtocolError, RemoteFailure, SyncError
from weightsync.plan import (
    MAX_PLAN_BUCKETS,
    MAX_TENSOR_DIMS,
    PLAN_FORMAT,
    Bucket,
    Plan,
    StreamedPlan,
    TensorSpec,
    make_plan,
)
from weightsync.session.channel import PROTOCOL_VERSION, Channel, Deadline
from weightsync.sources import IteratorSource

pytestmark = [pytest.mark.timeout(300)]

MIB = 1 << 20
LIMIT = 64 * MIB  # the largest tensor the decoders under test accept
BUCKET = MIB
BOUND = 24 * MIB  # the most memory a refused input may cost (resident, and asked of torch)


# ---------------------------------------------------------------------------- measuring
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


class PeakMemory:
    """How much resident memory this process took at its peak inside the block: the
    kernel's high-water mark is reset on entry, so what it shows afterwards is this
    block's own peak, not one from earlier in the process."""

    def __enter__(self) -> PeakMemory:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        self.before = _status_bytes("VmRSS")
        assert _status_bytes("VmHWM") - self.before < MIB, "the high-water mark was not reset"
        self.growth = 0
        return self

    def __exit__(self, *exc) -> None:
        self.growth = _status_bytes("VmHWM") - self.before


class TorchAllocations:
    """Records the bytes of every tensor factory call that takes a size (``torch.empty``,
    ``zeros``, ``ones``, ``full`` and the ``Tensor.new_*`` methods the buffers use), before
    it runs, so a request too large to be served is recorded too, per thread."""

    FACTORIES = ("empty", "zeros", "ones", "full")
    METHODS = ("new_empty", "new_zeros", "new_ones", "new_full")

    def __init__(self) -> None:
        self.sizes: list[tuple[str, int]] = []

    def _record(self, args: tuple, dtype: torch.dtype | None) -> None:
        first = args[0] if args else ()
        dims = (
            first if isinstance(first, tuple | list | torch.Size) else [a for a in args if isinstance(a, int)]
        )
        itemsize = (dtype or torch.get_default_dtype()).itemsize
        self.sizes.append((threading.current_thread().name, math.prod(int(d) for d in dims) * itemsize))

    def factory(self, real):
        def spied(*args, dtype=None, **kwargs):
            self._record(args[:1] if real.__name__ == "full" else args, dtype)
            return real(*args, dtype=dtype, **kwargs)

        return spied

    def method(self, real):
        def spied(tensor, *args, dtype=None, **kwargs):
            self._record(args[:1] if real.__name__ == "new_full" else args, dtype or tensor.dtype)
            return real(tensor, *args, dtype=dtype, **kwargs)

        return spied

    def largest(self, thread: str | None = None) -> int:
        return max((n for t, n in self.sizes if thread is None or t == thread), default=0)


@pytest.fixture
def allocations(monkeypatch):
    spy = TorchAllocations()
    for name in spy.FACTORIES:
        monkeypatch.setattr(torch, name, spy.factory(getattr(torch, name)))
    for name in spy.METHODS:
        monkeypatch.setattr(torch.Tensor, name, spy.method(getattr(torch.Tensor, name)))
    return spy


# ---------------------------------------------------------------------------- hostile values
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
dtypes = st.sampled_from(["float32", "bfloat16", "int8", "float64", "bool"])
small_dims = st.lists(st.integers(0, 16), max_size=3)
ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack carries
not_a_size = st.one_of(
    st.integers(-(2**63), -1),
    st.booleans(),
    st.floats(),
    st.text(max_size=5),
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
)
not_a_list = st.one_of(
    ints, st.text(max_size=8), st.none(), st.dictionaries(st.text(max_size=3), ints, max_size=2)
)
huge_dims = st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=4).filter(lambda d: math.prod(d) > LIMIT)
DTYPE_NAMES = set(plan_module._dtypes())


@st.composite
def hostile_specs(draw):
    """``(wire form, field its refusal must name)``: one thing wrong at a time."""
    name, dims, dtype = draw(names), draw(small_dims), draw(dtypes)
    case = draw(st.sampled_from(["huge", "size", "dims", "shape", "name", "dtype", "arity"]))
    if case == "huge":  # petabytes, or just over the limit
        return [name, draw(huge_dims), dtype], "shape"
    if case == "size":  # negative, bool, float, text... in place of one size
        at = draw(st.integers(0, len(dims)))
        return [name, dims[:at] + [draw(not_a_size)] + dims[at:], dtype], "shape"
    if case == "dims":
        return [name, [1] * draw(st.integers(MAX_TENSOR_DIMS + 1, 4 * MAX_TENSOR_DIMS)), dtype], "shape"
    if case == "shape":
        return [name, draw(not_a_list), dtype], "shape"
    if case == "name":
        return [
            draw(st.one_of(st.just(""), ints, st.none(), st.lists(ints, max_size=2))),
            dims,
            dtype,
        ], "name"
    if case == "dtype":
        bad = draw(st.one_of(ints, st.none(), st.text(max_size=10).filter(lambda t: t not in DTYPE_NAMES)))
        return [name, dims, bad], "dtype"
    return draw(
        st.one_of(not_a_list, st.lists(st.just("x"), max_size=5).filter(lambda x: len(x) != 3))
    ), "tensor spec"


@settings(max_examples=300, deadline=None)
@given(case=hostile_specs())
def test_tensor_spec_decoder_refuses_hostile_sizes_naming_the_field(case):
    data, field = case
    with PeakMemory() as peak:
        with pytest.raises(ValueError) as refused:
            TensorSpec.from_wire(data, max_bytes=LIMIT)
    assert field in str(refused.value), refused.value
    assert peak.growth < BOUND, peak.growth


PIECE_FIELDS = ["tensor", "tensor_offset", "length", "bucket_offset"]


@st.composite
def hostile_buckets(draw):
    """A bucket whose pieces are laid out sanely, then one thing made wrong."""
    index = draw(st.integers(0, 100))
    lengths = draw(st.lists(st.integers(0, 4096), min_size=1, max_size=4))
    pieces, end = [], 0
    for i, n in enumerate(lengths):
        pieces.append([i, 0, n, end])
        end += n
    nbytes = end
    case = draw(st.sampled_from(["arity", "index", "nbytes", "pieces", "piece", "field", "past", "overlap"]))
    if case == "arity":
        return draw(
            st.one_of(not_a_list, st.lists(st.integers(0, 3), max_size=5).filter(lambda x: len(x) != 3))
        ), "bucket"
    if case == "index":
        return [draw(not_a_size), nbytes, pieces], "bucket index"
    if case == "nbytes":
        return [index, draw(not_a_size), pieces], "nbytes"
    if case == "pieces":
        return [index, nbytes, draw(not_a_list)], "pieces"
    at = draw(st.integers(0, len(pieces) - 1))
    if case == "piece":
        pieces[at] = draw(
            st.one_of(not_a_list, st.lists(st.integers(0, 9), max_size=6).filter(lambda x: len(x) != 4))
        )
        return [index, nbytes, pieces], "piece"
    if case == "field":
        f = draw(st.integers(0, 3))
        pieces[at][f] = draw(not_a_size)
        return [index, nbytes, pieces], f"piece {PIECE_FIELDS[f]}"
    if case == "past":  # a length (huge, or one byte too many) that ends past the bucket
        pieces[-1][2] += draw(st.one_of(st.just(1), st.integers(1, 2**63)))
        return [index, nbytes, pieces], "length"
    # overlap: a piece that starts inside the one before it
    first = draw(st.integers(1, 4096))
    start = draw(st.integers(0, first - 1))
    second = draw(st.integers(0, 4096))
    return [index, max(first, start + second), [[0, 0, first, 0], [1, 0, second, start]]], "bucket_offset"


@settings(max_examples=300, deadline=None)
@given(case=hostile_buckets())
def test_bucket_decoder_refuses_hostile_sizes_naming_the_field(case):
    data, field = case
    with PeakMemory() as peak:
        with pytest.raises(ValueError) as refused:
            Bucket.from_wire(data)
    assert field in str(refused.value), refused.value
    assert peak.growth < BOUND, peak.growth


def good_specs(n):
    return [[f"w{i}", [256, 64], "float32"] for i in range(n)]  # 64 KiB each


@st.composite
def hostile_plans(draw):
    """``(wire plan, field, max_total_bytes)``."""
    specs = good_specs(draw(st.integers(0, 6)))
    plan = {"format": PLAN_FORMAT, "bucket_bytes": BUCKET, "tensors": specs}
    case = draw(
        st.sampled_from(["spec", "total", "bucket_bytes", "foreign_bucket", "tensors", "format", "map"])
    )
    if case == "spec":
        spec, field = draw(hostile_specs())
        specs.insert(draw(st.integers(0, len(specs))), spec)
        return plan, field, plan_module.MAX_PLAN_BYTES
    if case == "total":  # each tensor allowed, together more than a plan may hold
        plan["tensors"] = good_specs(8) + [["big", [LIMIT // 4], "float32"]]
        return plan, "bytes a plan may have", LIMIT
    if case == "bucket_bytes":
        plan["bucket_bytes"] = draw(st.one_of(not_a_size, st.integers(0, 63)))
        return plan, "bucket_bytes", plan_module.MAX_PLAN_BYTES
    if case == "foreign_bucket":  # a sane size, but not the one this side is configured with
        plan["bucket_bytes"] = draw(st.integers(64, 2**40).filter(lambda b: b != BUCKET))
        return plan, "bucket_bytes", plan_module.MAX_PLAN_BYTES
    if case == "tensors":
        plan["tensors"] = draw(not_a_list)
        return plan, "tensors", plan_module.MAX_PLAN_BYTES
    if case == "format":
        plan["format"] = draw(
            st.one_of(ints.filter(lambda f: f != PLAN_FORMAT), st.none(), st.text(max_size=3))
        )
        return plan, "format", plan_module.MAX_PLAN_BYTES
    return draw(st.one_of(st.lists(ints, max_size=3), ints, st.none())), "plan", plan_module.MAX_PLAN_BYTES


@settings(max_examples=300, deadline=None)
@given(case=hostile_plans())
@example(
    case=(
        {
            "format": PLAN_FORMAT,
            "bucket_bytes": BUCKET,
            "tensors": good_specs(8) + [["big", [LIMIT // 4], "float32"]],
        },
        "bytes a plan may have",
        LIMIT,
    )
)
def test_plan_decoder_refuses_hostile_sizes_naming_the_field(case):
    data, field, max_total = case
    with PeakMemory() as peak:
        with pytest.raises(ValueError) as refused:
            Plan.from_wire(data, bucket_bytes=BUCKET, max_tensor_bytes=LIMIT, max_total_bytes=max_total)
    assert field in str(refused.value), refused.value
    assert peak.growth < BOUND, peak.growth


def test_plan_decoder_refuses_too_many_tensors_or_buckets_before_building(monkeypatch):
    monkeypatch.setattr(plan_module, "MAX_PLAN_TENSORS", 8)
    with pytest.raises(ValueError, match="plan tensors: 9 tensors, more than the 8"):
        Plan.from_wire({"format": PLAN_FORMAT, "bucket_bytes": BUCKET, "tensors": good_specs(9)})
    # 64-byte buckets: a 1 GiB tensor would take 16M Bucket objects (GBs of Python memory).
    with PeakMemory() as peak:
        with pytest.raises(
            ValueError,
            match=rf"tensor 'w': the plan would have about \d+ buckets \(limit {MAX_PLAN_BUCKETS}\)",
        ):
            Plan.from_wire({"format": PLAN_FORMAT, "bucket_bytes": 64, "tensors": [["w", [1 << 30], "int8"]]})
    assert peak.growth < BOUND


def test_a_sane_plan_from_the_wire_is_the_plan_sent():
    specs = [
        TensorSpec("a", (300, 1000), "float32"),
        TensorSpec("b", (7,), "bfloat16"),
        TensorSpec("c", (0,), "bool"),
    ]
    sent = make_plan(specs, BUCKET)
    got = Plan.from_wire(sent.to_wire(), bucket_bytes=BUCKET, max_tensor_bytes=LIMIT)
    assert got == sent and got.hash == sent.hash


# ---------------------------------------------------------------------------- streamed plan
def announcements(specs: list[TensorSpec], bucket_bytes: int = BUCKET) -> list[tuple[list, list]]:
    """What a sender announces for ``specs`` streamed: each bucket with the specs new to it."""
    buckets = make_plan(specs, bucket_bytes).buckets
    out, told = [], 0
    for b in buckets:
        last = max((p.tensor for p in b.pieces), default=-1)
        out.append(([s.to_wire() for s in specs[told : last + 1]], b.to_wire()))
        told = max(told, last + 1)
    return out


STREAM_SPECS = [
    TensorSpec("a", (768, 1024), "float32"),
    TensorSpec("n", (64,), "float32"),
    TensorSpec("b", (300, 1024), "float32"),
]


@st.composite
def hostile_streams(draw):
    """``(announcements, field)``: a sane stream, one announcement of it made wrong."""
    good = announcements(STREAM_SPECS)  # a: 3 direct buckets, b: 2 (b is 1.2 MiB), then n packed
    at = draw(st.integers(0, len(good) - 1))
    tensors, bucket = (
        [list(t) for t in good[at][0]],
        [good[at][1][0], good[at][1][1], [list(p) for p in good[at][1][2]]],
    )
    case = draw(
        st.sampled_from(
            ["spec", "tensors", "index", "nbytes", "unknown", "offset", "length", "twice", "bucket"]
        )
    )
    field = None
    if case == "spec":
        spec, field = draw(hostile_specs())
        tensors.append(spec)
    elif case == "tensors":
        tensors, field = draw(not_a_list), "announced tensors"
    elif case == "index":
        bucket[0], field = draw(st.integers(0, 2**63).filter(lambda i: i != at)), "bucket index"
    elif case == "nbytes":  # more than a bucket; pieces still inside it
        bucket[1], field = draw(st.integers(BUCKET + 1, 2**63)), "nbytes"
    elif case == "unknown":
        bucket[2][0][0], field = draw(st.integers(len(STREAM_SPECS), 2**63)), "piece tensor"
    elif case == "offset":  # a piece that does not continue its tensor
        p = bucket[2][0]
        p[1] = draw(st.integers(0, 2**40).filter(lambda o: o != p[1]))
        field = "tensor_offset"
    elif case == "length":  # a tensor longer than its spec (the bucket grows with it)
        p = bucket[2][-1]
        extra = draw(st.integers(1, 2**40))
        p[2] += extra
        bucket[1] = p[3] + p[2]
        field = "nbytes" if bucket[1] > BUCKET else "tensor_offset"
    elif case == "twice":
        tensors.append(STREAM_SPECS[0].to_wire() if at else ["a", [1], "int8"])
        field = "announced twice"
    else:
        bucket, field = draw(st.one_of(not_a_list, st.lists(st.integers(0, 3), max_size=2))), "bucket"
    return good[:at] + [(tensors, bucket)], field


@settings(max_examples=300, deadline=None)
@given(case=hostile_streams())
def test_streamed_plan_refuses_hostile_announcements_naming_the_field(case):
    stream, field = case
    specs: list[TensorSpec] = []
    checker = StreamedPlan(BUCKET, specs, max_tensor_bytes=LIMIT)
    for tensors, bucket in stream[:-1]:
        checker.announce(tensors, bucket)
    before = list(specs)
    with PeakMemory() as peak:
        with pytest.raises(ValueError) as refused:
            checker.announce(*stream[-1])
    assert field in str(refused.value), refused.value
    assert specs == before  # nothing of a refused announcement reaches the assembler
    assert peak.growth < BOUND, peak.growth


def test_streamed_plan_accepts_what_a_sender_announces_and_bounds_the_total():
    specs: list[TensorSpec] = []
    checker = StreamedPlan(BUCKET, specs, max_tensor_bytes=LIMIT)
    got = [checker.announce(t, b)[1] for t, b in announcements(STREAM_SPECS)]
    assert specs == STREAM_SPECS and tuple(got) == make_plan(STREAM_SPECS, BUCKET).buckets
    total = StreamedPlan(BUCKET, [], max_tensor_bytes=LIMIT, max_total_bytes=4 * MIB)
    first, *rest = announcements(STREAM_SPECS)
    total.announce(*first)  # a: 3 MiB
    with pytest.raises(
        ValueError,
        match=r"tensor 'b': it brings the plan to \d+ bytes, more than the 4194304 bytes a plan may have",
    ):
        for t, b in rest:
            total.announce(t, b)


# ---------------------------------------------------------------------------- a real receiver
def greet(ch: Channel, d: Deadline, session: str) -> None:
    """A sender's side of the greeting, without a secret: challenge, the hello, welcome."""
    ch.send({"type": "challenge", "protocol": PROTOCOL_VERSION, "nonce": b"n" * 32}, d)
    ch.recv(d, expect="hello")
    ch.send({"type": "welcome", "protocol": PROTOCOL_VERSION, "session": session}, d)


class HostileSender:
    """Speaks the session protocol as a sender would (challenge, welcome, sync, go), over the
    ``tcp`` test transport's data port, then sends what the test says."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.data = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.token = secrets.token_hex(16)
        self.replies: list[dict] = []
        self.error: BaseException | None = None

    def engine(self, **extra) -> dict:
        return {
            "rank": 1,
            "world_size": 2,
            "senders": 1,
            "port": self.data.getsockname()[1],
            "token": self.token,
            **extra,
        }

    def sync(self, **fields) -> dict:
        msg = {
            "type": "sync",
            "protocol": PROTOCOL_VERSION,
            "version": 1,
            "bucket_bytes": BUCKET,
            "plan_hash": None,
            "force": False,
            "verify": "off",
            "engine": self.engine(),
        }
        msg.update(fields)
        return msg

    def serve(self, sync: dict, stream: list[tuple[list, list]] = ()) -> None:
        """One session: handshake with ``sync``; if the receiver is ready, go, then announce
        ``stream`` (sending each bucket's bytes), and read the receiver's replies."""
        try:
            conn, _ = self.listener.accept()
            with conn:
                ch = Channel(conn, "receiver")
                d = Deadline(20, "hostile sender")
                greet(ch, d, "hostile" * 4)
                ch.send(sync, d)
                reply = ch.recv(d)
                self.replies.append(reply)
                if reply["type"] == "error":
                    ch.send({"type": "abort", "message": "refused"}, d)
                    return
                ch.send({"type": "go"}, d)
                self.data.settimeout(20)
                data, _ = self.data.accept()
                with data:
                    data.recv(32)
                    try:
                        for tensors, bucket in stream:
                            ch.send({"type": "bucket", "tensors": tensors, "bucket": bucket}, d)
                            nbytes = bucket[1] if isinstance(bucket, list) and len(bucket) == 3 else 0
                            if (
                                isinstance(nbytes, int)
                                and not isinstance(nbytes, bool)
                                and 0 < nbytes <= BUCKET
                            ):
                                data.sendall(bytes(nbytes))  # its bytes, as a sender would
                        ch.send({"type": "end", "plan_hash": "whatever"}, d)
                    except (SyncError, OSError):
                        pass  # the receiver hung up
        except BaseException as e:  # reported by the test
            self.error = e

    def close(self) -> None:
        self.listener.close()
        self.data.close()


TCP = [
    "custom_backend_module=tcp_transport",
    "backend=tcp",
    "update_weights_bucket_megabytes=1",
    "timeout_s=10",
]


def receive_from(fake: HostileSender, sync: dict, stream=(), max_tensor_bytes: int | None = LIMIT):
    """Run one sync of a real receiver against ``fake``; return the receiver's error."""
    server = threading.Thread(target=fake.serve, args=(sync, stream), daemon=True)
    server.start()
    with Receiver(EngineConfig.from_overrides(TCP), fake.address, 0) as receiver:
        if max_tensor_bytes is not None:
            receiver.max_tensor_bytes = max_tensor_bytes
        try:
            for _ in receiver.receive():
                pass
        except SyncError as e:
            error = e
        else:
            error = None
        assert receiver.version is None
    server.join(timeout=30)
    assert not server.is_alive() and fake.error is None, fake.error
    return error


def refused_stream(stream, allocations):
    """Run a streamed sync of ``stream`` against a real receiver; return its error (a
    ProtocolError, checked here) and the memory the refusal cost."""
    fake = HostileSender()
    try:
        allocations.sizes.clear()
        with PeakMemory() as peak:
            error = receive_from(fake, fake.sync(), stream)
        assert isinstance(error, ProtocolError), error
        return error, peak
    finally:
        fake.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=hostile_streams())
def test_the_stream_reader_refuses_hostile_announcements_over_a_real_socket(case, allocations):
    stream, field = case
    error, peak = refused_stream(stream, allocations)
    assert "sender at 127.0.0.1" in str(error) and field in str(error), error
    # The transport's buffer, and the 3 MiB tensor of a sane announcement before the
    # hostile one (merged from its pieces): nothing of what was refused.
    assert allocations.largest() <= 3 * MIB, allocations.sizes
    assert peak.growth < BOUND, peak.growth


@st.composite
def oversized_streams(draw):
    """A sane stream, then a well-formed announcement of a tensor larger than the receiver
    takes, whose first piece fills a bucket (a receiver that believed it would allocate the
    whole tensor to merge its pieces into)."""
    good = announcements(STREAM_SPECS)
    at = draw(st.integers(0, len(good)))
    known = sum(len(t) for t, _ in good[:at])
    dims = draw(st.one_of(huge_dims, st.integers(LIMIT + 1, 1 << 45).map(lambda n: [n])))
    spec = ["huge.weight", dims, draw(st.sampled_from(["int8", "float32", "bfloat16"]))]
    return good[:at] + [([spec], [at, BUCKET, [[known, 0, BUCKET, 0]]])], "shape"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=oversized_streams())
def test_the_stream_reader_refuses_an_oversized_tensor_before_allocating_it(case, allocations):
    stream, field = case
    error, peak = refused_stream(stream, allocations)
    assert "tensor 'huge.weight': shape" in str(
        error
    ) and f"more than the {LIMIT} bytes a tensor may have" in str(error), error
    assert allocations.largest() <= 3 * MIB, allocations.sizes
    assert peak.growth < BOUND, peak.growth


TOTAL_CASE = (
    {
        "format": PLAN_FORMAT,
        "bucket_bytes": BUCKET,
        "tensors": good_specs(8) + [["big", [LIMIT // 4], "float32"]],
    },
    "bytes a plan may have",
    LIMIT,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=hostile_plans())
@example(case=TOTAL_CASE)
def test_a_hostile_plan_is_refused_in_the_handshake_naming_the_field(case, allocations):
    plan, field, max_total = case
    plan = dict(plan) if isinstance(plan, dict) else plan  # the examples are shared
    limit = LIMIT
    if max_total != plan_module.MAX_PLAN_BYTES:
        # A receiver's limits are the module's: with 1 MiB buckets, 4M buckets (4 TiB) bind
        # long before the 1 PiB total.
        plan["tensors"] = plan["tensors"][:-1] + [["big", [1 << 41], "int8"], ["big2", [1 << 41], "int8"]]
        field = f"buckets (limit {MAX_PLAN_BUCKETS})"
        limit = 1 << 50
    fake = HostileSender()
    try:
        allocations.sizes.clear()
        with PeakMemory() as peak:
            error = receive_from(fake, fake.sync(plan_hash="h", plan=plan), max_tensor_bytes=limit)
        assert isinstance(error, HandshakeError), error
        assert error.args[0].startswith("receiver rank 0 refused version 1: ") and field in str(error), error
        assert fake.replies[0]["type"] == "error" and field in fake.replies[0]["message"]
        assert allocations.largest() == 0, allocations.sizes
        assert peak.growth < BOUND, peak.growth
    finally:
        fake.close()


@pytest.mark.parametrize(
    "engine, field",
    [
        ({"world_size": 1 << 40}, "world_size"),
        ({"rank": -1}, "rank"),
        ({"senders": 2**63}, "senders"),
        ({"rank": 5, "world_size": 3}, "rank=5"),
        ({"world_size": "2"}, "world_size"),
    ],
)
def test_a_hostile_group_size_is_refused_in_the_handshake(engine, field, allocations):
    fake = HostileSender()
    try:
        error = receive_from(fake, fake.sync(engine=fake.engine(**engine)))
        assert isinstance(error, HandshakeError) and f"engine {field}" in str(error), error
        assert allocations.largest() == 0
    finally:
        fake.close()


def test_by_default_a_tensor_larger_than_the_devices_memory_is_refused():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fake = HostileSender()
    try:
        with Receiver(EngineConfig.from_overrides(TCP), fake.address, 0) as receiver:
            assert receiver.max_tensor_bytes == physical
        plan = {"format": PLAN_FORMAT, "bucket_bytes": BUCKET, "tensors": [["w", [physical + 1], "int8"]]}
        error = receive_from(fake, fake.sync(plan_hash="h", plan=plan), max_tensor_bytes=None)
        assert isinstance(error, HandshakeError), error
        assert (
            f"tensor 'w': shape ({physical + 1},) of 'int8' is {physical + 1} bytes, more than the {physical} bytes"
            in str(error)
        )
    finally:
        fake.close()


# ---------------------------------------------------------------------------- load_into checks first
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16))
        self.b = torch.nn.Parameter(torch.zeros(4))


def _load_in_thread(address, model, box):
    def run():
        try:
            with Receiver(EngineConfig.from_overrides(TCP), address, 0) as receiver:
                box["stats"] = receiver.load_into(model, version=1)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name="receiver-under-test", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("streamed", [False, True], ids=["plan", "streamed"])
def test_load_into_checks_every_spec_against_the_model_before_allocating_it(streamed, allocations):
    """A real sender (the ``tcp`` transport) sends ``w`` as 64 MiB where the model has 16
    floats: refused in the handshake (plan), or before any byte of it is unpacked
    (streamed: nothing of its size is allocated, the rest is drained, the sender is told)."""
    big = {"b": torch.ones(4), "w": torch.ones(16 * MIB)}
    source = IteratorSource(iter(big.items())) if streamed else big
    model = Tiny()
    with Sender(EngineConfig.from_overrides(TCP), "127.0.0.1:0", 1) as sender:
        box: dict = {}
        allocations.sizes.clear()
        with PeakMemory() as peak:
            thread = _load_in_thread(sender.address, model, box)
            with pytest.raises(RemoteFailure if streamed else HandshakeError) as failure:
                sender.send(source, version=1)
            thread.join(timeout=60)
    mismatch = r"tensor 'w': shape \(16777216,\) received, model has \(16,\)"
    assert failure.match(mismatch)
    assert isinstance(box.get("error"), SinkError if streamed else HandshakeError), box
    assert box["error"].args[0].endswith("tensor 'w': shape (16777216,) received, model has (16,)"), box[
        "error"
    ]
    assert allocations.largest("receiver-under-test") <= BUCKET, allocations.sizes
    assert peak.growth < 48 * MIB, peak.growth  # the sender's 64 MiB source existed before
    assert torch.equal(model.w, torch.zeros(16))


# ---------------------------------------------------------------------------- shm set-up
def test_shm_refuses_a_ring_whose_slots_differ_from_the_handshake():
    """A sender whose ring socket offers slots of another size than its handshake said:
    the receiver refuses before mapping anything."""
    from weightsync.engines.base import Join
    from weightsync.engines.ring import PeerError, pack_message
    from weightsync.engines.same_host import host_id
    from weightsync.engines.shm import ShmEngine

    name = f"weightsync-test-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    fd = os.memfd_create("weightsync-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * 4096)

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            socket.send_fds(conn, [pack_message({"slot_bytes": 1 << 40})], [fd])
            conn.recv(1)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    engine = ShmEngine(EngineConfig.from_overrides(["backend=shm", "timeout_s=10"]), torch.device("cpu"))
    info = {"socket": name, "token": "0" * 32, "generation": 1, "slot_bytes": 4096, "host_id": host_id()}
    join = Join(
        version=1, rank=1, world_size=2, senders=1, capacity=4096, name="receiver rank 0", receiver_rank=0
    )
    try:
        with pytest.raises(
            PeerError, match="shm: the sender offers slots of 1099511627776 bytes, its handshake said 4096"
        ):
            engine.connect(join, info)
        assert engine._ring is None and engine._memory is None
    finally:
        engine.close()
        server.join(timeout=10)
        listener.close()
        os.close(fd)


# ---------------------------------------------------------------------------- frame limits
def _fake_sender_that_then_sends(frame_header: bytes, body: bytes = b""):
    """A sender that completes the greeting (no secret), then sends ``frame_header`` and
    ``body`` raw; returns its address and the thread (which waits for the receiver to hang up)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        with listener:
            conn, _ = listener.accept()
            with conn:
                greet(Channel(conn, "receiver"), Deadline(20, "fake sender"), "fake" * 4)
                conn.sendall(frame_header + body)
                conn.settimeout(20)
                while conn.recv(4096):  # until the receiver hangs up
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_after_the_greeting_a_receiver_takes_plan_sized_frames_and_refuses_larger_at_once():
    """Before authentication a frame is at most ``HELLO_MAX_BYTES`` (4 KiB); after it the
    sender may send up to ``MAX_FRAME_BYTES`` (a whole plan), and a header claiming more is
    refused as read, without waiting for (or allocating) its body."""
    from weightsync.session.channel import HELLO_MAX_BYTES, MAX_FRAME_BYTES

    fake = HostileSender()
    try:
        big = fake.sync(padding=b"p" * (64 * HELLO_MAX_BYTES))  # 256 KiB: no greeting could be this large
        receive_from(fake, big)
        assert fake.replies and fake.replies[0]["type"] == "ready", fake.replies
    finally:
        fake.close()

    address, thread = _fake_sender_that_then_sends((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    t0 = time.monotonic()
    with Receiver(EngineConfig.from_overrides(TCP), address, 0) as receiver:
        with pytest.raises(
            ProtocolError,
            match=f"sender at {address} sent a {MAX_FRAME_BYTES + 1}-byte frame "
            f"\\(limit {MAX_FRAME_BYTES}\\)",
        ):
            list(receiver.receive())
        assert receiver.version is None
    assert time.monotonic() - t0 < 5  # refused on the header: its 64 MiB never came
    thread.join(timeout=10)


def test_an_authenticated_receiver_may_only_send_small_replies():
    """The sender reads at most ``RECEIVER_MAX_FRAME_BYTES`` (1 MiB) per frame from a
    receiver, also from one that holds the shared secret: a larger header fails the sync
    naming that receiver at once, without reading the body."""
    from weightsync.session.channel import RECEIVER_MAX_FRAME_BYTES
    from weightsync.session.control import connect

    overrides = ["backend=nccl", "timeout_s=30", "auth_secret=" + "s" * 32]
    config = EngineConfig.from_overrides(overrides)
    with Sender(config, "127.0.0.1:0", 1) as sender:
        sent = workers.Background(sender, {"w": torch.ones(4)}, 1)
        channel = connect(sender.address, 0, config)  # a genuine, authenticated greeting
        try:
            d = Deadline(20, "test receiver")
            assert channel.recv(d, expect="sync")["version"] == 1
            t0 = time.monotonic()
            channel.sock.sendall((RECEIVER_MAX_FRAME_BYTES + 1).to_bytes(4, "big"))  # and no body
            with pytest.raises(
                SyncError,
                match=rf"receiver rank 0 \(pid {os.getpid()}.*\) sent a "
                rf"{RECEIVER_MAX_FRAME_BYTES + 1}-byte frame \(limit {RECEIVER_MAX_FRAME_BYTES}\)",
            ):
                sent.join(timeout=30)
            assert time.monotonic() - t0 < 5
        finally:
            channel.close()


def test_a_close_behind_messages_not_read_yet_is_seen_without_reading_them():
    """The watch during a transfer peeks at the control connection: a streamed sync's
    announcements may wait unread there, and the peer's close behind them must still show
    (it did not: a receiver then waited out Gloo's deadline on a sender that had given up)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
        ch = Channel(ours, "sender at test")
        try:
            theirs.sendall(msgpack.packb({"type": "specs"}))
            time.sleep(0.1)
            assert not ch.is_dead(behind=True)  # alive, a message waiting
            theirs.close()
            time.sleep(0.1)
            assert not ch.is_dead()  # between syncs the message is read first (a goodbye, say)
            assert (
                ch.is_dead(behind=True)
                and ch.gone("during the test") == "sender at test disconnected during the test"
            )
        finally:
            ch.close()
