"""``weightsync bench --rollout vllm``: a weightsync update of real vLLM replicas against
the replicas reloading the same weights from disk, in one run.

The replicas start once. Per backend, a new ``VLLMRollout`` syncs the trainer's weights at
construction (``initial_version``, timed) unless ``initial_sync`` is off; then a first
update and ``repeats`` timed ones (the trainer's weights change before each), the row's
figure being their median. After each update the trainer saves the same weights
(``safetensors.torch.save_file``) and every replica reloads them at once
(``reload_weights(weights_path=...)``): the row's ratios compare medians taken in the
same stretch of the run, as the machine's load drifts. After the last update every
replica's greedy output is checked against the trainer's.

With several ``modes`` (``update_mode`` stream and staged) each backend gets a row per
mode; ``paused_s`` is what the modes differ in (a staged update pauses only for the local
load), and a staged row also measures one replica's generation (tokens/s) while a stage
runs against the same requests idle. With ``hosts`` (``--hosts N --link RATE``, root) the
trainer runs on emulated host 0 and the replicas' processes on the others, every NIC shaped.
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

from weightsync.bench.vllm_trainers import TrainerRanks, bump_weights

#: the Qwen2 shapes of the measurements in BENCHMARKS.md: (vocab, hidden, intermediate,
#: heads, kv heads) and the bytes of the two embeddings, of one layer (fp32)
_LARGE = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=2
)
_SMALL = dict(
    vocab_size=5000, hidden_size=128, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
)
#: vLLM's workers spin on their queue (``sched_yield``) for 1 s after each call they read:
#: the trainer's save waits that long after the last call, so it does not share the cores
#: with them (in an RL loop the save follows a training step, not a call)
_WORKERS_SPIN_S = 1.0


def _layer_bytes(c: dict[str, int]) -> int:
    h, i, kv = (
        c["hidden_size"],
        c["intermediate_size"],
        c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"],
    )
    return 4 * (2 * h * h + 2 * h * kv + 3 * h * i + h + 2 * kv + 2 * h)


def model_config(size_mb: float) -> dict[str, Any]:
    """A Qwen2 config of about ``size_mb`` MB in fp32 (392 MB: 8 layers of the large shape)."""
    base = _LARGE if size_mb >= 250 else _SMALL
    embed = 2 * 4 * base["vocab_size"] * base["hidden_size"]
    layers = max(1, round((size_mb * 1e6 - embed) / _layer_bytes(base)))
    return {
        "model_type": "qwen2",
        **base,
        "num_hidden_layers": layers,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }


@dataclass
class VLLMBenchOptions:
    backends: list[str] = field(default_factory=lambda: ["nccl", "shm"])
    model: str | None = None
    size_mb: float = 392
    replicas: int = 2
    bucket_mb: int = 64
    repeats: int = 5
    overrides: list[str] = field(default_factory=list)
    work_dir: str | None = None
    #: each rollout syncs the model at construction (``initial_version``); off: the first
    #: ``update`` is the first sync of the rollout (on fresh replicas, vLLM's first reload)
    initial_sync: bool = True
    #: ``update_mode`` values to measure per backend: ``stream`` and/or ``staged`` (rows
    #: per backend and mode; staged rows add the replicas' generation during a stage)
    modes: list[str] = field(default_factory=lambda: ["stream"])
    #: an emulated cluster (``weightsync.bench.cluster``, needs root): the trainer on host 0,
    #: the replicas on the others; 0: one host, loopback
    hosts: int = 0
    link: str = "1gbit"
    #: > 0: the replicas serve LoRA too, and each backend gets a ``lora`` row: a PEFT adapter
    #: of this rank (every linear layer) updated ``repeats`` times, against that backend's
    #: full-model update of the same replicas in the same run
    lora_rank: int = 0
    #: tensor-parallel workers per replica (with ``sharded``: each takes only its slices)
    tp: int = 1
    #: trainer ranks of backends where every rank sends (``sharded``, ``paired``): this
    #: process is rank 0, the others processes of their own (on hosts of their own with
    #: ``hosts``), each holding ``Shard(0)`` of every tensor as FSDP2 does
    trainers: int = 1


def _rss(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # the fields after the command name


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process used so far (all its threads)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CPU:
    """CPU seconds of the run's processes between two points: the trainer's (the sender
    and the replicas' vLLM front-ends), the replicas' engine cores (the workers' parents)
    and their workers. On 2 shared cores an update and a reload from disk are bounded by
    these sums, not by any one process."""

    def __init__(self, workers: list[int]) -> None:
        self.groups = {
            "trainer": [os.getpid()],
            "engine_cores": list(dict.fromkeys(int(_stat(w)[1]) for w in workers)),  # TP workers share one
            "workers": list(workers),
        }
        self.start: dict[str, float] = {}

    def now(self) -> dict[str, float]:
        return {k: sum(_cpu_s(p) for p in pids) for k, pids in self.groups.items()}

    def begin(self) -> None:
        self.start = self.now()

    def end(self) -> dict[str, float]:
        return {k: v - self.start[k] for k, v in self.now().items()}


def _show(cpu: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())


def _reset_peak(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (our own child process)
    except OSError:
        pass


#: the generation measured during a stage against idle: requests of this many tokens
_GEN_TOKENS = 48


def _generation(llm: Any, prompts: list[list[int]], during: Any = None) -> dict[str, float]:
    """Tokens per second of greedy requests on ``llm``, idle or while ``during()`` (started
    right after the requests were queued, in a thread) runs; its seconds as ``during_s``."""
    import threading

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=_GEN_TOKENS, ignore_eos=True)
    llm.enqueue([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spent: dict[str, float] = {}

    def run() -> None:
        t = time.perf_counter()
        during()
        spent["during_s"] = time.perf_counter() - t

    thread = threading.Thread(target=run, daemon=True) if during is not None else None
    t0 = time.perf_counter()
    if thread is not None:
        thread.start()
    outs = llm.wait_for_completion(use_tqdm=False)
    seconds = time.perf_counter() - t0
    if thread is not None:
        thread.join()
    return {
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
        "seconds": seconds,
        **spent,
    }


def _lora_row(
    opts: VLLMBenchOptions, rollout: Any, model: torch.nn.Module, step: int, full: dict[str, Any], say: Any
) -> dict[str, Any]:
    """LoRA-only updates through ``rollout`` (whose replicas serve ``model`` as synced): a
    PEFT adapter of ``opts.lora_rank`` on a copy of ``model``, changed before each of
    ``repeats + 1`` updates (the first not timed); the last one's greedy output checked
    against the trainer's merged model."""
    import copy

    from peft import LoraConfig, get_peft_model

    from weightsync.demo.vllm import LORA_TARGETS, PROMPTS, replica_greedy, trainer_greedy

    peft_model = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=opts.lora_rank, lora_alpha=2 * opts.lora_rank, target_modules=LORA_TARGETS),
    )
    adapter_bytes = sum(p.nbytes for n, p in peft_model.named_parameters() if ".lora_" in n)
    updates, wire = [], []
    for i in range(opts.repeats + 1):
        g = torch.Generator().manual_seed(step + i)
        with torch.no_grad():  # a training step's worth of change to every adapter tensor
            for name, p in peft_model.named_parameters():
                if ".lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-2)
        t0 = time.perf_counter()
        report = rollout.update(peft_model, step + 1 + i, lora=True)
        updates.append(time.perf_counter() - t0)
        wire.append(report.stats.bytes)
        say(f"{full['backend']} lora update {i}: {updates[-1]:.4f} s, {report.stats.bytes / 1e6:.3f} MB")
    merged = trainer_greedy(copy.deepcopy(peft_model).merge_and_unload(), PROMPTS, 8)
    llms = [getattr(r, "llm", None) for r in rollout.replicas]
    greedy = all(replica_greedy(llm, PROMPTS, 8, report.lora_request) == merged for llm in llms if llm)
    seconds = statistics.median(updates[1:])
    return {
        "backend": full["backend"],
        "update_mode": "lora",
        "bucket_mb": opts.bucket_mb,
        "lora_rank": opts.lora_rank,
        "bytes": adapter_bytes,
        "wire_bytes": max(wire),
        "first_s": round(updates[0], 4),
        "seconds": round(seconds, 4),
        "repeats_s": [round(u, 4) for u in updates[1:]],
        "paused_s": 0.0,
        "full_update_s": full["seconds"],
        "ratio_to_full_update": round(seconds / full["seconds"], 4),
        "greedy_matches_trainer": greedy,
    }


