"""TRL's GRPOTrainer with a real vLLM (CPU build) replica synced by weightsync
(``weightsync.integrations.trl``): the replica on the trainer's weights after every step,
versions equal to steps, a replica killed mid-update failing the step by name, and other TRL
or vLLM releases refused.

One replica is started for the module (about 20-50 s on 2 cores); the test that kills it
runs last, and a test that finds it dead starts it again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from procs import alive

from weightsync.demo.trl import (
    LOGPROB_TOLERANCE,
    TRLDemoOptions,
    build,
    check_replica,
    compare_digests,
    grpo_config,
    prompt_logprobs,
    target_reward,
)
from weightsync.integrations.replicas.reports import ReplicaUpdateError
from weightsync.sources import StateDictSource

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.trl, pytest.mark.timeout(300)]

TIMEOUT_S = 30
#: a lost replica is seen by its connection closing (0.2 s in test_vllm), not by the deadline
DETECT_S = 10
OPTS = TRLDemoOptions(
    steps=3, generations=4, prompts_per_step=2, overrides=("backend=nccl", f"timeout_s={TIMEOUT_S}")
)


class Replica:
    def __init__(self, tmp: str) -> None:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        self.tmp = tmp
        self.parts = build(tmp, OPTS)
        self.llm = self.parts["llms"]["r0"]

    def pid(self) -> int:
        return self.llm.collective_rpc("weightsync_status")[0]["pid"]

    def ready(self) -> None:
        """The replica alive: one killed by an earlier test is started anew."""
        try:
            up = alive(self.pid())
        except Exception:
            up = False
        if not up:
            _shutdown(self.llm)
            from weightsync.demo.vllm import start_replica

            self.llm = start_replica(self.parts["dir"], max_model_len=128, seed=OPTS.seed)

    def trainer(self, name: str, **kwargs):
        """A fresh trainer (the saved model's weights) over a new rollout of the replica."""
        from transformers import AutoModelForCausalLM

        from weightsync.integrations.trl import WeightsyncGRPOTrainer
        from weightsync.integrations.vllm_replicas import LLMReplica
        from weightsync.integrations.vllm_rollout import VLLMRollout

        model = AutoModelForCausalLM.from_pretrained(self.parts["dir"], dtype=torch.float32)
        rollout = VLLMRollout([LLMReplica(self.llm, "r0")], list(OPTS.overrides), model=model)
        trainer = WeightsyncGRPOTrainer(
            model=model,
            reward_funcs=target_reward,
            args=grpo_config(os.path.join(self.tmp, name), OPTS),
            train_dataset=self.parts["dataset"],
            processing_class=self.parts["tokenizer"],
            rollout=rollout,
            **kwargs,
        )
        return trainer, rollout


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    r = Replica(str(tmp_path_factory.mktemp("trl")))
    yield r
    _shutdown(r.llm)


@pytest.fixture
def ready(replica):
    replica.ready()
    return replica


def test_every_grpo_step_leaves_the_replica_on_the_trainers_weights_as_version_step(ready):
    from transformers import TrainerCallback

    trainer, rollout = ready.trainer("run")
    seen: list[tuple[int, int | None, int, list[str], str | None, set]] = []
    moved: list[float] = []  # how far each step moved the trainer's own prompt logprobs
    last = [prompt_logprobs(ready.llm, trainer.model)[1]]

    class Check(TrainerCallback):  # runs after the trainer's own sync callback
        def on_step_end(self, args, state, control, **_):
            gen = trainer.vllm_generation
            served = rollout.status()[0].version
            compared, differ = compare_digests(ready.llm, trainer.model)
            problem = check_replica(ready.llm, trainer.model)
            seen.append((state.global_step, served, compared, differ, problem, set(gen.last_versions)))
            own = prompt_logprobs(ready.llm, trainer.model)[1]
            moved.append(max(abs(a - b) for a, b in zip(own, last[0])))
            last[0] = own

    trainer.add_callback(Check())
    try:
        trainer.train()
    finally:
        rollout.close()
    assert [s[0] for s in seen] == [1, 2, 3]
    for step, served, compared, differ, problem, sampled in seen:
        assert served == step, (step, served)
        # embedding, lm_head, 5 norms, 3 q/k/v biases fused in 2 layers: what vLLM's CPU
        # build keeps readable (its linear matrices are packed: the logprobs cover them)
        assert compared >= 9 and differ == [], (step, compared, differ)
        assert problem is None, (step, problem)
        # this step's completions were sampled by the weights of the step before
        assert sampled == {step - 1}, (step, sampled)
    assert [s.version for s in trainer.syncs] == [0, 1, 2, 3]
    # the tolerance tells versions apart: every step moved the logprobs far past it
    assert min(moved) > 20 * LOGPROB_TOLERANCE, moved
    assert all(s.report.ok and s.report.replicas[0].caches_reset for s in trainer.syncs)


def test_other_trl_or_vllm_releases_are_refused_naming_both(monkeypatch):
    import weightsync.integrations.trl as wtrl

    for trl_v, vllm_v in (("1.17.0", "0.32.0"), ("1.16.0", "0.33.1"), (None, "0.32.0")):
        with pytest.raises(wtrl.UnsupportedVersion) as info:
            wtrl.check_versions(trl_v or "", vllm_v)
        msg = str(info.value)
        assert f"TRL {trl_v or 'not installed'} with vLLM {vllm_v}" in msg, msg
        assert "TRL 1.16.0 with vLLM 0.32.0" in msg, msg
    wtrl.check_versions()  # what .venv installs
    # the trainer refuses before building anything (no rollout, no model needed)
    monkeypatch.setattr(wtrl, "installed_versions", lambda: {"trl": "1.15.2", "vllm": "0.32.0"})
    with pytest.raises(wtrl.UnsupportedVersion, match=r"found TRL 1\.15\.2 with vLLM 0\.32\.0"):
        wtrl.WeightsyncGRPOTrainer(model=None, reward_funcs=[], rollout=None)


def test_a_replica_killed_mid_update_fails_the_step_naming_it_within_the_deadline(ready):
    """The replica's worker is killed as the sync of step 2 starts streaming (after the
    handshake, before the first tensor): ``train()`` raises ``ReplicaUpdateError`` naming
    the replica, found by the lost connection, far within ``timeout_s``; no step runs on
    completions of a replica that may hold a mix. Runs last: it leaves the replica dead."""
    # past whatever an earlier test left the replica on: replicas never go back a version
    base = 100
    trainer, rollout = ready.trainer("killed", version_offset=base)
    victim = ready.pid()
    update = rollout.update
    kill_at, timing = base + 2, {}

    class KillingSource(StateDictSource):
        def tensors(self):
            os.kill(victim, signal.SIGKILL)
            while alive(victim):
                time.sleep(0.05)
            yield from super().tensors()

    def killing_update(source, version, **kwargs):
        if version != kill_at:
            return update(source, version, **kwargs)
        timing["t0"] = time.monotonic()
        return update(KillingSource(dict(source.state_dict())), version, **kwargs)

    rollout.update = killing_update
    try:
        with pytest.raises(ReplicaUpdateError, match=r"replica 'r0'") as info:
            trainer.train()
    finally:
        rollout.close()
    assert time.monotonic() - timing["t0"] < DETECT_S < TIMEOUT_S
    assert trainer.state.global_step == 2  # the step whose sync failed ended no other
    (r0,) = info.value.report.replicas
    assert (r0.name, r0.ok, r0.version) == ("r0", False, None)
    assert [s.version for s in trainer.syncs] == [base, base + 1]
