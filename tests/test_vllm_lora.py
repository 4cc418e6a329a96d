"""LoRA-only sync into a real vLLM (CPU build) replica, from a real PEFT model.

One replica, started once with LoRA enabled for adapters of rank 4 (``max_loras=2``: the
new adapter and the one version kept for requests in flight; ``max_lora_rank`` 8, the next
value vLLM accepts). The trainer fine-tunes a PEFT LoRA on the tiny Qwen2 model the replica
loaded; each update moves only the adapter, from memory, and vLLM's greedy
output under the update's ``LoRARequest`` must equal the trainer's merged model's. The
checkpoint is float32 holding values bf16 holds exactly, so a trainer that keeps its base in
bf16 holds the same base.
"""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch
from procs import alive

from weightsync.demo.vllm import (
    PROMPTS,
    replica_greedy,
    save_tiny_model,
    start_replica,
    train_until_changed,
    trainer_greedy,
    vllm_environment,
)
from weightsync.integrations.replicas.reports import ReplicaUpdateError
from weightsync.integrations.vllm_lora import engine_lora_rank, start_for_rank
from weightsync.integrations.vllm_replicas import LLMReplica
from weightsync.integrations.vllm_rollout import VLLMRollout
from weightsync.lora import LoRAAdapter, base_weights, lora_adapter
from weightsync.sources import StateDictSource

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(240)]

NEW = 8
VOCAB = 5000
OVERRIDES = ["backend=shm", "update_weights_bucket_megabytes=1", "timeout_s=60"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4  # the replica's adapters: vLLM accepts no max_lora_rank of 4 (start_replica asks for 8)


def _peft(model_dir: str, rank: int, targets: list[str], base=None):
    """A PEFT LoRA over the checkpoint in ``model_dir`` (or over ``base``, a model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if base is None:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


def _train(model, seed: int) -> list[list[int]]:
    """Train the adapter until the greedy outputs change; the merged model's outputs."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    before = trainer_greedy(model, PROMPTS, NEW)
    target = torch.randint(0, VOCAB, (NEW,), generator=torch.Generator().manual_seed(seed)).tolist()
    train_until_changed(model, optimizer, target, before, NEW, max_iters=40)
    assert trainer_greedy(model, PROMPTS, NEW) != before
    merged = copy.deepcopy(model).merge_and_unload()
    return trainer_greedy(merged, PROMPTS, NEW)


#: a prompt spanning a full KV block (the replica's block size: vLLM's CPU default, 128)
LONG = [(37 * i + 11) % VOCAB for i in range(200)]


def _generate_long(llm, request) -> tuple[list[int], int]:
    """LONG's greedy tokens under ``request``'s adapter, and its prompt tokens reused from
    the prefix cache."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": LONG}], params, use_tqdm=False, lora_request=request)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _generate(llm, request, max_tokens: int = NEW) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=request
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _round_to_bf16(model_dir: str) -> None:
    """Store the checkpoint's float32 tensors as values bf16 holds exactly (still float32)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    save_file({n: t.to(torch.bfloat16).float() for n, t in tensors.items()}, path, metadata={"format": "pt"})


def _one_ulp_up(weight: torch.Tensor) -> None:
    """Move ``weight[0, 0]`` up by one ulp of its dtype, in place."""
    with torch.no_grad():
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf"), dtype=weight.dtype))


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    vllm_environment()
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("lora") / "model"), seed=3, vocab_size=VOCAB)
    _round_to_bf16(model_dir)
    llm = start_replica(model_dir, max_model_len=256, max_loras=2, lora_rank=RANK)
    yield model_dir, llm
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.timeout(360)  # four trained versions: 71 s on 2 idle cores, over 240 s on busy ones
def test_each_version_moves_only_the_adapter_and_serves_the_trainers_merged_outputs(replica):
    """Three versions of a rank-4 LoRA on a replica started for rank 4 (the third: rank 8,
    its max_lora_rank, on fewer modules, which vLLM serves as a new adapter): after each,
    greedy outputs under the report's LoRARequest equal the trainer's merged model's; only
    the adapter's bytes crossed; the base model serves as it did. A request of version N-1
    in flight while N loads finishes with N-1's adapter. Version 3 sent again with other
    weights under its name reuses no prefix-cached block of the earlier version 3."""
    from vllm import SamplingParams

    model_dir, llm = replica
    base_out = replica_greedy(llm, PROMPTS, NEW)
    model = _peft(model_dir, RANK, TARGETS)
    with VLLMRollout([LLMReplica(llm, "A")], OVERRIDES, lora_keep=1) as rollout:
        requests = []
        for version in (1, 2, 3):
            if version == 3:  # another rank and other target modules: a new adapter, served as such
                model = _peft(model_dir, 8, ["q_proj", "v_proj", "down_proj"])
            expected = _train(model, seed=version)
            adapter = lora_adapter(model)
            in_flight = None
            if requests:  # a long request on the previous version's adapter, running while this one loads
                long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
                llm.enqueue(
                    [{"prompt_token_ids": PROMPTS[0]}], long, use_tqdm=False, lora_request=requests[-1]
                )
            report = rollout.update(model, version, lora=True)
            if requests:
                in_flight = llm.llm_engine.has_unfinished_requests()
                (out,) = llm.wait_for_completion(use_tqdm=False)
                assert in_flight, "the long request ended before the new adapter loaded: it proves nothing"
                # the previous version's adapter, unchanged while the new one loaded beside it
                assert list(out.outputs[0].token_ids) == _generate(llm, requests[-1], 120)[0]
            assert report.ok and report.phase == "lora" and report.paused_s == 0, report.summary()
            assert report.stats.bytes == adapter.nbytes  # only the adapter moved
            assert report.stats.tensors == len(adapter.tensors)
            assert _generate(llm, report.lora_request) == expected, f"version {version}"
            assert report.lora_request.lora_name == f"weightsync-lora-v{version}"
            requests.append(report.lora_request)
        # slots rotate over lora_keep + 1 = 2 ids
        assert [r.lora_int_id for r in requests] == [1, 2, 1]
        # version 3 sent anew with other adapter weights (a restarted trainer's): vLLM's prefix
        # cache keys blocks by the adapter's name, the earlier version 3's, so the engine core
        # resets it: LONG reuses none of the earlier adapter's blocks
        tokens, _ = _generate_long(llm, requests[-1])
        assert _generate_long(llm, requests[-1]) == (tokens, 128)
        _train(model, seed=4)
        expected_long = trainer_greedy(copy.deepcopy(model).merge_and_unload(), [LONG], NEW)[0]
        assert expected_long != tokens
        report = rollout.update(model, 3, lora=True)
        assert report.ok and report.lora_request.lora_name == "weightsync-lora-v3", report.summary()
        assert _generate_long(llm, report.lora_request) == (expected_long, 0)
    assert replica_greedy(llm, PROMPTS, NEW) == base_out  # the base weights never changed


