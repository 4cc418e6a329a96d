"""Experts where the engine keeps them (docs/moe.md, "Expert parallelism"): each rank of an
expert-parallel replica declares the slots it holds, laid out by vLLM's own placement code
(``determine_expert_map``, linear and round robin; EPLB's rebalancing policy with redundant
experts), and ``sharded`` sends each expert's matrices only to the ranks whose slots hold
it, once per rank, landing in every slot that holds it. A map that changed after a rank
answered fails that rank's version naming the layer and the expert, before any expert byte
lands; the next sync routes by the new map."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_form import FAMILIES as CHECKPOINT_FAMILIES
from test_checkpoint_form import SHAPE as CHECKPOINT_SHAPE

from weightsync.plan import TensorSpec
from weightsync.sharding.experts import Slots, expert_boxes, expert_of

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]  # vLLM's placement code lays the slots out

EXPERTS, EP, REPLICAS, PHYSICAL = 8, 4, 2, 12
# the checkpoint-form tests' tiny Qwen3-MoE, with 8 experts (4 ranks keep 2 each)
SHAPE = {**CHECKPOINT_SHAPE, **CHECKPOINT_FAMILIES["qwen3_moe"], "num_experts": EXPERTS}
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _model(seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SHAPE), dtype=torch.float32)
    with torch.no_grad():  # every expert far from the others: a mix-up shows
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.add_(torch.arange(p.shape[0], dtype=p.dtype).view(-1, *[1] * (p.dim() - 1)))
    return model


def test_slots_read_vllms_maps_and_a_rank_needs_exactly_its_experts():
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    linear = [
        Slots.of_expert_map([0, 1], determine_expert_map(EP, r, EXPERTS, "linear")[1].tolist())
        for r in range(EP)
    ]
    assert [s.layers[1] for s in linear] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for experts, ep in (
        (8, 4),
        (10, 4),
        (3, 2),
        (128, 8),
    ):  # the bench's and the estimate's placement is vLLM's
        for r in range(ep):
            vllm = determine_expert_map(ep, r, experts, "linear")[1].tolist()
            assert Slots.linear([5], experts, ep, r) == Slots.of_expert_map([5], vllm), (experts, ep, r)
    spread = [
        Slots.of_expert_map([0], determine_expert_map(EP, r, EXPERTS, "round_robin")[1].tolist())
        for r in range(EP)
    ]
    assert [s.layers[0] for s in spread] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    load = torch.rand(2, EXPERTS, generator=torch.Generator().manual_seed(0))
    table = DefaultEplbPolicy.rebalance_experts(load, PHYSICAL, 1, 1, EP).tolist()
    balanced = [Slots.of_physical(dict(enumerate(table)), r, EP, EXPERTS) for r in range(EP)]
    for layer in (0, 1):  # every logical expert in some slot; the slots split evenly
        assert sorted({e for s in balanced for e in s.layers[layer]}) == list(range(EXPERTS))
        assert [len(s.layers[layer]) for s in balanced] == [PHYSICAL // EP] * EP
    specs = [
        TensorSpec(f"model.layers.{layer}.mlp.experts.{e}.{m}.weight", (48, 64), "float32")
        for layer in (0, 1)
        for e in range(EXPERTS)
        for m in ("gate_proj", "up_proj")
    ] + [TensorSpec("model.layers.0.mlp.gate.weight", (EXPERTS, 64), "float32")]
    for r, s in enumerate(spread):
        got = {expert_of(n) for n in expert_boxes(specs[:16], s)}
        assert got == {(0, e) for e in (r, r + EP)}, r
    assert "model.layers.0.mlp.gate.weight" not in expert_boxes(specs, linear[0])  # a router: not an expert's
    with pytest.raises(ValueError, match=r"experts\.9\..*layer 0, expert 9: the engine has 8 experts"):
        expert_boxes(
            [TensorSpec("model.layers.0.mlp.experts.9.up_proj.weight", (48, 64), "float32")], linear[0]
        )
    # a vLLM worker refuses an update once EPLB moved an expert from where vLLM's loader lands it
    from weightsync.integrations.vllm_experts import moved

    initial = [list(range(EXPERTS)) + list(range(PHYSICAL - EXPERTS))] * 2
    assert moved(initial, [3, 7], PHYSICAL - EXPERTS) is None
    first = (
        next(i for i, (a, b) in enumerate(zip(table[1], initial[1])) if a != b)
        if table[0] == initial[0]
        else None
    )
    where = moved(table, [3, 7], PHYSICAL - EXPERTS)
    assert where is not None and where.startswith(
        "layer 3" if first is None else f"layer 7 physical slot {first}"
    )
    assert balanced[0].changed(balanced[0]) is None
    moved = Slots({**balanced[0].layers, 1: (7, *balanced[0].layers[1][1:])}, EXPERTS)
    assert (
        balanced[0].changed(moved)
        == f"layer 1 slot 0 held expert {balanced[0].layers[1][0]} and holds expert 7 now"
    )


class _Engine:
    """A rank's expert slots as an engine keeps them: per MoE layer, fused stacks of its
    slots (transformers' layout, one row per slot), and the map; a rebalance re-lays the
    slots (the bytes of an expert it keeps move with it, a new one starts from zeros)."""

    def __init__(self, model: torch.nn.Module, slots: Slots) -> None:
        self.model, self.slots, self.stacks = model, slots, {}
        self.pending: Slots | None = None  # a rebalance to run right after this rank answers
        self.moved: dict[str, torch.Tensor] = {}  # the stacks as that rebalance left them
        for layer, held in slots.layers.items():
            for stack in STACKS:
                name = f"model.layers.{layer}.{stack}"
                shape = model.state_dict()[name].shape
                self.stacks[name] = torch.zeros((len(held), *shape[1:]))

    def rebalance(self, slots: Slots) -> None:
        stacks = {}
        for name, old in self.stacks.items():
            layer = int(name.split(".")[2])
            before, after = self.slots.layers[layer], slots.layers[layer]
            new = torch.zeros((len(after), *old.shape[1:]))
            for s, e in enumerate(after):
                if e in before:
                    new[s] = old[before.index(e)]
            stacks[name] = new
        self.slots, self.stacks = slots, stacks

    def views(self, slots: Slots):
        from weightsync.sharding.experts import slot_views

        assert slots == self.slots
        return slot_views(self.model, self.stacks, slots)


def _ep_rank(rank: int, folder: str, port: int, maps: dict) -> dict:
    """Ranks 0-1: an FSDP2 trainer (``Shard(0)``: 4 experts a rank) over ``sharded``, the
    checkpoint form; ranks 2-9: 2 replicas x 4 expert-parallel ranks (replica 0 linear,
    replica 1 round robin; from version 3 each replica's own EPLB map with 4 redundant
    slots), every rank holding the dense tensors whole (attention data-parallel). Version 4:
    receiver rank 5 rebalances right after it answers. Five versions."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from weightsync import EngineConfig, Receiver, Sender
    from weightsync.receiver.sharded_sink import ExpertSink
    from weightsync.sharding.fragments import local_shards

    config = EngineConfig.from_overrides(
        ["backend=sharded", "update_weights_bucket_megabytes=1", "timeout_s=30"]
    )
    address = f"127.0.0.1:{port}"
    mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it, in order
    report: dict = {"errors": {}, "wrong": {}, "taken": [], "kept": []}
    if rank < 2:
        model = _model(seed=1)
        fully_shard(model, mesh=mesh)
        peer = Sender(config, address, num_receivers=REPLICAS * EP, rank=rank, num_trainers=2)
    else:
        q = rank - 2
        model = _model(seed=2)
        engine = _Engine(model, maps[q][1])
        dense = {n: s for n, s in local_shards(model).items() if not n.endswith(STACKS)}

        class Rebalancing(ExpertSink):
            def layout(self, host, specs=None):
                out = super().layout(host, specs)
                if engine.pending is not None:  # the engine moves its experts after the answer
                    engine.rebalance(engine.pending)
                    engine.pending = None
                    engine.moved = {n: t.clone() for n, t in engine.stacks.items()}
                return out

        sink = Rebalancing(dense, lambda: engine.slots, engine.views)
        peer = Receiver(config, address, rank=q)
    for version in (1, 2, 3, 4, 5):
        if rank < 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(version)
            try:
                peer.send(model, version)
            except Exception as e:
                report["errors"][version] = str(e)
            full = {n: t.full_tensor() for n, t in model.state_dict().items()}
            if rank == 0:
                save_file(full, f"{folder}/v{version}.safetensors")
        else:
            if maps[q].get(version) is not None and maps[q][version] != engine.slots:
                if version == 4:
                    engine.pending = maps[q][version]
                else:
                    engine.rebalance(maps[q][version])
            try:
                stats = peer.load_into(sink, version)
                report["taken"].append(stats.bytes)
            except Exception as e:
                report["errors"][version] = str(e)
                report["unchanged"] = all(torch.equal(engine.moved[n], t) for n, t in engine.stacks.items())
        dist.barrier()
        if rank >= 2 and version not in report["errors"]:
            expect = load_file(f"{folder}/v{version}.safetensors")
            wrong = [n for n, s in dense.items() if not torch.equal(s.tensor, expect[n])]
            for name, stack in engine.stacks.items():
                layer = int(name.split(".")[2])
                for slot, e in enumerate(engine.slots.layers[layer]):
                    if not torch.equal(stack[slot], expect[name][e]):
                        wrong.append(f"{name}[slot {slot}: expert {e}]")
            report["wrong"][version] = wrong
            kept = sum(s.tensor.numel() * 4 for s in dense.values())
            for name, stack in engine.stacks.items():  # each distinct expert once
                layer = int(name.split(".")[2])
                kept += len(set(engine.slots.layers[layer])) * stack[0].numel() * 4
            report["kept"].append(kept)
        dist.barrier()
    peer.close()
    return report


@pytest.mark.slow
def test_each_expert_reaches_only_the_slots_that_hold_it_and_a_stale_map_fails_closed(tmp_path):
    from procs import CTX, collect, free_port, start, stop
    from test_sharding import _gloo_rank
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    layers = range(SHAPE["num_hidden_layers"])
    maps: dict[int, dict[int, Slots]] = {}
    for replica, strategy in enumerate(("linear", "round_robin")):
        gen = torch.Generator().manual_seed(replica)
        tables = [  # EPLB's policy on two rounds of expert loads: a rebalance between versions 3 and 4
            DefaultEplbPolicy.rebalance_experts(
                torch.rand(len(layers), EXPERTS, generator=gen), PHYSICAL, 1, 1, EP
            )
            for _ in range(2)
        ]
        for r in range(EP):
            start_map = determine_expert_map(EP, r, EXPERTS, strategy)[1].tolist()
            maps[replica * EP + r] = {
                1: Slots.of_expert_map(layers, start_map),
                3: Slots.of_physical(dict(enumerate(tables[0].tolist())), r, EP, EXPERTS),
                4: Slots.of_physical(dict(enumerate(tables[1].tolist())), r, EP, EXPERTS)
                if replica * EP + r == 3
                else None,
            }
    twice = [q for q, m in maps.items() for held in m[3].layers.values() if len(set(held)) < len(held)]
    assert twice, "no rank holds an expert in two slots: redundancy on one rank is untested"
    world = 2 + REPLICAS * EP
    queue, port, address_port = CTX.Queue(), free_port(), free_port()
    procs = [
        start(_gloo_rank, _ep_rank, rank, world, port, queue, str(tmp_path), address_port, maps)
        for rank in range(world)
    ]
    try:
        reports = dict(collect(queue, world, timeout=200))
    finally:
        stop(procs)
    assert all(isinstance(r, dict) for r in reports.values()), reports
    stale = 2 + 3  # receiver rank 3
    message = reports[stale]["errors"].get(4, "")
    assert "the engine's expert map changed after this rank answered" in message, reports[stale]["errors"]
    assert "layer " in message and "slot " in message, message
    assert reports[stale]["unchanged"], "an expert byte landed after the map changed"
    assert 4 in reports[0]["errors"] and "receiver" in reports[0]["errors"][4], reports[0]["errors"]
    for rank in range(2, world):
        versions = [v for v in (1, 2, 3, 4, 5) if v not in reports[rank]["errors"]]
        assert versions == ([1, 2, 3, 5] if rank == stale else [1, 2, 3, 4, 5]), (
            rank,
            reports[rank]["errors"],
        )
        for v in versions:
            assert reports[rank]["wrong"][v] == [], (rank, v, reports[rank]["wrong"][v][:4])
        # each expert's matrices once per rank, however many of its slots hold it
        assert reports[rank]["taken"] == reports[rank]["kept"], rank
