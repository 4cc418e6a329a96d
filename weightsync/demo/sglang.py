"""``weightsync demo --rollout sglang``: a trainer fine-tunes a small LM and syncs it after
every step into real SGLang replicas (``SGLangRollout``), checking after each version that
every replica's greedy output equals the trainer's and that SGLang's own
``weight_version`` names it. ``--in-flight``: the replicas generate while they are updated
(``weightsync.demo.inflight``). Runs where SGLang is installed (``make install-sglang``:
``.venv-sglang/bin/weightsync demo --rollout sglang``)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.demo.plain import DemoFailed
from weightsync.demo.vllm import PROMPTS, save_tiny_model, train_until_changed, trainer_greedy


@dataclass
class SGLangDemoOptions:
    model: str | None = None
    replicas: int = 2
    steps: int = 3
    bucket_mb: int = 64
    overrides: list[str] = field(default_factory=list)
    address: str = "127.0.0.1:0"
    seed: int = 0
    mode: str = "keep"
    new_tokens: int = 8
    backend: str = "nccl"
    #: tensor-parallel workers per replica (each one receiver; SGLang slices in its loaders)
    tp: int = 1


def sglang_greedy(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy token ids from an SGLang ``Engine`` (token ids in and out)."""
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    return [list(o["output_ids"]) for o in engine.generate(input_ids=prompts, sampling_params=params)]


