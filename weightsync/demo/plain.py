"""``weightsync demo``: the main job, end to end on one machine.

One trainer (this process) trains a small causal LM on synthetic data with a real
optimizer and syncs it after every step (version = step) to rollout processes, each of
which checks every tensor bit-exact against the trainer's checksums.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.config.scratch import scratch_overrides
from weightsync.platform import process_context, start_process
from weightsync.quant.replica import fp8_expected, fp8_holding
from weightsync.receiver.receiver import Receiver
from weightsync.sender.sender import Sender
from weightsync.sinks import ModuleSink
from weightsync.sources import as_source
from weightsync.stats import SyncStats
from weightsync.verify import tensor_digest

# The embedded default: a Qwen2-shaped model of about 44M parameters (fp32: 178 MB), built
# from this config with random weights; nothing is downloaded.
DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

#: ``--arch``: the embedded model's architecture (``moe``: its MLPs mixtures of experts)
ARCHS = ("dense", "moe")
#: ``--arch moe``: a Qwen3-MoE of the same width and depth (8 experts, top 2, about 60M
#: parameters); transformers holds its experts fused, engines load them one by one
MOE_OVERRIDES: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 352,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "head_dim": 64,
}


def embedded_config(base: dict[str, Any], arch: str, moe: dict[str, Any]) -> dict[str, Any]:
    """An embedded model's config for ``arch`` (``moe``: ``base`` with ``moe``'s keys)."""
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r}: expected one of {', '.join(ARCHS)}")
    return {**base, **moe} if arch == "moe" else dict(base)


@dataclass
class DemoOptions:
    model: str | None = None
    receivers: int = 2
    steps: int = 3
    backend: str = "nccl"
    bucket_mb: int = 64
    overrides: list[str] = field(default_factory=list)
    address: str = "127.0.0.1:0"
    seed: int = 0
    #: the embedded model's architecture when ``model`` is None (``ARCHS``)
    arch: str = "dense"
    #: "fp8": rollout rank 0 holds the decoder layers' matrices in FP8 blocks (``weightsync.quant``)
    quantize: str | None = None


def build_model(model: str | None, *, pretrained: bool, seed: int, arch: str = "dense") -> torch.nn.Module:
    """The trainer's model (weights from ``model`` if given) or a rollout's (config only)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    if model is None:
        config = AutoConfig.for_model(**embedded_config(DEFAULT_MODEL_CONFIG, arch, MOE_OVERRIDES))
    else:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
        if pretrained:
            return AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def checksums(module: torch.nn.Module) -> dict[str, str]:
    """A digest of every tensor's bytes, by state-dict name (tied names included)."""
    return {name: tensor_digest(t) for name, t in module.state_dict().items()}


def fp8_checksums(module: torch.nn.Module) -> dict[str, str]:
    """What an FP8 rollout (``fp8_holding``) holds once ``module``'s weights, as the trainer
    sends them (an MoE's experts one by one), reached it."""
    return {name: tensor_digest(t) for name, t in fp8_expected(dict(as_source(module).tensors())).items()}


def engine_config(opts: DemoOptions) -> EngineConfig:
    return EngineConfig.from_overrides(
        [f"backend={opts.backend}", f"update_weights_bucket_megabytes={opts.bucket_mb}", *opts.overrides]
    )


def send_json(conn: Connection, obj: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(obj).encode())  # JSON, not pickle, even between our own processes


