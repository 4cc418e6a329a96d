"""Layouts and the route planner of sharded sync (``weightsync.sharding``): pure functions,
checked as properties over random shapes, meshes and placements.

Boxes are checked against torch's own split of a DTensor (the private helper DTensor uses to
find a rank's local shape and offset), so a layout we derive is the shard torch holds. The
route is checked for what a sync relies on: every destination byte covered exactly once,
nothing read from a rank that does not hold it, balanced trainer NICs where holders allow,
and the same route and hash from inputs built independently.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box, Layout, Replicate, Shard, boxes_of_placements
from weightsync.sharding.route import RouteError, nic_bytes, plan_route

# What carries each link (``engine_kwargs.sharded.links``): the session tests run over both.
LINKS = ["collective", "mooncake"]

shapes = st.lists(st.integers(0, 13), min_size=1, max_size=3).map(tuple)
meshes = st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)


@st.composite
def placed(draw, shape=None, mesh=None):
    shape = draw(shapes) if shape is None else shape
    mesh = draw(meshes) if mesh is None else mesh
    dims = st.integers(0, len(shape) - 1).map(Shard)
    placements = draw(st.lists(st.one_of(dims, st.just(Replicate())), min_size=len(mesh), max_size=len(mesh)))
    return shape, mesh, placements


def _torch(placements):
    return [TorchShard(p.dim) if isinstance(p, Shard) else TorchReplicate() for p in placements]


def _coordinates(mesh):
    return list(itertools.product(*(range(n) for n in mesh)))


@settings(max_examples=300, deadline=None)
@given(placed())
def test_a_box_is_the_shard_torch_gives_that_rank(case):
    shape, mesh, placements = case
    for coordinate in _coordinates(mesh):
        box = boxes_of_placements(shape, mesh, coordinate, placements)
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh, list(coordinate), _torch(placements)
        )
        assert box.lengths == tuple(local), (coordinate, placements)
        assert box.starts == tuple(offset) or box.numel == 0, (coordinate, placements)


def _layouts(shape, mesh, placements, name="w", host_of=lambda i: ""):
    return [
        Layout({name: boxes_of_placements(shape, mesh, c, placements)}, host_of(i))
        for i, c in enumerate(_coordinates(mesh))
    ]


@st.composite
def syncs(draw):
    """A trainer mesh holding a few tensors, and 1-3 replicas each needing slices."""
    names = ["embed", "qkv", "norm"][: draw(st.integers(1, 3))]
    tensor_shapes = {n: draw(shapes) for n in names}
    dtype = draw(st.sampled_from(["float32", "bfloat16", "uint8"]))
    specs = [TensorSpec(n, s, dtype) for n, s in tensor_shapes.items()]
    trainer_mesh = draw(meshes)
    trainer = {n: draw(placed(s, trainer_mesh))[2] for n, s in tensor_shapes.items()}
    holders = [
        Layout(
            {n: boxes_of_placements(tensor_shapes[n], trainer_mesh, c, trainer[n]) for n in names}, f"t{i}"
        )
        for i, c in enumerate(_coordinates(trainer_mesh))
    ]
    needs = []
    for replica in range(draw(st.integers(1, 3))):
        tp = draw(st.integers(1, 4))
        placements = {n: draw(placed(s, (tp,)))[2] for n, s in tensor_shapes.items()}
        whole = draw(st.booleans()) and replica == 0  # a replica that declares nothing
        for r in range(tp if not whole else 1):
            boxes = {
                n: Box.whole(s) if whole else boxes_of_placements(s, (tp,), (r,), placements[n])
                for n, s in tensor_shapes.items()
            }
            needs.append(Layout(boxes, f"r{replica}-{r}"))
    return specs, holders, needs


@settings(max_examples=200, deadline=None)
@given(syncs())
def test_every_destination_byte_arrives_once_from_a_rank_that_holds_it(sync):
    specs, holders, needs = sync
    route = plan_route(specs, holders, needs)
    for dest, layout in enumerate(needs):
        for index, spec in enumerate(specs):
            need = layout.boxes[spec.name]
            count = torch.zeros(need.lengths, dtype=torch.int32)
            for f in route.for_dest(dest):  # from a trainer rank, or along its chain
                if f.tensor == index:
                    assert holders[f.source].boxes[spec.name].contains(f.box), f  # read only what it holds
                    assert need.contains(f.box), f
                    at = f.box.within(need)
                    count[tuple(slice(s, s + n) for s, n in zip(at.starts, at.lengths))] += 1
            assert bool((count == 1).all()), (spec.name, dest)
    assert sum(route.received_bytes().values()) == sum(
        layout.boxes[s.name].numel * s.torch_dtype.itemsize for layout in needs for s in specs
    )

    # ranks that keep the same boxes form a chain: the trainer ranks send its first rank
    # alone, so each trainer byte leaves its NIC once per distinct layout
    def kept(layout):
        return tuple(sorted((n, b) for n, b in layout.boxes.items() if b.numel))

    for chain in route.chains:
        assert all(kept(needs[d]) == kept(needs[chain[0]]) for d in chain)
        assert not any(f.dest in chain[1:] for f in route.fragments)
    distinct = {kept(layout) for layout in needs}
    assert sum(route.sent_bytes().values()) == sum(
        dict(boxes)[s.name].numel * s.torch_dtype.itemsize
        for boxes in distinct
        for s in specs
        if s.name in dict(boxes)
    )


@settings(max_examples=200, deadline=None)
@given(syncs())
def test_the_same_inputs_built_again_give_the_same_route_and_hash(sync):
    specs, holders, needs = sync
    again = [Layout(dict(reversed(list(layout.boxes.items()))), layout.host) for layout in holders]
    wanted = [Layout.from_wire(layout.to_wire()) for layout in needs]
    first, second = plan_route(specs, holders, needs), plan_route(specs, again, wanted)
    assert first == second and first.hash == second.hash
    if len(needs) > 1:  # the hash sees who takes what
        moved = plan_route(specs, holders, [*needs[1:], needs[0]])
        same = (moved.fragments, moved.chains) == (first.fragments, first.chains)
        assert (moved.hash == first.hash) == same


def _groups(rank_plan):
    """Each group of a ``RankPlan``: peer -> (its tensors' specs, its buckets relative to it)."""
    plan, out = rank_plan.plan, {}
    for peer in rank_plan.peers:
        buckets = [b for b in plan.buckets if rank_plan.peer_of(b.index) == peer]
        first = min((p.tensor for b in buckets for p in b.pieces), default=0)
        shape = [
            (b.nbytes, [(p.tensor - first, p.tensor_offset, p.length, p.bucket_offset) for p in b.pieces])
            for b in buckets
        ]
        count = len({p.tensor for b in buckets for p in b.pieces})
        out[peer] = (list(plan.tensors[first : first + count]), shape)
    return out


@settings(max_examples=150, deadline=None)
@given(syncs(), st.sampled_from([64, 256, 4096]))
def test_both_ends_of_every_pair_plan_the_same_buckets_and_blocking_sends_never_deadlock(sync, bucket_bytes):
    """Each trainer rank's plan (a group per receiver rank) and each receiver rank's (a group
    per trainer rank) hold every fragment once, and the two ends of a pair hold the same
    buckets in the same order. Moved one bucket at a time, each send waiting for its
    receive (the strictest a link can be), every rank finishes: the groups' rotated orders
    leave no circle of ranks each waiting for the next."""
    from weightsync.sharding.fragments import fragment_name, receiver_plan, trainer_plan

    specs, holders, needs = sync
    route = plan_route(specs, holders, needs, forward=False)  # pairs only: chains pass buckets on
    sources = sorted({f.source for f in route.fragments})
    dests = sorted({f.dest for f in route.fragments})
    senders = {s: trainer_plan(route, s, bucket_bytes) for s in sources}
    takers = {q: receiver_plan(route, q, bucket_bytes) for q in dests}
    names = sorted(fragment_name(route, f) for f in route.fragments)
    assert sorted(t.name for rp in senders.values() for t in rp.plan.tensors) == names
    assert sorted(t.name for rp in takers.values() for t in rp.plan.tensors) == names
    sent = {s: _groups(rp) for s, rp in senders.items()}
    taken = {q: _groups(rp) for q, rp in takers.items()}
    for s in sources:
        for q, group in sent[s].items():
            assert taken[q][s] == group, (s, q)
    # one bucket at a time, rendezvous per pair
    orders = {("t", s): [rp.peer_of(b.index) for b in rp.plan.buckets] for s, rp in senders.items()}
    orders |= {("r", q): [rp.peer_of(b.index) for b in rp.plan.buckets] for q, rp in takers.items()}
    circle = _circle_of_waits(orders)
    assert circle is None, circle


def _circle_of_waits(orders):
    """Move ``orders`` (each rank's peers, bucket by bucket: ``("t", s)`` a trainer rank's
    receivers, ``("r", q)`` a receiver rank's trainers) one blocking rendezvous at a time;
    None when every rank finishes, else what each rank still waits for (a circle)."""
    todo = {rank: list(peers) for rank, peers in orders.items()}
    while any(todo.values()):
        pair = next(
            (
                (s, q)
                for (side, s), peers in todo.items()
                if side == "t" and peers
                for q in [peers[0]]
                if todo.get(("r", q)) and todo[("r", q)][0] == s
            ),
            None,
        )
        if pair is None:
            return {k: v[:3] for k, v in todo.items() if v}
        todo[("t", pair[0])].pop(0)
        todo[("r", pair[1])].pop(0)
    return None


def test_the_deadlock_simulation_finds_a_circle_of_waits_in_a_planted_order():
    """The simulation above can fail: two trainer ranks and two receiver ranks where each
    side starts from the other's second peer wait in a circle (t0 -> r0 -> t1 -> r1 -> t0);
    the rotated orders the plans use finish."""
    rotated = {("t", 0): [0, 1], ("t", 1): [1, 0], ("r", 0): [0, 1], ("r", 1): [1, 0]}
    assert _circle_of_waits(rotated) is None
    planted = {("t", 0): [0, 1], ("t", 1): [1, 0], ("r", 0): [1, 0], ("r", 1): [0, 1]}
    assert _circle_of_waits(planted) == planted


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=12), st.integers(1, 6))
def test_replicated_holders_share_the_bytes_within_one_fragment_of_the_balanced_share(sizes, ranks):
    """Every trainer rank holds every whole tensor (verl hands whole tensors to each rank):
    each sends a balanced share, the most loaded NIC within one fragment of total / ranks."""
    specs = [TensorSpec(f"t{i}", (n, 3), "float32") for i, n in enumerate(sizes)]
    holders = [Layout.whole(specs, f"t{r}") for r in range(ranks)]
    route = plan_route(specs, holders, [Layout.whole(specs, "r0")])
    sent = nic_bytes(route, holders, [Layout.whole(specs, "r0")])
    total, largest = sum(s.nbytes for s in specs), max(s.nbytes for s in specs)
    assert max(v["sent"] for v in sent.values()) <= math.ceil(total / ranks) + largest


