"""``weightsync bench --rollout sglang``: a weightsync update of real SGLang replicas against
SGLang's own ``update_weights_from_disk`` of the same version, in one run.

The replicas start once (a Qwen2 model of ``size_mb``, float32, SGLang's CPU engine where
CUDA is absent). Per backend, an ``SGLangRollout`` sends a first update (untimed: buffers
and first-load costs), then ``repeats`` timed ones, the trainer's weights changed before
each. After each update the trainer saves the same weights (safetensors) and every replica
reloads them through ``update_weights_from_disk`` (page cache: the file was just written),
all replicas at once, as the update does: the row's ratio compares the medians of the two
taken in the same stretch of the run. Every update is checked before the reload
overwrites it: each replica's bytes (every TP worker's parameters, digested) have changed
and then equal what SGLang's reload of the same version loads; after the last update of a
row, before its reload, every replica's greedy output is the trainer's.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.bench.vllm import model_config
from weightsync.bench.vllm_trainers import bump_weights


@dataclass
class SGLangBenchOptions:
    backends: list[str] = field(default_factory=lambda: ["nccl", "shm"])
    model: str | None = None
    size_mb: float = 392
    replicas: int = 2
    bucket_mb: int = 64
    repeats: int = 3
    overrides: list[str] = field(default_factory=list)
    work_dir: str | None = None
    tp: int = 1


def run_sglang_bench(opts: SGLangBenchOptions, progress: Any = None) -> dict[str, Any]:
    """Run the rows; a dict with the model, one row per backend, each with the update's and
    the reload's medians (seconds) and their ratio. Raises on any failed update or a replica
    whose greedy output differs from the trainer's."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.demo.sglang import sglang_greedy
    from weightsync.demo.vllm import PROMPTS, trainer_greedy
    from weightsync.integrations.sglang import SGLangReplica, SGLangRollout, start_engine

    say = progress or (lambda text: None)
    work = opts.work_dir or tempfile.mkdtemp(prefix="weightsync-sglang-bench-")
    model_dir = opts.model
    if model_dir is None:
        model_dir = os.path.join(work, "model")
        torch.manual_seed(0)
        config = AutoConfig.for_model(**model_config(opts.size_mb))
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model_bytes = sum(t.nbytes for t in model.state_dict().values())
    say(f"model: {model_bytes / 1e6:.0f} MB float32; starting {opts.replicas} SGLang replicas (TP {opts.tp})")
    t0 = time.perf_counter()
    engines = [start_engine(model_dir, tp=opts.tp) for _ in range(opts.replicas)]
    say(f"replicas started in {time.perf_counter() - t0:.1f} s")
    replicas = [SGLangReplica(e, f"replica{i}") for i, e in enumerate(engines)]
    reload_dir = os.path.join(work, "reload")
    os.makedirs(reload_dir, exist_ok=True)
    for name in os.listdir(model_dir):  # the config and tokenizer files SGLang reads beside the weights
        if not name.endswith(".safetensors"):
            src, dst = os.path.join(model_dir, name), os.path.join(reload_dir, name)
            if os.path.isfile(src) and not os.path.exists(dst):
                os.symlink(src, dst)
    rows = []
    version = 0

    def check_greedy() -> None:
        expected = trainer_greedy(model, PROMPTS, 8)
        for engine, replica in zip(engines, replicas):
            got = sglang_greedy(engine, PROMPTS, 8)
            if got != expected:
                raise RuntimeError(f"{replica.name}: greedy output {got} != trainer's {expected}")

    pool = ThreadPoolExecutor(max_workers=len(replicas))
    try:
        for backend in opts.backends:
            config = [
                f"backend={backend}",
                f"update_weights_bucket_megabytes={opts.bucket_mb}",
                *opts.overrides,
            ]
            updates: list[float] = []
            reloads: list[float] = []
            saves: list[float] = []
            checked = 0
            held = list(pool.map(lambda r: r.call("weightsync_digests"), replicas))
            with SGLangRollout(replicas, config, model=model) as rollout:
                for i in range(opts.repeats + 1):
                    version += 1
                    bump_weights(model, version)
                    report = rollout.update(model, version)
                    synced = list(pool.map(lambda r: r.call("weightsync_digests"), replicas))
                    if i == opts.repeats:  # the update's tokens, before the reload overwrites them
                        check_greedy()
                    t0 = time.perf_counter()
                    save_file(
                        {k: v.contiguous() for k, v in model.state_dict().items()},
                        os.path.join(reload_dir, "model.safetensors"),
                    )
                    save_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    list(pool.map(lambda r: r.call("weightsync_reload_from_path", reload_dir), replicas))
                    reload_s = time.perf_counter() - t0
                    reloaded = list(pool.map(lambda r: r.call("weightsync_digests"), replicas))
                    for replica, before, got, want in zip(replicas, held, synced, reloaded):
                        if got == before or got != want:
                            differ = sorted(
                                n
                                for w_got, w_want in zip(got, want)
                                for n in w_want
                                if w_got.get(n) != w_want[n]
                            )
                            raise RuntimeError(
                                f"{replica.name}, version {version}: the update's bytes "
                                + (
                                    "did not change"
                                    if got == before
                                    else f"differ from SGLang's reload: {differ[:8]}"
                                )
                            )
                    held = reloaded
                    checked += 1
                    if i == 0:
                        continue  # first-use costs on both sides
                    updates.append(report.sync_s + report.pause_s + report.resume_s)
                    reloads.append(reload_s)
                    saves.append(save_s)
                    say(
                        f"{backend} v{version}: update {updates[-1]:.3f} s (sync {report.sync_s:.3f} s), "
                        f"update_weights_from_disk {reload_s:.3f} s (+ save {save_s:.3f} s)"
                    )
            update_s, reload_s = statistics.median(updates), statistics.median(reloads)
            rows.append(
                {
                    "backend": backend,
                    "replicas": opts.replicas,
                    "tp": opts.tp,
                    "update_s": update_s,
                    "reload_from_disk_s": reload_s,
                    "save_s": statistics.median(saves),
                    "update_vs_reload": update_s / reload_s,
                    "updates": updates,
                    "reloads": reloads,
                    "updates_checked_against_reload": checked,
                }
            )
            say(
                f"{backend}: update {update_s:.3f} s vs SGLang's update_weights_from_disk {reload_s:.3f} s "
                f"(median of {opts.repeats}): {update_s / reload_s:.2f}x; {checked} updates' bytes equal SGLang's "
                f"reload, greedy parity OK"
            )
    finally:
        pool.shutdown(wait=False)
        for engine in engines:
            engine.shutdown()
        for replica in replicas:
            replica.close()
    return {"model_bytes": model_bytes, "rows": rows}
