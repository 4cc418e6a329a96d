"""Real vLLM (CPU build) replicas as receivers: parity with the trainer, byte-equality with
vLLM's own reload from disk, pause modes, vLLM's weight-transfer registry, a killed replica.

Two replicas are started once for the module (about 20 s each on 2 cores). The tests do not
depend on their order: before each one, the ``setup`` fixture restarts a replica an earlier
test killed and brings both replicas to the trainer's current weights as a new version.
Without vLLM, conftest.py skips them (marker ``vllm``), or fails them under CI.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import workers
from procs import alive

from weightsync import EngineConfig, Sender
from weightsync.bench.vllm import _cpu_s, _stat
from weightsync.demo.vllm import (
    PROMPTS,
    replica_greedy,
    save_tiny_model,
    start_replica,
    train_until_changed,
    trainer_greedy,
    vllm_environment,
)
from weightsync.errors import SyncError
from weightsync.integrations.replicas.reports import ReplicaUpdateError
from weightsync.integrations.vllm_replicas import LLMReplica
from weightsync.integrations.vllm_rollout import VLLMRollout
from weightsync.integrations.vllm_versions import versioned
from weightsync.sources import StateDictSource

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(240)]

NEW = 8
# vocab 5000 x hidden 64 x fp32 = 1.28 MB: the embedding and lm_head span two 1 MiB buckets.
VOCAB = 5000
# Well above DETECT_S: a failure found only by waiting out a deadline fails the bounds of
# the failure tests, which assert detection (measured on 2 loaded cores: a refused
# configuration 0.04 s, a killed replica 0.2 s, a source failing mid-stream 2.0 s while the
# sender waited 2 s for a peer's EOF before reporting it; it no longer waits).
TIMEOUT_S = 60
DETECT_S = 10
OVERRIDES = ["backend=nccl", "update_weights_bucket_megabytes=1", f"timeout_s={TIMEOUT_S}"]
#: the replicas' KV block size (vLLM's CPU attention wants a multiple of 32; its default, 128,
#: would hold no full block of LONG)
BLOCK = 32
#: a prompt of several KV blocks: its 6 full blocks (192 tokens) can come from the prefix cache
LONG = [(37 * i + 11) % VOCAB for i in range(200)]
CACHEABLE = len(LONG) // BLOCK * BLOCK


# B also has weightsync as its vLLM weight-transfer engine (the registry path).
REPLICAS = {"A": {}, "B": {"weight_transfer_config": {"backend": "weightsync"}}}


class Setup:
    def __init__(self, tmp: str) -> None:
        from transformers import AutoModelForCausalLM

        vllm_environment()
        self.dir = save_tiny_model(os.path.join(tmp, "model"), seed=3, vocab_size=VOCAB)
        self.tmp = tmp
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(7)
        self.llms: list = []
        self.pids: list[int] = []  # each replica's worker process
        for name in REPLICAS:
            self._start(name)
        self.rollout: VLLMRollout | None = None
        self._connect()
        self.version = 0
        self.restarts = 0

    def _start(self, name: str) -> None:
        i = list(REPLICAS).index(name)
        # prefix caching is on (vLLM's default)
        llm = start_replica(self.dir, max_model_len=256, block_size=BLOCK, **REPLICAS[name])
        pid = llm.collective_rpc("weightsync_status")[0]["pid"]
        if i < len(self.llms):
            self.llms[i], self.pids[i] = llm, pid
        else:
            self.llms.append(llm)
            self.pids.append(pid)

    def _connect(self) -> None:
        """A new rollout (a new sender) over the current replicas; each worker joins it."""
        if self.rollout is not None:
            self.rollout.close()
        self.replicas = [LLMReplica(llm, name) for llm, name in zip(self.llms, REPLICAS)]
        self.rollout = VLLMRollout(self.replicas, OVERRIDES)

    def ready(self) -> None:
        """Before each test: every replica alive (one killed by an earlier test is started
        anew), and both serving the trainer's current weights as a new version."""
        dead = [name for name, pid in zip(REPLICAS, self.pids) if not alive(pid)]
        for name in dead:
            _shutdown(self.llms[list(REPLICAS).index(name)])
            self._start(name)
            self.restarts += 1
        if dead:
            self._connect()
        self.version += 1
        report = self.rollout.update(self.model, self.version)
        assert report.ok, report.summary()

    def train(self) -> list[list[int]]:
        """One training step that changes the greedy outputs; returns the new outputs."""
        before = trainer_greedy(self.model, PROMPTS, NEW)
        target = torch.randint(0, VOCAB, (NEW,), generator=self.gen).tolist()
        train_until_changed(self.model, self.optimizer, target, before, NEW)
        after = trainer_greedy(self.model, PROMPTS, NEW)
        assert after != before
        return after


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    s = Setup(str(tmp_path_factory.mktemp("vllm")))
    yield s
    s.rollout.close()
    for llm in s.llms:
        _shutdown(llm)


@pytest.fixture
def setup(replicas):
    """The module's replicas, ready for one test whatever ran before it."""
    replicas.ready()
    return replicas


def prompt_logprobs(llm) -> list[list[float]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]