def _all_send(backend: str) -> bool:
    from weightsync.engines.registry import get_engine

    return bool(getattr(get_engine(backend), "all_ranks_send", False))


def run_vllm_bench(opts: VLLMBenchOptions, progress: Any = None) -> dict[str, Any]:
    """Run the bench (see the module docstring); with ``opts.hosts``, on an emulated cluster,
    from a thread that enters each host's namespace (the process's own thread stays where
    it is)."""
    if opts.trainers > 1 and (opts.modes != ["stream"] or opts.lora_rank):
        raise ValueError(
            "--trainers above 1: streamed updates only (no --update-mode staged, no --lora-rank)"
        )
    if not opts.hosts:
        return _run(opts, progress, None)
    import threading

    from weightsync.bench.cluster import Cluster, parse_rate

    if opts.hosts < opts.trainers + 1:
        raise ValueError(
            f"--hosts {opts.hosts}: a host per trainer rank ({opts.trainers}) and at least one for the replicas"
        )
    out: dict[str, Any] = {}
    with Cluster(opts.hosts, parse_rate(opts.link)) as cluster:

        def run() -> None:
            try:
                out["result"] = _run(opts, progress, cluster)
            except BaseException as e:
                out["error"] = e

        thread = threading.Thread(target=run, name="weightsync-vllm-bench")
        thread.start()
        thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _run(opts: VLLMBenchOptions, progress: Any, cluster: Any) -> dict[str, Any]:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightsync.demo.vllm import PROMPTS, replica_greedy, start_replica, trainer_greedy, vllm_environment
    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout
    from weightsync.plan import TensorSpec
    from weightsync.platform import free_port
    from weightsync.sharding.typical import held, trainer_boxes

    def say(text: str) -> None:
        if progress is not None:
            progress(text)

    vllm_environment(opts.tp)
    tmp = tempfile.TemporaryDirectory(prefix="weightsync-vllm-bench-", dir=opts.work_dir)
    llms: list[Any] = []
    peers: TrainerRanks | None = None
    try:
        model_dir = opts.model
        if model_dir is None:
            model_dir = os.path.join(tmp.name, "model")
            torch.manual_seed(0)
            config = AutoConfig.for_model(**model_config(opts.size_mb))
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        nbytes = sum(t.nbytes for t in model.state_dict().values())
        tp = f" of {opts.tp} tensor-parallel workers" if opts.tp > 1 else ""
        say(f"model: {nbytes / 1e6:.0f} MB; starting {opts.replicas} replicas{tp}")
        host = "127.0.0.1"
        engine: dict[str, Any] = {"tensor_parallel_size": opts.tp} if opts.tp > 1 else {}
        if opts.lora_rank:
            engine |= dict(max_loras=2, lora_rank=opts.lora_rank)  # start_replica sizes max_lora_rank
        for i in range(opts.replicas):
            if cluster is not None:  # vLLM's processes start in the replica's host
                from weightsync.bench.cluster import enter

                enter(cluster.hosts[opts.trainers + i % (len(cluster.hosts) - opts.trainers)].netns)
            llms.append(start_replica(model_dir, max_model_len=128, **engine))
        if cluster is not None:
            enter(cluster.hosts[0].netns)
            host = cluster.hosts[0].address
        address = f"{host}:0"
        peers = TrainerRanks(opts.trainers, model_dir, cluster)
        state = model.state_dict()
        specs = [TensorSpec.of(n, t) for n, t in state.items()]

        def bump(step: int) -> None:
            assert peers is not None
            peers.bump(step)  # the other ranks change their copies meanwhile, outside the timed update
            bump_weights(model, step)
            peers.bumped()

        def senders(backend: str, overrides: list[str]) -> tuple[int, str, Any]:
            """A row's trainer ranks (every rank sends its Shard(0) where ``backend`` lets
            every rank send), the address rank 0 listens at, and this rank's source; the
            other ranks' senders are opened there."""
            assert peers is not None
            ranks = opts.trainers if _all_send(backend) else 1
            if ranks == 1:
                if backend == "ipc":  # the workers read the trainer's own tensors: in shared memory
                    from weightsync.engines.shared_tensors import share_tensors

                    share_tensors(model)
                return 1, address, model
            row_address = f"{host}:{free_port(host)}"
            peers.open(row_address, overrides, opts.replicas * opts.tp)
            return ranks, row_address, held(state, trainer_boxes(specs, ranks, 0))

        replicas = [LLMReplica(llm, f"replica{i}") for i, llm in enumerate(llms)]
        disk = os.path.join(tmp.name, "disk")
        os.makedirs(disk, exist_ok=True)
        for f in os.listdir(model_dir):
            if f.endswith(".json"):
                with open(os.path.join(model_dir, f), "rb") as src, open(os.path.join(disk, f), "wb") as dst:
                    dst.write(src.read())

        def disk_round(cpu: _CPU) -> tuple[float, float]:
            """The trainer saves the model, every replica reloads it at once: (save, reload)
            seconds; ``cpu`` measures the reload."""
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            time.sleep(_WORKERS_SPIN_S)
            t0 = time.perf_counter()
            save_file(state, os.path.join(disk, "model.safetensors"), metadata={"format": "pt"})
            save_s = time.perf_counter() - t0
            with ThreadPoolExecutor(len(replicas)) as pool:
                cpu.begin()
                t0 = time.perf_counter()
                for call in [pool.submit(r.call, "weightsync_reload_from_path", disk) for r in replicas]:
                    call.result()  # a replica's failure fails the bench
                return save_s, time.perf_counter() - t0

        step = 0
        rows: list[dict[str, Any]] = []
        saves, reloads = [], []
        for backend, mode in [(b, m) for b in opts.backends for m in opts.modes]:
            overrides = [
                f"backend={backend}",
                f"update_weights_bucket_megabytes={opts.bucket_mb}",
                f"update_mode={mode}",
                *opts.overrides,
            ]
            step += 1
            bump(step)
            ranks, row_address, source = senders(backend, overrides)
            if ranks > 1 and opts.initial_sync:
                peers.send(step)
            t0 = time.perf_counter()
            rollout = VLLMRollout(
                replicas,
                overrides,
                address=row_address,
                model=source,
                initial_version=step if opts.initial_sync else None,
                num_trainers=ranks,
            )
            init_s = time.perf_counter() - t0
            if ranks > 1 and opts.initial_sync:
                peers.sent(rollout.config.timeout_s)
            initial = rollout.initial_report
            say(
                f"{backend}: rollout created in {init_s:.3f} s"
                + (f" (initial sync {initial.sync_s:.3f} s)" if initial is not None else "")
            )
            try:
                pids = [w["pid"] for r in replicas for w in r.call("weightsync_status")]
                cpu = _CPU(pids)
                updates: list[dict[str, Any]] = []
                row_saves, row_reloads, row_disk_cpu = [], [], []
                for i in range(opts.repeats + 1):
                    step += 1
                    bump(step)
                    rss = [_rss(p)["VmRSS"] for p in pids]
                    for p in pids:
                        _reset_peak(p)
                    if ranks > 1:
                        peers.send(step)
                    cpu.begin()
                    t0 = time.perf_counter()
                    report = rollout.update(source, step, mode="keep")
                    total = time.perf_counter() - t0
                    update_cpu = cpu.end()
                    # each trainer rank's own bytes sent (rank 0's wire bytes count every rank's)
                    trainer_bytes = [report.stats.wire_bytes if report.stats else 0]
                    if ranks > 1:
                        others = [a["bytes"] for a in peers.sent(rollout.config.timeout_s)]
                        trainer_bytes = [trainer_bytes[0] - sum(others), *others]
                    workers = [w for r in replicas for w in r.call("weightsync_status")]
                    peaks = [_rss(p)["VmHWM"] for p in pids]

                    def most(
                        key: str, scale: float = 1.0
                    ) -> float | None:  # a staged update has no landing figures
                        values = [w[key] for w in workers if w.get(key) is not None]
                        return max(values) / scale if values else None

                    updates.append(
                        {
                            "seconds": total,
                            "paused_s": report.paused_s,
                            "pause_s": report.pause_s,
                            "sync_s": report.sync_s,
                            "resume_s": report.resume_s,
                            "stage_s": report.stage_s if mode == "staged" else None,
                            "handshake_s": report.stats.handshake_s if report.stats else None,
                            "transfer_s": report.stats.transfer_s if report.stats else None,
                            "worker_load_s": most("commit_s" if mode == "staged" else "load_s"),
                            "worker_first_s": most("first_s"),
                            "worker_wait_s": most("wait_s"),
                            "landing_mb": most("landing_bytes", 2**20),
                            "landing_allocated_mb": most("landing_allocated_bytes", 2**20),
                            "landing_peak_mb": most("landing_peak_bytes", 2**20),
                            "landing_wait_s": most("landing_wait_s"),
                            "landing_copied_mb": most("landing_copied_bytes", 2**20),
                            "landing_lent_mb": most("landing_lent_bytes", 2**20),
                            "staging_mb": most("staging_bytes", 2**20) if mode == "staged" else None,
                            "staging_allocated_mb": most("staging_allocated_bytes", 2**20)
                            if mode == "staged"
                            else None,
                            "worker_bytes": [b for rep in report.replicas for b in rep.worker_bytes],
                            "worker_wire_bytes": [
                                b for rep in report.replicas for b in rep.worker_wire_bytes
                            ],
                            "worker_kept_bytes": [
                                b for rep in report.replicas for b in rep.worker_kept_bytes
                            ],
                            "trainer_bytes": trainer_bytes,
                            "rss_before_mb": max(rss),
                            "rss_growth_mb": max(pk - r0 for pk, r0 in zip(peaks, rss)),
                            **{f"cpu_{k}_s": v for k, v in update_cpu.items()},
                        }
                    )
                    save_s, reload_s = disk_round(cpu)  # the same weights, from disk
                    disk_cpu = cpu.end()
                    if i:  # after the first update, as the updates' median
                        row_saves.append(save_s)
                        row_reloads.append(reload_s)
                        row_disk_cpu.append(disk_cpu)
                    say(
                        f"{backend} {mode} update {i}{' (first)' if i == 0 else ''}: {total:.3f} s "
                        f"(paused {report.paused_s:.3f}, load {updates[-1]['worker_load_s']:.3f}; "
                        f"CPU s {_show(update_cpu)}); disk: save {save_s:.3f} s, reload {reload_s:.3f} s "
                        f"(CPU s {_show(disk_cpu)})"
                    )
                generation = {}
                if mode == "staged":  # the replicas' generation during a stage, against idle
                    _generation(llms[0], PROMPTS)  # warm-up: the timed runs below see the same engine state
                    idle = _generation(llms[0], PROMPTS)
                    step += 1
                    bump(step)
                    busy = _generation(llms[0], PROMPTS, lambda: rollout.stage(model, step))
                    rollout.commit(step)
                    generation = {
                        "gen_idle_tokens_per_s": round(idle["tokens_per_s"], 1),
                        "gen_during_stage_tokens_per_s": round(busy["tokens_per_s"], 1),
                        "gen_during_stage_s": round(busy["seconds"], 4),
                        "gen_stage_s": round(busy["during_s"], 4),
                        # the share of that generation the stage ran beside
                        "gen_overlap": round(min(1.0, busy["during_s"] / busy["seconds"]), 3),
                    }
                    say(
                        f"{backend} staged: generation {idle['tokens_per_s']:.0f} tokens/s idle, "
                        f"{busy['tokens_per_s']:.0f} during a stage of {busy['during_s']:.3f} s"
                    )
                steady = updates[1:]
                seconds = statistics.median(u["seconds"] for u in steady)
                save_s, reload_s = statistics.median(row_saves), statistics.median(row_reloads)
                saves += row_saves
                reloads += row_reloads
                rows.append(
                    {
                        "backend": backend,
                        "update_mode": mode,
                        "bucket_mb": opts.bucket_mb,
                        "bytes": nbytes,
                        "tp": opts.tp,
                        "trainers": ranks,
                        # the last update's bytes received by each worker (TP rank), the bytes of
                        # the slices each keeps (sharded: its loaders' boxes), sent by each trainer rank
                        "worker_bytes": steady[-1]["worker_bytes"],
                        "worker_wire_bytes": steady[-1]["worker_wire_bytes"],
                        "worker_kept_bytes": steady[-1]["worker_kept_bytes"],
                        "trainer_bytes": steady[-1]["trainer_bytes"],
                        "init_s": round(init_s, 4),
                        "initial_sync_s": round(initial.sync_s, 4) if initial is not None else None,
                        "first_s": round(updates[0]["seconds"], 4),
                        "seconds": round(seconds, 4),
                        "repeats_s": [round(u["seconds"], 4) for u in steady],
                        **{
                            k: round(statistics.median(u[k] for u in steady), 4)
                            for k in (
                                "paused_s",
                                "pause_s",
                                "sync_s",
                                "resume_s",
                                "stage_s",
                                "handshake_s",
                                "transfer_s",
                                "worker_load_s",
                                "worker_first_s",
                                "worker_wait_s",
                                "landing_mb",
                                "landing_allocated_mb",
                                "landing_peak_mb",
                                "landing_wait_s",
                                "landing_copied_mb",
                                "landing_lent_mb",
                                "staging_mb",
                                "staging_allocated_mb",
                                "rss_before_mb",
                                *(f"cpu_{g}_s" for g in cpu.groups),
                            )
                            if steady[0][k] is not None
                        },
                        "rss_growth_mb": round(max(u["rss_growth_mb"] for u in steady), 1),
                        # where the first update's time went
                        "first": {
                            k: round(v, 4) for k, v in updates[0].items() if isinstance(v, (int, float))
                        },
                        "disk_reload_s": round(reload_s, 4),
                        "disk_reload_repeats_s": [round(x, 4) for x in row_reloads],
                        "save_s": round(save_s, 4),
                        **{
                            f"disk_cpu_{g}_s": round(statistics.median(c[g] for c in row_disk_cpu), 3)
                            for g in cpu.groups
                        },
                        "ratio_to_disk_reload": round(seconds / reload_s, 3),
                        "ratio_to_save_reload": round(seconds / (save_s + reload_s), 3),
                        **generation,
                    }
                )
                if opts.lora_rank and mode == opts.modes[0]:
                    rows.append(_lora_row(opts, rollout, model, step, rows[-1], say))
                    step += opts.repeats + 1
            finally:
                rollout.close()
                if ranks > 1:
                    peers.close_senders(60)
        save_s, reload_s = statistics.median(saves), statistics.median(reloads)

        # one more update, then greedy parity with the trainer
        step += 1
        bump(step)
        last = opts.backends[-1]
        overrides = [f"backend={last}", f"update_weights_bucket_megabytes={opts.bucket_mb}", *opts.overrides]
        ranks, row_address, source = senders(last, overrides)
        if ranks > 1:
            peers.send(step)
        with VLLMRollout(replicas, overrides, address=row_address, num_trainers=ranks) as rollout:
            rollout.update(source, step, mode="keep")
        if ranks > 1:
            peers.sent(60)
            peers.close_senders(60)
        expected = trainer_greedy(model, PROMPTS, 8)
        greedy = {r.name: replica_greedy(llm, PROMPTS, 8) == expected for r, llm in zip(replicas, llms)}
        return {
            "model_bytes": nbytes,
            "model_tensors": len(model.state_dict()),
            "replicas": opts.replicas,
            "tp": opts.tp,
            "trainers": opts.trainers,
            "rows": rows,
            "hosts": opts.hosts,
            "link": opts.link if opts.hosts else None,
            "disk_reload_s": round(reload_s, 4),
            "disk_reload_repeats_s": [round(s, 4) for s in reloads],
            "save_s": round(save_s, 4),
            "save_repeats_s": [round(s, 4) for s in saves],
            "greedy_matches_trainer": greedy,
        }
    finally:
        if peers is not None:
            peers.stop()
        for llm in llms:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        tmp.cleanup()
