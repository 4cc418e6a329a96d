"""The planner against every transport's routing, in process: for random tensor lists,
bucket sizes and receiver / trainer-rank counts, the plan, ``paired``'s deal and
forwarding, the ``nccl`` window and the slot ring deliver every bucket to every receiver
exactly once, in plan order, and every tensor assembles bit-exact.

Each rank's real engine code runs alone (``send_buckets`` with the real packer,
``recv_buckets`` with the real assembler); only the process group under it is replaced by
``Wire``: a receive is filled with the bytes its bucket must carry, and a send records
the bytes its buffer holds when the engine waits for it, the latest moment a real link
may still read them. Completion is drawn: never on its own (a slow wire: an operation
completes only when waited for), always, or at random. Afterwards every link's sends must
carry, in order, exactly the buckets its far end expected, and no send may lack a far end
that expected it. The multi-process tests of each backend run the same code over real
links: tests/test_sync.py (``nccl``'s broadcast over Gloo), tests/test_paired.py
(``paired``), tests/test_cluster.py (``nccl``'s chain, ``paired`` and ``mooncake`` between
emulated hosts).
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync import EngineConfig
from weightsync.engines import ring
from weightsync.engines.base import Join
from weightsync.engines.nccl import CollectiveEngine
from weightsync.engines.paired import PairedEngine
from weightsync.plan import Assembler, Bucket, Plan, TensorSpec, as_bytes, capacity, direct_bytes, make_plan
from weightsync.sender.packer import producer
from weightsync.sources import StateDictSource

MIB = 1 << 20
# Every dtype a plan carries (itemsize >= 1), with its itemsize: bytes are what travel.
DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "float8_e4m3fn",
    "float8_e5m2",
]


def pattern(index: int, nbytes: int) -> torch.Tensor:
    """Bytes that differ by tensor and by offset (cheap, unlike random bytes)."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 131 + index * 7919) % 251).to(torch.uint8)


