"""Real SGLang replicas (0.5.23, its CPU engine) fed by a trainer through weightsync: greedy
parity with the trainer after every version, SGLang's weight_version, a tensor SGLang's
loader does not take, a worker killed mid-update.

One engine is started for the module (about 30 s on 2 cores) and shared; the test that
kills its worker starts a second one, and the TP 2 test, last, its own (of a model whose
heads split over the ranks: ``TP2_MODEL``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from weightsync.demo.vllm import PROMPTS, save_tiny_model, train_until_changed, trainer_greedy
from weightsync.integrations.replicas.reports import ReplicaUpdateError
from weightsync.integrations.sglang import SGLangReplica, SGLangRollout, start_engine, versioned

pytestmark = [pytest.mark.timeout(300)]

NEW = 8
TIMEOUT_S = 30
OVERRIDES = ["backend=nccl", "update_weights_bucket_megabytes=1", f"timeout_s={TIMEOUT_S}"]


def greedy(engine, prompts=PROMPTS, new=NEW) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [list(o["output_ids"]) for o in outs]


#: The TP 2 replica's model: the demo's, with 4 query and 2 k/v heads (head size 32), so each
#: rank holds real heads. The demo's own (2 query heads, 1 k/v head) SGLang's CPU engine pads
#: at TP 2 to 4 and 2 (``adjust_config_with_unaligned_cpu_tp``: k/v heads padded to a multiple
#: of the ranks, 2 query heads per k/v head kept): rank 0 then holds every real head and rank
#: 1 only padding, zeros its loaders never write (its ``qkv_proj``/``o_proj`` digests equal
#: zeros' after every version), so rank 1's attention bytes could not show a wrong half.
TP2_MODEL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)


class Trainer:
    """A tiny model saved to ``<tmp>/model`` and its float32 trainer."""

    def __init__(self, tmp: str, **overrides) -> None:
        from transformers import AutoModelForCausalLM

        self.dir = save_tiny_model(os.path.join(tmp, "model"), seed=3, **overrides)
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(17)

    def train(self, target: list[int] | None = None) -> None:
        """Towards ``target`` (default: random tokens, which a model gets to only by
        weights throughout, so a TP rank holding a wrong slice would not produce them)."""
        if target is None:
            target = torch.randint(0, self.model.config.vocab_size, (NEW,), generator=self.gen).tolist()
        before = trainer_greedy(self.model, PROMPTS, NEW)
        # random targets take longer than constant ones to a loss with no near ties
        train_until_changed(self.model, self.optimizer, target, before, NEW, max_iters=600)


class Setup(Trainer):
    def __init__(self, tmp: str) -> None:
        super().__init__(tmp)
        self.engine = start_engine(self.dir)
        self.replica = SGLangReplica(self.engine, name="A")
        self.rollout = SGLangRollout([self.replica], OVERRIDES)
        self.version = 0

    def close(self) -> None:
        self.rollout.close()
        self.engine.shutdown()
        self.replica.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = Setup(str(tmp_path_factory.mktemp("sglang")))
    yield s
    s.close()


def matches_reload_from_disk(setup: Trainer, replica: SGLangReplica, disk: str) -> None:
    """``replica``'s bytes (each TP worker's) equal SGLang's own load of the trainer's
    ``save_pretrained`` into it; that load shown to write (from the first checkpoint every
    worker differs)."""
    synced = replica.call("weightsync_digests")
    replica.call("weightsync_reload_from_path", setup.dir)
    first = replica.call("weightsync_digests")
    assert all(f != s for f, s in zip(first, synced)), "the reload from disk wrote nothing"
    setup.model.save_pretrained(disk)
    replica.call("weightsync_reload_from_path", disk)
    for rank, (got, want) in enumerate(zip(synced, replica.call("weightsync_digests"))):
        assert got == want, f"TP rank {rank}: {sorted(n for n in want if got.get(n) != want[n])}"


def test_three_versions_greedy_parity(setup: Setup, tmp_path) -> None:
    """Each version the trainer sends is what SGLang serves: its greedy tokens equal the
    trainer's (float32 on both sides), SGLang's weight_version names it, and after the
    last its bytes equal SGLang's load of the trainer's checkpoint from disk."""
    assert greedy(setup.engine) == trainer_greedy(setup.model, PROMPTS, NEW)  # same checkpoint
    for _ in range(3):
        before = greedy(setup.engine)
        setup.train()
        expected = trainer_greedy(setup.model, PROMPTS, NEW)
        assert expected != before  # the version changes what is served
        setup.version += 1
        report = setup.rollout.update(setup.model, setup.version)
        assert report.ok, report.summary()
        assert [r.version for r in report.replicas] == [setup.version]
        assert greedy(setup.engine) == expected
        assert setup.replica.weight_version() == str(setup.version)
        assert [s["version"] for s in setup.replica.call("weightsync_status")] == [setup.version]
    matches_reload_from_disk(setup, setup.replica, str(tmp_path / "trained"))


def test_tensor_sglang_does_not_take_fails_naming_it(setup: Setup) -> None:
    """A tensor SGLang's loader skips (Qwen2's load_weights ignores unknown names) fails the
    update naming it; SGLang's weight_version is not moved to the failed version."""
    state = dict(setup.model.state_dict())
    state["model.layers.0.mlp.not_a_weight"] = torch.ones(4)
    served = setup.replica.weight_version()
    with pytest.raises(ReplicaUpdateError, match="model.layers.0.mlp.not_a_weight"):
        setup.rollout.update(state, setup.version + 1)
    assert setup.replica.weight_version() == served
    # the next whole version repairs it (the failed one left the replica a mix, paused)
    setup.version += 2
    report = setup.rollout.update(setup.model, setup.version)
    assert report.ok, report.summary()
    assert greedy(setup.engine) == trainer_greedy(setup.model, PROMPTS, NEW)