def long_greedy(llm) -> tuple[list[int], int]:
    """LONG's greedy tokens on ``llm``, and how many of its prompt tokens came from the
    prefix cache (``RequestOutput.num_cached_tokens``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": LONG}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def cache_long(llm) -> list[int]:
    """Put LONG's blocks in ``llm``'s prefix cache; shown there (a second request reuses
    them); its greedy tokens."""
    tokens, _ = long_greedy(llm)
    assert long_greedy(llm) == (tokens, CACHEABLE)
    return tokens


@pytest.mark.parametrize("staged", [False, True], ids=["streamed", "staged"])
def test_a_long_prompt_after_an_update_reuses_no_kv_of_the_old_version(setup, staged):
    """Prefix caching on, block size 32: LONG (200 tokens) generated on the old version is in
    both replicas' prefix cache. After an update (streamed; staged, then committed) a request
    for it reuses none of those blocks and generates the trainer's own greedy tokens for the
    new weights; its blocks are cached again for the new version. Streamed, an update
    refused before anything moved leaves the version and its cached blocks as they were."""
    old = [cache_long(llm) for llm in setup.llms]
    setup.train()
    expected = trainer_greedy(setup.model, [LONG], NEW)[0]
    assert old == [old[0]] * 2 and expected != old[0]
    setup.version += 1
    report = setup.rollout.update(setup.model, setup.version, staged=staged)
    assert (
        report.ok
        and [(r.version, r.caches_reset, r.resumed) for r in report.replicas]
        == [(setup.version, True, True)] * 2
    ), report.summary()
    for llm in setup.llms:
        assert long_greedy(llm) == (expected, 0)
        assert long_greedy(llm) == (expected, CACHEABLE)
    if not staged:
        left_out = "model.layers.1.mlp.down_proj.weight"
        without = {n: t for n, t in setup.model.state_dict().items() if n != left_out}
        with pytest.raises(ReplicaUpdateError, match="does not carry"):
            setup.rollout.update(without, setup.version + 1)
        for llm in setup.llms:
            assert long_greedy(llm) == (expected, CACHEABLE)


def test_two_versions_reach_both_replicas_with_greedy_parity(setup):
    bucket = EngineConfig.from_overrides(OVERRIDES).bucket_bytes
    assert max(t.nbytes for t in setup.model.state_dict().values()) > bucket  # split over buckets
    for _ in range(2):
        old = [replica_greedy(llm, PROMPTS, NEW) for llm in setup.llms]
        expected = setup.train()
        setup.version += 1
        report = setup.rollout.update(setup.model, setup.version, mode="abort")
        assert report.ok and report.stats.buckets >= 3
        phases = report.pause_s + report.sync_s + report.resume_s  # generation is paused across all three
        assert phases <= report.paused_s < phases + 0.1, report.summary()
        assert [(r.name, r.version, r.resumed) for r in report.replicas] == [
            ("A", setup.version, True),
            ("B", setup.version, True),
        ]
        for llm, before in zip(setup.llms, old):
            got = replica_greedy(llm, PROMPTS, NEW)
            assert got == expected and got != before
    assert [(r.name, r.version, r.mixed) for r in setup.rollout.status()] == [
        ("A", setup.version, False),
        ("B", setup.version, False),
    ]


def test_replicas_run_with_tcmalloc_preloaded_and_sleeping_openmp_threads_on_shared_cores(setup):
    """start_replica preloads TCMalloc (make install-vllm installs it) into the engine's
    processes only: every worker has it mapped, this process does not. The workers' OpenMP
    threads sleep at barriers (OMP_WAIT_POLICY=PASSIVE from vllm_environment): replicas
    sharing cores would otherwise spin on the cores each other's loads need."""
    for pid in setup.pids:
        with open(f"/proc/{pid}/maps") as f:
            assert "libtcmalloc" in f.read(), pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"OMP_WAIT_POLICY=PASSIVE" in f.read().split(b"\0"), pid
    with open("/proc/self/maps") as f:
        assert "libtcmalloc" not in f.read()
    assert "tcmalloc" not in os.environ.get("LD_PRELOAD", "")


def test_engine_cores_wait_for_an_update_without_spinning(setup):
    """vLLM's engine core spins on its workers' answer queue for 1 s after each read; during
    weightsync's calls it waits on the queue's notification socket instead (the plugin's
    ``register``), so it leaves the cores to the transfer and the workers' loading. Here
    the sender holds the update 1.5 s right after a status call (a read by each engine
    core): spinning, each engine core would burn about that second."""
    cores = [int(_stat(pid)[1]) for pid in setup.pids]  # a worker's parent: its engine core

    def held(state):
        time.sleep(1.5)  # the workers wait in weightsync_receive, the engine cores for them
        yield from state.items()

    setup.rollout.status()
    before = sum(_cpu_s(p) for p in cores)
    setup.version += 1
    report = setup.rollout.update(held(setup.model.state_dict()), setup.version)
    used = sum(_cpu_s(p) for p in cores) - before
    assert report.ok and report.sync_s > 1.5, report.summary()
    assert used < 0.3, f"the engine cores used {used:.2f} CPU s while waiting for their workers"


def test_a_new_rollout_warms_every_worker_up_at_init_and_its_first_update_reuses_it(setup):
    """weightsync_init connects every worker and forms the data plane while the sender
    warms up; the first update then joins nothing new. A replica that refuses its
    configuration fails the init at once (not after timeout_s)."""
    setup._connect()
    sender = setup.rollout.sender
    assert sender._transport._generation == 1
    warm = [r.call("weightsync_status")[0].get("warm_up_s") for r in setup.replicas]
    assert all(s is not None and s > 0 for s in warm), warm
    expected = setup.train()
    setup.version += 1
    report = setup.rollout.update(setup.model, setup.version)
    assert report.ok, report.summary()
    assert sender._transport._generation == 1
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == expected
    t0 = time.monotonic()
    with pytest.raises(Exception, match="custom_backend_module"):
        VLLMRollout(setup.replicas, OVERRIDES + ["custom_backend_module=json"])
    assert time.monotonic() - t0 < DETECT_S