def test_sharded_holders_each_send_only_their_shard_to_tensor_parallel_receivers():
    """FSDP2 (Shard(0) over 2 ranks) to a replica of 2 column-parallel ranks: each trainer
    rank sends exactly its shard, each receiver rank takes exactly its slice."""
    spec = TensorSpec("w", (8, 6), "bfloat16")
    holders = _layouts(spec.shape, (2,), [Shard(0)], host_of=lambda i: f"t{i}")
    needs = _layouts(spec.shape, (2,), [Shard(1)], host_of=lambda i: f"r{i}")
    route = plan_route([spec], holders, needs)
    assert route.sent_bytes() == {0: spec.nbytes // 2, 1: spec.nbytes // 2}
    assert route.received_bytes() == {0: spec.nbytes // 2, 1: spec.nbytes // 2}
    assert len(route.fragments) == 4  # each trainer shard crosses each receiver slice


def _blocking_makespan(senders, takers):
    """Bytes until the last rank is done when every rank moves its plan's buckets one at a
    time, in order, a bucket taking both its ends for its bytes (NICs of one rate)."""
    todo = {("t", s): list(rp.plan.buckets) for s, rp in senders.items()}
    todo |= {("r", q): list(rp.plan.buckets) for q, rp in takers.items()}
    peer = {("t", s): rp.peer_of for s, rp in senders.items()} | {
        ("r", q): rp.peer_of for q, rp in takers.items()
    }
    free = dict.fromkeys(todo, 0)
    while any(todo.values()):
        for s in senders:
            t = ("t", s)
            if not todo[t]:
                continue
            r = ("r", peer[t](todo[t][0].index))
            if todo[r] and peer[r](todo[r][0].index) == s:
                end = max(free[t], free[r]) + todo[t][0].nbytes
                free[t] = free[r] = end
                todo[t].pop(0)
                todo[r].pop(0)
                break
        else:
            raise AssertionError("a circle of waits")
    return max(free.values())


def test_four_fsdp2_ranks_to_two_tensor_parallel_ranks_keep_the_busiest_receiver_nic_busy_throughout():
    """The bench's LLM shape (256 MiB, 64 MiB buckets), 4 FSDP2-like trainer ranks to 2
    tensor-parallel ranks: pairs are unequal (a trainer rank's rows of a column-parallel
    tensor lie in one rank's half), yet moved one bucket at a time in the order every rank
    follows, the last rank is done when the busiest receiver NIC has moved its bytes. (In
    round order alone, a receiver rank idles while its next trainer rank finishes a larger
    pair: 8% longer.)"""
    from weightsync.bench import models
    from weightsync.sharding.fragments import receiver_plan, trainer_plan
    from weightsync.sharding.typical import replica_boxes, trainer_boxes

    specs = models.synthetic_specs("llm", 256, "bfloat16")
    holders = [Layout(trainer_boxes(specs, 4, t), f"t{t}") for t in range(4)]
    needs = [Layout(replica_boxes(specs, 2, r), f"r{r}") for r in range(2)]
    route = plan_route(specs, holders, needs)
    senders = {s: trainer_plan(route, s, 64 << 20) for s in range(4)}
    takers = {q: receiver_plan(route, q, 64 << 20) for q in range(2)}
    busiest = max(route.received_bytes().values())
    assert _blocking_makespan(senders, takers) == busiest


def test_a_steady_job_is_offered_the_route_hash_only_and_a_rank_that_lacks_it_gets_it_in_full():
    """The offer carries every layout until each peer answered the route's hash; then only
    the hash. A rank whose layout changed, or a new one that never held the route, answers
    with its layout and the sync is offered again in full."""
    from weightsync.sharding.agreement import RECEIVER, TRAINER, Agreement, RouteOffer

    spec = TensorSpec("w", (8, 6), "float32")
    holders = _layouts(spec.shape, (2,), [Shard(0)], host_of=lambda i: f"t{i}")
    needs = _layouts(spec.shape, (2,), [Shard(1)], host_of=lambda i: f"r{i}")
    offer = RouteOffer()
    ranks = {(TRAINER, 1): Agreement(TRAINER, 1 << 20), (RECEIVER, 0): Agreement(RECEIVER, 1 << 20)}
    ranks[(RECEIVER, 1)] = Agreement(RECEIVER, 1 << 20)
    own = {(TRAINER, 1): holders[1], (RECEIVER, 0): needs[0], (RECEIVER, 1): needs[1]}

    def sync() -> tuple[dict, list]:
        rounds = []
        while True:
            fields = offer.fields([spec], holders[0], [0, 1], 2)
            answers = [(side, r, a.answer(fields, r, own[(side, r)])) for (side, r), a in ranks.items()]
            rounds.append(fields)
            if not offer.take([(side, r, reply) for side, r, (_, reply) in answers]):
                assert all(part is not None for _, _, (part, _) in answers)
                return fields, rounds

    first, rounds = sync()
    assert len(rounds) == 2 and "needs" in first  # layouts learned, then the route agreed
    steady, rounds = sync()
    assert rounds == [{"hash": first["hash"], "compact": True}]
    ranks[(RECEIVER, 1)] = Agreement(RECEIVER, 1 << 20)  # a restarted receiver rank
    again, rounds = sync()
    assert [("compact" in r) for r in rounds] == [True, False] and again["hash"] == first["hash"]
    assert sync()[1] == [{"hash": first["hash"], "compact": True}]


def test_a_needed_byte_no_rank_holds_and_overlapping_holders_are_refused_naming_the_tensor():
    spec = TensorSpec("lm_head", (4, 4), "float32")
    half = Layout({"lm_head": Box((0, 0), (2, 4))})
    with pytest.raises(RouteError, match=r"'lm_head'.*8 elements no trainer rank holds"):
        plan_route([spec], [half], [Layout.whole([spec])])
    skewed = Layout({"lm_head": Box((1, 0), (2, 4))})
    with pytest.raises(RouteError, match=r"'lm_head'.*overlap"):
        plan_route([spec], [half, skewed], [Layout.whole([spec])])


@pytest.mark.parametrize("delta", ["on", "auto"])
def test_sharded_refuses_delta_at_configuration_and_wire_dtype_before_a_sync(delta):
    """docs/sharded.md, "Not yet": ``delta`` is refused when the configuration is made;
    ``wire_dtype`` (given to the ``Sender`` or to one ``send``) when a sync is asked for,
    before anything waits for a peer or moves."""
    from weightsync import ConfigError, EngineConfig, Sender

    with pytest.raises(ConfigError, match=rf"backend=sharded with delta='{delta}': .*set delta=off"):
        EngineConfig.from_overrides(["backend=sharded", f"delta={delta}"])
    config = EngineConfig.from_overrides(["backend=sharded", "timeout_s=5"])
    weights = {"w": torch.ones(4, 4)}
    with Sender(config, "127.0.0.1:0", 1, wire_dtype=torch.bfloat16) as sender:
        with pytest.raises(ValueError, match="sends each shard in its own dtype: cast the model"):
            sender.send(weights, version=1)
    with Sender(config, "127.0.0.1:0", 1) as sender:
        with pytest.raises(ValueError, match="sends each shard in its own dtype: cast the model"):
            sender.send(weights, version=1, wire_dtype=torch.bfloat16)


# ------------------------------------------------ real DTensors: FSDP2 and tensor parallelism
def _gloo_rank(body, rank: int, world: int, port: int, queue, *args) -> None:
    """A rank of a Gloo world of ``world`` ranks on loopback: puts ``(rank, body(rank, *args))``,
    or ``(rank, repr(error))``, on ``queue``."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        queue.put((rank, body(rank, *args)))
    except BaseException as e:
        queue.put((rank, repr(e)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_dtensor_boxes(rank: int) -> dict:
    """A rank of 2: an FSDP2 model and a column/row-parallel one; for every parameter,
    whether its local shard is the box ``box_of_dtensor`` names of the full tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from weightsync.sharding.layout import box_of_dtensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    fsdp = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))  # 7 and 3 rows: uneven
    fully_shard(fsdp, mesh=mesh)
    tp = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    found = {}
    for prefix, model in (("fsdp", fsdp), ("tp", tp)):
        for name, p in model.named_parameters():
            box = box_of_dtensor(p)
            whole = p.full_tensor()
            sliced = whole[tuple(slice(s, s + n) for s, n in zip(box.starts, box.lengths))]
            local = p.to_local()
            found[f"{prefix}.{name}"] = (box.to_wire(), torch.equal(local, sliced))
    return found


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_box_of_dtensor_names_each_ranks_local_shard_of_fsdp2_and_tensor_parallel_parameters():
    from procs import CTX, collect, free_port, start, stop

    queue, port = CTX.Queue(), free_port()
    procs = [start(_gloo_rank, _report_dtensor_boxes, rank, 2, port, queue) for rank in range(2)]
    try:
        reports = dict(collect(queue, 2, timeout=90))
    finally:
        stop(procs)
    assert all(isinstance(r, dict) for r in reports.values()), reports
    for rank, found in reports.items():
        assert len(found) == 8, found
        wrong = {name: box for name, (box, ok) in found.items() if not ok}
        assert not wrong, f"rank {rank}: local shards that are not the named box: {wrong}"
    # the uneven FSDP2 split (3 rows over 2 ranks: 2 and 1) and a row-parallel Shard(1)
    boxes = {rank: {name: box for name, (box, _) in found.items()} for rank, found in reports.items()}
    assert boxes[0]["fsdp.1.weight"] == [[0, 0], [2, 7]] and boxes[1]["fsdp.1.weight"] == [[2, 0], [1, 7]]
    assert boxes[1]["tp.2.weight"] == [[0, 3], [4, 2]]


