"""A real vLLM (CPU build) replica under expert parallelism: tensor parallelism 2 with
``enable_expert_parallel``, the demo's Qwen3-MoE (6 experts), synced over ``sharded``.

Each worker declares the experts its own layers keep (their ``ExpertMapManager``'s map,
``weightsync.integrations.vllm_experts``), so the trainer sends each worker only its
experts; what each worker holds after every version equals vLLM's own load of the trainer's
``save_pretrained`` into the same replica. vLLM 0.32's CPU build starts such an engine but
its second worker dies at the first forward (exit -11), so nothing here generates: the
bytes are the check (tokens from one need two GPUs: docs/moe.md).
"""

from __future__ import annotations

import pytest
import torch

from weightsync.demo.vllm import save_tiny_model, start_replica, vllm_environment
from weightsync.demo.vllm_checks import reload_matches
from weightsync.integrations.vllm_replicas import LLMReplica
from weightsync.integrations.vllm_rollout import VLLMRollout
from weightsync.sharding.experts import Slots, expert_of

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(400)]

EXPERTS = 6  # the demo's --arch moe


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    vllm_environment(tp=2)
    folder = save_tiny_model(str(tmp_path_factory.mktemp("ep") / "model"), seed=5, arch="moe")
    llm = start_replica(folder, max_model_len=128, tensor_parallel_size=2, enable_expert_parallel=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rollout = VLLMRollout(
        [LLMReplica(llm, "ep")],
        ["backend=sharded", "update_weights_bucket_megabytes=1", "timeout_s=60"],
        model=model,
    )
    yield llm, model, rollout, folder
    rollout.close()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def test_an_expert_the_model_lacks_is_named_by_the_worker_that_was_sent_it(replica):
    """Under expert parallelism a worker skips the experts other ranks keep; an expert id
    the model does not have is no rank's, and the update fails naming it. (First in the
    module: the worker has derived its slices of the model's tensors only.)"""
    from weightsync.integrations.replicas.reports import ReplicaUpdateError
    from weightsync.sources import as_source

    llm, model, rollout, folder = replica
    state = dict(as_source(model).tensors())
    unknown = f"model.layers.0.mlp.experts.{EXPERTS}.up_proj.weight"
    state[unknown] = state["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    with pytest.raises(ReplicaUpdateError) as info:
        rollout.update(state, 1)
    (rep,) = info.value.report.replicas
    assert unknown in (rep.error or ""), rep.error
    report = rollout.update(model, 2)  # the next complete version is taken
    assert report.ok, report.summary()


def test_each_worker_takes_only_the_experts_its_map_keeps_and_holds_what_vllm_loads(replica, tmp_path):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    llm, model, rollout, folder = replica
    workers = rollout.slices["ep"]
    assert len(workers) == 2
    for rank, worker in enumerate(workers):  # vLLM's own placement, asked independently
        held = Slots.of_expert_map([0, 1], determine_expert_map(2, rank, EXPERTS, "linear")[1].tolist())
        asked = {expert_of(n) for n in worker["boxes"] if expert_of(n) is not None}
        assert asked == {(layer, e) for layer in (0, 1) for e in held.layers[layer]}, (rank, sorted(asked))
        assert not worker["whole_tensors"], worker["whole_tensors"]  # every tensor it keeps, by its loaders
    gen = torch.Generator().manual_seed(3)
    for version in (3, 4):
        with torch.no_grad():  # every expert's bytes this version's own
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        report = rollout.update(model, version)
        assert report.ok, report.summary()
        (rep,) = report.replicas
        # each worker took exactly what it keeps: its attention slices and its own experts
        assert rep.worker_bytes == rep.worker_kept_bytes == [w["kept_bytes"] for w in workers], rep
        # every worker's tensors equal its own reload of save_pretrained (raises naming them);
        # at the first version the reload is shown to write
        disk = str(tmp_path / f"v{version}")
        experts = reload_matches(llm, model.state_dict(), folder, disk, first=version == 3)
        assert len(experts) == 4, experts