def test_a_rollout_with_an_initial_version_serves_the_model_when_constructed(setup):
    """initial_version: the constructor syncs the trainer's weights (changed since the
    replicas' last update) as that version; every replica serves it, greedy parity."""
    expected = setup.train()
    setup.version += 1
    setup.rollout.close()
    setup.rollout = VLLMRollout(setup.replicas, OVERRIDES, model=setup.model, initial_version=setup.version)
    report = setup.rollout.initial_report
    assert report is not None and report.ok and report.stats.bytes > 0, report
    assert [(r.version, r.ok) for r in setup.rollout.status()] == [(setup.version, True)] * 2
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == expected
    with pytest.raises(ValueError, match="initial_version needs model"):
        VLLMRollout(setup.replicas, OVERRIDES, initial_version=setup.version + 1)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("update_mode", ["stream", "staged"])
def test_delta_sync_reaches_both_replicas_bit_exact(setup, tmp_path, update_mode):
    """delta=on through real vLLM workers. Streamed, each worker keeps a base copy and
    streams full tensors into vLLM's reload; staged, the staging copies are the delta base
    (deltas applied into them in place, no third copy). Versions after the first go
    relative, outputs match the trainer, and after three versions A's weights equal vLLM's
    own reload of the trainer's checkpoint from disk into B, bit for bit (B's reload shown to
    change B first: from the first checkpoint it differs). (``on``: in this loaded
    test process ``auto`` may rightly find deltas slower.)"""
    setup.rollout.close()
    setup.rollout = VLLMRollout(
        setup.replicas, OVERRIDES + ["delta=on", "verify=crc32", f"update_mode={update_mode}"]
    )
    try:
        bases = []
        for step in range(3):
            expected = setup.train()
            setup.version += 1
            report = setup.rollout.update(setup.model, setup.version, mode="abort")
            assert report.ok and report.phase == ("staged" if update_mode == "staged" else "update"), (
                report.summary()
            )
            bases.append(report.stats.delta_base)
            for llm in setup.llms:
                assert replica_greedy(llm, PROMPTS, NEW) == expected
        # the first update gives both workers their base; the later ones go as deltas
        assert bases == [None, setup.version - 2, setup.version - 1], bases
        # B got the same deltas as A: first show that B's reload changes it (from the module's
        # first checkpoint B differs from A), then reload it from the trainer's
        a, b = setup.llms
        synced = a.collective_rpc("weightsync_digests")[0]
        assert b.collective_rpc("weightsync_digests")[0] == synced
        b.collective_rpc("weightsync_reload_from_path", args=(setup.dir,))
        assert b.collective_rpc("weightsync_digests")[0] != synced, "the reload left B as it was"
        setup.model.save_pretrained(str(tmp_path))
        b.collective_rpc("weightsync_reload_from_path", args=(str(tmp_path),))
        assert b.collective_rpc("weightsync_digests")[0] == synced
        if update_mode == "stream":
            # docs/vllm.md: a replica taken in (add_replica) gets a delta sync dense. B leaves,
            # A takes a trained version as a delta; B, back under a new rank, holds the one
            # before: the same weights as the next version go as a (null) delta to A and
            # dense to B (a delta applied to B's older base would leave it where it was).
            rollout = setup.rollout
            removed = rollout.remove_replica("B")
            expected = setup.train()
            setup.version += 1
            report = rollout.update(setup.model, setup.version, mode="abort")
            assert report.ok and report.stats.delta_base == setup.version - 1, report.summary()
            rollout.add_replica(removed)
            setup.version += 1
            report = rollout.update(setup.model, setup.version, mode="abort")
            assert report.ok and [r.name for r in report.replicas] == ["A", "B"], report.summary()
            stats = report.stats
            assert stats.delta_base == setup.version - 1 and stats.wire_bytes > stats.bytes, stats
            for llm in setup.llms:
                assert replica_greedy(llm, PROMPTS, NEW) == expected
            assert b.collective_rpc("weightsync_digests")[0] == a.collective_rpc("weightsync_digests")[0]
    finally:
        setup._connect()  # the module's usual rollout (no delta) for the next tests


def test_updates_over_ipc_read_the_trainers_own_tensors_with_greedy_parity(setup):
    """``backend=ipc`` (docs/ipc.md) into real vLLM workers: the trainer's tensors moved into
    shared memory once (``share_tensors``; the optimizer keeps training them in place), each
    worker maps them and vLLM's loader reads them in place (no landing copy); three trained
    versions keep greedy parity, the large tensors read from the trainer's memory, the rest
    staged in the same sync and copied."""
    from weightsync.engines.shared_tensors import share_tensors

    share_tensors(setup.model)
    setup.rollout.close()
    setup.rollout = VLLMRollout(setup.replicas, ["backend=ipc", *OVERRIDES[1:]])
    try:
        for _ in range(3):
            expected = setup.train()
            setup.version += 1
            report = setup.rollout.update(setup.model, setup.version)
            assert report.ok, report.summary()
            stats = report.stats
            assert stats.shared_bytes + stats.staged_bytes == stats.wire_bytes, stats
            assert stats.shared_bytes > stats.bytes / 2, stats  # the embedding and head at least
            for r in setup.replicas:  # vLLM's loader read those in place: no landing copy of them
                for w in r.call("weightsync_status"):
                    assert w["landing_lent_bytes"] == stats.shared_bytes, w
                    assert w["landing_copied_bytes"] == stats.staged_bytes, w
            for llm in setup.llms:
                assert replica_greedy(llm, PROMPTS, NEW) == expected
    finally:
        setup._connect()  # the module's usual rollout (nccl) for the next tests