# ------------------------------------------------ fragments between real processes
class _Collectives:
    """Counts collectives on the given process groups while entered: c10d's (``dist.all_gather``,
    a group's ``broadcast``) and the functional ones DTensor issues (``full_tensor``,
    ``redistribute``), named by op. The engine's own links are other groups: not counted."""

    def __init__(self, *groups) -> None:
        self.names = {g.group_name for g in groups}
        self.seen: list[str] = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional") and outer._on_ours(
                    [*args, *(kwargs or {}).values()]
                ):
                    outer.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _on_ours(self, args) -> bool:
        for a in args:
            if isinstance(a, str) and a in self.names:  # functional collectives name their group
                return True
            if type(a).__name__ == "ScriptObject":  # c10d's pass the group itself
                try:
                    if torch.distributed.ProcessGroup.unbox(a).group_name in self.names:
                        return True
                except RuntimeError:
                    pass
        return False


class _Tiny(torch.nn.Module):
    """Every kind of tensor a tensor-parallel replica keeps: a vocab-parallel embedding,
    column- and row-parallel projections (the row-parallel bias replicated), an uneven
    column split (7 rows over 2 ranks), and a norm no rank splits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 8)
        self.head = torch.nn.Linear(8, 7, bias=False)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        return self.head(h + self.down(torch.relu(self.up(h))))


def _gather_bytes(data: bytes, world: int) -> list[bytes]:
    """Every rank's ``data`` (msgpack bytes here), over the default group: no pickle."""
    import torch.distributed as dist

    size = torch.tensor([len(data)])
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    found = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(found, mine)
    return [bytes(t[: int(n.item())].tolist()) for t, n in zip(found, sizes)]


