"""The ``weightsync`` command line's commands: what ``demo``, ``bench``, ``estimate``,
``config`` and ``gpu-check`` run, from the arguments ``weightsync.cli.parser`` builds, and
``main``, which parses and dispatches."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from weightsync.cli.parser import build_parser
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import DELTA_MODES, UPDATE_MODES, ConfigError
from weightsync.config.reference import docs_markdown


def _allowed(flag: str, values: list[str], allowed: tuple[str, ...]) -> bool:
    """Whether every value of a comma-separated option is allowed; if not, say which on stderr."""
    if bad := [v for v in values if v not in allowed]:
        print(f"{flag} {','.join(bad)}: expected {', '.join(allowed)}", file=sys.stderr)
    return not bad


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
    args.tp = _tp_of(args)
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
                ep=args.ep,
            )
        dtype = args.dtype or cluster.dtype
        size_mb = args.size_gb * 1024 if args.size_gb is not None else args.size_mb
        specs = (
            models.directory_specs(args.model)
            if args.model
            else models.synthetic_specs(args.shape, size_mb, dtype, per_expert=cluster.ep > 1)
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
        f"{len(cluster.trainers)} trainer rank(s), {cluster.replicas} replica(s) x {cluster.ranks} rank(s) on "
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
        in_flight=args.in_flight,
        backend=args.backend,
        tp=args.tp,
        trainers=args.trainers,
        arch=args.arch,
    )
    try:
        if opts.in_flight:
            from weightsync.demo.vllm_inflight import run_in_flight_demo

            run_in_flight_demo(opts)
        else:
            run_vllm_demo(opts)
    except Exception as e:
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _sharded_demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.sharded import ShardedDemoOptions, run_sharded_demo

    return _demo_run(
        run_sharded_demo,
        ShardedDemoOptions(
            **_demo_kwargs(args), trainers=args.trainers, tp=args.tp, ep=args.ep, quantize=args.quantize
        ),
    )


def _demo_kwargs(args: argparse.Namespace) -> dict:
    """What every plain-process demo takes from the command line."""
    keys = ("model", "receivers", "steps", "backend", "bucket_mb", "overrides", "address", "seed", "arch")
    return {k: getattr(args, k) for k in keys}


def _demo_run(run, opts) -> int:
    try:
        run(opts)
    except Exception as e:  # every failure ends as one readable line and a non-zero exit
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _trl_demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.trl import TRLDemoOptions, run_trl_demo

    if (
        args.rollout == "sglang"
        or args.trainers != 1
        or args.tp != 1
        or args.quantize
        or args.lora_rank
        or args.in_flight
        or args.model
        or args.arch != "dense"
    ):
        print(
            "demo: --trainer trl runs GRPO on the embedded tiny model with one vLLM replica: it takes "
            "--steps, --backend, --bucket-mb, --set and --seed",
            file=sys.stderr,
        )
        return 2
    overrides = [f"backend={args.backend or 'nccl'}", f"update_weights_bucket_megabytes={args.bucket_mb}"]
    return _demo_run(
        run_trl_demo,
        TRLDemoOptions(steps=args.steps or 6, overrides=(*overrides, *args.overrides), seed=args.seed),
    )


def _demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.plain import DemoOptions, run_demo

    if args.trainer == "trl":
        return _trl_demo_command(args)
    if args.steps is None:
        args.steps = 3
    if args.trainers < 1 or args.tp < 1 or args.receivers < 1:
        print("demo: --trainers, --tp and --receivers must be at least 1", file=sys.stderr)
        return 2
    if args.model and args.arch != "dense":
        print(
            "demo: --arch picks the embedded model; with --model DIR the directory's config decides",
            file=sys.stderr,
        )
        return 2
    if args.ep != 1 and (args.ep < 1 or args.arch != "moe" or args.tp != 1 or args.rollout != "process"):
        print(
            "demo: --ep runs the embedded MoE (--arch moe) into rollout processes, without --tp (each expert-"
            "parallel rank keeps the attention whole)",
            file=sys.stderr,
        )
        return 2
    if args.backend is None:  # shards on either side: each byte from its holder to its keeper
        args.backend = "sharded" if args.trainers > 1 or args.tp > 1 or args.ep > 1 else "nccl"
    if args.quantize and args.rollout != "process":
        print(_NO_ENGINE_FP8.format(what="demo", fp8=args.quantize), file=sys.stderr)
        return 2
    if args.rollout == "sglang":
        from weightsync.cli.sglang import sglang_demo_command

        return sglang_demo_command(args)
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
        if args.in_flight and (
            args.trainers > 1 or args.tp > 1 or args.lora_rank or args.pause_mode != "keep"
        ):
            print(
                "demo: --in-flight runs with one trainer, replicas without --tp, full updates, pause mode keep",
                file=sys.stderr,
            )
            return 2
        return _vllm_demo_command(args)
    if args.in_flight:
        print(
            "demo: --in-flight generates on engine replicas during updates: use it with --rollout vllm or sglang",
            file=sys.stderr,
        )
        return 2
    if args.lora_rank:
        print(
            "demo: --lora-rank syncs a LoRA adapter into vLLM replicas: use it with --rollout vllm",
            file=sys.stderr,
        )
        return 2
    if args.quantize and (
        args.backend in ("paired", "disk", "naive")
        or (args.backend == "sharded" and args.tp > 1)
        or (args.backend != "sharded" and args.trainers > 1)
    ):
        print(
            f"demo: --quantize {args.quantize} quantizes on one trainer rank for a dense transport "
            "(nccl, shm, mooncake, ipc) or on every FSDP2 rank with --backend sharded (replicas without "
            "--tp), not with --backend paired, disk or naive",
            file=sys.stderr,
        )
        return 2
    if args.backend == "sharded":
        return _sharded_demo_command(args)
    if args.trainers != 1 or args.tp != 1 or args.ep != 1:
        print(
            "demo: --trainers, --tp and --ep shard the trainer and the replicas: use them with --backend sharded",
            file=sys.stderr,
        )
        return 2
    return _demo_run(run_demo, DemoOptions(**_demo_kwargs(args), quantize=args.quantize))


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


def _tp_of(args: argparse.Namespace) -> int:
    """``--tp``, which defaults to ``--ep`` (vLLM's TP with expert parallelism), else 1."""
    return args.tp if args.tp is not None else max(args.ep, 1)


#: --quantize with an engine: neither engine's CPU build serves FP8 here
_NO_ENGINE_FP8 = (
    "{what}: --quantize {fp8} runs with plain rollout processes: vLLM's CPU build serves no FP8 without AMX, "
    "and engine workers do not declare FP8 forms yet (docs/quantized.md)"
)


def _bench_command(args: argparse.Namespace) -> int:
    if args.codec:
        return _codec_bench_command(args)
    args.tp = _tp_of(args)
    if args.ep != 1 and (
        args.rollout != "processes" or args.model or args.shape != "moe" or args.tp not in (1, args.ep)
    ):
        print(
            "bench: --ep runs with rollout processes on --shape moe (its checkpoint form), --tp 1 or equal to --ep",
            file=sys.stderr,
        )
        return 2
    if args.quantize and args.rollout != "processes":
        print(_NO_ENGINE_FP8.format(what="bench", fp8=args.quantize), file=sys.stderr)
        return 2
    if args.rollout == "vllm":
        return _vllm_bench_command(args)
    if args.rollout == "sglang":
        from weightsync.cli.sglang import sglang_bench_command

        return sglang_bench_command(args)
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
        ep=args.ep,
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
        quantize=args.quantize,
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
    from weightsync.bench import models

    shape = (
        f"moe ({models.MOE_EXPERTS} experts, top {models.MOE_TOP_K})" if args.shape == "moe" else args.shape
    )
    what = f"{args.model}" if args.model else f"synthetic {shape} {opts.size_mb:g} MiB {args.dtype}"
    senders = f"{args.trainers} trainer ranks (paired), else 1 sender" if args.trainers > 1 else "1 sender"
    ranks = f" x {opts.ranks} ranks ({'EP ' + str(opts.ep) if opts.ep > 1 else 'TP ' + str(opts.tp)})"
    title = f"{what}, {rows[0].tensors} tensors, {senders} -> {opts.receivers} receivers{ranks if opts.ranks > 1 else ''}"
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
