"""The ``weightsync`` command line: ``demo`` and ``config``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from weightsync.config import ConfigError, EngineConfig, docs_markdown


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
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json + safetensors), loaded locally")
    p.add_argument("--receivers", type=int, default=2, help="rollout processes (default: 2)")
    p.add_argument("--steps", type=int, default=3, help="training steps, one sync each (default: 3)")
    p.add_argument("--backend", default="nccl", help="transfer backend (default: nccl; Gloo on CPU)")
    p.add_argument("--bucket-mb", type=int, default=64, help="bucket size in MiB (default: 64; may be smaller than the largest tensor)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any configuration key (repeatable), e.g. --set timeout_s=60")
    p.add_argument("--address", default="127.0.0.1:0", help="sender's control address (default: 127.0.0.1, a free port)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--rollout", choices=("process", "vllm"), default="process",
                   help="rollout side: plain PyTorch processes (default) or vLLM replicas (needs weightsync[vllm])")
    p.add_argument("--pause-mode", choices=("keep", "abort", "wait"), default="keep",
                   help="--rollout vllm: what pausing does to in-flight requests (default: keep)")


def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="print the effective configuration, validate it, or print the parameter reference",
        description="Print the effective configuration for the given overrides (key=value, short or full form).",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
    p.add_argument("--yaml", metavar="FILE", help="read a YAML file first (nested or flat keys)")
    p.add_argument("--check", action="store_true", help="only validate: exit 0 if valid, 2 with the message if not")
    p.add_argument("--json", action="store_true", help="print the configuration as JSON")
    p.add_argument("--docs", action="store_true", help="print the parameter reference (Markdown) generated from the code")
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="language of --docs (default: en)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Move model weights from an RL trainer to its inference fleet: bit-exact, versioned, fast.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engines do")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(sub)
    _add_config(sub)
    return parser


def _config_command(args: argparse.Namespace) -> int:
    if args.docs:
        sys.stdout.write(docs_markdown(args.lang))
        return 0
    try:
        config = (
            EngineConfig.from_yaml(args.yaml, args.overrides) if args.yaml else EngineConfig.from_overrides(args.overrides)
        )
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    from weightsync.demo_vllm import VLLMDemoOptions, run_vllm_demo

    opts = VLLMDemoOptions(
        model=args.model, replicas=args.receivers, steps=args.steps, bucket_mb=args.bucket_mb,
        overrides=args.overrides, address=args.address, seed=args.seed, mode=args.pause_mode,
    )
    try:
        run_vllm_demo(opts)
    except Exception as e:
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    from weightsync.demo import DemoOptions, run_demo

    if args.rollout == "vllm":
        return _vllm_demo_command(args)
    opts = DemoOptions(
        model=args.model, receivers=args.receivers, steps=args.steps, backend=args.backend,
        bucket_mb=args.bucket_mb, overrides=args.overrides, address=args.address, seed=args.seed,
    )
    try:
        run_demo(opts)
    except Exception as e:  # every failure ends as one readable line and a non-zero exit
        print(f"demo FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "config":
        return _config_command(args)
    return _demo_command(args)


if __name__ == "__main__":
    sys.exit(main())
