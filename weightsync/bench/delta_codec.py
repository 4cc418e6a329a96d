"""Delta codec benchmark: wire bytes of each encoding and codec throughput on RL-like versions.

    python -m weightsync.bench.delta_codec --size-mb 512

Builds an LLM-shaped bf16 model (``llm_specs``), steps it with ``AdamWUpdates`` at each
learning rate, and encodes the last step's change tensor by tensor: every encoding's total
wire bytes as a percentage of the dense bytes, which one each tensor chose, and the encode
and apply throughput (model bytes per second). Synthetic rows change a uniform random
fraction of the elements by one unit in the last place. Every apply is checked bit for bit
against the new version. One thread (torch is pinned to one: per-thread rates; ``weightsync
bench --codec`` measures the codec on every core against the memory-speed floor), times
are CPU seconds of this process, so a shared machine skews them less; wall seconds are in
``--json``. AdamW steps use every thread torch has (wall seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from weightsync.bench.models import llm_specs
from weightsync.bench.updates import AdamWUpdates, changed_fraction, clone_state
from weightsync.delta.decoder import apply
from weightsync.delta.encoder import encode
from weightsync.delta.format import Kind
from weightsync.delta.header import digest
from weightsync.plan import as_bytes

#: the encodings of the table: (label, kinds, low bytes); each is applied to every tensor
ENCODINGS = {
    "index": ([Kind.INDEX], False),  # int32 positions + values (what verl's delta engine sends)
    "bitmask": ([Kind.BITMASK], False),
    "gaps": ([Kind.GAPS], False),
    "index+low": ([Kind.INDEX], True),
    "bitmask+low": ([Kind.BITMASK], True),
    "gaps+low": ([Kind.GAPS], True),
    "chosen": (None, True),  # per tensor the fewest bytes, dense and empty included
}
TIMED = ("index", "bitmask", "gaps+low", "chosen")


@dataclass
class Row:
    name: str
    density: float
    dense_bytes: int
    bytes: dict[str, int] = field(default_factory=dict)  # encoding -> wire bytes (all tensors)
    winners: dict[str, int] = field(default_factory=dict)  # chosen kind -> tensors
    winner_bytes: dict[str, int] = field(default_factory=dict)  # chosen kind -> dense bytes of those tensors
    gap_widths: dict[str, int] = field(default_factory=dict)  # GAPS tensors by width
    encode_cpu_s: dict[str, float] = field(default_factory=dict)
    apply_cpu_s: dict[str, float] = field(default_factory=dict)
    encode_wall_s: dict[str, float] = field(default_factory=dict)
    apply_wall_s: dict[str, float] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)  # AdamW step wall seconds (AdamW rows)
    step_cpu_s: list[float] = field(default_factory=list)  # and CPU seconds (all threads)
    densities: list[float] = field(default_factory=list)  # density of every step (AdamW rows)

    def percent(self, label: str) -> float:
        return 100.0 * self.bytes[label] / self.dense_bytes

    def gbps(self, which: str, label: str) -> float:
        seconds = (self.encode_cpu_s if which == "encode" else self.apply_cpu_s)[label]
        return self.dense_bytes / seconds / 1e9 if seconds else float("inf")


def _timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_bytes(a), as_bytes(b))


def measure(
    name: str, base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], density: float | None = None
) -> Row:
    """Encode ``new`` against ``base`` tensor by tensor with every encoding of the table
    (torch on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(name, base, new, density)
    finally:
        torch.set_num_threads(threads)


def _measure(
    name: str, base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], density: float | None
) -> Row:
    dense = sum(t.numel() * t.element_size() for t in new.values())
    row = Row(name, changed_fraction(base, new) if density is None else density, dense)
    for label, (kinds, low) in ENCODINGS.items():
        total = 0
        enc_cpu = enc_wall = 0.0
        payloads = {}
        for tname, t in new.items():
            enc, cpu, wall = _timed(lambda: encode(base[tname], t, kinds=kinds, low_bytes=low))
            enc_cpu, enc_wall = enc_cpu + cpu, enc_wall + wall
            total += enc.nbytes
            payloads[tname] = enc
            if label == "chosen":
                row.winners[enc.kind.name] = row.winners.get(enc.kind.name, 0) + 1
                row.winner_bytes[enc.kind.name] = row.winner_bytes.get(enc.kind.name, 0) + enc.dense_nbytes
            if label == "gaps+low" and enc.payload is not None:
                width = f"gaps{int(enc.payload[5])}"
                row.gap_widths[width] = row.gap_widths.get(width, 0) + 1
        row.bytes[label] = total
        if label not in TIMED:
            continue
        row.encode_cpu_s[label], row.encode_wall_s[label] = enc_cpu, enc_wall
        targets = {tname: t.clone() for tname, t in base.items()}
        app_cpu = app_wall = 0.0
        for tname, enc in payloads.items():
            payload = enc.payload if enc.kind != Kind.DENSE else as_bytes(new[tname])
            _, cpu, wall = _timed(lambda t=targets[tname], k=enc.kind, p=payload: apply(t, k, p))
            app_cpu, app_wall = app_cpu + cpu, app_wall + wall
        row.apply_cpu_s[label], row.apply_wall_s[label] = app_cpu, app_wall
        bad = [tname for tname in new if not _bits_equal(targets[tname], new[tname])]
        if bad:
            raise AssertionError(f"{name}/{label}: apply did not reproduce {bad[:3]}")
        del targets, payloads
    return row