@st.composite
def models(draw, splits: bool) -> tuple[dict[str, torch.Tensor], int]:
    """A state dict and a bucket size: 0-dim and empty tensors, runs of small tensors
    between large ones (at and above ``direct_bytes``), tensors over several buckets."""
    bucket = draw(st.sampled_from([2 * MIB, 3 * MIB, 6 * MIB]))  # 6 MiB: buckets in chain pieces
    large = direct_bytes(bucket)
    biggest = 2 * bucket + 3 if splits else bucket
    state: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, 24))):
        kind = draw(st.sampled_from(["scalar", "empty", "small", "small", "small", "small", "large"]))
        dtype = draw(st.sampled_from(DTYPES))
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if kind == "scalar":
            shape: tuple[int, ...] = ()
        elif kind == "empty":
            shape = (draw(st.integers(0, 3)), 0)
        else:
            low, high = (1, large - 1) if kind == "small" else (large, biggest)
            shape = (max(1, draw(st.integers(low, high)) // size),)
        n = size * (torch.Size(shape).numel())
        raw = pattern(i, n) % 2 if dtype == "bool" else pattern(i, n)  # a bool's byte is 0 or 1
        state[f"t{i}.{kind}"] = raw.view(getattr(torch, dtype)).reshape(shape)
    return state, bucket


class Op:
    """An operation on the simulated wire; ``finish`` runs when the engine waits for it."""

    def __init__(self, finish: Callable[[], None], completes: Callable[[], bool]) -> None:
        self._finish, self._completes, self._done = finish, completes, False

    def is_completed(self) -> bool:
        return self._done or self._completes()

    def wait(self) -> None:
        if not self._done:
            self._done = True
            self._finish()


class Wire:
    """What crossed each link ``(from rank, to rank)`` (``to`` None: to every rank)."""

    def __init__(self, plan: Plan, source: dict[str, torch.Tensor], completes: Callable[[], bool]) -> None:
        self.plan, self.completes = plan, completes
        self.flat = [as_bytes(source[s.name]) for s in plan.tensors]
        self.sent: dict[tuple[int, int | None], list[bytes | None]] = defaultdict(list)
        # Per link, each receive: (bucket, offset in it, length): a chain moves pieces.
        self.expected: dict[tuple[int, int], list[tuple[Bucket, int, int]]] = defaultdict(list)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a few buckets; the cache dies with the test)
    def image(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The bytes ``bucket`` must carry, and which of them matter (not the padding)."""
        data, mask = (
            torch.zeros(bucket.nbytes, dtype=torch.uint8),
            torch.zeros(bucket.nbytes, dtype=torch.bool),
        )
        for p in bucket.pieces:
            data[p.bucket_offset : p.bucket_offset + p.length] = self.flat[p.tensor][
                p.tensor_offset : p.tensor_offset + p.length
            ]
            mask[p.bucket_offset : p.bucket_offset + p.length] = True
        return data, mask

    def fill(self, bucket: Bucket, offset: int, target: torch.Tensor) -> None:
        target.copy_(self.image(bucket)[0][offset : offset + target.numel()])

    def carries(self, bucket: Bucket, offset: int, length: int, data: bytes) -> bool:
        want, mask = (t[offset : offset + length] for t in self.image(bucket))
        got = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        return len(data) == length and torch.equal(got[mask], want[mask])


def simulated(cls: type) -> type:
    """``cls`` with its process group replaced by a ``Wire``."""

    class Simulated(cls):
        def bind(self, wire: Wire) -> None:
            self.wire, self.routed, self.offset = wire, None, 0

        def pieces(self, bucket: Bucket, tensor: torch.Tensor):
            self.routed, self.offset = bucket, 0  # the bucket the next receives are for
            return super().pieces(bucket, tensor)

        def _recv_op(self, source: int, tensor: torch.Tensor) -> Op:
            bucket, offset = self.routed, self.offset
            self.offset += tensor.numel()
            self.wire.expected[(source, self.rank)].append((bucket, offset, tensor.numel()))
            return Op(lambda: self.wire.fill(bucket, offset, tensor), self.wire.completes)

        def _send_op(self, to: int | None, tensor: torch.Tensor) -> Op:
            sent = self.wire.sent[(self.rank, to)]
            sent.append(None)
            k = len(sent) - 1

            def finish() -> None:  # what the buffer holds when the engine may reuse it
                sent[k] = tensor.numpy().tobytes()

            return Op(finish, self.wire.completes)

    return Simulated


def run_sync(
    cls: type,
    state: dict[str, torch.Tensor],
    bucket: int,
    receivers: int,
    trainers: int,
    completion: str,
    seed: int,
    land: bool,
    topology: str = "chain",
) -> None:
    plan = make_plan([TensorSpec.of(n, t) for n, t in state.items()], bucket)
    rng = random.Random(seed)
    completes = {"never": lambda: False, "always": lambda: True, "random": lambda: rng.random() < 0.5}[
        completion
    ]
    wire = Wire(plan, state, completes)
    config = EngineConfig.from_overrides([f"update_weights_bucket_megabytes={bucket // MIB}"])
    world = receivers + trainers

    def engine(rank: int) -> CollectiveEngine:
        e = simulated(cls)(config, torch.device("cpu"))
        join = Join(
            version=1,
            rank=rank,
            world_size=world,
            senders=trainers,
            capacity=capacity(plan, bucket),
            name=f"rank {rank}",
        )
        e.arrange(join, topology)
        e.start(join)
        e.bind(wire)
        return e

    trainer_ranks = [0] + [receivers + s for s in range(1, trainers)]
    for rank in trainer_ranks:
        e = engine(rank)
        _, produce, _ = producer(StateDictSource(state), bucket, plan, "off", lambda msg: None, sends=e.sends)
        e.send_buckets(produce)
    for rank in range(1, receivers + 1):
        e = engine(rank)
        model = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in plan.tensors}
        assembler = Assembler(
            plan.tensors, torch.device("cpu"), (lambda s: model[s.name]) if land else None, owned=True
        )
        yielded = []
        for b, buffer in e.recv_buckets(
            lambda it=iter(plan.buckets): next(it, None), assembler.landing if land else None
        ):
            yielded.append(b.index)
            for name, tensor in assembler.unpack(b, buffer):
                as_bytes(model[name]).copy_(as_bytes(tensor))
        assert yielded == [b.index for b in plan.buckets], f"rank {rank} yielded buckets {yielded}"
        assert not assembler.incomplete
        for name, tensor in state.items():
            assert torch.equal(as_bytes(model[name]), as_bytes(tensor)), f"rank {rank}: tensor {name} differs"
    # Every link carried, in order, exactly the buckets its far end expected.
    for (src, dst), buckets in wire.expected.items():
        sent = wire.sent.get((src, dst), wire.sent.get((src, None)))
        assert sent is not None and len(sent) == len(buckets), (
            f"link {src}->{dst}: {len(sent or [])} sent, {len(buckets)} expected"
        )
        for (b, offset, length), data in zip(buckets, sent):
            assert data is not None and wire.carries(b, offset, length, data), (
                f"link {src}->{dst}: bucket {b.index} arrived changed"
            )
    # Every send had a far end that expected it: a send to one rank, that rank's receives
    # from the sender; a broadcast, the receives from its sender on a link with no sends of
    # its own (those the broadcast's sends were matched against above).
    for src, dst in wire.sent:
        if dst is not None:
            assert (src, dst) in wire.expected, f"a send nobody received: link {src}->{dst}"
        else:
            assert any(s == src and (s, d) not in wire.sent for s, d in wire.expected), (
                f"a send nobody received: a broadcast from rank {src}"
            )


COMMON = dict(
    deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@settings(**COMMON)
@given(
    models(splits=False),
    st.integers(1, 5),
    st.integers(1, 3),
    st.sampled_from(["never", "always", "random"]),
    st.integers(0, 2**32),
    st.booleans(),
)
def test_paired_delivers_every_bucket_once_to_every_receiver(
    model, receivers, trainers, completion, seed, land
):
    state, bucket = model
    run_sync(PairedEngine, state, bucket, receivers, trainers, completion, seed, land)


@settings(**COMMON)
@given(
    models(splits=True),
    st.integers(1, 4),
    st.sampled_from(["never", "always", "random"]),
    st.integers(0, 2**32),
    st.booleans(),
    st.sampled_from(["broadcast", "chain"]),
)
def test_nccl_window_delivers_every_bucket_once_to_every_receiver(
    model, receivers, completion, seed, land, topology
):
    """Both routes of ``nccl``: the broadcast and the chain (in pieces of ``CHUNK_BYTES``)."""
    state, bucket = model
    run_sync(CollectiveEngine, state, bucket, receivers, 1, completion, seed, land, topology)


@settings(**COMMON)
@given(models(splits=True))
def test_the_slot_ring_holds_every_bucket_apart_from_its_neighbours(model):
    """``shm`` and ``mooncake`` put bucket k in slot ``k % SLOTS`` of a ring of slots of
    the plan's capacity: every bucket fits, and bucket k+1 never overlaps bucket k."""
    state, bucket = model
    plan = make_plan([TensorSpec.of(n, t) for n, t in state.items()], bucket)
    cap = capacity(plan, bucket)
    ringbuf = torch.zeros(ring.SLOTS * cap, dtype=torch.uint8)
    for b in plan.buckets:
        here = ring.slot(ringbuf, cap, b.index)
        assert b.nbytes <= here.numel() == cap
        after = ring.slot(ringbuf, cap, b.index + 1)
        assert here.data_ptr() + cap <= after.data_ptr() or after.data_ptr() + cap <= here.data_ptr()


def test_the_demo_models_plan_through_a_forwarding_replica():
    """The shape that broke ``paired`` with plan format 4 (the demo's default model, 64 MiB
    buckets, 2 replicas): a forwarding replica whose two buffer slots were both on their
    way on, behind a forward from a landed bucket, ended its receive early."""
    from weightsync.demo.plain import build_model

    state = build_model(None, pretrained=True, seed=0).state_dict()
    run_sync(PairedEngine, state, 64 * MIB, 2, 1, "never", 0, land=True)