def _prepare(opts: SGLangDemoOptions, console: Any) -> tuple[Any, Any, str, Any]:
    """The console, configuration, model directory and the trainer's model (float32) of an
    SGLang demo, and its header lines."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from weightsync.config.engine import EngineConfig

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    console = console or Console(width=None if sys.stdout.isatty() else 100)
    config = EngineConfig.from_overrides(
        [f"backend={opts.backend}", f"update_weights_bucket_megabytes={opts.bucket_mb}", *opts.overrides]
    )
    workdir = tempfile.mkdtemp(prefix="weightsync-sglang-demo-")
    model_dir = opts.model or save_tiny_model(os.path.join(workdir, "model"), seed=opts.seed)
    torch.manual_seed(opts.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    vocab = model.config.vocab_size
    if any(t >= vocab for p in PROMPTS for t in p):
        raise DemoFailed(f"the model's vocabulary ({vocab}) is too small for the demo prompts")
    tp = f" x {opts.tp} TP workers" if opts.tp > 1 else ""
    console.print(
        f"[bold]weightsync demo --rollout sglang[/]: 1 trainer -> {opts.replicas} SGLang replicas{tp}, backend "
        f"{config.backend}, bucket {opts.bucket_mb} MiB, {opts.steps} steps, pause mode {opts.mode}"
    )
    console.print(
        f"model: {opts.model or 'tiny Qwen2-shaped default'}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, float32"
    )
    return console, config, model_dir, model


def _start(
    opts: SGLangDemoOptions, console: Any, model_dir: str, engines: list[Any], replicas: list[Any]
) -> None:
    """Start ``opts.replicas`` SGLang engines into ``engines`` and ``replicas`` (the caller
    shuts down what started, also after a failure)."""
    from weightsync.integrations.sglang import SGLangReplica, start_engine

    t0 = time.perf_counter()
    with console.status(f"starting {opts.replicas} SGLang replicas"):
        for i in range(opts.replicas):
            engines.append(start_engine(model_dir, tp=opts.tp, seed=opts.seed))
            replicas.append(SGLangReplica(engines[-1], f"replica{i}"))
    console.print(f"started {opts.replicas} SGLang replicas in {time.perf_counter() - t0:.1f} s")


def _shut(engines: list[Any], replicas: list[Any]) -> None:
    for engine in engines:
        engine.shutdown()
    for replica in replicas:
        replica.close()


def run_sglang_demo(opts: SGLangDemoOptions, console: Any = None) -> list[Any]:
    """Run the demo; raise ``DemoFailed`` (or a sync error) on any mismatch or failure."""
    from weightsync.integrations.sglang import SGLangRollout

    console, config, model_dir, model = _prepare(opts, console)
    vocab = model.config.vocab_size
    tp = f" x {opts.tp} TP workers" if opts.tp > 1 else ""
    engines: list[Any] = []
    replicas: list[Any] = []
    try:
        _start(opts, console, model_dir, engines, replicas)
        reports = []
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(opts.seed)
        with SGLangRollout(replicas, config, address=opts.address, model=model) as rollout:
            before = [sglang_greedy(e, PROMPTS, opts.new_tokens) for e in engines]
            for step in range(1, opts.steps + 1):
                target = torch.randint(0, vocab, (opts.new_tokens,), generator=gen).tolist()
                t0 = time.perf_counter()
                loss, iters = train_until_changed(
                    model, optimizer, target, trainer_greedy(model, PROMPTS, opts.new_tokens), opts.new_tokens
                )
                console.print(
                    f"step {step}: {iters} training iterations, loss {loss:.4f} "
                    f"({time.perf_counter() - t0:.1f} s); updating to version {step}"
                )
                report = rollout.update(model, version=step, mode=opts.mode)  # type: ignore[arg-type]
                expected = trainer_greedy(model, PROMPTS, opts.new_tokens)
                for i, (engine, replica, rep) in enumerate(zip(engines, replicas, report.replicas)):
                    got = sglang_greedy(engine, PROMPTS, opts.new_tokens)
                    if rep.version != step or replica.weight_version() != str(step):
                        raise DemoFailed(
                            f"{rep.name} reports version {rep.version} (SGLang's weight_version "
                            f"{replica.weight_version()!r}), expected {step}"
                        )
                    if got != expected:
                        raise DemoFailed(
                            f"{rep.name}, version {step}: greedy output {got} != trainer's {expected}"
                        )
                    if got == before[i]:
                        raise DemoFailed(f"{rep.name}, version {step}: output did not change with the update")
                    before[i] = got
                    console.print(
                        f"  version {step} {rep.name}: parity OK ({len(PROMPTS)} prompts x {opts.new_tokens} "
                        f"tokens), weight_version {replica.weight_version()!r}, "
                        f"{rep.bytes / 1e6:.3f} MB received"
                    )
                console.print(
                    f"  version {step}: pause {report.pause_s:.3f} s, sync {report.sync_s:.3f} s, "
                    f"resume {report.resume_s:.3f} s"
                )
                reports.append(report)
    finally:
        _shut(engines, replicas)
    console.print(
        f"demo OK: {len(reports)} updates to {opts.replicas} SGLang replicas{tp}, greedy parity with the trainer"
    )
    return reports


def run_sglang_in_flight_demo(opts: SGLangDemoOptions, console: Any = None) -> list[Any]:
    """``--in-flight`` on SGLang replicas (``weightsync.demo.inflight``, where its check is
    described): every replica generates in a thread of its own while the trainer updates it
    every step (``keep``: SGLang retracts the requests in flight, which recompute their KV
    under the new weights); raise ``DemoFailed`` on any mismatch."""
    from weightsync.demo.inflight import NEW_TOKENS, Engine, run_in_flight
    from weightsync.integrations.sglang import SGLangRollout

    console, config, model_dir, model = _prepare(opts, console)
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    progress: dict[str, dict[int, int]] = {}  # replica -> prompt index -> tokens so far

    def generate(replica: Any, prompts: list[list[int]]) -> list[Any]:
        counts = progress[replica.name] = {}
        try:
            return replica.generate(prompts, params, progress=counts.__setitem__)
        finally:
            counts.clear()

    def under_way(replica: Any, tokens: int) -> bool:
        return any(tokens <= n < NEW_TOKENS - tokens for n in list(progress.get(replica.name, {}).values()))

    engines: list[Any] = []
    replicas: list[Any] = []
    try:
        _start(opts, console, model_dir, engines, replicas)
        with SGLangRollout(replicas, config, address=opts.address, model=model, initial_version=0) as rollout:
            return run_in_flight(
                Engine(generate=generate, under_way=under_way, name="SGLang"),
                replicas,
                rollout,
                model,
                steps=opts.steps,
                seed=opts.seed,
                new_tokens=opts.new_tokens,
                console=console,
            )
    finally:
        _shut(engines, replicas)