def adamw_rows(specs, lrs: list[float], steps: int, seed: int, log: Callable[[str], None]) -> list[Row]:
    rows = []
    for lr in lrs:
        updates = AdamWUpdates(specs, lr=lr, seed=seed)
        prev = clone_state(updates.tensors)
        step_s, step_cpu_s, densities = [], [], []
        for step in range(steps):
            if step:
                for k, t in updates.tensors.items():
                    prev[k].copy_(t)
            _, cpu, wall = _timed(updates.step)
            step_s.append(wall)
            step_cpu_s.append(cpu)
            densities.append(changed_fraction(prev, updates.tensors))
            log(
                f"lr {lr:g} step {step + 1}: {wall:.2f} s ({cpu:.2f} CPU s), density {100 * densities[-1]:.2f}%"
            )
        row = measure(f"AdamW lr {lr:g}, step {steps}", prev, updates.tensors, densities[-1])
        row.step_s, row.step_cpu_s, row.densities = step_s, step_cpu_s, densities
        rows.append(row)
        log(format_row(row))
        del updates, prev
    return rows


def synthetic_rows(specs, densities: list[float], seed: int, log: Callable[[str], None]) -> list[Row]:
    """The initial weights, and a version where a uniform random ``density`` of the elements
    moved by one unit in the last place (up or down)."""
    base = AdamWUpdates(specs, lr=0.0, seed=seed).tensors  # the initial bf16 weights, no masters needed
    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    for density in densities:
        new = clone_state(base)
        for t in new.values():
            ints = t.view(torch.int16).view(-1)
            pick = torch.rand(ints.shape, generator=gen) < density
            step = torch.randint(0, 2, (int(pick.sum()),), generator=gen, dtype=torch.int16) * 2 - 1
            ints[pick] += step
        row = measure(f"uniform {100 * density:g}%", base, new)
        rows.append(row)
        log(format_row(row))
        del new
    return rows


def digest_rate(state: Mapping[str, torch.Tensor]) -> dict[str, float]:
    dense = sum(t.numel() * t.element_size() for t in state.values())
    rates = {}
    for algorithm in ("xxh3_64", "blake2b"):
        try:
            _, cpu, wall = _timed(lambda: digest(state, algorithm=algorithm))
        except ImportError:
            continue
        rates[algorithm] = dense / cpu / 1e9
    return rates


def format_row(row: Row) -> str:
    return f"{row.name}: density {100 * row.density:.2f}%, chosen {row.percent('chosen'):.2f}% of dense, winners {dict(row.winners)}"


def table(rows: list[Row]) -> str:
    head = "| version | density | " + " | ".join(ENCODINGS) + " | winner (tensors: count) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r.percent(label):.2f}%" for label in ENCODINGS]
        winners = ", ".join(f"{k.lower()} {v}" for k, v in Counter(r.winners).most_common())
        lines.append(f"| {r.name} | {100 * r.density:.2f}% | " + " | ".join(cells) + f" | {winners} |")
    return "\n".join(lines)


def speed_table(rows: list[Row]) -> str:
    head = (
        "| version | "
        + " | ".join(f"encode {t}" for t in TIMED)
        + " | "
        + " | ".join(f"apply {t}" for t in TIMED)
        + " |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r.gbps('encode', t):.2f}" for t in TIMED] + [f"{r.gbps('apply', t):.2f}" for t in TIMED]
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=512, help="bf16 model size (llm_specs)")
    parser.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="AdamW learning rates, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per rate; the last one is encoded")
    parser.add_argument("--densities", default="0.02,0.05,0.15", help="synthetic uniform densities")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    specs = llm_specs(int(args.size_mb * (1 << 20)), "bfloat16")
    total = sum(s.nbytes for s in specs)
    log(f"model: {len(specs)} bf16 tensors, {total / 2**20:.0f} MiB")
    rows = []
    if args.lrs:
        rows += adamw_rows(specs, [float(x) for x in args.lrs.split(",")], args.steps, args.seed, log)
    if args.densities:
        rows += synthetic_rows(specs, [float(x) for x in args.densities.split(",")], args.seed, log)
    rates = digest_rate(AdamWUpdates(specs, lr=0.0, seed=args.seed).tensors)
    print(f"model: {len(specs)} bf16 tensors, {total / 2**20:.0f} MiB (llm_specs); one thread, CPU seconds\n")
    print("Wire bytes, % of dense:\n")
    print(table(rows))
    print("\nThroughput, GB/s of model bytes (one thread):\n")
    print(speed_table(rows))
    print("\nDigest, GB/s (one thread): " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    for r in rows:
        if r.step_s:
            steps = ", ".join(f"{s:.1f} ({c:.1f})" for s, c in zip(r.step_s, r.step_cpu_s, strict=True))
            dens = ", ".join(f"{100 * d:.2f}%" for d in r.densities)
            print(f"{r.name}: AdamW step seconds, wall (CPU) {steps}; density per step {dens}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model_bytes": total,
                    "tensors": len(specs),
                    "digest_gbps": rates,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