def test_a_removed_replica_keeps_what_it_holds_and_taken_back_gets_the_next_version(setup):
    """remove_replica('B'): the next update goes to A alone and B keeps serving the version
    it held; add_replica takes B back under a receiver rank no replica had, and the update
    after reaches both, greedy parity with the trainer."""
    a, b = setup.llms
    held = replica_greedy(b, PROMPTS, NEW)
    rollout = setup.rollout
    try:
        removed = rollout.remove_replica("B")
        assert [r.name for r in rollout.replicas] == ["A"] and rollout.sender.receivers == [0]
        with pytest.raises(ValueError, match="the rollout's last"):
            rollout.remove_replica("A")
        expected = setup.train()
        setup.version += 1
        report = rollout.update(setup.model, setup.version)
        assert report.ok and [r.name for r in report.replicas] == ["A"], report.summary()
        assert replica_greedy(a, PROMPTS, NEW) == expected
        assert replica_greedy(b, PROMPTS, NEW) == held != expected
        assert b.collective_rpc("weightsync_status")[0]["version"] == setup.version - 1
        rollout.add_replica(removed)
        assert rollout.sender.receivers == [0, 2]
        setup.version += 1
        report = rollout.update(setup.model, setup.version)
        assert report.ok and [r.name for r in report.replicas] == ["A", "B"], report.summary()
        assert replica_greedy(b, PROMPTS, NEW) == expected
    finally:
        setup._connect()  # the module's rollout over both, ranks 0 and 1, for the next tests


def test_kv_cache_release_refused_on_cpu_leaves_replicas_serving(setup):
    """vLLM 0.32 frees KV cache memory only on GPUs: its CPU replicas do not declare it, and
    the update is refused before anything is paused or moves, naming both replicas; both go
    on serving their version."""
    served = [replica_greedy(llm, PROMPTS, NEW) for llm in setup.llms]
    assert all("release_kv_cache" not in r.capabilities for r in setup.replicas)
    with pytest.raises(ValueError, match=r"release_kv_cache=True: replica\(s\) 'A', 'B' do not take them"):
        setup.rollout.update(setup.model, setup.version + 1, release_kv_cache=True)
    assert [(r.version, r.ok) for r in setup.rollout.status()] == [(setup.version, True)] * 2
    assert [replica_greedy(llm, PROMPTS, NEW) for llm in setup.llms] == served


def test_synced_replica_equals_vllm_reload_from_disk(setup):
    """B reloads version N from a safetensors directory with vLLM's own reload_weights;
    A gets version N through weightsync; their parameters, persistent buffers and prompt logprobs are
    identical."""
    setup.train()
    disk = os.path.join(setup.tmp, "from_disk")
    setup.model.save_pretrained(disk)
    a, b = setup.llms
    seconds = b.collective_rpc("weightsync_reload_from_path", args=(disk,))[0]
    from_disk = b.collective_rpc("weightsync_digests")[0]
    disk_logprobs = prompt_logprobs(b)
    before = a.collective_rpc("weightsync_digests")[0]
    assert before != from_disk
    setup.version += 1
    report = setup.rollout.update(setup.model, setup.version)
    synced = a.collective_rpc("weightsync_digests")[0]
    assert synced.keys() == from_disk.keys() and len(synced) > 10
    assert synced == from_disk
    assert prompt_logprobs(a) == disk_logprobs
    print(f"\nvLLM reload_weights from disk: {seconds:.3f} s; weightsync update: sync {report.sync_s:.3f} s")


