"""``weightsync demo --rollout vllm|sglang --in-flight``: generation never stops for the trainer.

Each replica generates in a thread of its own, batch after batch, while the trainer trains
and updates every replica every step (``mode="keep"``: requests running at the pause stay
in the engine and go on under the new weights). Every finished request is printed with the
versions that sampled its tokens (``[(first_token_index, version), ...]``, from the
engine's own labels: ``weightsync.integrations.replicas.versions``). Each update waits until
every replica has a request a quarter generated, so that it crosses requests whatever the
machine's speed.

The check does not trust those spans: it replays every request in the trainer's own model
(transformers, float32), each token by the weights of the version its span names over the
whole prefix: an update drops the engine's caches computed with the old weights, so the
requests kept across it compute their KV again under the new weights (vLLM: the prefix
cache reset preempts them; SGLang: its ``retract`` pause). Every token must be the replay's
greedy choice (a tie within ``TIE`` of the top logit is counted apart: the implementations
round differently). A boundary put one token off puts a token under the wrong version:
where the two versions disagree there (a *decisive* boundary), the replay fails. The demo
exits non-zero on any mismatch, or when no request crossed an update with a decisive
boundary (nothing would have been shown).

The engines differ only in ``Engine``: how a replica generates a batch, and how far its
requests in flight are (``weightsync.demo.vllm_inflight``, ``weightsync.demo.sglang``).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.demo.plain import DemoFailed
from weightsync.demo.vllm import PROMPTS, train_until_changed, trainer_greedy

#: greedy tokens whose top two logits in the replay are closer than this are ties
TIE = 1e-3
#: generated tokens per request; prompts of PROMPT_LEN tokens, BATCH requests per call.
#: Prompts span more than one KV block (BLOCK, vLLM's prefix caching on) and the first of
#: every batch is the same: after an update it would reuse the old version's cached KV
#: unless the update dropped the engine's caches, and its replay would fail.
NEW_TOKENS, PROMPT_LEN, BATCH, BLOCK = 48, 72, 4, 32


@dataclass
class Engine:
    """What the in-flight demo needs of an engine's replicas."""

    #: ``generate(replica, prompts)``: one batch of token-id prompts, greedy, ``NEW_TOKENS``
    #: each, as ``VersionedOutput``s; called from the replica's generating thread
    generate: Callable[[Any, list[list[int]]], list[Any]]
    #: ``under_way(replica, tokens)``: whether the replica has a request in flight with at
    #: least ``tokens`` generated and more than ``tokens`` still to come
    under_way: Callable[[Any, int], bool]
    name: str