def _session_rank(rank: int, folder: str, port: int, links: str) -> dict:
    """Ranks 0-1: an FSDP2 trainer (``Sender``, backend ``sharded``); ranks 2-3: one replica,
    tensor-parallel over 2 ranks (``Receiver.load_into``: receiver ranks 0-1); rank 4: a
    receiver that declares nothing (``Receiver.receive``: whole tensors, receiver rank 2).
    Three AdamW versions through the session, over ``links`` (``engine_kwargs.sharded.links``)."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate as Rep
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from weightsync import EngineConfig, Receiver, Sender
    from weightsync.sharding.fragments import local_shards

    trainers = 2
    trainer_mesh = DeviceMesh("cpu", [0, 1])  # every rank builds both meshes, in order
    replica_mesh = DeviceMesh("cpu", [2, 3])
    config = EngineConfig.from_overrides(
        [
            "backend=sharded",
            "update_weights_bucket_megabytes=1",
            "timeout_s=60",
            f"engine_kwargs.sharded.links={links}",
        ]
    )
    address = f"127.0.0.1:{port}"
    torch.manual_seed(0)
    model = _Tiny()
    if rank < trainers:
        fully_shard(model, mesh=trainer_mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        peer = Sender(config, address, num_receivers=3, rank=rank, num_trainers=trainers)
    else:
        torch.manual_seed(rank)  # the replicas start from other weights than the trainer's
        model = _Tiny()
        if rank < 4:
            plan = {
                "embed": RowwiseParallel(input_layouts=Rep()),
                "up": ColwiseParallel(),
                "down": RowwiseParallel(),
                "head": ColwiseParallel(),
            }
            parallelize_module(model, replica_mesh, plan)
        peer = Receiver(config, address, rank=rank - trainers)
    shards = local_shards(model)
    report = {"sent": [], "taken": [], "wire": [], "links": [], "exact": [], "collectives": []}
    for version in (1, 2, 3):
        if rank < trainers:
            ids = torch.arange(6).remainder(10).view(2, 3) + version
            model(ids).square().mean().backward()
            optim.step()
            optim.zero_grad()
            # every collective on the trainer mesh (or the world) during the sync: a gather
            # of any kind (full_tensor, redistribute to Replicate, an all_gather) shows here
            with _Collectives(trainer_mesh.get_group(), dist.group.WORLD) as collectives:
                stats = peer.send(model, version)
            report["collectives"] += collectives.seen
            report["sent"].append(stats.wire_bytes)  # counted by the transport as it posts
            full = {n: p.full_tensor() for n, p in model.state_dict().items()}  # the check, not the sync
            if rank == 0:
                save_file(full, f"{folder}/v{version}.safetensors")
        elif rank < 4:
            stats = peer.load_into(model, version)
            report["taken"].append(stats.bytes)
            report["wire"].append(stats.wire_bytes)  # the buckets the transport handed over
            report["links"].append(peer._transport.received_bytes)  # the pieces its links took
        else:
            got = dict(peer.receive(version))
            model.load_state_dict(got)
            report["taken"].append(peer.last_stats.bytes)
            report["wire"].append(peer.last_stats.wire_bytes)
            report["links"].append(peer._transport.received_bytes)
            report["names"] = sorted(got)
        assert peer.version == version if rank >= trainers else True
        dist.barrier()
        if rank >= trainers:
            expect = load_file(f"{folder}/v{version}.safetensors")
            state = model.state_dict()
            got = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in state.items()}
            report["exact"].append({n: torch.equal(got[n], expect[n]) for n in expect})
        dist.barrier()
    peer.close()
    report["kept"] = sum(s.tensor.numel() * s.tensor.element_size() for s in shards.values())
    return report


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("links", LINKS)
def test_fsdp2_shards_reach_a_tensor_parallel_replica_slice_by_slice_and_a_whole_replica_bit_exact(
    tmp_path, links
):
    """``backend=sharded`` through the session: FSDP2 on 2 trainer ranks -> one replica
    tensor-parallel over 2 ranks, and one receiver that declares nothing, in the same sync:
    three AdamW versions, each trainer rank sending fragments of its local shard (no
    collective on the trainer mesh during a send: no gather of any kind), every kept slice
    bit-exact against the trainer's saved full tensors, every receiver rank taking exactly
    the bytes it keeps (the whole one: every tensor), the bytes counted on the wire at both
    ends agreeing.
    Over Gloo pairs, and over Mooncake one-sided writes (``links=mooncake``)."""
    from procs import CTX, collect, free_port, start, stop

    queue, port, address_port = CTX.Queue(), free_port(), free_port()
    procs = [
        start(_gloo_rank, _session_rank, rank, 5, port, queue, str(tmp_path), address_port, links)
        for rank in range(5)
    ]
    try:
        reports = dict(collect(queue, 5, timeout=150))
    finally:
        stop(procs)
    assert all(isinstance(r, dict) for r in reports.values()), reports
    for rank in (2, 3, 4):
        report = reports[rank]
        assert len(report["exact"]) == 3
        for version, exact in enumerate(report["exact"], 1):
            wrong = [n for n, ok in exact.items() if not ok]
            assert not wrong and len(exact) == 8, f"rank {rank}, version {version}: {wrong}"
    whole = sum(p.numel() * 4 for p in _Tiny().parameters())
    assert reports[4]["names"] == sorted(n for n, _ in _Tiny().named_parameters())
    assert reports[4]["kept"] == whole and reports[2]["kept"] + reports[3]["kept"] < 1.2 * whole
    for rank in (2, 3, 4):  # exactly its slices, each byte once
        assert reports[rank]["taken"] == [reports[rank]["kept"]] * 3, rank
    for rank in (0, 1):  # the sync never gathers: no collective on the trainer mesh at all
        assert reports[rank]["collectives"] == [], (rank, reports[rank]["collectives"])
    # Bytes counted on the wire, at both ends: each trainer rank's transport counts what it
    # posts (rank 0's figure adds the others' reports), each receiver's what its transport
    # handed over. Every bucket crosses once (no chains here): the two ends agree, each
    # receiver takes its slices plus at most the alignment of its pieces (64 bytes each),
    # and each trainer rank sends about half. A bucket sent twice, or dropped, breaks these.
    for v in range(3):
        total = reports[0]["sent"][v]
        assert total == sum(reports[r]["wire"][v] for r in (2, 3, 4)), (v, total, reports)
        for rank in (2, 3, 4):
            kept = reports[rank]["kept"]
            assert kept <= reports[rank]["wire"][v] < kept + 64 * 16, (rank, v, reports[rank]["wire"], kept)
            # what its links took, piece by piece, is what its transport handed over
            assert reports[rank]["links"] == reports[rank]["wire"], (rank, reports[rank])
        assert 0.4 * total < reports[1]["sent"][v] < 0.6 * total, (v, reports[1]["sent"], total)


SHARDED = ["backend=sharded", "update_weights_bucket_megabytes=1", "timeout_s=30"]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("links", LINKS)
def test_whole_holders_share_the_sends_and_a_trainer_rank_dying_mid_transfer_is_named(links):
    """Over Gloo pairs and over Mooncake writes (``engine_kwargs.sharded.links``): two trainer ranks that each hold every whole tensor (what verl hands a backend) and
    three receivers that declare nothing (one chain): each trainer rank sends about half,
    every receiver gets every tensor bit-exact. Trainer rank 1 crashing mid-transfer fails
    the sync on rank 0 naming it, within seconds (timeout_s is 30); receivers keep version 1
    or say the sync of version 2 failed; with a new trainer rank 1, version 3 is exact."""
    import time

    import workers
    from procs import CTX, collect, start, stop

    from weightsync import EngineConfig, Sender, SyncError

    q = CTX.Queue()
    overrides = [*SHARDED, f"engine_kwargs.sharded.links={links}"]
    receivers = 3
    with Sender(
        EngineConfig.from_overrides(overrides), "127.0.0.1:0", receivers, rank=0, num_trainers=2
    ) as sender:
        procs = [
            start(workers.run_receiver, sender.address, r, overrides, [1, 2, 3], q, None, False, True)
            for r in range(receivers)
        ]
        procs.append(
            start(
                workers.run_sharded_backend_trainer, sender.address, 1, 2, overrides, receivers, [1, 2], q, 2
            )
        )
        try:
            stats = sender.send(workers.make_weights(1), version=1)
            reports = collect(q, receivers + 1)
            (trainer,) = [r for r in reports if isinstance(r[0], tuple)]
            weights = workers.make_weights(1)
            model = sum(t.numel() * t.element_size() for t in weights.values())
            assert stats.bytes == receivers * model  # every receiver took every tensor once
            # Counted on the wire (rank 0's figure adds rank 1's): the chain's first receiver
            # takes each byte once from the trainer ranks, plus at most each fragment's
            # alignment (64 bytes; a tensor is split at most once between 2 ranks), and rank 1
            # sends about half. A bucket sent twice breaks it.
            assert model <= stats.wire_bytes < model + 64 * 2 * len(weights), (stats.wire_bytes, model)
            assert 0.3 * model < trainer[2] < 0.7 * model, (trainer, model)  # rank 1's share
            for rank, version, digests, held in (r for r in reports if not isinstance(r[0], tuple)):
                assert (version, held, digests) == (1, 1, workers.expected_digests(1)), rank
            t0 = time.monotonic()
            with pytest.raises(SyncError, match="trainer rank 1") as err:
                sender.send(workers.make_weights(2), version=2)
            assert time.monotonic() - t0 < 15, err.value  # noticed, not waited out
            for rank, version, digests, held in collect(q, receivers):
                if version == "error":  # failed it: keeps version 1 (torn where slices landed)
                    assert held == 1 and "version 2" in digests, (rank, digests)
                else:
                    assert (version, held, digests) == (2, 2, workers.expected_digests(2))
            procs.append(
                start(workers.run_sharded_backend_trainer, sender.address, 1, 2, overrides, receivers, [3], q)
            )
            sender.send(workers.make_weights(3), version=3)
            reports = collect(q, receivers + 1)
            for rank, version, digests, held in (r for r in reports if not isinstance(r[0], tuple)):
                assert (version, held, digests) == (3, 3, workers.expected_digests(3)), rank
        finally:
            stop(procs)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("links", LINKS)
def test_verify_names_the_fragments_damaged_on_the_wire_and_the_retry_is_exact(monkeypatch, links):
    """``verify=crc32`` with two trainer ranks and two receivers in a chain, over Gloo pairs
    and over Mooncake writes: each receiver
    rank checks the buckets of its own plan against the checksums their trainer ranks took.
    A byte of trainer rank 0's first bucket flipped on the wire: both receivers (the chain
    passes the bucket on) fail the version naming that bucket's fragments; the same version
    sent again, undamaged, is exact."""
    import workers
    from procs import CTX, collect, start, stop

    from weightsync import EngineConfig, Sender, SyncError

    overrides = [
        "backend=corrupting-sharded",
        "custom_backend_module=faulty_engine",
        "verify=crc32",
        "update_weights_bucket_megabytes=1",
        "timeout_s=30",
        f"engine_kwargs.sharded.links={links}",
    ]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2, rank=0, num_trainers=2) as sender:
        procs = [
            start(workers.run_resilient_receiver, sender.address, r, overrides, [1, 1], q) for r in range(2)
        ]
        procs.append(
            start(workers.run_sharded_backend_trainer, sender.address, 1, 2, overrides, 2, [1, 1], q)
        )
        try:
            monkeypatch.setenv("WEIGHTSYNC_TEST_CORRUPT", "0")  # only this process, trainer rank 0
            with pytest.raises(SyncError) as failure:
                sender.send(workers.make_weights(1), version=1)
            message = str(failure.value)
            for r in (0, 1):
                assert f"receiver rank {r}: version 1 failed verification (crc32) in 1 bucket(s)" in message
            assert "tensors affected: " in message and "@[" in message, message  # fragments by name
            reports = collect(q, 3)
            assert sorted(r[1] for r in reports if not isinstance(r[0], tuple)) == ["error", "error"], reports
            monkeypatch.delenv("WEIGHTSYNC_TEST_CORRUPT")
            sender.send(workers.make_weights(1), version=1)
            reports = collect(q, 3)
            for rank, version, digests, held in (r for r in reports if not isinstance(r[0], tuple)):
                assert (version, held, digests) == (1, 1, workers.expected_digests(1)), rank
        finally:
            stop(procs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensor_parallel_receivers_list_what_no_trainer_has_refuse_layouts_without_a_route_and_report_torn():
    """docs/sharded.md's promises to receivers that keep slices (declared, as a TP rank of a
    replica; 2 trainer ranks holding whole tensors, 2 receiver ranks):
    version 1: each slice exact, and a kept tensor no trainer rank has is in ``stats.missing``;
    version 2: trainer rank 0 holds only rows of the embedding, overlapping rank 1's whole
    one: the layouts make no route, and the sync is aborted on every rank naming that tensor,
    before a byte is written (not torn); version 3: trainer rank 1 dies mid-transfer: every
    receiver that did not take all its fragments keeps version 1, ``torn`` where slices of
    version 3 landed; version 4,
    with a new trainer rank 1, is exact and clears ``torn``."""
    import workers
    from procs import CTX, collect, start, stop

    from weightsync import EngineConfig, Sender, SyncError
    from weightsync.sharding.typical import held

    q = CTX.Queue()
    extra = {"extra.weight": (3, 5)}

    def receivers(n):
        got = sorted(r for r in collect(q, n) if not isinstance(r[0], tuple))
        assert [r[0] for r in got] == [0, 1], got
        return got

    with Sender(EngineConfig.from_overrides(SHARDED), "127.0.0.1:0", 2, rank=0, num_trainers=2) as sender:
        procs = [
            start(workers.run_slice_receiver, sender.address, r, SHARDED, [1, 2, 3, 4], q, extra)
            for r in range(2)
        ]
        procs.append(
            start(workers.run_sharded_backend_trainer, sender.address, 1, 2, SHARDED, 2, [1, 2, 3], q, 3)
        )
        try:
            sender.send(workers.make_weights(1), version=1)
            for rank, version, digests, missing, held_v, failed, torn in receivers(3):
                assert (version, missing, held_v, torn) == (1, ["extra.weight"], 1, False), rank
                assert digests == workers.slice_digests(1, rank), rank
            state = workers.make_weights(2)
            boxes = {n: Box.whole(tuple(t.shape)) for n, t in state.items()}
            boxes["embed.weight"] = Box((0, 0), (100, 512))
            with pytest.raises(SyncError, match=r"'embed\.weight'") as err:
                sender.send(held(state, boxes), version=2)
            reports = collect(q, 3)
            (trainer,) = [r for r in reports if isinstance(r[0], tuple)]
            assert trainer[1] == "error" and "embed.weight" in trainer[2], trainer
            for rank, version, digests, message, held_v, failed, torn in sorted(
                r for r in reports if not isinstance(r[0], tuple)
            ):
                assert version == "error" and "embed.weight" in message, (rank, message, err.value)
                assert (held_v, torn, digests) == (1, False, workers.slice_digests(1, rank)), rank
            with pytest.raises(SyncError, match="trainer rank 1"):
                sender.send(workers.make_weights(3), version=3)
            landed = []
            for rank, version, digests, message, held_v, failed, torn in receivers(2):
                if version == 3:  # it took all its fragments before the loss
                    assert (held_v, torn, digests) == (3, False, workers.slice_digests(3, rank)), rank
                    continue
                assert version == "error" and "version 3" in message, (rank, message)
                assert (held_v, failed) == (1, 3), rank
                # torn wherever a slice holds bytes of version 3 (also where a receive was only
                # posted straight into a slice: it may have written some)
                changed = digests != workers.slice_digests(1, rank)
                assert torn or not changed, (rank, torn, changed)
                landed.append(torn)
            procs.append(start(workers.run_sharded_backend_trainer, sender.address, 1, 2, SHARDED, 2, [4], q))
            sender.send(workers.make_weights(4), version=4)
            for rank, version, digests, missing, held_v, failed, torn in receivers(3):
                assert (version, missing, held_v, torn) == (4, ["extra.weight"], 4, False), rank
                assert digests == workers.slice_digests(4, rank), rank
            assert any(landed), "no receiver was left torn by version 3: torn was not put to the test"
        finally:
            stop(procs)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("links", LINKS)
def test_with_drop_lost_receivers_a_lost_receiver_fails_the_sync_and_the_next_goes_to_the_others(links):
    """docs/reliability.md, ``sharded`` with ``drop_lost_receivers=true`` (2 trainer ranks,
    3 receivers that declare nothing: one chain; over Gloo pairs and over Mooncake writes):
    receiver 1, the middle of the chain, exits abruptly after its first tensor of version 2.
    The route is every trainer rank's, so it
    is not rebuilt around the loss in the same sync: the sync fails on rank 0 naming the
    lost receiver, which rank 0 drops by itself; version 3 is planned for the two others and
    reaches them bit-exact, both trainer ranks sending, with no ``remove_receiver``. A new
    receiver under a rank no one had (3, as ``VLLMRollout.add_replica`` gives) then takes
    version 4 with them. In version 5 receiver 2, now the middle of the chain 0, 2, 3 (group
    rank 2: its place among the members, not its rank), exits the same way: receiver 3,
    whose link from it closed, fails naming it by its rank (over Mooncake links, where the
    link's error names the peer; Gloo's does not)."""
    import time

    import workers
    from procs import CTX, collect, start, stop

    from weightsync import EngineConfig, PeerLost, Sender

    q = CTX.Queue()
    overrides = [*SHARDED, "drop_lost_receivers=true", f"engine_kwargs.sharded.links={links}"]
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 3, rank=0, num_trainers=2) as sender:
        procs = [
            start(workers.run_receiver, sender.address, 0, overrides, [1, 2, 3, 4, 5], q, None, False, True),
            start(workers.run_receiver, sender.address, 1, overrides, [1, 2], q, 1, False, True, 2),
            start(workers.run_receiver, sender.address, 2, overrides, [1, 2, 3, 4, 5], q, 1, False, True, 5),
            start(
                workers.run_sharded_backend_trainer, sender.address, 1, 2, overrides, 3, [1, 2, 3, 4, 5], q
            ),
        ]
        try:
            sender.send(workers.make_weights(1), version=1)
            assert sorted(str(r[1]) for r in collect(q, 4)) == ["1"] * 4
            t0 = time.monotonic()
            with pytest.raises(PeerLost, match=r"receiver rank 1 \(pid \d+, 127\.0\.0\.1:\d+\)") as err:
                sender.send(workers.make_weights(2), version=2)
            assert time.monotonic() - t0 < 15  # noticed, not waited out (timeout_s is 30)
            assert "the next sync goes to receiver rank(s) [0, 2]" in str(err.value)
            assert err.value.ranks == [1] and sender.receivers == [0, 2]
            procs[1].join(timeout=10)
            assert procs[1].exitcode == 9
            for rank, version, *rest in collect(q, 3):  # failed it, or took all of it first
                if version == "error":
                    assert "version 2" in rest[0] and (rank == ("trainer", 1) or rest[1] == 1), rest
                else:
                    assert (version, rest) == (2, [workers.expected_digests(2), 2]), rank
            stats = sender.send(workers.make_weights(3), version=3)  # no remove_receiver, on any rank
            model = sum(t.numel() * t.element_size() for t in workers.make_weights(3).values())
            assert stats.receivers == 2 and stats.bytes == 2 * model
            reports = collect(q, 3)
            (trainer,) = [r for r in reports if isinstance(r[0], tuple)]
            assert trainer[1] == 3 and trainer[2] > 0, trainer  # trainer rank 1 sent its part
            got = sorted(r for r in reports if not isinstance(r[0], tuple))
            assert got == [(r, 3, workers.expected_digests(3), 3) for r in (0, 2)]
            sender.add_receiver(3)
            procs.append(
                start(workers.run_receiver, sender.address, 3, overrides, [4, 5], q, None, False, True)
            )
            stats = sender.send(workers.make_weights(4), version=4)
            assert stats.receivers == 3 and sender.receivers == [0, 2, 3]
            reports = collect(q, 4)
            got = sorted(r for r in reports if not isinstance(r[0], tuple))
            assert got == [(r, 4, workers.expected_digests(4), 4) for r in (0, 2, 3)]
            with pytest.raises(PeerLost, match=r"receiver rank 2 \(pid \d+") as err:
                sender.send(workers.make_weights(5), version=5)
            assert err.value.ranks == [2] and sender.receivers == [0, 3]
            reports = {rank: rest for rank, *rest in collect(q, 3)}
            version, message, held = reports[3]  # its link from receiver 2 closed mid-version
            assert (version, held) == ("error", 4) and "version 5" in message, message
            if links == "mooncake":
                assert "receiver rank 2 closed its link (mooncake)" in message, message
        finally:
            stop(procs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("links", LINKS)
def test_receivers_carry_their_links_over_what_trainer_rank_0_names(links):
    """``engine_kwargs.sharded.links`` is trainer rank 0's choice: a receiver configured for
    the other links (receiver 0; receiver 1 as the sender) joins the sender's and takes
    every version bit-exact, as ``nccl``'s receivers follow the sender's topology."""
    import workers
    from procs import CTX, collect, start, stop

    from weightsync import EngineConfig, Sender

    q = CTX.Queue()
    ours = [*SHARDED, f"engine_kwargs.sharded.links={links}"]
    other = [*SHARDED, f"engine_kwargs.sharded.links={'collective' if links == 'mooncake' else 'mooncake'}"]
    with Sender(EngineConfig.from_overrides(ours), "127.0.0.1:0", 2) as sender:
        procs = [
            start(workers.run_receiver, sender.address, 0, other, [1, 2], q),
            start(workers.run_receiver, sender.address, 1, ours, [1, 2], q),
        ]
        try:
            for v in (1, 2):
                sender.send(workers.make_weights(v), version=v)
                for rank, version, digests, held in collect(q, 2):
                    assert (version, held, digests) == (v, v, workers.expected_digests(v)), rank
        finally:
            stop(procs)


#: the pieces of a Mooncake link in ``test_mooncake_links_wait_while_a_socket_buffer_is_full``:
#: a 16 MiB bucket is then 256 pieces, so 3 buckets posted ahead are 768 frames each way,
#: as many frames per posted byte as 2048 MiB buckets of 1 MiB pieces have
SMALL_PIECE = 64 << 10


def _small_link_frames(patch, direction: str) -> None:
    """Mooncake links of this process from now on: pieces of ``SMALL_PIECE``, and the
    sockets of the frames going ``direction`` ("post": receiver to trainer, "landed": back)
    with the smallest buffers the kernel allows (about 100 frames, where 768 may be
    unread). ``patch(owner, name, value)`` sets an attribute (``monkeypatch.setattr``, or
    ``setattr`` in a child process)."""
    import socket

    from weightsync.engines import mooncake_links, nccl

    # (sending end's socket, receiving end's): the buffer each fills going ``direction``
    sending, receiving = {
        "post": (socket.SO_RCVBUF, socket.SO_SNDBUF),
        "landed": (socket.SO_SNDBUF, socket.SO_RCVBUF),
    }[direction]

    def shrink(sock: socket.socket, option: int) -> None:
        sock.setsockopt(socket.SOL_SOCKET, option, 1)  # the kernel raises it to its minimum

    def endpoint(init):
        def opened(self, *args, **kwargs):
            init(self, *args, **kwargs)
            shrink(self.listener, receiving)  # receiving ends' sockets inherit it on accept

        return opened

    def end(init, option):
        def opened(self, endpoint, sock, *args, **kwargs):
            shrink(sock, option)
            init(self, endpoint, sock, *args, **kwargs)

        return opened

    for module in (nccl, mooncake_links):
        patch(module, "CHUNK_BYTES", SMALL_PIECE)
    patch(mooncake_links._Endpoint, "__init__", endpoint(mooncake_links._Endpoint.__init__))
    patch(mooncake_links._Sending, "__init__", end(mooncake_links._Sending.__init__, sending))
    patch(mooncake_links._Receiving, "__init__", end(mooncake_links._Receiving.__init__, receiving))


def _big_buckets(version: int) -> dict[str, torch.Tensor]:
    """``workers.make_weights`` plus six 16 MiB tensors: a 16 MiB bucket each."""
    import workers

    g = torch.Generator().manual_seed(version)
    return {
        **workers.make_weights(version),
        **{f"extra.{i}": torch.randn(1 << 22, generator=g) for i in range(6)},
    }


def _receiver_of_small_link_frames(address, rank, overrides, versions, queue, direction):
    """``workers.run_receiver`` over ``_small_link_frames``, its consumer holding the first
    bucket of each version 0.5 s: the trainer writes the posted buckets' pieces meanwhile,
    and says so in LANDED frames no one reads."""
    import time

    import workers

    from weightsync.engines.sharded import ShardedEngine

    _small_link_frames(setattr, direction)
    recv = ShardedEngine.recv_buckets

    def holding(self, *args, **kwargs):
        for i, item in enumerate(recv(self, *args, **kwargs)):
            yield item
            if i == 0:
                time.sleep(0.5)

    ShardedEngine.recv_buckets = holding
    workers.run_receiver(address, rank, overrides, versions, queue)


@pytest.mark.mooncake
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("direction", ["post", "landed"])
def test_mooncake_links_wait_while_a_socket_buffer_is_full_and_every_version_is_exact(monkeypatch, direction):
    """A Mooncake link's frames (a POST per piece from the receiver, a LANDED per piece
    back) fill the socket buffers of their direction (``_small_link_frames``: up to 768 of
    them unread, where about 100 fit), as the kernel's default buffers fill at the default
    2048 MiB buckets. "post": the receiver keeps 4 buckets posted, the trainer reads a POST
    per piece it writes. "landed": the receiver's consumer holds a bucket while the trainer
    writes the 3 buckets posted after it. A full buffer waits; it is not a peer that "closed
    its link". Two versions to one receiver, bit-exact."""
    import workers
    from procs import CTX, collect, start, stop

    from weightsync import EngineConfig, Sender

    _small_link_frames(monkeypatch.setattr, direction)
    overrides = [
        "backend=sharded",
        "update_weights_bucket_megabytes=16",
        "timeout_s=30",
        "engine_kwargs.sharded.links=mooncake",
    ]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        procs = [start(_receiver_of_small_link_frames, sender.address, 0, overrides, [1, 2], q, direction)]
        try:
            for v in (1, 2):
                weights = _big_buckets(v)
                stats = sender.send(weights, version=v)
                assert stats.buckets >= 6, stats
                expected = {n: workers.digest(t.contiguous()) for n, t in weights.items()}
                ((rank, version, digests, held),) = collect(q, 1)
                assert (version, held) == (v, v), digests
                assert digests == expected
        finally:
            stop(procs)
