"""``weightsync demo --rollout vllm --in-flight``: generation never stops for the trainer.

Each replica generates in a thread of its own, batch after batch, while the trainer trains
and updates every replica every step (``mode="keep"``: requests running at the pause stay
in the engine and go on under the new weights). Every finished request is printed with the
versions that sampled its tokens (``[(first_token_index, version), ...]``, from the
engine's own labels: ``weightsync.integrations.vllm_versions``).

The check does not trust those spans: it replays every request in the trainer's own model
(transformers, float32), each token by the weights of the version its span names over the
whole prefix: an update resets the engine's prefix cache, which preempts the requests kept
across it, so their KV is computed again by the new weights (``vllm_caches``). Every
token must be the replay's greedy choice (a tie within ``TIE`` of the top logit is counted
apart: the two implementations round differently). A boundary put one token off puts a
token under the wrong version: where the two versions disagree there (a *decisive*
boundary), the replay fails. The demo exits non-zero on any mismatch, or when no request
crossed an update with a decisive boundary (nothing would have been shown).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch

from weightsync.demo.plain import DemoFailed
from weightsync.demo.vllm import (
    PROMPTS,
    VLLMDemoOptions,
    prepare_demo,
    start_replicas,
    train_until_changed,
    trainer_greedy,
)

#: greedy tokens whose top two logits in the replay are closer than this are ties
TIE = 1e-3
#: generated tokens per request; prompts of PROMPT_LEN tokens, BATCH requests per call.
#: Prompts span more than one KV block (BLOCK, prefix caching on) and the first of every
#: batch is the same: after an update it would reuse the old version's cached KV unless
#: the update reset the prefix cache, and its replay would fail.
NEW_TOKENS, PROMPT_LEN, BATCH, BLOCK = 48, 72, 4, 32


def run_in_flight_demo(opts: VLLMDemoOptions, console: Any = None) -> list[Any]:
    """Run the in-flight demo; raise ``DemoFailed`` on any mismatch."""
    from vllm import SamplingParams

    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout

    setup = prepare_demo(opts, console)
    console, config, model = setup.console, setup.config, setup.model
    llms = start_replicas(
        opts, console, setup.model_dir, setup.max_len, enable_prefix_caching=True, block_size=BLOCK
    )
    replicas = [LLMReplica(llm, f"replica{i}") for i, llm in enumerate(llms)]
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    states: dict[int, dict[str, torch.Tensor]] = {0: _copy(model)}
    finished: list[tuple[str, list[int], Any]] = []  # (replica, prompt, VersionedOutput)
    lock, stop = threading.Lock(), threading.Event()
    errors: list[BaseException] = []

    def generate(replica: LLMReplica, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        repeated = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        try:
            while not stop.is_set():
                prompts = [repeated] + [
                    torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(BATCH - 1)
                ]
                outs = replica.generate([{"prompt_token_ids": p} for p in prompts], params)
                with lock:
                    for p, out in zip(prompts, outs):
                        finished.append((replica.name, p, out))
                        console.print(f"  {replica.name} request {len(finished)}: spans {list(out.spans[0])}")
        except BaseException as e:
            errors.append(e)

    reports = []
    with VLLMRollout(replicas, config, address=opts.address, model=model, initial_version=0) as rollout:
        console.print(
            f"rollout ready, version 0 synced; {len(replicas)} generating threads, {BATCH} requests of "
            f"{NEW_TOKENS} tokens per call, mode keep"
        )
        threads = [
            threading.Thread(target=generate, args=(r, opts.seed + i), name=f"generate-{r.name}", daemon=True)
            for i, r in enumerate(replicas)
        ]
        for t in threads:
            t.start()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(opts.seed)
        try:
            for step in range(1, opts.steps + 1):
                target = torch.randint(0, vocab, (opts.new_tokens,), generator=gen).tolist()
                loss, iters = train_until_changed(
                    model, optimizer, target, trainer_greedy(model, PROMPTS, opts.new_tokens), opts.new_tokens
                )
                states[step] = _copy(model)
                _mid_batch(llms, NEW_TOKENS // 4)
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
        f"demo OK: {len(reports)} updates to {len(replicas)} vLLM replicas while they generated: "
        f"{len(finished)} requests, {checked['crossing']} crossed an update; every token replayed under the "
        f"version its span names ({checked['tokens']} tokens, "
        f"{checked['ties']} ties), {checked['decisive']} boundaries where the versions on either side disagree"
    )
    return reports


def _mid_batch(llms: list[Any], tokens: int, timeout_s: float = 60.0) -> None:
    """Wait until every replica has a request in flight with ``tokens`` generated and most
    still to come, so that the update that follows crosses requests whatever the machine's
    speed (left to chance, a fast engine can finish each batch between two updates). Reads
    vLLM 0.32's front-end request states, which the generating thread advances."""
    deadline = time.monotonic() + timeout_s

    def under_way(llm: Any) -> bool:
        try:
            states = list(llm.llm_engine.output_processor.request_states.values())
        except RuntimeError:  # the generating thread changed the dict meanwhile
            return False
        return any(tokens <= s.detokenizer.num_output_tokens() < NEW_TOKENS - tokens for s in states)

    while not all(under_way(llm) for llm in llms) and time.monotonic() < deadline:
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
    version computed (at a new version the cache is computed again, as the preempted request
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
    for name, prompt, out in finished:
        tokens = list(out.output.outputs[0].token_ids)
        versions = out.token_versions(0)
        ties, problems = replay(replayer, states, prompt, tokens, versions)
        counts["tokens"] += len(tokens)
        counts["ties"] += ties
        failures += [
            f"{name} request {out.output.request_id} (spans {list(out.spans[0])}): {p}" for p in problems
        ]
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
