"""``weightsync bench --codec``: the delta codec against the memory-speed floor, in one run.

An LLM-shaped bf16 model (``llm_specs``) takes ``steps`` AdamW steps (``AdamWUpdates``);
the last step's change is then encoded and applied ``repeats`` times, each time after the
floor: one plain element compare of version and base per tensor (it reads 2 bytes per model
byte, as any codec must), with torch's threads. Encode runs as the sender runs it (a thread
pool of one worker per core, largest tensors first), apply as a receiver does
(``delta.apply_many``: in place, on every core). Each apply is checked bit for bit against the version. Ratios are of
medians measured in the same run: ``encode_vs_floor`` = floor seconds / encode seconds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from weightsync.bench.models import llm_specs
from weightsync.bench.updates import AdamWUpdates, changed_fraction, clone_state
from weightsync.delta.decoder import apply_many
from weightsync.delta.encoder import Encoded, encode
from weightsync.delta.format import Kind, flat_ints
from weightsync.plan import as_bytes
from weightsync.platform import local_device, synchronize


@dataclass
class CodecRow:
    """One ``--codec`` run: seconds are medians of ``repeats``, GB/s of model bytes."""

    device: str
    tensors: int
    model_bytes: int
    lr: float
    density: float  # fraction of elements changed by the last step
    wire_fraction: float  # delta payloads (and dense tensors) / model bytes
    kinds: dict[str, int]  # tensors by chosen kind
    floor_s: float
    encode_s: float
    apply_s: float
    repeats: int
    threads: int

    @property
    def encode_vs_floor(self) -> float:
        return self.floor_s / self.encode_s

    @property
    def apply_vs_floor(self) -> float:
        return self.floor_s / self.apply_s

    def gbps(self, seconds: float) -> float:
        return self.model_bytes / seconds / 1e9

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            encode_vs_floor=round(self.encode_vs_floor, 3),
            apply_vs_floor=round(self.apply_vs_floor, 3),
            floor_gbps=round(self.gbps(self.floor_s), 3),
            encode_gbps=round(self.gbps(self.encode_s), 3),
            apply_gbps=round(self.gbps(self.apply_s), 3),
        )
        return out


def run_codec_bench(
    size_mb: float = 512,
    lr: float = 1e-6,
    steps: int = 2,
    repeats: int = 5,
    device: str = "cpu",
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> CodecRow:
    """Measure encode and apply against the floor (see the module's docstring)."""
    dev = local_device(device)
    specs = llm_specs(int(size_mb * (1 << 20)), "bfloat16")
    updates = AdamWUpdates(specs, lr=lr, seed=seed)
    prev = clone_state(updates.tensors)
    for step in range(steps):
        progress(f"AdamW step {step + 1}/{steps}")
        if step:
            for name, t in updates.tensors.items():
                prev[name].copy_(t)
        updates.step()
    density = changed_fraction(prev, updates.tensors)
    base = {name: t.to(dev) for name, t in prev.items()}
    new = {name: t.to(dev) for name, t in updates.tensors.items()}
    del updates, prev
    names = sorted(new, key=lambda n: -new[n].numel())  # the sender's order: largest first
    target = {name: t.clone() for name, t in base.items()}
    mask = torch.empty(max(t.numel() for t in new.values()), dtype=torch.bool, device=dev)
    workers = (os.cpu_count() or 1) if dev.type == "cpu" else 1  # a device runs one stream of kernels

    def timed(fn: Callable[[], object]) -> tuple[object, float]:
        synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        synchronize(dev)
        return out, time.perf_counter() - t0

    def floor() -> None:
        for name in names:
            b, n = flat_ints(base[name]), flat_ints(new[name])
            torch.ne(b, n, out=mask[: b.numel()].view(b.shape))

    def apply(encoded: list[Encoded]) -> None:
        apply_many(
            (target[name], enc.kind, enc.payload if enc.kind != Kind.DENSE else as_bytes(new[name]))
            for name, enc in zip(names, encoded)
        )

    floors, encodes, applies = [], [], []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightsync-codec") as pool:
        encoded: list[Encoded] = []
        for r in range(repeats + 1):  # the first round warms up
            progress(f"round {r}/{repeats}")
            _, f = timed(floor)
            encoded, e = timed(lambda: list(pool.map(lambda name: encode(base[name], new[name]), names)))
            _, a = timed(lambda: apply(encoded))
            bad = [name for name in names if not torch.equal(as_bytes(target[name]), as_bytes(new[name]))]
            if bad:
                raise AssertionError(f"apply did not reproduce {bad[:3]}")
            for name in names:
                target[name].copy_(base[name])
            if r:
                floors.append(f)
                encodes.append(e)
                applies.append(a)
    kinds: dict[str, int] = {}
    for enc in encoded:
        kinds[enc.kind.name] = kinds.get(enc.kind.name, 0) + 1
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    return CodecRow(
        device=str(dev),
        tensors=len(names),
        model_bytes=model_bytes,
        lr=lr,
        density=density,
        wire_fraction=sum(enc.nbytes for enc in encoded) / model_bytes,
        kinds=kinds,
        floor_s=statistics.median(floors),
        encode_s=statistics.median(encodes),
        apply_s=statistics.median(applies),
        repeats=repeats,
        threads=torch.get_num_threads(),
    )


def codec_table(row: CodecRow) -> str:
    """A Markdown table of one run (as BENCHMARKS.md holds it)."""
    lines = [
        "| step | seconds (median) | GB/s of model | vs floor |",
        "|---|---|---|---|",
        f"| floor (element compare) | {row.floor_s:.3f} | {row.gbps(row.floor_s):.2f} | 1.00x |",
        f"| encode | {row.encode_s:.3f} | {row.gbps(row.encode_s):.2f} | {row.encode_vs_floor:.2f}x |",
        f"| apply | {row.apply_s:.3f} | {row.gbps(row.apply_s):.2f} | {row.apply_vs_floor:.2f}x |",
    ]
    head = (
        f"{row.model_bytes / 2**20:.0f} MiB bf16, {row.tensors} tensors on {row.device} ({row.threads} torch threads), "
        f"AdamW lr {row.lr:g}: {100 * row.density:.2f}% of elements changed, wire {100 * row.wire_fraction:.2f}% "
        f"of dense ({', '.join(f'{k.lower()} {v}' for k, v in sorted(row.kinds.items()))}); {row.repeats} repeats"
    )
    return head + "\n\n" + "\n".join(lines)