def run_in_flight(
    engine: Engine,
    replicas: list[Any],
    rollout: Any,
    model: torch.nn.Module,
    *,
    steps: int,
    seed: int,
    new_tokens: int,
    console: Any,
) -> list[Any]:
    """Generate on every replica while the trainer trains and updates them ``steps`` times
    through ``rollout`` (which synced ``model`` as version 0); replay and check every request.
    Returns the updates' reports; raises ``DemoFailed`` on any mismatch."""
    vocab = model.config.vocab_size
    states: dict[int, dict[str, torch.Tensor]] = {0: _copy(model)}
    finished: list[tuple[str, list[int], Any]] = []  # (replica, prompt, VersionedOutput)
    lock, stop = threading.Lock(), threading.Event()
    errors: list[BaseException] = []

    def generate(replica: Any, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        repeated = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        try:
            while not stop.is_set():
                prompts = [repeated] + [
                    torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(BATCH - 1)
                ]
                outs = engine.generate(replica, prompts)
                with lock:
                    for p, out in zip(prompts, outs):
                        finished.append((replica.name, p, out))
                        console.print(f"  {replica.name} request {len(finished)}: spans {list(out.spans[0])}")
        except BaseException as e:
            errors.append(e)

    console.print(
        f"rollout ready, version 0 synced; {len(replicas)} generating threads, {BATCH} requests of "
        f"{NEW_TOKENS} tokens per call, mode keep"
    )
    threads = [
        threading.Thread(target=generate, args=(r, seed + i), name=f"generate-{r.name}", daemon=True)
        for i, r in enumerate(replicas)
    ]
    for t in threads:
        t.start()
    reports = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    try:
        for step in range(1, steps + 1):
            target = torch.randint(0, vocab, (new_tokens,), generator=gen).tolist()
            loss, iters = train_until_changed(
                model, optimizer, target, trainer_greedy(model, PROMPTS, new_tokens), new_tokens
            )
            states[step] = _copy(model)
            _mid_batch(engine, replicas, NEW_TOKENS // 4)
            report = rollout.update(model, version=step, mode="keep")
            console.print(
                f"step {step}: {iters} training iterations, loss {loss:.4f}; version {step} on every "
                f"replica, generation paused {report.paused_s:.3f} s"
            )
            reports.append(report)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    if errors:
        raise DemoFailed(f"generation failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    checked = _check(finished, states, model)
    console.print(
        f"demo OK: {len(reports)} updates to {len(replicas)} {engine.name} replicas while they generated: "
        f"{len(finished)} requests, {checked['crossing']} crossed an update; every token replayed under the "
        f"version its span names ({checked['tokens']} tokens, "
        f"{checked['ties']} ties), {checked['decisive']} boundaries where the versions on either side disagree"
    )
    return reports


def _mid_batch(engine: Engine, replicas: list[Any], tokens: int, timeout_s: float = 60.0) -> None:
    """Wait until every replica has a request in flight with ``tokens`` generated and most
    still to come (left to chance, a fast engine can finish each batch between two updates,
    and the update would cross nothing)."""
    deadline = time.monotonic() + timeout_s
    while not all(engine.under_way(r, tokens) for r in replicas) and time.monotonic() < deadline:
        time.sleep(0.002)


def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def replay(
    model: torch.nn.Module,
    states: dict[int, dict[str, torch.Tensor]],
    prompt: list[int],
    tokens: list[int],
    versions: list[Any],
) -> tuple[int, list[str]]:
    """Replay one request under its per-token versions; the ties and each mismatch, named.
    Token i is sampled by ``versions[i]`` over the prompt and tokens 0..i-1, whose KV that
    version computed (at a new version the cache is computed again, as the kept request's
    is in the engine)."""
    from transformers import DynamicCache

    cache, loaded, ties, problems = DynamicCache(), None, 0, []
    for i, (token, version) in enumerate(zip(tokens, versions)):
        if version not in states:
            return ties, [f"token {i}: version {version} was never synced"]
        if version != loaded:
            model.load_state_dict(states[version])
            loaded, cache = version, DynamicCache()
            ids = torch.tensor([prompt + tokens[:i]])
        else:
            ids = torch.tensor([[tokens[i - 1]]])
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        best = int(logits.argmax())
        if best == token:
            continue
        if float(logits[best] - logits[token]) < TIE:
            ties += 1
        else:
            problems.append(f"token {i} is {token}, version {version} gives {best}")
    return ties, problems


def _check(
    finished: list[tuple[str, list[int], Any]],
    states: dict[int, dict[str, torch.Tensor]],
    model: torch.nn.Module,
) -> dict[str, int]:
    """Replay every finished request; raise ``DemoFailed`` naming the mismatches."""
    replayer = copy.deepcopy(model).eval()
    counts = {"tokens": 0, "ties": 0, "crossing": 0, "decisive": 0}
    failures = []
    t0 = time.perf_counter()
    for number, (name, prompt, out) in enumerate(finished, start=1):
        tokens = list(out.tokens[0])
        versions = out.token_versions(0)
        ties, problems = replay(replayer, states, prompt, tokens, versions)
        counts["tokens"] += len(tokens)
        counts["ties"] += ties
        failures += [f"{name} request {number} (spans {list(out.spans[0])}): {p}" for p in problems]
        spans = out.spans[0]
        if len(spans) > 1:
            counts["crossing"] += 1
            # each boundary: would the version before it have sampled the same first token?
            for start, _ in spans[1:]:
                shifted = versions[:start] + [versions[start - 1]] + versions[start + 1 :]
                _, wrong = replay(replayer, states, prompt, tokens[: start + 1], shifted[: start + 1])
                counts["decisive"] += bool(wrong)
    if failures:
        raise DemoFailed(f"{len(failures)} tokens are not what their spans say: " + "; ".join(failures[:5]))
    if not counts["decisive"]:
        raise DemoFailed(
            f"no request crossed an update at a token the versions disagree on ({counts['crossing']} crossed): "
            "the spans were not put to the test"
        )
    counts["replay_s"] = int(time.perf_counter() - t0)
    return counts