def test_a_base_model_one_ulp_off_the_replicas_checkpoint_is_refused_naming_the_tensor(replica):
    """One ulp in one tensor, in a trainer holding the base in float32 (the checkpoint's
    dtype) and in one holding it in bf16 (the checkpoint's values exactly, but one)."""
    from transformers import AutoModelForCausalLM

    model_dir, llm = replica
    name = "model.layers.0.mlp.up_proj.weight"
    for dtype in (torch.float32, torch.bfloat16):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model = _peft(model_dir, 8, TARGETS, base=base)
        _one_ulp_up(model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight)
        assert name in dict(base_weights(model))
        with VLLMRollout([LLMReplica(llm, "A")], OVERRIDES) as rollout:
            with pytest.raises(
                Exception,
                match=rf"not the checkpoint this replica loaded .*1 of \d+ tensors differ: {name} "
                rf"\(values differ \(trainer {dtype}, checkpoint torch.float32\)\)",
            ):
                rollout.update(model, 1, lora=True)


def test_a_trainer_holding_the_base_in_bf16_over_the_float32_checkpoint_of_its_values_passes(replica):
    """The base check compares values: the trainer's bf16 base is the replica's float32
    checkpoint (every value exact in bf16), so the adapter loads and serves, the base sent
    never."""
    from transformers import AutoModelForCausalLM

    model_dir, llm = replica
    model = _peft(
        model_dir, RANK, TARGETS, base=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    )
    assert {t.dtype for _, t in base_weights(model)} == {torch.bfloat16}
    with VLLMRollout([LLMReplica(llm, "A")], OVERRIDES) as rollout:
        report = rollout.update(model, 5, lora=True)  # between the versions of the tests above and below
        assert report.ok and report.stats.bytes == lora_adapter(model).nbytes, report.summary()
        # a fresh adapter adds nothing (PEFT's lora_B starts at zero): the base's outputs
        assert _generate(llm, report.lora_request) == replica_greedy(llm, PROMPTS, NEW)


