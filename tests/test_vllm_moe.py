"""A real vLLM (CPU build) replica of a mixture of experts (the demo's ``--arch moe``: a
Qwen3-MoE, 6 experts, top 2, 2 k/v heads, an expert width vLLM's CPU kernel pads 48 ->
64), fed by a trainer whose transformers model holds its experts fused: the trainer sends
each expert's matrices (the checkpoint form, ``weightsync.wire.checkpoint``), the replica
serves the trainer's tokens after every version, and an update the engine does not wholly
take fails naming the tensor. One replica for the module (about a minute to start). The
FSDP2 trainers and the tensor-parallel replica over ``sharded`` are the demo's doc
commands (test_doc_commands.py). Without vLLM, conftest.py skips them, or fails them in CI.
"""

from __future__ import annotations

import pytest
import torch
from vllm_planted import EXTENSION, importable

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
from weightsync.integrations.replicas.reports import ReplicaUpdateError
from weightsync.integrations.vllm_replicas import LLMReplica
from weightsync.integrations.vllm_rollout import VLLMRollout
from weightsync.sources import as_source

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(300)]

NEW = 8
OVERRIDES = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=60"]


class Setup:
    def __init__(self, tmp: str) -> None:
        from transformers import AutoModelForCausalLM

        vllm_environment()
        self.dir = save_tiny_model(f"{tmp}/model", seed=5, arch="moe")
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(11)
        with importable():  # weightsync's extension and its plants
            self.llm = start_replica(self.dir, max_model_len=128, worker_extension_cls=EXTENSION)
        self.rollout = VLLMRollout([LLMReplica(self.llm, "moe")], OVERRIDES)
        self.version = 0

    def train(self, perturb_experts: bool = False) -> list[list[int]]:
        before = trainer_greedy(self.model, PROMPTS, NEW)
        target = torch.randint(0, self.model.config.vocab_size, (NEW,), generator=self.gen).tolist()
        train_until_changed(self.model, self.optimizer, target, before, NEW)
        if perturb_experts:
            # Training moves an expert no token routes to by weight decay alone; noise on
            # every expert of every layer makes each one's bytes this version's own.
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if ".experts." in name:
                        p.add_(torch.randn(p.shape, generator=self.gen) * 1e-3)
        after = trainer_greedy(self.model, PROMPTS, NEW)
        assert after != before
        return after


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(str(tmp_path_factory.mktemp("moe")))
    yield s
    s.rollout.close()
    try:
        s.llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def test_three_versions_of_fused_experts_reach_the_replica_one_by_one_with_greedy_parity(setup, tmp_path):
    """Each version serves the trainer's tokens, and the replica's bytes (every expert
    layer's ``w13_weight``/``w2_weight`` as vLLM holds them: padded, prepacked) equal vLLM's
    own load of the trainer's ``save_pretrained`` into the same replica. The prompts route
    to a few experts; every expert's bytes change each version, so an expert left stale or
    two experts swapped, in a layer no prompt reaches, fails on the bytes."""
    names = [s.name for s in as_source(setup.model).specs()]
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    for _ in range(3):
        held = setup.llm.collective_rpc("weightsync_digests")[0]
        expected = setup.train(perturb_experts=True)
        setup.version += 1
        report = setup.rollout.update(setup.model, setup.version)
        assert report.ok, report.summary()
        assert replica_greedy(setup.llm, PROMPTS, NEW) == expected, f"version {setup.version}"
        synced = setup.llm.collective_rpc("weightsync_digests")[0]
        experts = [n for n in synced if n.endswith(("w13_weight", "w2_weight"))]
        assert len(experts) == 2 * setup.model.config.num_hidden_layers, sorted(synced)
        assert all(synced[n] != held[n] for n in experts), "an expert stack the version did not change"
        # the replica's tensors equal its own reload of save_pretrained (raises naming them);
        # at the first version the reload is shown to write
        disk = str(tmp_path / f"v{setup.version}")
        reload_matches(setup.llm, setup.model.state_dict(), setup.dir, disk, first=setup.version == 1)


def _refused(setup, state, *names, before=None, staged=False):
    """The update (``staged``: staged, then committed) fails naming ``names``; ``before``:
    refused before anything moved, the replica still serving that version (else a mix,
    reported), its bytes and greedy tokens as they were before the update (``state``
    carries other weights: nothing moved)."""
    held = setup.llm.collective_rpc("weightsync_digests")[0]
    tokens = replica_greedy(setup.llm, PROMPTS, NEW) if before is not None else None
    setup.version += 1
    with pytest.raises(ReplicaUpdateError) as info:
        setup.rollout.update(state, setup.version, staged=staged)
    (rep,) = info.value.report.replicas
    assert all(n in rep.error for n in names), rep.error
    assert (rep.ok, rep.version, rep.mixed) == (False, before, before is None), rep
    if before is not None:
        assert setup.llm.collective_rpc("weightsync_digests")[0] == held, "a refused version moved bytes"
        assert replica_greedy(setup.llm, PROMPTS, NEW) == tokens


def test_an_expert_update_the_engine_does_not_wholly_take_fails_naming_it(setup):
    """vLLM reports the parameters it wrote, and all experts of a layer are one parameter to
    it: a version missing one expert's matrix was a complete write of ``w13_weight``. Now it
    is refused before anything moves, naming the matrix (the replica serves what it had), and
    so is a misspelled one (named beside the matrix it hides); an expert the model lacks
    fails naming it once the loader took nothing of it. Staged, the version missing the matrix
    passes the stage and is refused at the commit, before the load, naming it; with that check
    planted off, the check after the load names it, the replica reporting a mix. The next complete
    version serves the trainer. The versions refused carry newly trained weights, so one
    that moved anything would show in the replica's bytes and tokens."""
    expected = setup.train()
    state = dict(as_source(setup.model).tensors())
    assert replica_greedy(setup.llm, PROMPTS, NEW) != expected
    left_out = "model.layers.1.mlp.experts.3.up_proj.weight"
    serving = setup.rollout.status()[0].version
    _refused(
        setup, {n: t for n, t in state.items() if n != left_out}, left_out, "does not carry", before=serving
    )
    renamed = "model.layers.0.mlp.experts.2.upp_proj.weight"
    swapped = {
        (renamed if n == "model.layers.0.mlp.experts.2.up_proj.weight" else n): t for n, t in state.items()
    }
    _refused(setup, swapped, renamed, "model.layers.0.mlp.experts.2.up_proj.weight", before=serving)
    # staged: the stage takes what is sent, and the commit checks it before the load
    without = {n: t for n, t in state.items() if n != left_out}
    _refused(setup, without, "commit refused before anything moved", left_out, before=serving, staged=True)
    # the check after the load, alone (the one before planted off): it names the matrix too,
    # the replica reporting the mix it then holds
    setup.llm.collective_rpc("plant_no_vet")
    try:
        _refused(setup, without, "did not carry 1 tensor(s) of the model's checkpoint", left_out)
    finally:
        setup.llm.collective_rpc("plant_no_vet", args=(False,))
    unknown = "model.layers.0.mlp.experts.6.up_proj.weight"  # 6 experts: ids 0-5
    first, *rest = state.items()
    _refused(setup, dict([first, (unknown, state[left_out]), *rest]), unknown)

    setup.version += 1
    report = setup.rollout.update(setup.model, setup.version)
    assert report.ok, report.summary()
    assert replica_greedy(setup.llm, PROMPTS, NEW) == expected
