"""``weightsync demo --rollout sglang`` and ``weightsync bench --rollout sglang``: the command
line's side (SGLang is imported only here, when asked for)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

NO_SGLANG = "needs SGLang: make install-sglang, then run it as .venv-sglang/bin/weightsync"


def sglang_demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo.sglang import SGLangDemoOptions, run_sglang_demo

    if importlib.util.find_spec("sglang") is None:
        print(f"demo: --rollout sglang {NO_SGLANG}", file=sys.stderr)
        return 2

    if args.trainers != 1 or args.lora_rank or args.pause_mode == "wait":
        print(
            "demo: --rollout sglang runs one trainer, full-weight updates, pause mode keep or abort",
            file=sys.stderr,
        )
        return 2
    if args.in_flight and (args.tp > 1 or args.pause_mode != "keep"):
        print("demo: --in-flight runs replicas without --tp, pause mode keep", file=sys.stderr)
        return 2
    opts = SGLangDemoOptions(
        model=args.model,
        replicas=args.receivers,
        steps=args.steps,
        bucket_mb=args.bucket_mb,
        overrides=args.overrides,
        address=args.address,
        seed=args.seed,
        mode=args.pause_mode,
        backend=args.backend or "nccl",
        tp=args.tp,
    )
    try:
        if args.in_flight:
            from weightsync.demo.sglang import run_sglang_in_flight_demo

            run_sglang_in_flight_demo(opts)
        else:
            run_sglang_demo(opts)
    except Exception as e:
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def sglang_bench_command(args: argparse.Namespace) -> int:
    from weightsync.bench.sglang import SGLangBenchOptions, run_sglang_bench

    if importlib.util.find_spec("sglang") is None:
        print(f"bench: --rollout sglang {NO_SGLANG}", file=sys.stderr)
        return 2

    if args.trainers != 1 or args.lora_rank or args.update_mode != ["stream"]:
        print(
            "bench: --rollout sglang measures streamed full-weight updates from one trainer", file=sys.stderr
        )
        return 2
    opts = SGLangBenchOptions(
        backends=args.backend,
        model=args.model,
        size_mb=args.size_mb or 392,
        replicas=args.receivers or 2,
        bucket_mb=args.bucket_mb[0],
        repeats=args.repeats,
        overrides=args.overrides,
        work_dir=args.work_dir,
        tp=args.tp,
    )
    try:
        result = run_sglang_bench(opts, lambda text: print(text, file=sys.stderr, flush=True))
    except Exception as e:
        print(f"bench FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in result["rows"]:
            print(
                f"{row['backend']:>6}  replicas {row['replicas']} x TP {row['tp']}  update {row['update_s']:.3f} s  "
                f"update_weights_from_disk {row['reload_from_disk_s']:.3f} s  "
                f"ratio {row['update_vs_reload']:.2f}x  (model {result['model_bytes'] / 1e6:.0f} MB)"
            )
    return 0
