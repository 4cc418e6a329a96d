"""The ``weightsync`` command line's arguments: a subparser per command (``demo``,
``bench``, ``estimate``, ``config``, ``gpu-check``) with its flags, defaults and help. What
each command does with them is in ``weightsync.cli.commands``."""

from __future__ import annotations

import argparse
from pathlib import Path

from weightsync.config.keys import DELTA_MODES

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
    p.add_argument(
        "--arch",
        choices=("dense", "moe"),
        default="dense",
        help="the embedded model when no --model is given: dense (Qwen2-shaped, default) or moe "
        "(Qwen3-MoE-shaped: experts fused in the trainer, sent one by one as engines load them)",
    )
    p.add_argument("--receivers", type=int, default=2, help="rollout processes (default: 2)")
    p.add_argument(
        "--quantize",
        choices=("fp8",),
        default=None,
        help="rollout rank 0 holds the decoder layers' matrices in FP8 128x128 blocks, quantized on the "
        "trainer, checked against vLLM's convention; the other ranks take the same sync as the trainer holds "
        "it (docs/quantized.md)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="training steps, one sync each (default: 3; --trainer trl: 6)"
    )
    p.add_argument(
        "--trainer",
        choices=("torch", "trl"),
        default="torch",
        help="the trainer: a plain PyTorch loop (default) or TRL's GRPOTrainer with a vLLM replica synced "
        "by weightsync (needs weightsync[trl,vllm]; docs/trl.md)",
    )
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
    _add_overrides(p, "any configuration key (repeatable), e.g. --set timeout_s=60")
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
        "--ep",
        type=int,
        default=1,
        help="--arch moe: expert-parallel ranks per replica, each keeping the experts vLLM's linear placement "
        "gives it in slots of its own and the attention whole (backend sharded; default: 1)",
    )
    p.add_argument(
        "--rollout",
        choices=("process", "vllm", "sglang"),
        default="process",
        help="rollout side: plain PyTorch processes (default), vLLM replicas (needs weightsync[vllm]) or "
        "SGLang replicas (needs SGLang: make install-sglang)",
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
    p.add_argument(
        "--in-flight",
        action="store_true",
        help="--rollout vllm or sglang: every replica generates in a thread of its own while the trainer updates every "
        "step; every request printed with the versions that sampled its tokens, each token checked against them",
    )


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
        default=None,
        help="tensor-parallel ranks per replica: each row has --receivers x --tp receiver processes; "
        "sharded sends each rank only its slices, the other backends the whole model (default: 1; with --ep, "
        "--ep: vLLM's tensor_parallel_size with enable_expert_parallel)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks per replica (--shape moe, sent in its checkpoint form): each keeps the "
        "experts vLLM's linear placement gives it and its --tp slices of the other tensors (--tp 1: whole, "
        "the attention data-parallel); sharded sends each rank only those (default: 1)",
    )
    p.add_argument(
        "--size-mb",
        type=float,
        default=None,
        help="synthetic model size in MiB (default: 1024; with --rollout vllm: a 392 MB fp32 Qwen2 model)",
    )
    p.add_argument(
        "--rollout",
        choices=("processes", "vllm", "sglang"),
        default="processes",
        help="receivers: plain processes (default), or real vLLM replicas (--receivers of them, default 2 "
        "here: update vs. the replicas reloading from disk and the trainer's save)",
    )
    p.add_argument(
        "--shape",
        choices=("llm", "moe", "small-tensors"),
        default="llm",
        help="synthetic model: a Qwen2-like decoder, a Qwen3-MoE-like one (8 experts, top 2, stacked as "
        "transformers holds them; replicas keep whole experts of their own), or only 256 KiB tensors "
        "(default: llm)",
    )
    p.add_argument(
        "--quantize",
        choices=("fp8",),
        default=None,
        help="each backend's row again with receivers holding the decoder layers' matrices in FP8 "
        "128x128 blocks, quantized on the trainer (docs/quantized.md): seconds and wire bytes against "
        "the plain row",
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
        help="how versions differ: every byte of every tensor (bump, default), or an AdamW step of fp32 "
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
    _add_overrides(p, "configuration key for weightsync's rows (repeatable)")
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
        "--tp",
        type=int,
        default=None,
        help="--hosts: tensor-parallel ranks per replica (default: 1; with --ep, --ep)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="--hosts: expert-parallel ranks per replica, each keeping its experts (--shape moe; default: 1)",
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
        "--shape",
        choices=("llm", "moe", "small-tensors"),
        default="llm",
        help="synthetic model (default: llm)",
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


def _add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    """``--set KEY=VALUE`` (repeatable): configuration overrides, as Hydra-style dotted keys."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
