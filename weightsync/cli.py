"""The ``weightsync`` command line: ``demo``, ``bench``, ``estimate``, ``config`` and ``gpu-check``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from weightsync.config.engine import EngineConfig
from weightsync.config.keys import DELTA_MODES, UPDATE_MODES, ConfigError
from weightsync.config.reference import docs_markdown

#: where ``weightsync estimate --calibrate`` saves this machine's costs, and reads them from
CALIBRATION_FILE = Path("~/.cache/weightsync/calibration.json").expanduser()


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small LM and sync it to rollout processes after every step, checking bit-exactness",
        description=(
            "Start 1 trainer and N rollout processes on this machine; the trainer trains a small "
            "causal LM (built from a config in code, or --model DIR) for a few steps and syncs after "
            "every step (version = step). Every rollout checks every tensor bit-exact."
        ),
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face model directory (config.json + safetensors), loaded locally",
    )
    p.add_argument("--receivers", type=int, default=2, help="rollout processes (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="training steps, one sync each (default: 3)")
    p.add_argument(
        "--backend",
        default=None,
        help="transfer backend (default: nccl, Gloo on CPU; sharded with --trainers or --tp above 1)",
    )
    p.add_argument(
        "--bucket-mb",
        type=int,
        default=64,
        help="bucket size in MiB (default: 64; may be smaller than the largest tensor)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any configuration key (repeatable), e.g. --set timeout_s=60",
    )
    p.add_argument(
        "--address", default="127.0.0.1:0", help="sender's control address (default: 127.0.0.1, a free port)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--trainers",
        type=int,
        default=1,
        help="FSDP2 trainer ranks, each sending its own shards (backend sharded; default: 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per replica, each taking only its slices (backend sharded; with --rollout "
        "vllm, learned from the workers' own loaders; default: 1)",
    )
    p.add_argument(
        "--rollout",
        choices=("process", "vllm"),
        default="process",
        help="rollout side: plain PyTorch processes (default) or vLLM replicas (needs weightsync[vllm])",
    )
    p.add_argument(
        "--pause-mode",
        choices=("keep", "abort", "wait"),
        default="keep",
        help="--rollout vllm: what pausing does to in-flight requests (default: keep)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="--rollout vllm: fine-tune a PEFT LoRA of this rank and sync only the adapter each step",
    )


def _allowed(flag: str, values: list[str], allowed: tuple[str, ...]) -> bool:
    """Whether every value of a comma-separated option is allowed; if not, say which on stderr."""
    if bad := [v for v in values if v not in allowed]:
        print(f"{flag} {','.join(bad)}: expected {', '.join(allowed)}", file=sys.stderr)
    return not bad


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    return parse


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure syncs per backend and bucket size against per-tensor broadcast, disk and the transport's ceiling",
        description=(
            "Sync a model (synthetic LLM-shaped, or --model DIR) from 1 sender to N receiver processes on "
            "this machine, for each backend and bucket size, and measure in the same run the alternatives "
            "(one broadcast per tensor, safetensors written and reloaded) and each transport's ceiling. "
            "Reports the median of --repeats syncs after a warm-up; compare ratios, not absolute times."
        ),
    )
    p.add_argument(
        "--backend",
        type=_csv(str),
        default=["nccl", "shm"],
        help="comma-separated backends (default: nccl,shm)",
    )
    p.add_argument(
        "--bucket-mb", type=_csv(int), default=[64], help="comma-separated bucket sizes in MiB (default: 64)"
    )
    p.add_argument(
        "--receivers", type=int, default=None, help="receiver processes (default: 3; vLLM replicas: 2)"
    )
    p.add_argument(
        "--trainers",
        type=int,
        default=1,
        help="trainer processes for backends where every trainer rank sends: paired, sharded (default: 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per replica: each row has --receivers x --tp receiver processes; "
        "sharded sends each rank only its slices, the other backends the whole model (default: 1)",
    )
    p.add_argument(
        "--size-mb",
        type=float,
        default=None,
        help="synthetic model size in MiB (default: 1024; with --rollout vllm: a 392 MB fp32 Qwen2 model)",
    )
    p.add_argument(
        "--rollout",
        choices=("processes", "vllm"),
        default="processes",
        help="receivers: plain processes (default), or real vLLM replicas (--receivers of them, default 2 "
        "here: update vs. the replicas reloading from disk and the trainer's save)",
    )
    p.add_argument(
        "--shape",
        choices=("llm", "small-tensors"),
        default="llm",
        help="synthetic model: a Qwen2-like decoder, or only 256 KiB tensors (default: llm)",
    )
    p.add_argument("--dtype", default="bfloat16", help="synthetic model dtype (default: bfloat16)")
    p.add_argument("--model", metavar="DIR", help="benchmark the *.safetensors weights of DIR instead")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed syncs per row after one warm-up (default: 3)"
    )
    p.add_argument(
        "--update",
        choices=("bump", "adamw"),
        default="bump",
        help="how versions differ: every tensor a little (bump, default), or an AdamW step of fp32 "
        "masters sent in the model dtype, with rows for delta off, auto and on per backend (adamw)",
    )
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate of --update adamw (default: 1e-6)")
    p.add_argument(
        "--delta",
        type=_csv(str),
        default=list(DELTA_MODES),
        metavar="MODES",
        help="--update adamw: comma-separated delta settings, a row per backend and setting (default: "
        "off,auto,on)",
    )
    p.add_argument(
        "--no-initial-sync",
        dest="initial_sync",
        action="store_false",
        help="--rollout vllm: no sync at each rollout's construction (VLLMRollout initial_version), so "
        "the first update pays vLLM's first reload on fresh replicas",
    )
    p.add_argument(
        "--update-mode",
        type=_csv(str),
        default=["stream"],
        metavar="MODES",
        help="--rollout vllm: comma-separated update_mode values, a row per backend and mode: stream "
        "(default), staged (stage while generating, pause only for the commit; adds generation "
        "tokens/s during a stage against idle)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="--rollout vllm: also a row per backend of LoRA-only updates of a PEFT adapter of this rank, "
        "against that backend's full-model update of the same replicas",
    )
    p.add_argument(
        "--no-alternatives",
        dest="alternatives",
        action="store_false",
        help="measure only weightsync's backends (no per-tensor, disk or ceiling rows)",
    )
    p.add_argument("--work-dir", metavar="DIR", help="where the disk path writes (default: the temp dir)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where every process holds its model and transfer buffers: cpu (default) or cuda[:N], all "
        "processes on that one GPU; the alternatives are then the d2d-ceiling row only (device-to-device "
        "copy of the bytes every receiver needs)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="an emulated cluster of N hosts (network namespaces, needs root): trainer rank(s) on their own "
        "host(s), receivers on the others; rows report ratio_to_link_ceiling and each NIC's bytes per timed sync",
    )
    p.add_argument(
        "--link",
        default="1gbit",
        metavar="RATE",
        help="--hosts: every NIC's rate, egress and ingress (default: 1gbit)",
    )
    p.add_argument(
        "--trainer-link",
        default=None,
        metavar="RATE",
        help="--hosts: the trainer hosts' NIC rate (default: --link)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="configuration key for weightsync's rows (repeatable)",
    )
    p.add_argument(
        "--codec",
        action="store_true",
        help="measure the delta codec instead of syncs: encode and apply of an AdamW step (--lr, --size-mb, "
        "default 512, --repeats, --device) against the memory-speed floor, in one run",
    )
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="draw GB/s against bucket size per backend")


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="predict a sync's seconds and each NIC's bytes on a cluster you describe",
        description=(
            "Predict one sync per backend on a cluster described by a YAML file (--cluster, docs/estimate.md) "
            "or by the flags of `weightsync bench --hosts` (each rank on a host of its own), from the route "
            "the real sync would take: bytes through each NIC, the bottleneck, seconds, and the link ceiling."
        ),
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="FILE", help="a cluster file (YAML; docs/estimate.md)")
    where.add_argument("--hosts", type=int, help="hosts, as for `weightsync bench --hosts` (default: 4)")
    p.add_argument("--trainers", type=int, default=1, help="--hosts: trainer ranks (default: 1)")
    p.add_argument(
        "--tp", type=int, default=1, help="--hosts: tensor-parallel ranks per replica (default: 1)"
    )
    p.add_argument("--receivers", type=int, default=3, help="--hosts: replicas (default: 3)")
    p.add_argument("--link", default="1gbit", help="--hosts: every NIC's rate (default: 1gbit)")
    p.add_argument(
        "--trainer-link", default=None, help="--hosts: the trainer hosts' NIC rate (default: --link)"
    )
    p.add_argument("--bucket-mb", type=int, default=64, help="--hosts: bucket size in MiB (default: 64)")
    p.add_argument("--model", metavar="DIR", help="the *.safetensors weights of DIR (their specs only)")
    p.add_argument("--size-mb", type=float, default=1024, help="synthetic model size in MiB (default: 1024)")
    p.add_argument(
        "--size-gb", type=float, default=None, help="synthetic model size in GiB (instead of --size-mb)"
    )
    p.add_argument(
        "--shape", choices=("llm", "small-tensors"), default="llm", help="synthetic model (default: llm)"
    )
    p.add_argument(
        "--dtype", default=None, help="synthetic model dtype (default: the cluster's, or bfloat16)"
    )
    p.add_argument(
        "--backend",
        type=_csv(str),
        default=["nccl", "paired", "mooncake", "sharded"],
        help="comma-separated backends (default: nccl,paired,mooncake,sharded)",
    )
    p.add_argument(
        "--calibration",
        metavar="FILE",
        default=str(CALIBRATION_FILE),
        help=f"this machine's costs, as --calibrate saves them (default: {CALIBRATION_FILE}; "
        "documented defaults where absent)",
    )
    p.add_argument(
        "--calibrate", action="store_true", help="measure this machine's costs, save them, print them"
    )
    p.add_argument(
        "--json", action="store_true", help="print the estimates as a JSON list instead of a table"
    )


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="print the effective configuration, validate it, or print the parameter reference",
        description="Print the effective configuration for the given overrides (key=value, short or full form).",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
    p.add_argument(
        "--yaml",
        metavar="FILE",
        help="read a YAML file first: weightsync's own (nested or flat keys) or a whole verl trainer config, read as verl reads it",
    )
    p.add_argument(
        "--check", action="store_true", help="only validate: exit 0 if valid, 2 with the message if not"
    )
    p.add_argument("--json", action="store_true", help="print the configuration as JSON")
    p.add_argument(
        "--docs", action="store_true", help="print the parameter reference (Markdown) generated from the code"
    )
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="language of --docs (default: en)")


def _add_gpu_check(sub: argparse._SubParsersAction) -> None:
    from weightsync.gpucheck.driver import add_arguments

    p = sub.add_parser(
        "gpu-check",
        help="on a CUDA machine: run the cuda tests and GPU bench rows, write DIR/gpu-check.json and .txt",
        description=(
            "Run every CUDA path of weightsync in one short run: the multi-process tests marked cuda "
            "(nccl, shm, paired with tensors on cuda:0) and bench rows on the GPU against the device-to-device "
            "copy ceiling; write the results to --out. Exit 0 only if every check passed, 3 where there is no CUDA device."
        ),
    )
    add_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Move model weights from an RL trainer to its inference fleet: bit-exact, versioned, fast.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engines do")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub)
    _add_bench(sub)
    _add_estimate(sub)
    _add_config(sub)
    _add_gpu_check(sub)
    return parser


def _estimate_command(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from weightsync.bench import models
    from weightsync.estimate.cluster import Cluster
    from weightsync.estimate.predict import Calibration, calibrate, predict
    from weightsync.estimate.routes import BACKENDS

    if args.calibrate:
        measured = calibrate()
        measured.save(args.calibration)
        print(json.dumps(dataclasses.asdict(measured), indent=2))
        print(f"saved to {args.calibration}", file=sys.stderr)
        return 0
    if not _allowed("--backend", args.backend, BACKENDS):
        return 2
    try:
        if args.cluster:
            cluster = Cluster.from_yaml(args.cluster)
        else:
            cluster = Cluster.of_flags(
                args.hosts or 4,
                args.trainers,
                args.receivers,
                args.link,
                args.trainer_link,
                args.tp,
                args.bucket_mb,
            )
        dtype = args.dtype or cluster.dtype
        size_mb = args.size_gb * 1024 if args.size_gb is not None else args.size_mb
        specs = (
            models.directory_specs(args.model)
            if args.model
            else models.synthetic_specs(args.shape, size_mb, dtype)
        )
        calibration = Calibration.load(args.calibration)
        estimates = [predict(cluster, specs, b, calibration) for b in args.backend]
    except (ValueError, OSError, KeyError) as e:
        print(f"estimate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([e.to_dict() for e in estimates], indent=2))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(
        f"{len(cluster.trainers)} trainer rank(s), {cluster.replicas} replica(s) x {cluster.tp} rank(s) on "
        f"{len(cluster.hosts)} host(s); model {sum(s.nbytes for s in specs) / 1e9:.2f} GB; costs: {calibration.source}"
    )
    table = Table(title="one sync, predicted")
    for col in (
        "backend",
        "route",
        "seconds",
        "ceiling s",
        "x ceiling",
        "bottleneck",
        "busiest NIC MB out / in",
    ):
        table.add_column(col, justify="left" if col in ("backend", "route", "bottleneck") else "right")
    for e in estimates:
        tx = max((v["tx"] for v in e.nic_bytes.values()), default=0)
        rx = max((v["rx"] for v in e.nic_bytes.values()), default=0)
        table.add_row(
            e.backend,
            e.route,
            f"{e.seconds:.3f}",
            f"{e.ceiling_s:.3f}",
            f"{e.ceiling_s / e.seconds:.2f}",
            e.bottleneck,
            f"{tx / 1e6:.1f} / {rx / 1e6:.1f}",
        )
    console.print(table)
    return 0


def _config_command(args: argparse.Namespace) -> int:
    if args.docs:
        sys.stdout.write(docs_markdown(args.lang))
        return 0
    notes: list[str] = []
    try:
        config = (
            EngineConfig.from_yaml(args.yaml, args.overrides, notes)
            if args.yaml
            else EngineConfig.from_overrides(args.overrides)
        )
    except (ConfigError, OSError) as e:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.check:
        print("config OK")
        return 0
    flat = config.to_flat()
    if args.json:
        print(json.dumps(flat, indent=2))
    else:
        for key, value in flat.items():
            print(f"{key}={'null' if value is None else value}")
    return 0


def _vllm_demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.vllm import VLLMDemoOptions, run_vllm_demo

    opts = VLLMDemoOptions(
        model=args.model,
        replicas=args.receivers,
        steps=args.steps,
        bucket_mb=args.bucket_mb,
        overrides=args.overrides,
        address=args.address,
        seed=args.seed,
        mode=args.pause_mode,
        lora_rank=args.lora_rank,
        backend=args.backend,
        tp=args.tp,
        trainers=args.trainers,
    )
    try:
        run_vllm_demo(opts)
    except Exception as e:
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _sharded_demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.sharded import ShardedDemoOptions, run_sharded_demo

    return _demo_run(
        run_sharded_demo, ShardedDemoOptions(**_demo_kwargs(args), trainers=args.trainers, tp=args.tp)
    )


def _demo_kwargs(args: argparse.Namespace) -> dict:
    """What every plain-process demo takes from the command line."""
    keys = ("model", "receivers", "steps", "backend", "bucket_mb", "overrides", "address", "seed")
    return {k: getattr(args, k) for k in keys}


def _demo_run(run, opts) -> int:
    try:
        run(opts)
    except Exception as e:  # every failure ends as one readable line and a non-zero exit
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.plain import DemoOptions, run_demo

    if args.trainers < 1 or args.tp < 1 or args.receivers < 1:
        print("demo: --trainers, --tp and --receivers must be at least 1", file=sys.stderr)
        return 2
    if args.backend is None:  # shards on either side: each byte from its holder to its keeper
        args.backend = "sharded" if args.trainers > 1 or args.tp > 1 else "nccl"
    if args.rollout == "vllm":
        if args.trainers > 1 and args.backend != "sharded":
            print(
                f"demo: --trainers {args.trainers} sends each FSDP2 rank's shards: use --backend sharded",
                file=sys.stderr,
            )
            return 2
        if args.lora_rank and (args.trainers > 1 or args.tp > 1):
            print("demo: --lora-rank runs with one trainer and replicas without --tp", file=sys.stderr)
            return 2
        return _vllm_demo_command(args)
    if args.lora_rank:
        print(
            "demo: --lora-rank syncs a LoRA adapter into vLLM replicas: use it with --rollout vllm",
            file=sys.stderr,
        )
        return 2
    if args.backend == "sharded":
        return _sharded_demo_command(args)
    if args.trainers != 1 or args.tp != 1:
        print(
            "demo: --trainers and --tp shard the trainer and the replicas: use them with --backend sharded",
            file=sys.stderr,
        )
        return 2
    return _demo_run(run_demo, DemoOptions(**_demo_kwargs(args)))


def _vllm_bench_command(args: argparse.Namespace) -> int:
    import json

    from weightsync.bench.vllm import VLLMBenchOptions, run_vllm_bench

    opts = VLLMBenchOptions(
        backends=args.backend,
        model=args.model,
        size_mb=args.size_mb or 392,
        replicas=args.receivers or 2,
        bucket_mb=args.bucket_mb[0],
        repeats=args.repeats,
        overrides=args.overrides,
        work_dir=args.work_dir,
        initial_sync=args.initial_sync,
        modes=args.update_mode,
        hosts=args.hosts,
        link=args.link,
        lora_rank=args.lora_rank,
        tp=args.tp,
        trainers=args.trainers,
    )
    if not _allowed("--update-mode", args.update_mode, UPDATE_MODES):
        return 2
    if args.trainers > 1 and (args.update_mode != ["stream"] or args.lora_rank):
        print("bench: --rollout vllm with --trainers above 1 measures streamed updates only", file=sys.stderr)
        return 2
    try:
        result = run_vllm_bench(opts, lambda text: print(text, file=sys.stderr, flush=True))
    except Exception as e:
        print(f"bench FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"model {result['model_bytes'] / 1e6:.0f} MB, {result['replicas']} vLLM replicas; "
            f"disk reload (all replicas at once) {result['disk_reload_s']:.3f} s, trainer save {result['save_s']:.3f} s"
        )
        for r in result["rows"]:
            if r["update_mode"] == "lora":
                print(
                    f"  {r['backend']:>8}   lora rank {r['lora_rank']}: update {r['seconds']:.4f} s (first "
                    f"{r['first_s']:.4f} s), nothing paused, {r['wire_bytes'] / 1e6:.3f} MB on the wire for "
                    f"{r['bytes'] / 1e6:.3f} MB of adapter; x full-model update {r['ratio_to_full_update']:.3f}"
                )
                continue
            print(
                f"  {r['backend']:>8} {r['update_mode']:>6} {r['bucket_mb']} MiB: update {r['seconds']:.3f} s (first {r['first_s']:.3f} s; "
                f"paused {r['paused_s']:.3f}: pause {r['pause_s']:.3f}, sync {r['sync_s']:.3f}, resume {r['resume_s']:.3f}; worker load "
                f"{r['worker_load_s']:.3f}); disk reload {r['disk_reload_s']:.3f} s, save {r['save_s']:.3f} s; "
                f"x disk reload {r['ratio_to_disk_reload']:.2f}, x save+reload "
                f"{r['ratio_to_save_reload']:.2f}; landing {r.get('landing_mb', 0):.0f} MiB, staging "
                f"{r.get('staging_mb', 0):.0f} MiB, RSS growth {r['rss_growth_mb']:.0f} MB; MB received per "
                f"worker {'/'.join(f'{b / 1e6:.1f}' for b in r['worker_bytes'])}"
                + (
                    f"; generation {r['gen_during_stage_tokens_per_s']:.0f} tokens/s during a stage, "
                    f"{r['gen_idle_tokens_per_s']:.0f} idle"
                    if "gen_idle_tokens_per_s" in r
                    else ""
                )
            )
        print(f"greedy output matches the trainer: {result['greedy_matches_trainer']}")
    lora_ok = all(r.get("greedy_matches_trainer", True) for r in result["rows"])
    return 0 if all(result["greedy_matches_trainer"].values()) and lora_ok else 1


def _codec_bench_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from weightsync.bench.codec import codec_table, run_codec_bench

    err = Console(stderr=True)
    with err.status("codec bench") as status:
        row = run_codec_bench(
            size_mb=args.size_mb or 512,
            lr=args.lr,
            repeats=args.repeats,
            device=args.device,
            progress=lambda msg: status.update(f"codec bench: {msg}"),
        )
    print(json.dumps([row.to_dict()], indent=1) if args.json else codec_table(row))
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    if args.codec:
        return _codec_bench_command(args)
    if args.rollout == "vllm":
        return _vllm_bench_command(args)
    if args.lora_rank:
        print(
            "bench: --lora-rank measures LoRA updates of vLLM replicas: use it with --rollout vllm",
            file=sys.stderr,
        )
        return 2
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if not _allowed("--delta", args.delta, DELTA_MODES):
        return 2
    from weightsync.bench.report import plot, table, to_json
    from weightsync.bench.runner import BenchError, BenchOptions, run_bench

    opts = BenchOptions(
        backends=args.backend,
        bucket_mb=args.bucket_mb,
        receivers=args.receivers or 3,
        trainers=args.trainers,
        tp=args.tp,
        size_mb=args.size_mb or 1024,
        shape=args.shape,
        dtype=args.dtype,
        model=args.model,
        repeats=args.repeats,
        alternatives=args.alternatives,
        overrides=args.overrides,
        work_dir=args.work_dir,
        device=args.device,
        update=args.update,
        lr=args.lr,
        deltas=args.delta,
        hosts=args.hosts,
        link=args.link,
        trainer_link=args.trainer_link,
    )
    err = Console(stderr=True)  # progress on stderr keeps --json output clean
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} syncs"),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as bar:
            task = bar.add_task("starting", total=None)
            rows = run_bench(
                opts,
                lambda label, done, total: bar.update(task, description=label, completed=done, total=total),
            )
    except (BenchError, ValueError, FileNotFoundError, ConfigError) as e:
        print(f"bench FAILED: {e}", file=sys.stderr)
        return 1
    what = f"{args.model}" if args.model else f"synthetic {args.shape} {opts.size_mb:g} MiB {args.dtype}"
    senders = f"{args.trainers} trainer ranks (paired), else 1 sender" if args.trainers > 1 else "1 sender"
    title = f"{what}, {rows[0].tensors} tensors, {senders} -> {opts.receivers} receivers"
    if rows[0].device != "cpu":
        title += f", every process on {rows[0].device}"
    if args.hosts:
        title += f", {args.hosts} emulated hosts, NICs {args.link}" + (
            f" (trainers {args.trainer_link})" if args.trainer_link else ""
        )
    if args.json:
        print(to_json(rows))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(table(rows, title))
    if args.plot:
        plot(rows, args.plot, title)
        err.print(f"plot written to {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "config":
        return _config_command(args)
    if args.command == "bench":
        return _bench_command(args)
    if args.command == "estimate":
        return _estimate_command(args)
    if args.command == "gpu-check":
        from weightsync.gpucheck.driver import run

        return run(args)
    return _demo_command(args)


if __name__ == "__main__":
    sys.exit(main())