def rollout_main(conn: Connection, opts: DemoOptions, address: str, rank: int) -> None:
    """A rollout process: receive every version into its own model and report checksums."""
    torch.set_num_threads(1)
    try:
        config = engine_config(opts)
        model = build_model(opts.model, pretrained=False, seed=opts.seed + 1000 + rank, arch=opts.arch)
        held: dict[str, torch.Tensor] | None = None  # an FP8 rollout's tensors
        if opts.quantize and rank == 0:
            held = fp8_holding(as_source(model).specs())
            del model  # this rollout holds its weights in FP8 only
        with Receiver(config, address, rank) as receiver:
            for step in range(1, opts.steps + 1):
                stats = receiver.load_into(ModuleSink(held) if held is not None else model, version=step)
                sums = (
                    {n: tensor_digest(t) for n, t in held.items()} if held is not None else checksums(model)
                )
                send_json(
                    conn,
                    {"rank": rank, "version": receiver.version, "stats": stats.to_dict(), "checksums": sums},
                )
    except BaseException as e:  # report, then fail: the trainer turns this into its error
        send_json(conn, {"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from e
    finally:
        conn.close()


class DemoFailed(RuntimeError):
    pass


def _embedded_name(arch: str) -> str:
    return "embedded Qwen3-MoE-shaped (--arch moe)" if arch == "moe" else "embedded Qwen2-shaped default"


def _compare(expected: dict[str, str], got: dict[str, str], rank: int, version: int) -> None:
    bad = [n for n, digest in expected.items() if got.get(n) != digest]
    if bad:
        raise DemoFailed(
            f"rollout rank {rank}, version {version}: {len(bad)} tensor(s) differ from the trainer's, "
            f"first {bad[0]!r}"
        )


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, gen: torch.Generator) -> float:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (4, 64), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run_demo(opts: DemoOptions, console=None) -> list[SyncStats]:
    """Run the demo; raise ``DemoFailed`` (or a sync error) on any mismatch or failure.
    ``backend=disk`` without ``engine_kwargs.disk.path`` publishes into a temporary
    directory, removed at the end."""
    with scratch_overrides([f"backend={opts.backend}", *opts.overrides]) as overrides:
        return _run_demo(dataclasses.replace(opts, overrides=overrides[1:]), console)


def _run_demo(opts: DemoOptions, console=None) -> list[SyncStats]:
    from rich.console import Console
    from rich.table import Table

    # Piped output gets 100 columns rather than rich's 80, so the table stays readable.
    console = console or Console(width=None if sys.stdout.isatty() else 100)
    config = engine_config(opts)
    colocated = config.backend == "naive"
    console.print(
        f"[bold]weightsync demo[/]: 1 trainer -> {opts.receivers} rollout "
        f"{'receivers in this process' if colocated else 'processes'}, backend {config.backend}, "
        f"bucket {opts.bucket_mb} MiB, {opts.steps} steps"
    )
    torch.manual_seed(opts.seed)
    with console.status("building the trainer's model"):
        model = build_model(opts.model, pretrained=True, seed=opts.seed, arch=opts.arch)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"model: {opts.model or _embedded_name(opts.arch)}, {n_params / 1e6:.1f}M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(opts.seed)

    procs: list[mp.Process] = []
    conns: list[Connection] = []
    local: list[tuple[Receiver, torch.nn.Module]] = []
    rows: list[SyncStats] = []
    table = Table(title="syncs")
    for col in ("version", "tensors", "MB", "buckets", "setup s", "wire s", "total s", "GB/s", "check"):
        table.add_column(col, justify="right")

    with Sender(config, opts.address, opts.receivers) as sender:
        try:
            if colocated:
                for r in range(opts.receivers):
                    local.append(
                        (
                            Receiver(config, sender.address, r),
                            build_model(
                                opts.model, pretrained=False, seed=opts.seed + 1000 + r, arch=opts.arch
                            ),
                        )
                    )
            else:
                ctx = process_context(["weightsync.demo.plain"])
                for r in range(opts.receivers):
                    parent, child = ctx.Pipe(duplex=False)
                    p = start_process(ctx, rollout_main, child, opts, sender.address, r)
                    child.close()
                    procs.append(p)
                    conns.append(parent)
            for step in range(1, opts.steps + 1):
                t0 = time.perf_counter()
                with console.status(f"step {step}: training"):
                    loss = _train_step(model, optimizer, gen)
                console.print(
                    f"step {step}: loss {loss:.4f} ({time.perf_counter() - t0:.1f} s); syncing version {step}"
                )
                with console.status(f"syncing version {step} to {opts.receivers} receivers"):
                    t_sync = time.perf_counter()
                    stats = sender.send(model, version=step)
                    for receiver, rollout in local:
                        receiver.load_into(rollout, version=step)
                    if colocated:  # the receivers' copies are the sync's real cost here
                        stats.seconds = time.perf_counter() - t_sync
                expected = checksums(model)
                for receiver, rollout in local:
                    _compare(expected, checksums(rollout), receiver.rank, step)
                quantized = fp8_checksums(model) if opts.quantize else {}
                named = [(f"rollout rank {r}", procs[r], conn) for r, conn in enumerate(conns)]
                for r, report in enumerate(read_reports(named, config.timeout_s)):
                    if report["version"] != step:
                        raise DemoFailed(
                            f"rollout rank {r} reports version {report['version']}, expected {step}"
                        )
                    _compare(
                        quantized if r == 0 and opts.quantize else expected, report["checksums"], r, step
                    )
                rows.append(stats)
                table.add_row(
                    str(step),
                    str(stats.tensors),
                    f"{stats.bytes / 1e6:.1f}",
                    str(stats.buckets),
                    f"{stats.handshake_s:.3f}",
                    f"{stats.transfer_s:.3f}",
                    f"{stats.seconds:.3f}",
                    f"{stats.gbps:.2f}",
                    "bit-exact",
                )
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:  # only our own children, by handle
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
            for receiver, _ in local:
                receiver.close()
    console.print(table)
    fp8 = (
        " (rollout rank 0 in FP8 blocks: vLLM's per_block_cast_to_fp8 bytes and scales)"
        if opts.quantize
        else ""
    )
    console.print(f"demo OK: {len(rows)} syncs to {opts.receivers} receivers, bit-exact{fp8}")
    return rows


def read_reports(
    named: Sequence[tuple[str, mp.Process, Connection]], timeout_s: float
) -> list[dict[str, Any]]:
    """The next JSON report of each demo process (``(who, process, pipe)``, who: "rollout
    rank 1"), in the order given. All are awaited at once, so the first to fail ends the wait
    (DemoFailed naming it): an error it reports, or its exit without a report, even while the
    others still wait on it (a trainer rank waiting its handshake deadline for a rollout rank
    that died before connecting). DemoFailed naming the silent ones after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    reports: dict[int, dict[str, Any]] = {}
    while len(reports) < len(named):
        pending = [i for i in range(len(named)) if i not in reports]
        left = deadline - time.monotonic()
        if left <= 0:
            silent = ", ".join(f"{named[i][0]} (pid {named[i][1].pid})" for i in pending)
            raise DemoFailed(f"{silent}: no report within {timeout_s:.0f} s")
        wait([named[i][2] for i in pending] + [named[i][1].sentinel for i in pending], timeout=min(left, 1.0))
        for i in pending:
            who, proc, conn = named[i]
            try:
                if conn.poll(0):
                    reports[i] = json.loads(conn.recv_bytes())
                elif proc.is_alive():
                    continue
            except EOFError:  # its end of the pipe closed: it exits without a report
                proc.join(timeout=5)
            if i not in reports:
                raise DemoFailed(f"{who} (pid {proc.pid}) exited with code {proc.exitcode}")
            if "error" in reports[i]:
                raise DemoFailed(f"{who} failed: {reports[i]['error']}")
    return [reports[i] for i in range(len(named))]
