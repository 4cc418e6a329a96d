"""``weightsync demo --rollout vllm``: the demo with real vLLM replicas as the rollout side.

The rollout syncs the trainer's weights to every replica as version 0 when it is created;
then the trainer (this process) trains a causal LM towards a new target sequence every step
and updates every replica (pause, sync, resume) with version = step. After each update, greedy
generation from every replica for fixed token-id prompts must equal the trainer's own
greedy generation with its updated weights (same dtype), and must differ from what that
replica generated before the update. At the end, vLLM's own reload from a weights
directory on disk is timed on one replica, and its weights are compared byte for byte with
a replica synced by weightsync.

``--tp T``: each replica runs T tensor-parallel workers; with ``backend=sharded`` (the
default then) each worker takes only the slices its loaders keep, and every update must
bring each worker exactly those bytes. ``--trainers M``: this process is rank 0 of an FSDP2
trainer on M Gloo ranks; ranks 1.. train the same steps in processes of their own and send
their own shards with every update. ``--arch moe`` with ``--trainers M``: the last version
is first sent without one expert's matrix and must fail after the load naming it, then sent
complete (``weightsync.demo.vllm_checks``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.demo.plain import DemoFailed, embedded_config, read_reports, send_json
from weightsync.demo.vllm_checks import (
    LEFT_OUT,
    check_left_out,
    check_slices,
    gathered,
    leaves_expert_out,
    reload_matches,
    shards_without,
    table_bytes,
    tp_table,
)
from weightsync.platform import free_port, process_context, start_process

# A tiny Qwen2-shaped model (about 0.6M parameters) when no --model is given; the CPU
# attention backend of vLLM needs a head size that is a multiple of 32.
TINY_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

#: ``--arch moe``: the tiny model's MLPs as a Qwen3-MoE's (6 experts, top 2, 4 query and
#: 2 k/v heads); an expert width that vLLM's CPU kernel pads (48 -> 64), as TP slices of
#: real models are
TINY_MOE_OVERRIDES: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

PROMPTS: list[list[int]] = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12, 13]]


@dataclass
class VLLMDemoOptions:
    model: str | None = None
    replicas: int = 2
    steps: int = 3
    bucket_mb: int = 64
    overrides: list[str] = field(default_factory=list)
    address: str = "127.0.0.1:0"
    seed: int = 0
    mode: str = "keep"
    new_tokens: int = 8
    max_model_len: int = 128
    #: > 0: LoRA-only updates of a PEFT adapter of this rank (``run_vllm_lora_demo``)
    lora_rank: int = 0
    #: generation runs through every update; each request's version spans checked
    #: (``weightsync.demo.vllm_inflight``)
    in_flight: bool = False
    backend: str = "nccl"
    #: tensor-parallel workers per replica (``backend=sharded``: each takes only its slices)
    tp: int = 1
    #: trainer ranks (FSDP2 over Gloo, ``backend=sharded``): this process is rank 0
    trainers: int = 1
    #: the tiny model's architecture when ``model`` is None (``dense`` or ``moe``)
    arch: str = "dense"


def vllm_environment(tp: int = 1) -> None:
    """Defaults that keep CPU vLLM small and quiet here; the caller's settings win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per replica
    # One replica's workers: nothing bound (replicas share the cores); tensor-parallel
    # workers: a core each, as vLLM's CPU build wants (more workers than cores share them)
    # ("nobind", this function's own default for replicas without TP, gives way to a binding)
    cores = os.cpu_count() or 1
    if tp > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") in (None, "nobind"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(k % cores) for k in range(tp))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # ... so their OpenMP threads must sleep at a barrier, not spin: a spinning one holds the
    # core another replica's thread needs (two replicas loading at once on 2 cores took
    # 0.45-1.25 s, 0.21-0.27 s passive). OpenMP reads it when it starts: it takes effect in
    # the processes started from here on (the engines'), not in this one.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays the caller's (--json)