def test_parameter_left_unwritten_fails_naming_it(setup: Setup) -> None:
    """A full version that leaves a parameter of SGLang's model unwritten fails naming it,
    unless the caller says partial=True."""
    state = {k: v for k, v in setup.model.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ReplicaUpdateError, match="model.norm.weight"):
        setup.rollout.update(state, setup.version + 1)
    setup.version += 2
    report = setup.rollout.update(state, setup.version, partial=True)
    assert report.ok, report.summary()
    assert greedy(setup.engine) == trainer_greedy(setup.model, PROMPTS, NEW)


def test_an_update_whose_cache_flush_sglang_refuses_fails_and_the_next_one_flushes(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang flushes its cache (radix tree and KV pool) after loading a version only where no
    request holds it, and says so in the flag weightsync checks. Its own ``in_place`` pause
    leaves running requests in the batch (Miles #2782/#2783): the replica is paused that
    way here (weightsync pauses with ``retract``) while a request generates, and the update
    then fails, saying SGLang did not flush; the replica is reported a mix, kept paused with
    its request, and SGLang's weight_version stays. The next update, paused as weightsync
    pauses, flushes and resumes: the request finishes, and the replica serves the trainer's
    tokens."""
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    replica = setup.replica
    served = replica.weight_version()
    setup.train()
    started, out = threading.Event(), {}

    async def generate() -> None:
        params = {"temperature": 0.0, "max_new_tokens": 240, "ignore_eos": True}
        stream = await setup.engine.async_generate(input_ids=PROMPTS[0], sampling_params=params, stream=True)
        async for chunk in stream:
            started.set()  # in the running batch: it has tokens out, and ~240 to go
            out["last"] = chunk

    runner = threading.Thread(target=replica._run, args=(lambda tm: generate(),), daemon=True)
    runner.start()
    assert started.wait(60)
    monkeypatch.setattr(
        replica,
        "pause",
        lambda mode: replica._run(lambda tm: tm.pause_generation(PauseGenerationReqInput(mode="in_place"))),
    )
    with pytest.raises(ReplicaUpdateError, match="the cache was not flushed") as info:
        setup.rollout.update(setup.model, setup.version + 1)
    (rep,) = info.value.report.replicas
    assert (rep.ok, rep.version, rep.mixed, rep.resumed) == (False, None, True, False), rep
    assert replica.weight_version() == served
    assert runner.is_alive()  # paused, its request held
    monkeypatch.undo()
    setup.version += 2
    report = setup.rollout.update(setup.model, setup.version)
    assert report.ok and report.replicas[0].resumed, report.summary()
    runner.join(timeout=60)
    assert not runner.is_alive() and len(out["last"]["output_ids"]) == 240, out.get("last")
    assert greedy(setup.engine) == trainer_greedy(setup.model, PROMPTS, NEW)
    assert replica.weight_version() == str(setup.version)


def test_a_request_retracted_across_an_update_reports_sglangs_spans_at_the_exact_token(setup: Setup) -> None:
    """Versions v1 and v2 each emit a token of their own (t1, t2) whatever the prefix. A
    request admitted under v1 and kept across the update to v2 (weightsync's ``keep``:
    SGLang retracts it, and it recomputes its KV under v2) reads t1... t2...; the spans
    weightsync reads through from SGLang's own ``meta_info`` put v2's first token exactly
    where the tokens change. A fresh request reports v2 alone."""
    import workers

    replica, marks = setup.replica, (101, 202)
    v1, v2 = setup.version + 1, setup.version + 2
    setup.version = v2
    assert setup.rollout.update(workers.emitting(setup.model, marks[0]), v1).ok
    started, out = threading.Event(), {}

    async def generate() -> None:
        params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
        stream = await setup.engine.async_generate(input_ids=PROMPTS[0], sampling_params=params, stream=True)
        async for chunk in stream:
            if len(chunk["output_ids"]) >= 3:
                started.set()  # some tokens under v1, most still to come
            out["last"] = chunk

    runner = threading.Thread(target=replica._run, args=(lambda tm: generate(),), daemon=True)
    runner.start()
    assert started.wait(60)
    assert setup.rollout.update(workers.emitting(setup.model, marks[1]), v2, mode="keep").ok
    runner.join(timeout=60)
    got = versioned(out["last"])
    tokens = list(out["last"]["output_ids"])
    assert len(tokens) == 200
    ((first, a), (boundary, b)) = got.spans[0]
    assert (first, a, b) == (0, v1, v2) and 0 < boundary < 200, got.spans
    assert tokens == [marks[0]] * boundary + [marks[1]] * (200 - boundary), (boundary, tokens)
    assert got.token_versions() == [v1] * boundary + [v2] * (200 - boundary)
    (fresh,) = replica.generate([PROMPTS[1]], {"temperature": 0.0, "max_new_tokens": 4})
    assert fresh.spans == (((0, v2),),) and list(fresh.output["output_ids"]) == [marks[1]] * 4


def test_updates_an_sglang_replica_does_not_declare_are_refused_before_anything_moves(setup: Setup) -> None:
    """SGLang replicas take streamed updates only (no ``capabilities``, pause modes keep and
    abort): staged and LoRA updates, a KV-cache release, ``mode="wait"`` and a rollout
    configured ``update_mode=staged`` are refused naming the replica, before a pause or a
    byte: the replica serves what it served, at its version."""
    served, version = greedy(setup.engine), setup.replica.weight_version()
    refused = {
        r"staged updates: replica\(s\) 'A'": {"staged": True},
        r"LoRA updates: replica\(s\) 'A'": {"lora": True},
        r"release_kv_cache=True: replica\(s\) 'A'": {"release_kv_cache": True},
        r"mode='wait': replica\(s\) 'A' have no such pause mode": {"mode": "wait"},
    }
    for message, kwargs in refused.items():
        with pytest.raises(ValueError, match=message):
            setup.rollout.update(setup.model, setup.version + 1, **kwargs)
    with pytest.raises(ValueError, match="update_mode=staged"):
        SGLangRollout([setup.replica], OVERRIDES + ["update_mode=staged"])
    assert [s["version"] for s in setup.replica.call("weightsync_status")] == [setup.version]
    assert setup.replica.weight_version() == version and greedy(setup.engine) == served


def test_worker_killed_mid_update_is_named_fast_and_the_other_replica_serves_it(setup: Setup) -> None:
    """Replica B (a second engine, added to the rollout) has its TP worker killed after the
    handshake of an update: the update fails naming B well within the deadline, and A ends
    on the new version whole and serves it. B leaves the rollout (its workers are gone).
    B's ``shutdown()`` kills every subprocess of this process (SGLang 0.5.23), A's
    scheduler too: the tests that use A run before this one."""
    from procs import alive

    from weightsync.sources import StateDictSource

    engine_b = start_engine(setup.dir)
    b = SGLangReplica(engine_b, name="B")
    try:
        setup.rollout.add_replica(b)
        setup.version += 1
        report = setup.rollout.update(setup.model, setup.version)  # B joins on this version
        assert [r.version for r in report.replicas] == [setup.version] * 2, report.summary()
        assert greedy(engine_b) == trainer_greedy(setup.model, PROMPTS, NEW)
        setup.train()
        victim = b.call("weightsync_status")[0]["pid"]

        class KillingSource(StateDictSource):
            def tensors(self):
                os.kill(victim, signal.SIGKILL)
                while alive(victim):
                    time.sleep(0.05)
                yield from super().tensors()

        t0 = time.monotonic()
        with pytest.raises(ReplicaUpdateError, match=r"replica 'B'") as info:
            setup.rollout.update(KillingSource(dict(setup.model.state_dict())), setup.version + 1)
        assert time.monotonic() - t0 < TIMEOUT_S, info.value  # named by the lost worker, not by a deadline
        ra, rb = info.value.report.replicas
        assert (rb.name, rb.ok) == ("B", False)
        assert (ra.name, ra.ok, ra.version, ra.resumed) == ("A", True, setup.version + 1, True), ra
        setup.version += 1
        assert greedy(setup.engine) == trainer_greedy(setup.model, PROMPTS, NEW)
        assert setup.replica.weight_version() == str(setup.version)
    finally:
        if any(r.name == "B" for r in setup.rollout.replicas):
            setup.rollout.remove_replica("B")
        threading.Thread(target=engine_b.shutdown, daemon=True).start()
        b.close()


def test_tp2_replica_over_gloo_each_rank_loads_through_sglang(tmp_path) -> None:
    """A replica of 2 TP workers (SGLang's CPU engine, Gloo between them) of a model whose
    heads split over the ranks (``TP2_MODEL``): both join as receivers, each loads the
    version through SGLang's own sliced loaders, every tensor of each rank
    changes with the version (rank 1's attention among them: none is padding), the
    replica's greedy output is the trainer's (trained on random tokens), and each rank's
    bytes equal SGLang's TP 2 load of the trainer's checkpoint from disk."""
    trainer = Trainer(str(tmp_path), **TP2_MODEL)
    engine = start_engine(trainer.dir, tp=2)
    replica = SGLangReplica(engine, name="T")
    try:
        with SGLangRollout([replica], OVERRIDES) as rollout:
            held = replica.call("weightsync_digests")
            assert all(
                n in held[1]
                for n in (
                    "model.layers.0.self_attn.qkv_proj.weight",
                    "model.layers.0.self_attn.o_proj.weight",
                )
            )
            trainer.train()
            report = rollout.update(trainer.model, 1)
            assert report.ok, report.summary()
            statuses = replica.call("weightsync_status")
            assert [(s["tp_rank"], s["version"], s["ok"]) for s in statuses] == [(0, 1, True), (1, 1, True)]
            synced = replica.call("weightsync_digests")
            for rank, (a, b) in enumerate(zip(held, synced)):
                assert not [n for n in a if a[n] == b[n]], f"TP rank {rank}: unchanged by the version"
            assert greedy(engine) == trainer_greedy(trainer.model, PROMPTS, NEW)
            assert replica.weight_version() == "1"
            matches_reload_from_disk(trainer, replica, str(tmp_path / "trained"))
    finally:
        engine.shutdown()
        replica.close()
