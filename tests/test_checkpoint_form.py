"""The checkpoint form of transformers MoE models: what the trainer sends is exactly what
``save_pretrained`` writes (names, shapes, bytes: gate/up order, every expert), as views of
the model's own stacks; a receiver holding the fused form lands it in views of its own, and
a sync that leaves one expert out says so."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from weightsync import EngineConfig, ModuleSink, Receiver, Sender
from weightsync.sources import CheckpointSource, ModuleSource, as_source
from weightsync.wire.checkpoint import is_converted

SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts_per_tok=2,
)
# Two families whose experts transformers 5 fuses, one with a shared expert beside them.
FAMILIES = {
    "qwen3_moe": dict(num_experts=6, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80),
}


def moe_model(family: str, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # every expert distinct and far from the others: a mix-up shows
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.add_(torch.arange(p.shape[0], dtype=p.dtype).view(-1, *[1] * (p.dim() - 1)))
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_form_is_save_pretrained_exactly_as_views(family, tmp_path):
    model = moe_model(family)
    assert is_converted(model)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    src = as_source(model)
    assert isinstance(src, CheckpointSource)
    sent = dict(src.tensors())
    assert list(sent) == [s.name for s in src.specs()]  # specs tell the order it yields
    assert sorted(sent) == sorted(saved)
    for name, tensor in sent.items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name
    stacks = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies = [n for n, t in sent.items() if t.untyped_storage().data_ptr() not in stacks]
    assert copies == []  # every piece a view: no expert stack copied to send it
    assert any(".experts.0." in n for n in sent) and not any(n.endswith("gate_up_proj") for n in sent)


def test_module_form_on_request_and_dense_models_unchanged():
    model = moe_model("qwen3_moe")
    assert isinstance(as_source(model, form="module"), ModuleSource)
    assert any(s.name.endswith("experts.gate_up_proj") for s in as_source(model, form="module").specs())
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **SHAPE))
    assert not is_converted(dense) and not isinstance(as_source(dense), CheckpointSource)
    with pytest.raises(ValueError, match="form 'fused'"):
        as_source(model, form="fused")


@pytest.mark.parametrize("form", ["checkpoint", "module"])
def test_fused_receiver_takes_either_form_bit_exact(form):
    config = EngineConfig()  # naive: the session's checks in one process
    trainer, rollout = moe_model("qwen3_moe", seed=1), moe_model("qwen3_moe", seed=2)
    with (
        Sender(config, f"moe-{form}", num_receivers=1, form=form) as sender,
        Receiver(config, f"moe-{form}", 0) as receiver,
    ):
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(version)
            sender.send(trainer, version=version)
            stats = receiver.load_into(rollout, version=version)
            assert stats.missing == []
            for (n, a), (_, b) in zip(trainer.state_dict().items(), rollout.state_dict().items()):
                assert torch.equal(a, b), n


def test_fused_receiver_names_a_stack_one_expert_short():
    trainer, rollout = moe_model("qwen3_moe", seed=1), moe_model("qwen3_moe", seed=2)
    sink = ModuleSink(rollout)
    for name, tensor in as_source(trainer).tensors():
        if name != "model.layers.1.mlp.experts.3.up_proj.weight":
            sink.load(name, tensor)
    assert sink.missing() == ["model.layers.1.mlp.experts.gate_up_proj"]


def _fsdp2_rank(rank: int, folder: str, port: int, backend: str, family: str) -> dict:
    """Ranks 0-1: an FSDP2 trainer of an MoE (``Shard(0)`` of each expert stack: half the
    experts a rank), sending over ``nccl`` (Gloo here; rank 0 sends, rank 1 gathers with
    it) or ``sharded`` (each rank its own experts' matrices); rank 2: a receiver loading
    into its own fused model. Two versions."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    config = EngineConfig.from_overrides(
        [f"backend={backend}", "update_weights_bucket_megabytes=1", "timeout_s=60"]
    )
    address = f"127.0.0.1:{port}"
    mesh = DeviceMesh("cpu", [0, 1])  # every rank builds it, in order
    if rank < 2:
        model = moe_model(family, seed=1)
        fully_shard(model, mesh=mesh)
        peer = Sender(config, address, num_receivers=1, rank=rank, num_trainers=2)
    else:
        model = moe_model(family, seed=2)
        peer = Receiver(config, address, rank=0)
    exact, names, sent = [], [], []
    for version in (1, 2):
        if rank < 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(version)
            stats = peer.send(model, version)
            names.append(stats.tensors)
            sent.append(stats.bytes)
            full = {n: t.full_tensor() for n, t in model.state_dict().items()}
            if rank == 0:
                save_file(full, f"{folder}/v{version}.safetensors")
        else:
            stats = peer.load_into(model, version)
            names.append(stats.missing)
        dist.barrier()
        if rank == 2:
            expect = load_file(f"{folder}/v{version}.safetensors")
            exact.append([n for n, t in model.state_dict().items() if not torch.equal(t, expect[n])])
        dist.barrier()
    peer.close()
    return {"exact": exact, "names": names, "sent": sent}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("backend", "family"), [("nccl", "qwen3_moe"), ("sharded", "mixtral")])
def test_fsdp2_trainer_sends_each_expert_matrix_bit_exact(tmp_path, backend, family):
    """FSDP2 shards each expert stack over the trainer ranks; the dense route gathers one
    layer at a time (every rank in the same order) and sends each expert's matrices; the
    sharded route sends each rank's own experts' matrices, cut from its shard (Mixtral: the
    checkpoint renames the fused parent too)."""
    from procs import CTX, collect, free_port, start, stop
    from test_sharding import _gloo_rank

    queue, port, address_port = CTX.Queue(), free_port(), free_port()
    procs = [
        start(_gloo_rank, _fsdp2_rank, rank, 3, port, queue, str(tmp_path), address_port, backend, family)
        for rank in range(3)
    ]
    try:
        reports = dict(collect(queue, 3, timeout=150))
    finally:
        stop(procs)
    assert all(isinstance(r, dict) for r in reports.values()), reports
    pieces = as_source(moe_model(family)).specs()
    if backend == "nccl":
        assert reports[0]["names"] == [len(pieces), len(pieces)]  # each expert's matrices, not the stacks
    else:  # each expert's matrices whole from the rank holding it, the rest half from each rank
        experts = sum(1 for s in pieces if ".experts." in s.name)
        whole = sum(math.prod(s.shape) * 4 for s in pieces)
        assert reports[0]["names"] == [experts + 2 * (len(pieces) - experts)] * 2
        assert reports[0]["sent"] == [whole, whole]  # rank 0's figure: every rank's fragments
        assert reports[1]["sent"] == [whole // 2, whole // 2]  # its own half: its experts, its rows
    assert reports[2]["names"] == [[], []]  # nothing of the fused model left unwritten
    assert reports[2]["exact"] == [[], []]
