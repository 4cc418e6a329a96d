"""Real vLLM (CPU build) tensor-parallel replicas of the MoE families transformers converts,
synced over ``sharded`` (Qwen3-MoE: the TP 2 demo line).

Mixtral's checkpoint names its experts after another parent than transformers 5 holds them
(``block_sparse_moe.experts.{e}.w1/w2/w3`` against fused ``mlp.experts`` stacks), so the
module form cannot reach vLLM ("no module named layers.0.mlp"); Qwen2-MoE has a shared
expert beside its routed ones. The checkpoint form, which ``sharded`` sends, reaches both:
each of 2 workers takes its half of every expert's matrices, serves the trainer's greedy
tokens after each version, and holds what vLLM's own reload of the trainer's
``save_pretrained`` holds: two versions through ``VLLMRollout``, the third through vLLM's own
trainer-side factory (``ModuleSource``).
"""

from __future__ import annotations

import pytest
import torch
from procs import free_port
from vllm_client import LLMClient

from weightsync.demo.vllm import (
    PROMPTS,
    replica_greedy,
    save_tiny_model,
    start_replica,
    train_until_changed,
    trainer_greedy,
    vllm_environment,
)
from weightsync.demo.vllm_checks import reload_matches
from weightsync.integrations.vllm_replicas import LLMReplica
from weightsync.integrations.vllm_rollout import VLLMRollout

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(400)]

NEW = 8
OVERRIDES = ["backend=sharded", "update_weights_bucket_megabytes=1", "timeout_s=60"]
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts_per_tok": 2}
FAMILIES = {
    "mixtral": (
        {"intermediate_size": 64, "num_local_experts": 4},
        "model.layers.1.block_sparse_moe.experts.3.w2.weight",
    ),
    "qwen2_moe": (
        {  # no head_dim of its own: 2 heads of 32 (vLLM's CPU attention takes multiples of 32)
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
        },
        "model.layers.1.mlp.shared_expert.down_proj.weight",
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_moe_family_reaches_a_tensor_parallel_replica_over_sharded_with_parity(tmp_path, family):
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    vllm_environment(tp=2)
    config, checkpoint_name = FAMILIES[family]
    folder = save_tiny_model(str(tmp_path / family), seed=7, model_type=family, **{**HEADS, **config})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert any(".mlp.experts." in n for n, _ in model.named_parameters())  # fused in memory
    llm = start_replica(
        folder, max_model_len=128, tensor_parallel_size=2, weight_transfer_config={"backend": "weightsync"}
    )
    rollout = VLLMRollout(
        [LLMReplica(llm, family)],
        OVERRIDES,
        model=model,
    )
    try:
        (workers,) = rollout.slices.values()
        names = set(workers[0]["boxes"])
        assert checkpoint_name in names, sorted(names)[:8]
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)  # no stack
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(5)
        for version in (1, 2):
            before = trainer_greedy(model, PROMPTS, NEW)
            target = torch.randint(0, model.config.vocab_size, (NEW,), generator=gen).tolist()
            train_until_changed(model, optimizer, target, before, NEW)
            expected = trainer_greedy(model, PROMPTS, NEW)
            report = rollout.update(model, version)
            assert report.ok, report.summary()
            (rep,) = report.replicas
            assert rep.worker_bytes == rep.worker_kept_bytes, rep  # each worker its slices, once
            assert sum(rep.worker_bytes) < 1.2 * sum(p.numel() * 4 for p in model.parameters())
            assert replica_greedy(llm, PROMPTS, NEW) == expected, f"version {version}"
            # every worker's tensors equal its own reload of save_pretrained (raises naming them)
            reload_matches(llm, model.state_dict(), folder, str(tmp_path / f"v{version}"), first=version == 1)
        rollout.close()
        # Version 3 through vLLM's own trainer-side factory (ModuleSource), over sharded too:
        # the same checkpoint names reach the workers, where the module form's fused stacks
        # would fail the load ("no module named layers.0.mlp" for Mixtral)
        train_until_changed(model, optimizer, target[::-1], expected, NEW)
        info = WeightsyncTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=3, rank=0, overrides=OVERRIDES
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=LLMClient(llm), source=ModuleSource(model)
        )
        try:
            engine.send_weights(version=3)
        finally:
            engine.shutdown()
        assert replica_greedy(llm, PROMPTS, NEW) == trainer_greedy(model, PROMPTS, NEW), "version 3"
        reload_matches(llm, model.state_dict(), folder, str(tmp_path / "v3"), first=False)
    finally:
        rollout.close()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
