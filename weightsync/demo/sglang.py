"""``weightsync demo --rollout sglang``: a trainer fine-tunes a small LM and syncs it after
every step into real SGLang replicas (``SGLangRollout``), checking after each version that
every replica's greedy output equals the trainer's and that SGLang's own
``weight_version`` names it. Runs where SGLang is installed (``make install-sglang``:
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


def run_sglang_demo(opts: SGLangDemoOptions, console: Any = None) -> list[Any]:
    """Run the demo; raise ``DemoFailed`` (or a sync error) on any mismatch or failure."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from weightsync.config.engine import EngineConfig
    from weightsync.integrations.sglang import SGLangReplica, SGLangRollout, start_engine

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
    t0 = time.perf_counter()
    engines = []
    replicas = []
    try:
        with console.status(f"starting {opts.replicas} SGLang replicas"):
            for i in range(opts.replicas):
                engines.append(start_engine(model_dir, tp=opts.tp, seed=opts.seed))
                replicas.append(SGLangReplica(engines[-1], f"replica{i}"))
        console.print(f"started {opts.replicas} SGLang replicas in {time.perf_counter() - t0:.1f} s")
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
        for engine in engines:
            engine.shutdown()
        for replica in replicas:
            replica.close()
    console.print(
        f"demo OK: {len(reports)} updates to {opts.replicas} SGLang replicas{tp}, greedy parity with the trainer"
    )
    return reports