def test_lora_keep_beyond_max_loras_and_a_rank_beyond_max_lora_rank_are_refused_before_anything_moves(
    replica,
):
    """Each names the replica, the limit, and what to start it with: for a rank-12 adapter
    max_lora_rank 16 (vLLM accepts no 12)."""
    model_dir, llm = replica
    with VLLMRollout([LLMReplica(llm, "A")], OVERRIDES, lora_keep=2) as rollout:
        with pytest.raises(
            ValueError, match=r"replica 'A': max_loras=2.* lora_keep=2 keeps 3 adapters loaded"
        ):
            rollout.update(_peft(model_dir, 8, TARGETS), 1, lora=True)
        rollout.lora_keep = 1
        with pytest.raises(
            ValueError,
            match=r"replica 'A': the adapter's rank 12 is above its max_lora_rank 8: "
            r"start it with max_lora_rank=16",
        ):
            rollout.update(_peft(model_dir, 12, TARGETS), 1, lora=True)


def test_the_engines_max_lora_rank_is_the_next_value_vllm_accepts():
    """vLLM's own config (no engine) refuses a max_lora_rank of 4; ``engine_lora_rank``
    gives one it accepts, the smallest that holds the adapter's rank."""
    from vllm.config.lora import LoRAConfig

    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=4)
    got = {rank: engine_lora_rank(rank) for rank in (1, 2, 4, 8, 12, 24, 320, 400)}
    assert got == {1: 1, 2: 8, 4: 8, 8: 8, 12: 16, 24: 32, 320: 320, 400: 512}
    for value in got.values():
        assert LoRAConfig(max_lora_rank=value).max_lora_rank == value
    with pytest.raises(ValueError, match="LoRA rank 1024: vLLM serves adapters up to max_lora_rank 512"):
        engine_lora_rank(1024)
    assert start_for_rank(1024).startswith("LoRA rank 1024: vLLM serves adapters up to")  # the check's advice


def test_a_failed_adapter_load_leaves_the_previous_adapter_serving(replica):
    """An adapter vLLM refuses (DoRA, which vLLM does not serve: found by the worker's own
    check, vLLM's ``PEFTHelper.validate_legal``, as the rollout checks only the engine's
    limits) fails the update naming the replica; the previous version's adapter still
    serves its outputs."""
    model_dir, llm = replica
    model = _peft(model_dir, 8, TARGETS)
    with VLLMRollout([LLMReplica(llm, "A")], OVERRIDES) as rollout:
        expected = _train(model, seed=11)
        # versions above the first test's: a worker refuses an adapter older than one it holds
        good = rollout.update(model, 11, lora=True).lora_request
        assert _generate(llm, good) == expected
        bad = lora_adapter(model)
        bad.config = {**bad.config, "use_dora": True}  # a feature vLLM does not serve
        with pytest.raises(ReplicaUpdateError, match=r"replica 'A' .*DoRA.*serves adapter version 11"):
            rollout.update(bad, 12, lora=True)
        assert _generate(llm, good) == expected