def save_tiny_model(path: str, seed: int = 0, arch: str = "dense", **overrides: Any) -> str:
    """Save a tiny random Qwen2-shaped model (``arch="moe"``: Qwen3-MoE-shaped) (config +
    safetensors) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        **{**embedded_config(TINY_MODEL_CONFIG, arch, TINY_MOE_OVERRIDES), **overrides}
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


#: vLLM's CPU setup preloads TCMalloc into its processes (its workers warn when it is
#: missing): every layerwise reload then reuses the memory the last one freed instead of
#: faulting in fresh pages. Debian's libtcmalloc-minimal4 (``make install-vllm``).
TCMALLOC = "tcmalloc_minimal"


def start_replica(
    model_dir: str, *, max_model_len: int, seed: int = 0, lora_rank: int = 0, **kwargs: Any
) -> Any:
    """A vLLM ``LLM`` for ``model_dir`` with the weightsync worker extension (float32,
    token ids in and out, eager), its processes started with TCMalloc preloaded where the
    system has it, as vLLM's CPU installation guide sets up. ``lora_rank``: LoRA enabled,
    for adapters up to that rank (``max_lora_rank``: the next value vLLM accepts,
    ``engine_lora_rank``); ``kwargs`` go to ``LLM`` (``max_loras`` ...)."""
    import ctypes.util

    from vllm import LLM

    from weightsync.integrations.vllm_lora import engine_lora_rank
    from weightsync.integrations.vllm_replicas import EXTENSION

    if lora_rank:
        kwargs = {"enable_lora": True, "max_lora_rank": engine_lora_rank(lora_rank), **kwargs}

    args: dict[str, Any] = dict(
        model=model_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=16,
        seed=seed,
        worker_extension_cls=EXTENSION,
        disable_log_stats=True,
    )
    preload = os.environ.get("LD_PRELOAD")
    lib = ctypes.util.find_library(TCMALLOC)
    if lib is not None and TCMALLOC not in (preload or ""):
        # Only the engine's processes (started now) get it, not the ones this process starts later.
        os.environ["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    try:
        return LLM(**(args | kwargs))
    finally:
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload


def replica_greedy(
    llm: Any, prompts: list[list[int]], new_tokens: int, lora_request: Any = None
) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.no_grad()
def trainer_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding by hand (full forward per token): no generation config involved."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        for _ in range(new_tokens):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(ids[0, len(p) :].tolist())
    return out


def train_until_changed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    target: list[int],
    before: list[list[int]],
    new_tokens: int,
    max_iters: int = 300,
) -> tuple[float, int]:
    """Train towards ``target`` after every prompt until the greedy outputs differ from
    ``before`` and the loss is low enough that greedy decoding has no near ties (vLLM's CPU
    kernels and transformers round differently; a near tie could flip either way)."""
    batch = torch.tensor([p[-3:] + target for p in PROMPTS])
    labels = batch.clone()
    labels[:, :3] = -100
    loss = float("nan")
    for it in range(1, max_iters + 1):
        loss_t = model(input_ids=batch, labels=labels).loss
        loss_t.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_t.item()
        if it % 10 == 0 and loss < 0.05 and trainer_greedy(model, PROMPTS, new_tokens) != before:
            return loss, it
    return loss, max_iters


def start_replicas(
    opts: VLLMDemoOptions, console: Any, model_dir: str, max_len: int, **engine: Any
) -> list[Any]:
    t0 = time.perf_counter()
    llms = []
    with console.status(f"starting {opts.replicas} vLLM replicas"):
        for _ in range(opts.replicas):
            llms.append(start_replica(model_dir, max_model_len=max_len, seed=opts.seed, **engine))
    console.print(f"started {opts.replicas} vLLM replicas in {time.perf_counter() - t0:.1f} s")
    return llms


@dataclass
class DemoSetup:
    """What every vLLM demo starts from (``prepare_demo``)."""

    console: Any
    config: Any  # EngineConfig
    workdir: str
    model_dir: str
    model: torch.nn.Module  # the trainer's, float32
    max_len: int  # the replicas' max_model_len


def prepare_demo(opts: VLLMDemoOptions, console: Any = None) -> DemoSetup:
    """The environment, configuration, the model (saved, and loaded as the trainer's) and the
    header lines of a vLLM demo."""
    vllm_environment(opts.tp)
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
    if opts.trainers > 1 and config.backend != "sharded":
        raise DemoFailed(f"--trainers {opts.trainers} sends each rank's FSDP2 shards: use --backend sharded")
    workdir = tempfile.mkdtemp(prefix="weightsync-vllm-demo-")
    model_dir = opts.model or save_tiny_model(os.path.join(workdir, "model"), seed=opts.seed, arch=opts.arch)
    torch.manual_seed(opts.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    trainer = "1 trainer" if opts.trainers == 1 else f"{opts.trainers} FSDP2 trainer ranks"
    tp = f" x {opts.tp} tensor-parallel workers" if opts.tp > 1 else ""
    console.print(
        f"[bold]weightsync demo --rollout vllm[/]: {trainer} -> {opts.replicas} vLLM replicas{tp}, backend "
        f"{config.backend}, bucket {opts.bucket_mb} MiB, {opts.steps} steps, pause mode {opts.mode}"
    )
    console.print(
        f"model: {opts.model or ('tiny Qwen3-MoE-shaped (--arch moe)' if opts.arch == 'moe' else 'tiny Qwen2-shaped default')}, {n_params / 1e6:.2f}M parameters, float32"
    )
    if any(t >= vocab for p in PROMPTS for t in p):
        raise DemoFailed(f"the model's vocabulary ({vocab}) is too small for the demo prompts")
    max_len = min(opts.max_model_len, getattr(model.config, "max_position_embeddings", opts.max_model_len))
    return DemoSetup(console, config, workdir, model_dir, model, max_len)


def run_vllm_demo(opts: VLLMDemoOptions, console: Any = None) -> list[Any]:
    """Run the demo; raise ``DemoFailed`` (or a sync error) on any mismatch or failure."""
    from rich.table import Table

    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout

    setup = prepare_demo(opts, console)
    console, config, workdir, model_dir = setup.console, setup.config, setup.workdir, setup.model_dir
    model, max_len, vocab = setup.model, setup.max_len, setup.model.config.vocab_size
    tp = f" x {opts.tp} tensor-parallel workers" if opts.tp > 1 else ""
    model_bytes = sum(t.nbytes for t in model.state_dict().values())

    if opts.lora_rank:
        return run_vllm_lora_demo(opts, console, config, model_dir, model, max_len)
    llms = start_replicas(
        opts, console, model_dir, max_len, **({"tensor_parallel_size": opts.tp} if opts.tp > 1 else {})
    )
    replicas = [LLMReplica(llm, f"replica{i}") for i, llm in enumerate(llms)]
    host, _, port = opts.address.rpartition(":")
    address = opts.address if port not in ("", "0") or opts.trainers == 1 else f"{host}:{free_port()}"

    table = Table(title="updates")
    for col in (
        "version",
        "MB",
        "MB per worker",
        "pause s",
        "sync s",
        "resume s",
        *[r.name for r in replicas],
    ):
        table.add_column(col, justify="right")
    reports = []
    with _trainer_ranks(opts, model, model_dir, address, opts.replicas * opts.tp) as peers:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(opts.seed)
        t0 = time.perf_counter()
        # initial_version=0: every replica serves the trainer's weights from here on, and vLLM's
        # slower first reload is paid now, not by the first training step's update
        with VLLMRollout(
            replicas, config, address=address, model=model, initial_version=0, num_trainers=opts.trainers
        ) as rollout:
            peers.reported(0)
            console.print(
                f"rollout ready in {time.perf_counter() - t0:.2f} s: every worker joined, version 0 "
                f"synced in {rollout.initial_report.sync_s:.3f} s"
            )
            split = _checked_slices(opts, rollout, model)
            for name, workers in rollout.slices.items():
                for rank, w in enumerate(workers):
                    whole = f"; taken whole: {', '.join(w['whole_tensors'])}" if w["whole_tensors"] else ""
                    console.print(
                        f"  {name} TP rank {rank}: keeps {w['kept_bytes'] / 1e6:.3f} MB of the "
                        f"{model_bytes / 1e6:.3f} MB model ({w['sliced_tensors']} tensors sliced, learned from "
                        f"its loaders in {w['derive_s']:.3f} s){whole}"
                    )
            before = [replica_greedy(llm, PROMPTS, opts.new_tokens) for llm in llms]
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
                if leaves_expert_out(opts, step):
                    _left_out_version(rollout, model, opts, step, console)
                    peers.reported(step)
                report = rollout.update(model, version=step, mode=opts.mode)
                peers.reported(step)
                expected = trainer_greedy(model, PROMPTS, opts.new_tokens)
                verdicts = []
                for i, (llm, rep) in enumerate(zip(llms, report.replicas)):
                    got = replica_greedy(llm, PROMPTS, opts.new_tokens)
                    if rep.version != step:
                        raise DemoFailed(f"{rep.name} reports version {rep.version}, expected {step}")
                    if got != expected:
                        raise DemoFailed(
                            f"{rep.name}, version {step}: greedy output {got} != trainer's {expected}"
                        )
                    if got == before[i]:
                        raise DemoFailed(
                            f"{rep.name}, version {step}: output did not change with the update: {got}"
                        )
                    if rep.worker_kept_bytes and rep.worker_bytes != rep.worker_kept_bytes:
                        raise DemoFailed(
                            f"{rep.name}, version {step}: its workers received {rep.worker_bytes} bytes, "
                            f"their slices are {rep.worker_kept_bytes}"
                        )
                    if split is not None and rep.worker_bytes != split:
                        raise DemoFailed(
                            f"{rep.name}, version {step}: its workers received {rep.worker_bytes} bytes, "
                            f"vLLM's split rule gives them {split}"
                        )
                    before[i] = got
                    verdicts.append("parity OK")
                    console.print(
                        f"  version {step} {rep.name}: parity OK ({len(PROMPTS)} prompts x {opts.new_tokens} "
                        f"tokens), each worker received {_mb(rep.worker_bytes)} MB"
                        + (" as vLLM's split rule gives" if split is not None else "")
                    )
                if opts.trainers > 1:  # no second replica to compare with: vLLM's own reload of this version
                    state = gathered(model)  # every trainer rank gathers here
                    for i, llm in enumerate(llms):
                        experts = reload_matches(
                            llm, state, model_dir, os.path.join(workdir, f"v{step}-{i}"), first=step == 1
                        )
                        console.print(
                            f"  version {step} replica{i}: every tensor equals vLLM's reload of save_pretrained"
                            + (f" ({len(experts)} expert stacks among them)" if experts else "")
                        )
                console.print(
                    f"  version {step}: pause {report.pause_s:.3f} s, sync {report.sync_s:.3f} s, "
                    f"resume {report.resume_s:.3f} s"
                )
                table.add_row(
                    str(step),
                    f"{sum(r.bytes for r in report.replicas) / 1e6:.2f}",
                    _mb(report.replicas[0].worker_bytes),
                    f"{report.pause_s:.3f}",
                    f"{report.sync_s:.3f}",
                    f"{report.resume_s:.3f}",
                    *verdicts,
                )
                reports.append(report)
            baseline = _reload_baseline(llms, model, workdir, opts) if opts.trainers == 1 else None
    console.print(table)
    sync_s = sum(r.sync_s for r in reports) / len(reports)
    if baseline is not None:
        reload_s, save_s = baseline
        console.print(
            f"vLLM reload_weights from disk: {reload_s:.3f} s (plus {save_s:.3f} s to save); "
            f"weightsync sync: {sync_s:.3f} s on average"
            + ("; reloaded weights equal the synced ones byte for byte" if len(llms) > 1 else "")
        )
    console.print(
        f"demo OK: {len(reports)} updates to {opts.replicas} vLLM replicas{tp}, greedy parity with the trainer"
    )
    return reports


def _checked_slices(opts: VLLMDemoOptions, rollout: Any, model: torch.nn.Module) -> list[int] | None:
    """``--tp T`` over ``sharded`` with the tiny model: each worker's dry-run boxes checked
    against vLLM's split rule worked out from the config (``vllm_checks.tp_table``); the bytes
    that table gives each worker (every version must bring exactly those), else None."""
    if opts.model is not None or opts.tp < 2 or not rollout.slices:
        return None
    from weightsync.sharding.agreement import ShardSource

    specs = ShardSource.of(model, form=rollout.sender.form).specs()  # what the rollout learned the slices of
    table = tp_table(specs, opts.tp, model.config)
    for name, workers in rollout.slices.items():
        check_slices(name, workers, specs, table)
    return [table_bytes(specs, boxes) for boxes in table]


def _left_out_version(
    rollout: Any, model: torch.nn.Module, opts: VLLMDemoOptions, step: int, console: Any
) -> None:
    """Version ``step`` first without one expert's matrix (``vllm_checks.LEFT_OUT``): every
    worker refuses it before anything moves, naming the matrix; the replicas serve the
    version before."""
    from weightsync.integrations.replicas.reports import ReplicaUpdateError

    shards = shards_without(model, opts.trainers, 0)
    before = {rep.name: rep.version for rep in rollout.status()}
    error: ReplicaUpdateError | None = None
    try:
        report = rollout.update(shards, version=step, mode=opts.mode)
    except ReplicaUpdateError as e:
        error, report = e, e.report
    check_left_out(error, report, opts.tp, before)
    console.print(
        f"  version {step} without {LEFT_OUT}: refused by every worker before anything moved, naming it; "
        "the replicas serve the version before until the complete one"
    )


def _mb(values: list[int]) -> str:
    return "/".join(f"{v / 1e6:.3f}" for v in values)


def _reload_baseline(
    llms: list[Any], model: torch.nn.Module, workdir: str, opts: VLLMDemoOptions
) -> tuple[float, float]:
    """vLLM's own reload of the same weights from a directory on disk: its seconds and the
    save's; the reloaded weights must equal a synced replica's."""
    disk = os.path.join(workdir, f"version{opts.steps}")
    t0 = time.perf_counter()
    model.save_pretrained(disk)
    save_s = time.perf_counter() - t0
    reload_s = llms[0].collective_rpc("weightsync_reload_from_path", args=(disk,))[0]
    if len(llms) > 1:
        a, b = (llm.collective_rpc("weightsync_digests")[0] for llm in llms[:2])
        if a != b:
            bad = [n for n in a if a[n] != b.get(n)]
            raise DemoFailed(
                f"weights reloaded from disk differ from weights synced by weightsync: {bad[:4]}"
            )
    return reload_s, save_s


class _Peers:
    """Trainer ranks 1.. of ``--trainers N``: their processes and report pipes."""

    def __init__(self, procs: list[tuple[Any, Any]], timeout_s: float) -> None:
        self.procs, self.timeout_s = procs, timeout_s

    def reported(self, version: int) -> None:
        """Every other trainer rank sent ``version`` (or DemoFailed naming the one that did not)."""
        named = [
            (f"trainer rank {rank}", proc, conn) for rank, (proc, conn) in enumerate(self.procs, start=1)
        ]
        for rank, report in enumerate(read_reports(named, self.timeout_s), start=1):
            if report.get("version") != version:
                raise DemoFailed(
                    f"trainer rank {rank} sent version {report.get('version')}, expected {version}"
                )


@contextlib.contextmanager
def _trainer_ranks(
    opts: VLLMDemoOptions, model: torch.nn.Module, model_dir: str, address: str, receivers: int
) -> Iterator[_Peers]:
    """``--trainers N``: this process becomes trainer rank 0 of an FSDP2 world of N Gloo
    ranks (``model`` sharded in place), ranks 1.. train the same steps in processes of
    their own and send their shards in step with this one's updates."""
    if opts.trainers == 1:
        yield _Peers([], 0.0)
        return
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    port = free_port()
    ctx = process_context(["weightsync.demo.vllm", "weightsync.sender.sender"])
    procs = []
    for rank in range(1, opts.trainers):
        parent, child = ctx.Pipe(duplex=False)
        procs.append(
            (
                start_process(ctx, trainer_rank_main, child, opts, model_dir, address, receivers, rank, port),
                parent,
            )
        )
        child.close()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=opts.trainers,
            timeout=datetime.timedelta(seconds=600),
        )
        fully_shard(model)
        yield _Peers(procs, 600.0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for proc, _ in procs:  # only our own children, by handle
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def trainer_rank_main(
    conn: Any, opts: VLLMDemoOptions, model_dir: str, address: str, receivers: int, rank: int, port: int
) -> None:
    """Trainer rank ``rank`` > 0 of ``--trainers N``: the same FSDP2 training steps as rank 0
    (the same batches, so every collective matches), sending its own shards of every
    version with rank 0's update; reports each version sent (JSON) to the demo."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from weightsync.config.engine import EngineConfig
    from weightsync.errors import SyncError
    from weightsync.sender.sender import Sender

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=opts.trainers,
            timeout=datetime.timedelta(seconds=600),
        )
        torch.manual_seed(opts.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        vocab = model.config.vocab_size
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(opts.seed)
        config = EngineConfig.from_overrides(
            [f"backend={opts.backend}", f"update_weights_bucket_megabytes={opts.bucket_mb}", *opts.overrides]
        )
        with Sender(config, address, receivers, rank=rank, num_trainers=opts.trainers) as sender:
            sender.send(model, version=0)
            send_json(conn, {"version": 0})
            for step in range(1, opts.steps + 1):
                target = torch.randint(0, vocab, (opts.new_tokens,), generator=gen).tolist()
                train_until_changed(
                    model, optimizer, target, trainer_greedy(model, PROMPTS, opts.new_tokens), opts.new_tokens
                )
                if leaves_expert_out(opts, step):  # rank 0's incomplete version: this rank's share of it
                    try:
                        sender.send(shards_without(model, opts.trainers, rank), version=step)
                        send_json(conn, {"version": step, "incomplete": "sent"})
                    except SyncError as e:
                        send_json(conn, {"version": step, "incomplete": str(e)})
                stats = sender.send(model, version=step)
                send_json(conn, {"version": step, "bytes": stats.bytes})
                trainer_greedy(model, PROMPTS, opts.new_tokens)  # rank 0's check: its collectives
                gathered(model)  # rank 0's reload check: its collectives
        dist.destroy_process_group()
    except BaseException as e:
        send_json(conn, {"error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from e
    finally:
        conn.close()


#: the modules a demo adapter targets: every linear layer of a Qwen2 decoder block
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_vllm_lora_demo(
    opts: VLLMDemoOptions, console: Any, config: Any, model_dir: str, model: torch.nn.Module, max_len: int
) -> list[Any]:
    """``weightsync demo --rollout vllm --lora-rank R``: the trainer fine-tunes a PEFT LoRA of
    rank R on the model the replicas loaded; every step only the adapter moves (the base is
    checked by digest, never sent) and each replica serves it from memory; greedy output
    under the step's ``LoRARequest`` must equal the trainer's, and change with every step."""
    from peft import LoraConfig, get_peft_model

    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout

    llms = start_replicas(opts, console, model_dir, max_len, max_loras=2, lora_rank=opts.lora_rank)
    replicas = [LLMReplica(llm, f"replica{i}") for i, llm in enumerate(llms)]
    peft_model = get_peft_model(
        model, LoraConfig(r=opts.lora_rank, lora_alpha=2 * opts.lora_rank, target_modules=LORA_TARGETS)
    )
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    console.print(
        f"LoRA rank {opts.lora_rank} on {', '.join(LORA_TARGETS)}: {trainable / 1e3:.1f}K parameters trained"
    )
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=5e-2)
    gen = torch.Generator().manual_seed(opts.seed)
    vocab = model.config.vocab_size
    reports = []
    before = trainer_greedy(peft_model, PROMPTS, opts.new_tokens)
    with VLLMRollout(replicas, config, address=opts.address, lora_keep=1) as rollout:
        for step in range(1, opts.steps + 1):
            target = torch.randint(0, vocab, (opts.new_tokens,), generator=gen).tolist()
            # a few steps: a rank-R adapter on the tiny model changes the outputs, it cannot fit them
            loss, iters = train_until_changed(
                peft_model, optimizer, target, before, opts.new_tokens, max_iters=40
            )
            report = rollout.update(peft_model, version=step, lora=True)
            expected = trainer_greedy(peft_model, PROMPTS, opts.new_tokens)
            for llm, rep in zip(llms, report.replicas):
                got = replica_greedy(llm, PROMPTS, opts.new_tokens, report.lora_request)
                if got != expected:
                    raise DemoFailed(
                        f"{rep.name}, adapter version {step}: greedy output {got} != trainer's {expected}"
                    )
                if got == before:
                    raise DemoFailed(f"{rep.name}, adapter version {step}: output did not change: {got}")
            console.print(
                f"step {step}: {iters} training iterations, loss {loss:.4f}; adapter "
                f"{report.stats.bytes / 1e3:.1f} KB loaded as {report.lora_request.lora_name!r} in "
                f"{report.sync_s:.3f} s, nothing paused; parity OK on {len(llms)} replicas"
            )
            before = expected
            reports.append(report)
    console.print(
        f"demo OK: {len(reports)} updates to {opts.replicas} vLLM replicas, LoRA adapter only "
        f"(base checked by digest, never sent), greedy parity with the trainer"
    )
    return reports