def test_keep_mode_carries_an_in_flight_request_across_the_update(setup):
    from vllm import SamplingParams

    a = setup.llms[0]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    setup.train()
    setup.version += 1
    a.enqueue([{"prompt_token_ids": PROMPTS[0]}], long, use_tqdm=False)
    report = setup.rollout.update(setup.model, setup.version, mode="keep")
    assert report.ok
    (out,) = a.wait_for_completion(use_tqdm=False)
    assert out.finished and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 200
    # The same in abort mode ends the request instead.
    setup.version += 1
    a.enqueue([{"prompt_token_ids": PROMPTS[0]}], long, use_tqdm=False)
    assert setup.rollout.update(setup.model, setup.version, mode="abort").ok
    (out,) = a.wait_for_completion(use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort"


def _runs(tokens: list[int]) -> list[tuple[int, int]]:
    """``(first_index, token)`` where each run of equal tokens starts."""
    return [(i, t) for i, t in enumerate(tokens) if i == 0 or tokens[i - 1] != t]


def _generated(llm, request_id: str) -> int:
    """Output tokens of an unfinished request the front end processed so far (vLLM's own
    request state), stepping the front end to read what the engine produced meanwhile."""
    llm.llm_engine.step()  # the request is far from done: this returns no finished output
    return llm.llm_engine.output_processor.request_states[request_id].detokenizer.num_output_tokens()


def _advance(llm, request_id: str, tokens: int) -> None:
    """Wait until ``request_id`` generated ``tokens`` more tokens."""
    start = _generated(llm, request_id)
    deadline = time.monotonic() + 30
    while _generated(llm, request_id) < start + tokens:
        assert time.monotonic() < deadline, (
            f"request {request_id} stalled at {_generated(llm, request_id)} tokens"
        )


KEPT_TOKENS = 240  # generated tokens of a request kept across updates (max_model_len 256)


def test_a_request_kept_across_updates_reports_each_versions_tokens_by_span(setup):
    """Versions v1, v2, v3 each emit a token of their own (t1, t2, t3) whatever the prefix.
    A request admitted under v1 and kept (``mode="keep"``) across the updates to v2 and v3,
    each update made while the request is still generating: its tokens read t1... t2...
    t3..., and the spans the replica reports put each version's first token exactly where
    the tokens change. The other replica's label follows too; a fresh request reports v3
    alone."""
    from vllm import SamplingParams

    from weightsync.integrations.vllm_versions import engine_label

    a, replica = setup.llms[0], setup.replicas[0]
    marks = [101, 202, 303]
    versions = [setup.version + 1, setup.version + 2, setup.version + 3]
    setup.version = versions[-1]
    assert setup.rollout.update(workers.emitting(setup.model, marks[0]), versions[0]).ok
    params = SamplingParams(temperature=0.0, max_tokens=KEPT_TOKENS, ignore_eos=True)
    (rid,) = a.enqueue([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    for version, mark in zip(versions[1:], marks[1:]):
        _advance(a, rid, 3)  # some tokens under the version served; the request goes on
        report = setup.rollout.update(workers.emitting(setup.model, mark), version, mode="keep")
        assert report.ok and [r.version for r in report.replicas] == [version] * 2, report.summary()
    (out,) = a.wait_for_completion(use_tqdm=False)
    got = versioned(out)
    tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == KEPT_TOKENS and [t for _, t in _runs(tokens)] == marks, _runs(tokens)
    # the boundaries, read from the tokens alone, against what the engine reported
    assert got.spans[0] == tuple((i, versions[marks.index(t)]) for i, t in _runs(tokens))
    assert got.token_versions() == [versions[marks.index(t)] for t in tokens]
    assert [engine_label(llm) for llm in setup.llms] == [versions[-1]] * 2
    (fresh,) = replica.generate(
        [{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0.0, max_tokens=4)
    )
    assert (
        fresh.spans == (((0, versions[-1]),),) and list(fresh.output.outputs[0].token_ids) == [marks[-1]] * 4
    )


def test_a_request_admitted_while_a_version_is_staged_reports_the_version_it_ran_under(setup):
    """``stage`` (generation goes on) with a request admitted while the staged version's
    transfer is held under way: its tokens until the commit come from the version served and
    say so (not the staged one); committed with ``mode="keep"``, it goes on under the new
    version from the exact token where the tokens change."""
    from vllm import SamplingParams

    a = setup.llms[0]
    old, new = setup.version + 1, setup.version + 2
    setup.version = new
    assert setup.rollout.update(workers.emitting(setup.model, 111), old).ok
    source = workers.HeldSource(workers.emitting(setup.model, 222))
    stage, out = _in_thread(setup.rollout.stage, source, new)
    assert source.holding.wait(30)
    params = SamplingParams(temperature=0.0, max_tokens=KEPT_TOKENS, ignore_eos=True)
    (rid,) = a.enqueue([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)
    _advance(a, rid, 3)
    source.release.set()
    stage.join(timeout=60)
    assert out["value"].ok and [r.staged for r in out["value"].replicas] == [new] * 2
    _advance(a, rid, 3)  # staged and complete, not committed: still the old version's tokens
    assert setup.rollout.commit(new, mode="keep").ok
    (done,) = a.wait_for_completion(use_tqdm=False)
    tokens = list(done.outputs[0].token_ids)
    runs = _runs(tokens)
    assert [t for _, t in runs] == [111, 222] and runs[1][0] >= 6, runs
    assert versioned(done).spans == (((0, old), (runs[1][0], new)),)


def test_vllm_weight_transfer_registry_backend(setup):
    """vLLM's own RL API (init_weight_transfer_engine, start/update/finish_weight_update)
    with weightsync as the registered backend; the engine core waits for update_weights
    without spinning, as for weightsync's own calls."""
    b = setup.llms[1]
    expected = setup.train()
    config = EngineConfig.from_overrides(OVERRIDES)
    with Sender(config, "127.0.0.1:0", num_receivers=1) as sender:
        init = threading.Thread(
            target=b.collective_rpc,
            args=("init_weight_transfer_engine",),
            kwargs={
                "args": (
                    {"address": sender.address, "rank_offset": 0, "overrides": OVERRIDES, "warm_up": True},
                )
            },
        )
        init.start()
        sender.warm_up()  # the worker joins the data plane in init_weight_transfer_engine
        init.join(timeout=60)
        assert sender._transport._generation == 1
        b.collective_rpc("start_weight_update")
        errors: list[BaseException] = []

        def update() -> None:
            try:
                b.collective_rpc("update_weights", args=({"version": 100},))
            except BaseException as e:
                errors.append(e)

        old_long = cache_long(b)  # the old version's blocks of LONG, cached
        core = int(_stat(setup.pids[1])[1])  # B's engine core
        before = _cpu_s(core)
        t = threading.Thread(target=update)
        t.start()
        time.sleep(1.5)  # right after start_weight_update: spinning, the engine core would burn this
        stats = sender.send(setup.model, version=100)
        t.join(timeout=60)
        assert not errors and stats.version == 100
        assert _cpu_s(core) - before < 0.3  # it waited idle for update_weights (weightsync is the backend)
        assert sender._transport._generation == 1  # the update joined no new group
        # the engine core reset the prefix cache as update_weights returned: LONG reuses no
        # block of the old version and gets the trainer's tokens (its blocks cached again)
        expected_long = trainer_greedy(setup.model, [LONG], NEW)[0]
        assert expected_long != old_long
        assert long_greedy(b) == (expected_long, 0)
        assert long_greedy(b) == (expected_long, CACHEABLE)
        # never silent on this path too: a full version that leaves a parameter out is
        # refused before anything moves (B keeps its bytes and tokens though the version
        # carries newly trained weights), failing update_weights naming it (and the sender's
        # send); the next complete one serves
        expected = setup.train()
        left_out = "model.layers.1.mlp.down_proj.weight"
        without = {n: x for n, x in setup.model.state_dict().items() if n != left_out}
        held, tokens = b.collective_rpc("weightsync_digests")[0], replica_greedy(b, PROMPTS, NEW)
        for version, source in ((101, without), (102, setup.model)):
            errors.clear()
            if version == 102:  # vLLM ends the update session where update_weights raised
                b.collective_rpc("start_weight_update")
            t = threading.Thread(
                target=lambda v=version: _catch(
                    errors, b.collective_rpc, "update_weights", args=({"version": v},)
                )
            )
            t.start()
            sent: list[BaseException] = []
            _catch(sent, sender.send, source, version=version)
            t.join(timeout=60)
            if source is without:
                assert len(errors) == 1 and len(sent) == 1 and isinstance(sent[0], SyncError), (errors, sent)
                assert "receiver rank 0 refused version 101" in str(errors[0]), errors
                assert f"does not carry 1 tensor(s) of the served model's checkpoint: {left_out}" in str(
                    errors[0]
                )
                # refused before anything moved: B's bytes, tokens and the cached blocks stay
                assert b.collective_rpc("weightsync_digests")[0] == held
                assert replica_greedy(b, PROMPTS, NEW) == tokens
                assert long_greedy(b) == (expected_long, CACHEABLE)
            else:
                assert not errors and not sent, (errors, sent)
                # the newly trained version: LONG reuses no block of the refused-over one
                assert long_greedy(b) == (trainer_greedy(setup.model, [LONG], NEW)[0], 0)
        b.collective_rpc("finish_weight_update")
        b.collective_rpc("shutdown_weight_transfer_engine")
    assert replica_greedy(b, PROMPTS, NEW) == expected


def _catch(errors, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except BaseException as e:
        errors.append(e)


def test_replica_killed_during_a_sync_fails_fast_naming_it_and_the_other_keeps_serving(setup):
    a, b = setup.llms
    served = setup.version  # both replicas serve it (the fixture)
    old_outputs = replica_greedy(a, PROMPTS, NEW)
    assert old_outputs == trainer_greedy(setup.model, PROMPTS, NEW)
    setup.train()
    victim = b.collective_rpc("weightsync_status")[0]["pid"]

    class KillingSource(StateDictSource):
        """The trainer's weights; B's worker is killed mid-sync: after the handshake,
        before the first tensor. (Killed before the handshake, its connection may already
        show as closed when the sync starts, and the sender then waits, as it should, up
        to the deadline for it to come back.)"""

        def tensors(self):
            os.kill(victim, signal.SIGKILL)
            while alive(victim):
                time.sleep(0.05)
            yield from super().tensors()

    t0 = time.monotonic()
    with pytest.raises(ReplicaUpdateError, match=r"replica 'B' \(receiver rank 1\)") as info:
        setup.rollout.update(KillingSource(dict(setup.model.state_dict())), served + 1)
    assert time.monotonic() - t0 < DETECT_S  # the lost connection named B, no deadline did
    report = info.value.report
    ra, rb = report.replicas
    assert (rb.name, rb.ok, rb.version) == ("B", False, None)
    # A: the kill came mid-transfer, so A holds its old version untouched, or the new one
    # whole (the broadcast reached it first), and serves it; or a mix, reported and kept
    # paused. Never a mix reported as a version, never resumed on one.
    assert ra.name == "A"
    if ra.mixed:
        assert (ra.version, ra.resumed, ra.failed_version) == (None, False, served + 1)
    else:
        assert ra.version in (served, served + 1) and ra.resumed, ra
        expected = old_outputs if ra.version == served else trainer_greedy(setup.model, PROMPTS, NEW)
        assert replica_greedy(a, PROMPTS, NEW) == expected


def test_a_source_failing_mid_stream_leaves_both_replicas_mixed_and_paused_until_a_complete_update(setup):
    """The trainer's source raises before the lm_head, after the embedding, both layers
    and the norm went out (buckets 0-2 of the plan's 5): every worker's reload_weights got
    those 26 tensors and a stream that ended, so each replica holds a mix of two versions.
    Both report it and stay paused: requests queued meanwhile do not run (they would
    finish in well under a second on a resumed replica). The next complete update makes
    them whole and resumes them, and the queued requests then generate what the trainer
    does."""
    from vllm import SamplingParams

    served = setup.version
    setup.train()
    expected = trainer_greedy(setup.model, PROMPTS, NEW)
    state = dict(setup.model.state_dict())
    after = list(state).index("lm_head.weight")
    assert after == len(state) - 1  # the last tensor, alone in the plan's last two buckets
    t0 = time.monotonic()
    with pytest.raises(ReplicaUpdateError, match="kept paused") as info:
        setup.rollout.update(workers.FailingSource(state, after), served + 1)
    assert time.monotonic() - t0 < DETECT_S  # the sender's abort reached the workers, no deadline did
    for rep in info.value.report.replicas:
        assert (rep.ok, rep.version, rep.mixed, rep.resumed, rep.failed_version) == (
            False,
            None,
            True,
            False,
            served + 1,
        ), rep
    assert [(r.version, r.mixed, r.ok) for r in setup.rollout.status()] == [(None, True, False)] * 2
    for r in setup.replicas:  # the partial stream reached vLLM's reload in every worker
        assert [s["applied"] for s in r.call("weightsync_status")] == [after], r.name

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    done: dict[int, list[list[int]]] = {}

    def run(i, llm):  # blocks until the requests finish: never, while the replica is paused
        done[i] = [list(o.outputs[0].token_ids) for o in llm.wait_for_completion(use_tqdm=False)]

    runners = []
    for i, llm in enumerate(setup.llms):
        llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        runners.append(threading.Thread(target=run, args=(i, llm), daemon=True))
        runners[-1].start()
    time.sleep(3)
    assert all(t.is_alive() for t in runners) and not done, "a replica serving a mix of versions generated"

    setup.version = served + 2
    report = setup.rollout.update(setup.model, setup.version)
    assert (
        report.ok
        and [(r.version, r.mixed, r.resumed) for r in report.replicas] == [(setup.version, False, True)] * 2
    )
    for t in runners:
        t.join(timeout=60)
    assert done == {0: expected, 1: expected}
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == expected


def _refused(setup, update, version, *names):
    """``update`` fails naming ``names`` for both replicas, each worker and its receiver
    rank; both then report a mix, kept paused, and still answer."""
    with pytest.raises(ReplicaUpdateError) as info:
        update()
    message = str(info.value)
    for rep, rank in zip(info.value.report.replicas, (0, 1)):
        assert f"replica {rep.name!r} (receiver rank {rank})" in message
        assert f"worker 0 (receiver rank {rank}): the engine did not take the update" in rep.error or (
            f"worker 0 (receiver rank {rank}): the engine's loader failed on tensor" in rep.error
        ), rep.error
        assert all(n in rep.error for n in names), rep.error
        assert (rep.ok, rep.version, rep.mixed, rep.resumed) == (False, None, True, False), rep
    assert [(r.version, r.mixed, r.failed_version) for r in setup.rollout.status()] == [
        (None, True, version)
    ] * 2
    return message


def test_an_update_the_engine_does_not_wholly_take_fails_naming_it_and_the_next_complete_one_serves_the_trainer(
    setup,
):
    """Never silent: each worker checks an update against what vLLM's loader reports it
    loaded. An extra tensor its loader skips without a word (a ``.bias`` where the layer has
    none: vLLM ignores such names), one it has no parameter for, and a full version that
    leaves a parameter out (streamed, or staged then committed: refused before anything
    moves, the replicas' bytes and greedy tokens as they were though the version carries
    newly trained weights) each fail naming it; after the first two the replicas report a
    mix and stay paused. A complete update then serves the trainer's outputs, and an update
    that says ``partial=True`` may leave a parameter as it is."""
    served = setup.version
    held = [llm.collective_rpc("weightsync_digests")[0] for llm in setup.llms]
    tokens = [replica_greedy(llm, PROMPTS, NEW) for llm in setup.llms]
    expected = setup.train()
    state = dict(setup.model.state_dict())
    first, *rest = state.items()

    left_out = "model.layers.1.mlp.down_proj.weight"
    without = {n: t for n, t in state.items() if n != left_out}
    # streamed: refused before anything moves (each worker vets the offered tensors against
    # its model's checkpoint), so the replicas keep serving what they held, byte for byte
    with pytest.raises(ReplicaUpdateError) as info:
        setup.rollout.update(without, served + 1)
    for rep in info.value.report.replicas:
        assert "refused version" in rep.error and "does not carry" in rep.error and left_out in rep.error
        assert (rep.ok, rep.version, rep.mixed) == (False, served, False), rep
    assert [llm.collective_rpc("weightsync_digests")[0] for llm in setup.llms] == held
    assert [replica_greedy(llm, PROMPTS, NEW) for llm in setup.llms] == tokens
    # staged: the stage takes what is sent; the commit checks it before the load
    staged = setup.rollout.stage(without, served + 2)
    assert staged.ok, staged.summary()
    with pytest.raises(ReplicaUpdateError) as info:
        setup.rollout.commit(served + 2)
    for rep in info.value.report.replicas:
        assert "commit refused before anything moved" in rep.error and left_out in rep.error, rep.error
        assert (rep.ok, rep.version, rep.mixed) == (False, served, False), rep
    assert [llm.collective_rpc("weightsync_digests")[0] for llm in setup.llms] == held
    assert [replica_greedy(llm, PROMPTS, NEW) for llm in setup.llms] == tokens

    def extra(name):  # early in the version, so loading goes on past it
        return dict([first, (name, torch.zeros(state[name.replace("bias", "weight")].shape[:1])), *rest])

    skipped = "model.layers.0.mlp.down_proj.bias"  # Qwen2's MLP has no bias: vLLM skips the name
    _refused(
        setup, lambda: setup.rollout.update(extra(skipped), served + 3), served + 3, skipped, "took nothing"
    )
    unknown = "model.layers.0.mlp.extra_proj.weight"
    state_unknown = dict([first, (unknown, torch.zeros(4, 4)), *rest])
    _refused(setup, lambda: setup.rollout.update(state_unknown, served + 4), served + 4, unknown)

    setup.version = served + 5
    report = setup.rollout.update(setup.model, setup.version)
    assert (
        report.ok
        and [(r.version, r.mixed, r.resumed) for r in report.replicas] == [(setup.version, False, True)] * 2
    )
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == expected
    setup.version = served + 6  # left_out did not change since the last version: partial says so
    report = setup.rollout.update(without, setup.version, partial=True)
    assert report.ok and [r.version for r in report.replicas] == [setup.version] * 2, report.summary()
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == expected


def _in_thread(fn, *args, **kwargs):
    """Run ``fn`` in a thread; returns the thread and a dict that gets "value" or "error"."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_staged_updates_load_while_replicas_generate_and_commit_matches_the_trainer(setup):
    """stage: the version moves into every worker's staging copy while the replicas keep
    serving the old one (requests sent while the stage's transfer is held under way complete
    with the old weights' outputs before it goes on); commit pauses only for the local load.
    Two versions: greedy parity with the trainer after each commit, and the second stage
    allocates nothing (the staging copy is reused)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for step in range(2):
        old = trainer_greedy(setup.model, PROMPTS, NEW)
        expected = setup.train()
        setup.version += 1
        source = workers.HeldSource(dict(setup.model.state_dict()))
        stage, out = _in_thread(setup.rollout.stage, source, setup.version)
        # The stage's transfer is under way and held there (the rollout thread is inside the
        # sender's send, not using the engines' clients) until requests sent now returned:
        # they run on the old weights while it lasts.
        assert source.holding.wait(30)
        for llm in setup.llms:
            llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        served = [
            [list(o.outputs[0].token_ids) for o in llm.wait_for_completion(use_tqdm=False)]
            for llm in setup.llms
        ]
        during = not source.finished.is_set() and not source.held_out
        source.release.set()
        assert during, (
            f"the requests waited for the stage ({source.hold_s:g} s held): the replicas did not generate"
        )
        assert served == [old, old]
        stage.join(timeout=60)
        report = out["value"]
        assert report.ok and report.phase == "stage" and report.paused_s == 0, report.summary()
        assert [(r.version, r.staged, r.resumed) for r in report.replicas] == [
            (setup.version - 1, setup.version, False)
        ] * 2
        size = sum(t.nbytes for t in setup.model.state_dict().values())
        assert all(r.staging_bytes >= size for r in report.replicas)  # one copy per worker
        if step == 1:
            assert [r.staging_allocated_bytes for r in report.replicas] == [0, 0]  # reused
        commit = setup.rollout.commit(setup.version, mode="abort")
        assert commit.ok and commit.phase == "commit" and commit.paused_s > 0, commit.summary()
        assert [(r.version, r.resumed) for r in commit.replicas] == [(setup.version, True)] * 2
        for llm in setup.llms:
            assert replica_greedy(llm, PROMPTS, NEW) == expected
    with pytest.raises(
        ValueError,
        match=f"cannot commit version {setup.version + 1}: replica 'A' has version {setup.version} staged",
    ):
        setup.rollout.commit(setup.version + 1)


def test_a_stage_whose_source_fails_leaves_every_replica_serving_and_unpaused(setup):
    """The trainer's source raises mid-stage (after the embedding and both layers went out):
    the stage raises naming both replicas, each still serves its version untouched and
    generates at once (nothing was paused), the torn staging copy cannot be committed, and
    the next staged update goes through."""
    served = setup.version
    old = replica_greedy(setup.llms[0], PROMPTS, NEW)
    expected = setup.train()
    state = dict(setup.model.state_dict())
    t0 = time.monotonic()
    with pytest.raises(
        ReplicaUpdateError, match=r"stage of version \d+ failed: replica 'A'.*untouched, generating"
    ) as info:
        setup.rollout.stage(workers.FailingSource(state, list(state).index("lm_head.weight")), served + 1)
    assert time.monotonic() - t0 < DETECT_S
    for rep in info.value.report.replicas:
        assert (rep.ok, rep.version, rep.mixed, rep.staged) == (False, served, False, None), rep
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == old
    with pytest.raises(ValueError, match="replica 'A' has no complete version staged"):
        setup.rollout.commit(served + 1)
    setup.version = served + 2
    report = setup.rollout.update(setup.model, setup.version, staged=True)
    assert report.ok and report.phase == "staged" and report.stage_s > 0, report.summary()
    for llm in setup.llms:
        assert replica_greedy(llm, PROMPTS, NEW) == expected


def test_a_replica_quantized_online_still_refuses_a_full_version_missing_a_matrix(tmp_path):
    """vLLM skips its own full-version check for any quantized model, and weightsync did too,
    so a replica quantizing a complete BF16 checkpoint online took a version missing a
    matrix as complete. Now its versions are checked against the checkpoint as an
    unquantized replica's are: streamed, refused before anything moves, and staged, refused
    at the commit before the load (bytes as they were in both). The replica: the tiny Qwen2 in
    bfloat16 with vLLM's online ``int8_per_channel_weight_only`` (on this CPU build it
    quantizes MoE layers only, so every dense layer stays as it is, but
    ``model_config.quantization`` is set: the path of every online-quantized replica;
    float32 is refused by the method, an MoE does not start without AMX)."""
    from transformers import AutoModelForCausalLM

    vllm_environment()
    model_dir = save_tiny_model(str(tmp_path / "model"), seed=3, vocab_size=VOCAB)
    llm = start_replica(
        model_dir, max_model_len=128, dtype="bfloat16", quantization="int8_per_channel_weight_only"
    )
    try:
        assert llm.llm_engine.vllm_config.model_config.quantization == "int8_per_channel_weight_only"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        with VLLMRollout([LLMReplica(llm, "Q")], OVERRIDES) as rollout:
            assert rollout.update(model, 1).ok
            held = llm.collective_rpc("weightsync_digests")[0]
            left_out = "model.layers.1.mlp.down_proj.weight"
            without = {n: t + 0.5 for n, t in model.state_dict().items() if n != left_out}
            with pytest.raises(ReplicaUpdateError) as info:
                rollout.update(without, 2)
            (rep,) = info.value.report.replicas
            assert "refused version 2" in rep.error and "does not carry 1 tensor(s)" in rep.error, rep.error
            assert left_out in rep.error and (rep.version, rep.mixed) == (1, False), rep
            assert llm.collective_rpc("weightsync_digests")[0] == held
            with pytest.raises(ReplicaUpdateError) as info:
                rollout.update(without, 3, staged=True)
            (rep,) = info.value.report.replicas
            assert (
                "commit refused before anything moved" in rep.error
                and "does not carry 1 tensor(s)" in rep.error
            )
            assert left_out in rep.error and (rep.version, rep.mixed) == (1, False), rep
            assert llm.collective_rpc("weightsync_digests")[0] == held
            assert rollout.update(model, 4).ok
            assert llm.collective_rpc("weightsync_digests")[0] == held
    finally:
        _shutdown(llm)