def test_a_full_update_keeps_the_adapters_serving_on_the_new_base(replica):
    """A full update makes vLLM drop every adapter. Before, a request naming one then ended
    the engine (vLLM looked for the placeholder path). Now the worker adds its adapters back
    from memory, applied to the new base, as vLLM's reload from a path would serve them:
    version 21's adapter is served over the base merged with it (version 22: the outputs the
    trainer's adapter gives over that base, its delta applied a second time, not that
    base's alone), a new adapter over that base (23) gives its trainer's outputs, and with
    the original base back (24) version 21's adapter gives its trainer's outputs again."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model_dir, llm = replica
    base_out = replica_greedy(llm, PROMPTS, NEW)
    torch.manual_seed(21)
    model = _peft(model_dir, 8, TARGETS)
    with VLLMRollout([LLMReplica(llm, "A")], OVERRIDES, lora_keep=1) as rollout:
        expected = _train(model, seed=21)  # differs from base_out: _train asserts it
        old = rollout.update(model, 21, lora=True).lora_request
        merged = copy.deepcopy(model).merge_and_unload()
        assert rollout.update(merged, 22).ok
        assert replica_greedy(llm, PROMPTS, NEW) == expected  # the new base: the merged model
        # The engine lives, and serves it over the new base: its delta applied again, as the
        # trainer's adapter over the merged base gives (an adapter added back empty, not
        # applied or otherwise scaled would not)
        twice = _peft(model_dir, 8, TARGETS, base=copy.deepcopy(merged))
        set_peft_model_state_dict(twice, get_peft_model_state_dict(model))
        again = trainer_greedy(twice.merge_and_unload(), PROMPTS, NEW)
        assert again != expected
        assert _generate(llm, old) == again
        fresh = _peft(model_dir, 8, TARGETS, base=copy.deepcopy(merged))
        fresh_out = _train(fresh, seed=23)
        assert _generate(llm, rollout.update(fresh, 23, lora=True).lora_request) == fresh_out
        original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert rollout.update(original, 24).ok
        assert _generate(llm, old) == expected  # version 21's adapter, over the base it was trained on
    assert replica_greedy(llm, PROMPTS, NEW) == base_out


@pytest.mark.mooncake
def test_a_replica_killed_mid_update_is_named_at_once_and_the_other_serves_the_new_adapter(replica):
    """Two replicas, mooncake with drop_lost_receivers: B's worker is SIGKILLed after the
    handshake, before the adapter's first tensor. The update raises within seconds naming
    B (its rank), and A serves the new adapter: the report's LoRARequest gives the merged
    model's outputs there. B left the rollout: the next update goes to A alone, at once."""
    model_dir, a = replica
    b = start_replica(model_dir, max_model_len=256, max_loras=2, lora_rank=RANK)
    victim = b.collective_rpc("weightsync_status")[0]["pid"]
    try:
        model = _peft(model_dir, 8, TARGETS)
        overrides = ["backend=mooncake", "drop_lost_receivers=true", "timeout_s=60"]
        with VLLMRollout([LLMReplica(a, "A"), LLMReplica(b, "B")], overrides) as rollout:
            rollout.update(model, 31, lora=True)  # the first one checks the base: a PEFT model's
            expected = _train(model, seed=21)
            adapter = lora_adapter(model)

            class KillingSource(StateDictSource):
                """The adapter; B's worker killed on the first pass, after the handshake, before
                the first tensor (the sender sends the version again to the others)."""

                def tensors(self):
                    if alive(victim):
                        os.kill(victim, signal.SIGKILL)
                        while alive(victim):
                            time.sleep(0.05)
                    yield from super().tensors()

            t0 = time.monotonic()
            with pytest.raises(ReplicaUpdateError, match=r"replica 'B' \(receiver rank 1\)") as info:
                rollout.update(LoRAAdapter(KillingSource(adapter.tensors), adapter.config), 32, lora=True)
            assert time.monotonic() - t0 < 15  # the lost connection named B, no deadline did
            report = info.value.report
            ra, rb = report.replicas
            assert (ra.name, ra.ok, ra.adapter) == ("A", True, 32), ra
            assert (rb.name, rb.ok, rb.left) == ("B", False, True), rb
            assert "replica 'B' (receiver rank 1)" in str(info.value) and "left the rollout" in str(
                info.value
            )
            assert _generate(a, report.lora_request) == expected
            assert [r.name for r in rollout.replicas] == ["A"] and rollout.sender.receivers == [0]
            expected = _train(model, seed=22)
            t0 = time.monotonic()
            report = rollout.update(model, 33, lora=True)
            assert report.ok and [r.name for r in report.replicas] == ["A"], report.summary()
            assert time.monotonic() - t0 < 15  # B is not waited for
            assert _generate(a, report.lora_request) == expected
    finally:
        try:
            b.llm_engine.engine_core.shutdown()
        except Exception:
            pass
