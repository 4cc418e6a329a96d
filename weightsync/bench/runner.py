"""``weightsync bench``: weightsync's backends against what users would do instead.

Rows, all from one run on one machine (compare ratios, not absolute times):

- one per weightsync backend and bucket size (``Sender``/``Receiver`` as users call them);
- ``per-tensor-broadcast``: one Gloo/NCCL broadcast per tensor, straight into the model;
- ``safetensors-reload``: the trainer writes safetensors, every receiver loads them;
- the transports' ceilings: ``broadcast-ceiling`` (one broadcast of all bytes as a single
  buffer, the bound for ``nccl``) and ``memcpy-ceiling`` (one process copying the bytes
  every receiver needs, the bound for ``shm`` and ``ipc``).

With ``device="cuda"`` every process holds its model and transfer buffers on that GPU
(all processes share it); the CPU-only alternatives are left out and the one ceiling is
``d2d-ceiling``: one process copying the bytes every receiver needs device to device,
which bounds every transport between processes on one GPU.

A ceiling is as noisy as the machine: on 2 busy cores one run of the broadcast ceiling
read 0.64 s and the next 1.26 s. So a ceiling is measured interleaved with the rows it
bounds (ceiling, row, ceiling, row, ..., ceiling), each time after a warm-up, and its row
reports the median of every timed repeat (at least ``CEILING_REPEATS``) with their spread:
the interquartile range over the median. A row's ratio is the ceiling's median over the
row's median, both of this run; a ceiling whose spread exceeds ``NOISY_SPREAD`` marks its
rows' ratios as noisy (``ceiling_noisy``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weightsync.bench import models
from weightsync.bench.workers import (
    Job,
    alternative,
    cleanup_disk,
    memcpy_ceiling,
    sync_receiver,
    sync_sender,
)
from weightsync.config.scratch import scratch_overrides
from weightsync.plan import TensorSpec
from weightsync.platform import process_context, start_process
from weightsync.quant.replica import fp8_wire_specs

ALTERNATIVES = ("per-tensor-broadcast", "safetensors-reload")
#: backends where every trainer rank sends a share (``--trainers`` applies to them)
_ALL_RANKS_SEND = ("paired", "sharded")
#: backends that move bytes between hosts (``shm`` needs one host's memory, ``disk`` a
#: directory both sides see, ``naive`` one process)
CROSS_HOST = ("nccl", "mooncake", "paired", "sharded")
#: the ceiling row that bounds each backend (backends not listed have none measured)
CEILING_OF = {
    "nccl": "broadcast-ceiling",
    "paired": "broadcast-ceiling",
    "shm": "memcpy-ceiling",
    "ipc": "memcpy-ceiling",
}
#: the ceiling of those backends when the model lives on a device (``--device cuda``)
DEVICE_CEILING = "d2d-ceiling"
#: rows measured by one process alone (no receivers join)
_SINGLE_PROCESS = ("memcpy-ceiling", DEVICE_CEILING)
#: timed repeats a ceiling row reports at least, summed over its interleaved runs
CEILING_REPEATS = 5
#: a ceiling whose spread (interquartile range over median) exceeds this makes ratios noisy
NOISY_SPREAD = 0.15


def ceiling_of(backend: str, device: str = "cpu") -> str | None:
    """The ceiling row that bounds ``backend`` on ``device`` (None: none is measured)."""
    if backend not in CEILING_OF:
        return None
    return CEILING_OF[backend] if device == "cpu" else DEVICE_CEILING


class BenchError(RuntimeError):
    """A benchmark row failed; the message names the row and the process."""


@dataclass
class BenchOptions:
    backends: list[str] = field(default_factory=lambda: ["nccl", "shm"])
    bucket_mb: list[int] = field(default_factory=lambda: [64])
    receivers: int = 3
    #: trainer processes for backends where every trainer rank sends (``paired``, ``sharded``)
    trainers: int = 1
    #: tensor-parallel ranks per replica: every row has ``receivers * tp`` receiver
    #: processes; ``sharded`` sends each only its slices, the others the whole model
    tp: int = 1
    #: expert-parallel ranks per replica (``--shape moe`` in its checkpoint form, one tensor
    #: per expert's matrix): ``sharded`` sends each rank only the experts vLLM's linear
    #: placement gives it; every row has ``receivers * max(tp, ep)`` receiver processes
    ep: int = 1
    size_mb: float = 1024
    shape: str = "llm"
    dtype: str = "bfloat16"
    model: str | None = None
    repeats: int = 3
    alternatives: bool = True
    overrides: list[str] = field(default_factory=list)
    work_dir: str | None = None
    timeout_s: float = 300.0
    #: how versions differ: "bump" (every byte of every tensor changes, cheaply) or "adamw" (an AdamW step
    #: of fp32 masters sent in the model's dtype; rows with delta off, auto and on per backend)
    update: str = "bump"
    lr: float = 1e-6
    #: the ``delta`` settings of ``update="adamw"``: a row per backend and setting
    deltas: list[str] = field(default_factory=lambda: ["off", "auto", "on"])
    #: where every process holds the model and transfer buffers: "cpu", or "cuda" / "cuda:N"
    device: str = "cpu"
    #: an emulated cluster of this many hosts (0: every process on this machine): trainer
    #: ranks on hosts 0..trainers-1, receivers on the others, NICs shaped to ``link``
    #: (``trainer_link`` for the trainers' hosts)
    hosts: int = 0
    link: str = "1gbit"
    trainer_link: str | None = None
    #: "fp8": each backend's row again with every receiver holding the decoder layers' matrices
    #: in FP8 blocks, quantized on the trainer (``weightsync.quant``), beside the plain row
    quantize: str | None = None

    @property
    def ranks(self) -> int:
        """Receiver ranks per replica."""
        return max(self.tp, self.ep)


@dataclass
class Row:
    """One measured row; ``to_dict`` is its ``--json`` form."""

    backend: str
    bucket_mb: int | None
    receivers: int
    bytes: int
    tensors: int
    seconds: float
    sender_peak_rss_mb: float
    receiver_peak_rss_mb: float | None
    sender_overhead_mb: float
    receiver_overhead_mb: float | None
    repeats: list[float]
    ratios: dict[str, float | None] = field(default_factory=dict)
    #: the row's ``delta`` setting (None: the configuration's)
    delta: str | None = None
    #: median bytes the transport carried per sync, and fraction of elements changed
    wire_bytes: int | None = None
    density: float | None = None
    device: str = "cpu"
    #: where a sync's seconds go on the sender (medians): ``encode_s`` (a delta sync's
    #: encoding), ``handshake_s`` (the rest of the handshake: a delta sync's receivers hash
    #: their base there), ``transfer_s``, ``rest_s`` (verification, receivers applying
    #: and acknowledging)
    phases: dict[str, float] | None = None
    #: on an emulated cluster: each host's NIC bytes per timed sync (``tx``, ``rx``; the
    #: warm-up not counted), host 0 first
    nic_bytes: list[dict[str, int]] | None = None
    #: versions (the warm-up and the timed ones) after which every receiver's digest was
    #: checked against the sender's (0: a ceiling, which moves no model)
    versions_checked: int = 0
    #: the receivers' quantized form ("fp8"; None: they hold the model as the trainer does)
    quantize: str | None = None

    @property
    def spread(self) -> float | None:
        """Interquartile range of the timed repeats over their median (None: fewer than 4)."""
        return spread(self.repeats)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "bucket_mb": self.bucket_mb,
            "receivers": self.receivers,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "seconds": round(self.seconds, 4),
            "gbps": round(self.gbps, 3),
            "sender_peak_rss_mb": self.sender_peak_rss_mb,
            "receiver_peak_rss_mb": self.receiver_peak_rss_mb,
            "sender_overhead_mb": self.sender_overhead_mb,
            "receiver_overhead_mb": self.receiver_overhead_mb,
            "repeats_s": [round(s, 4) for s in self.repeats],
            "spread": None if self.spread is None else round(self.spread, 3),
            "delta": self.delta,
            "wire_bytes": self.wire_bytes,
            "density": None if self.density is None else round(self.density, 5),
            "device": self.device,
            "versions_checked": self.versions_checked,
            "quantize": self.quantize,
            **({"phases_s": {k: round(v, 4) for k, v in self.phases.items()}} if self.phases else {}),
            **({"nic_bytes_per_sync": self.nic_bytes} if self.nic_bytes is not None else {}),
            **self.ratios,
        }


def spread(samples: list[float]) -> float | None:
    """Interquartile range over the median of ``samples`` (None: fewer than 4 samples)."""
    if len(samples) < 4 or not statistics.median(samples):
        return None
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def _specs(opts: BenchOptions) -> list[TensorSpec]:
    if opts.model:
        return models.directory_specs(opts.model)
    return models.synthetic_specs(opts.shape, opts.size_mb, opts.dtype, per_expert=opts.ep > 1)


def plan_rows(opts: BenchOptions) -> list[tuple[str, int | None, str | None]]:
    """(kind, bucket MiB, delta) of every run, in order: the alternatives first, then the
    backends' rows, each ceiling run before every row it bounds and once after the last
    (its runs make one row); with ``update="adamw"`` each backend runs with ``delta`` off,
    auto, then on."""
    runs: list[tuple[str, int | None, str | None]] = []
    if opts.alternatives and opts.device == "cpu":  # per-tensor broadcast and disk reload: CPU paths
        runs += [(alt, None, None) for alt in ALTERNATIVES]
    deltas: list[str | None] = list(opts.deltas) if opts.update == "adamw" else [None]
    last: dict[str, int] = {}  # each ceiling: the position after the last row it bounds
    for b in opts.backends:
        ceiling = ceiling_of(b, opts.device) if opts.alternatives else None
        for mb in opts.bucket_mb:
            for d in deltas if b != "disk" else deltas[:1]:
                if ceiling:
                    runs.append((ceiling, None, None))
                runs.append((b, mb, d))
                if ceiling:
                    last[ceiling] = len(runs)
    for ceiling, at in sorted(last.items(), key=lambda item: -item[1]):  # the closing runs
        runs.insert(at, (ceiling, None, None))
    return runs


def ceiling_repeats(opts: BenchOptions, runs: list[tuple[str, int | None, str | None]], kind: str) -> int:
    """Timed repeats of each run of ceiling ``kind``: ``repeats``, or more, so that its runs
    together give at least ``CEILING_REPEATS``."""
    count = sum(1 for k, _, _ in runs if k == kind)
    return max(opts.repeats, -(-CEILING_REPEATS // max(count, 1)))


def run_bench(opts: BenchOptions, progress: Callable[[str, int, int], None] | None = None) -> list[Row]:
    """Run every row; ``progress(description, done, total)`` is called as repetitions finish."""
    if opts.receivers < 1 or opts.repeats < 1 or opts.trainers < 1:
        raise ValueError("--receivers, --trainers and --repeats must be at least 1")
    for backend in opts.backends:
        if backend == "naive":
            raise ValueError(
                "backend 'naive' hands tensors over inside one process: there is no transport to bench"
            )
        if opts.quantize and backend in (*_ALL_RANKS_SEND, "disk"):
            raise ValueError(
                f"--quantize {opts.quantize}: backend {backend!r} cannot carry quantized forms (they go over "
                "a dense backend from one trainer rank: nccl, shm, mooncake, ipc)"
            )
    if opts.quantize not in (None, "fp8"):
        raise ValueError(f"--quantize {opts.quantize!r}: expected fp8")
    if opts.hosts:
        return _run_on_hosts(opts, progress)
    return _run_rows(opts, progress)


def _run_on_hosts(opts: BenchOptions, progress: Callable[[str, int, int], None] | None) -> list[Row]:
    """Every row on an emulated cluster (``weightsync.bench.cluster``), made for the run
    and deleted after it; each row gets its link ceiling and its NICs' bytes."""
    from weightsync.bench.cluster import Cluster
    from weightsync.estimate.cluster import Cluster as Layout
    from weightsync.estimate.predict import ceiling_s, predict

    others = [b for b in opts.backends if b not in CROSS_HOST]
    if others:
        raise ValueError(
            f"--hosts: {', '.join(others)} cannot cross hosts; the cross-host backends are {', '.join(CROSS_HOST)}"
        )
    if opts.device != "cpu":
        raise ValueError(
            "--hosts emulates hosts with network namespaces on this machine's CPU: leave --device at cpu"
        )

    # where each process runs and what each NIC can carry: the same description
    # ``weightsync estimate`` predicts from, so every row is set against its prediction
    def layout(bucket_mb: int | None) -> Layout:
        return Layout.of_flags(
            opts.hosts,
            opts.trainers,
            opts.receivers,
            opts.link,
            opts.trainer_link,
            opts.tp,
            bucket_mb or 64,
            ep=opts.ep,
        )

    placed = layout(None)
    with Cluster(opts.hosts, placed.rates) as cluster:
        netns = {
            key: cluster.hosts[placed.host_of(key)].netns
            for key in range(opts.receivers * opts.ranks + opts.trainers)
        }
        rows = _run_rows(
            opts, progress, netns=netns, host=cluster.hosts[0].address, counters=cluster.counters
        )
    plain = _specs(opts)
    fp8 = fp8_wire_specs(plain) if opts.quantize else plain
    for row in rows:
        specs = fp8 if row.quantize else plain  # the bytes the row carried
        ceiling = ceiling_s(placed, specs, row.backend)
        predicted = predict(layout(row.bucket_mb), specs, row.backend).seconds
        row.ratios = {
            "link_ceiling_s": round(ceiling, 4),
            "ratio_to_link_ceiling": round(ceiling / row.seconds, 3),
            "predicted_s": round(predicted, 4),  # weightsync estimate's, for the same flags
        }
    _add_dense_ratios(rows)
    _add_quantized_ratios(rows)
    return rows


def _run_rows(
    opts: BenchOptions,
    progress: Callable[[str, int, int], None] | None,
    netns: dict[int, str] | None = None,
    host: str = "127.0.0.1",
    counters: Callable[[], list[dict[str, int]]] | None = None,
) -> list[Row]:
    if netns is not None and opts.alternatives:
        opts = dataclasses.replace(opts, alternatives=False)  # the link ceiling is their yardstick there
    device = _device(opts.device)
    specs = _specs(opts)
    planned = plan_rows(opts)
    ceilings = {k for k, mb, _ in planned if mb is None and k not in ALTERNATIVES}
    repeats = {k: ceiling_repeats(opts, planned, k) for k in ceilings}
    total_ticks = sum(repeats.get(k, opts.repeats) for k, _, _ in planned)
    done = 0
    rows: list[Row] = []
    if opts.update not in ("bump", "adamw"):
        raise ValueError(f"--update {opts.update!r}: expected bump or adamw")
    total_ticks += sum(opts.repeats for _, mb, _ in planned if mb and opts.quantize)
    for kind, mb, delta in planned:
        label = f"{kind}" + (f" {mb} MiB buckets" if mb else "") + (f" delta={delta}" if delta else "")
        overrides = (
            [f"update_weights_bucket_megabytes={mb}", f"timeout_s={opts.timeout_s}", *opts.overrides]
            if mb
            else []
        )
        if delta is not None:
            overrides.append(f"delta={delta}")

        def tick(n: int, label: str = label) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(label, done, total_ticks)

        if progress is not None:
            progress(label, done, total_ticks)
        # --quantize: the same backend and bucket again, to receivers holding FP8
        for quantize in [None, opts.quantize] if opts.quantize and mb else [None]:
            # backend=disk without a path publishes into a temporary directory under --work-dir
            with scratch_overrides(
                [f"backend={kind}", *overrides] if mb else [], opts.work_dir
            ) as row_overrides:
                job = Job(
                    kind,
                    specs,
                    opts.receivers * opts.ranks,
                    repeats.get(kind, opts.repeats),
                    row_overrides[1:],
                    opts.model,
                    opts.work_dir,
                    opts.timeout_s,
                    trainers=opts.trainers if kind in _ALL_RANKS_SEND else 1,
                    tp=opts.tp,
                    ep=opts.ep,
                    update=opts.update,
                    lr=opts.lr,
                    device=device,
                    netns=netns or {},
                    host=host,
                    quantize=quantize,
                    values=opts.quantize is not None,
                )
                row = _run_row(job, mb, tick, counters)
                row.delta, row.quantize = delta, quantize
                rows.append(row)
    rows = merge_ceiling_runs(rows)
    if netns is None:
        _add_ratios(rows, device)
    return rows


def merge_ceiling_runs(rows: list[Row]) -> list[Row]:
    """The alternatives, then one row per ceiling (every run's timed repeats together,
    their median its seconds; the other figures are its first run's), then the backends'
    rows, each group in the order it ran."""
    first: dict[str, Row] = {}
    for row in rows:
        if row.bucket_mb is not None or row.backend in ALTERNATIVES:
            continue
        if row.backend in first:
            first[row.backend].repeats += row.repeats
        else:
            first[row.backend] = dataclasses.replace(row, repeats=list(row.repeats))
    for row in first.values():
        row.seconds = statistics.median(row.repeats)
    alternatives = [r for r in rows if r.backend in ALTERNATIVES and r.bucket_mb is None]
    return [*alternatives, *first.values(), *(r for r in rows if r.bucket_mb is not None)]


def _device(device: str) -> str:
    """The device every process of a row uses: "cpu", or one with its index ("cuda" ->
    "cuda:0"), so all processes agree; refused where this machine has no such device."""
    import torch

    from weightsync import platform

    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r}: {e}") from None
    if parsed.type == "cpu":
        return "cpu"
    here = platform.current_platform().kind
    if parsed.type != here:
        raise ValueError(f"--device {device}: this machine has no {parsed.type} device (platform: {here})")
    return f"{parsed.type}:{parsed.index or 0}"


def _run_row(
    job: Job,
    bucket_mb: int | None,
    tick: Callable[[int], None],
    counters: Callable[[], list[dict[str, int]]] | None = None,
) -> Row:
    """One row's processes, run to the end. ``counters``: the NICs' byte counters (an
    emulated cluster), read after the warm-up and after the last sync: ``Row.nic_bytes``
    covers the timed syncs only."""
    ctx = process_context(["weightsync.bench.workers"])
    q = ctx.Queue()
    job = dataclasses.replace(job, driver_pid=os.getpid())
    before: list[dict[str, int]] | None = None
    if counters is not None:
        job = dataclasses.replace(job, counted=ctx.Event())
    procs: list[mp.process.BaseProcess] = []
    results: dict[int, dict[str, Any]] = {}
    expected = 1 if job.kind in _SINGLE_PROCESS else job.receivers + job.trainers

    def spawn(target, *args) -> None:
        procs.append(start_process(ctx, target, *args))

    collective = job.kind in (*ALTERNATIVES, "broadcast-ceiling")  # our own Gloo group
    if not collective and job.kind not in _SINGLE_PROCESS:  # a Sender's row: its processes' steps
        job = dataclasses.replace(job, between=ctx.Barrier(expected))
    if job.kind in _SINGLE_PROCESS:
        spawn(memcpy_ceiling, job, q)
    elif collective:
        spawn(alternative, job, 0, None, q)
    else:
        spawn(sync_sender, job, q)
    deadline = time.monotonic() + job.timeout_s * (job.repeats + 2)
    try:
        while len(results) < expected:
            try:
                kind, rank, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(f"{job.kind}: a process died (exit code {dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"{job.kind}: no result within {job.timeout_s * (job.repeats + 2):.0f} s"
                    ) from None
                continue
            if kind == "ready" and rank == 0 and job.kind not in _SINGLE_PROCESS:
                for r in range(job.receivers):  # peers join once rank 0 listens
                    if collective:
                        spawn(alternative, job, r + 1, payload, q)
                    else:
                        spawn(sync_receiver, job, payload, r, q)
                for t in range(1, job.trainers):  # the other trainer ranks (paired)
                    spawn(sync_sender, job, q, t, payload)
            elif kind == "warm" and job.counted is not None:
                before = counters()
                job.counted.set()
            elif kind == "tick":
                tick(payload)
            elif kind == "result":
                results[rank] = payload
            elif kind == "error":
                raise BenchError(
                    f"{job.kind}{f' ({bucket_mb} MiB buckets)' if bucket_mb else ''}: process {rank} failed: {payload}"
                )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # only the processes this row started
                p.kill()
                p.join(timeout=5)
        if job.kind == "safetensors-reload":
            cleanup_disk(job)
    checked = _check_digests(job, results)
    sender = results[0]
    receivers = [
        results[r + 1] for r in range(job.receivers) if r + 1 in results
    ]  # none for the copy ceilings
    return Row(
        backend=job.kind,
        bucket_mb=bucket_mb,
        receivers=job.receivers,
        bytes=sum(s.nbytes for s in job.specs),
        tensors=len(job.specs),
        seconds=statistics.median(sender["seconds"]),
        sender_peak_rss_mb=sender["peak_rss_mb"],
        receiver_peak_rss_mb=max((r["peak_rss_mb"] for r in receivers), default=None),
        sender_overhead_mb=sender["overhead_mb"],
        receiver_overhead_mb=max((r["overhead_mb"] for r in receivers), default=None),
        repeats=sender["seconds"],
        wire_bytes=int(statistics.median(sender["wire_bytes"])) if sender.get("wire_bytes") else None,
        density=_median_or_none(sender.get("density")),
        device=job.device,
        phases={k: statistics.median(p[k] for p in sender["phases"]) for k in sender["phases"][0]}
        if sender.get("phases")
        else None,
        nic_bytes=None
        if before is None
        else [{k: (a[k] - b[k]) // job.repeats for k in a} for a, b in zip(counters(), before)],
        versions_checked=checked,
    )


def _check_digests(job: Job, results: dict[int, dict[str, Any]]) -> int:
    """Every process that holds the model reported one digest per version, and at each
    version all of them agree (the sender's, result 0, against every receiver's); the
    number of versions checked."""
    digests = {r: res["digests"] for r, res in sorted(results.items()) if "digests" in res}
    if not digests:  # the ceilings move bytes that are not a model
        return 0
    if 0 not in digests or len(digests) != len(results):
        raise BenchError(f"{job.kind}: digests from processes {sorted(digests)} of {sorted(results)}")
    for i, version in enumerate(job.versions):
        at = {r: d[i] if i < len(d) else None for r, d in digests.items()}
        if None in at.values() or len(set(at.values())) > 1:
            raise BenchError(
                f"{job.kind}: after version {version} the receivers do not hold the sender's bytes "
                f"(digest by process, 0 the sender): {at}"
            )
    return len(job.versions)


def _median_or_none(values: list[float | None] | None) -> float | None:
    known = [v for v in values or [] if v is not None]
    return statistics.median(known) if known else None


def _add_ratios(rows: list[Row], device: str = "cpu") -> None:
    by_kind = {r.backend: r for r in rows if r.bucket_mb is None}
    for row in rows:
        if row.bucket_mb is None:
            continue
        ceiling = by_kind.get(ceiling_of(row.backend, device) or "")
        per_tensor = by_kind.get("per-tensor-broadcast")
        disk = by_kind.get("safetensors-reload")
        noisy = ceiling is not None and (ceiling.spread or 0.0) > NOISY_SPREAD
        row.ratios = {
            "ratio_to_ceiling": round(ceiling.seconds / row.seconds, 3) if ceiling else None,
            "ceiling_spread": None if ceiling is None or ceiling.spread is None else round(ceiling.spread, 3),
            "ceiling_noisy": noisy if ceiling is not None else None,
            "speedup_vs_per_tensor": round(per_tensor.seconds / row.seconds, 2) if per_tensor else None,
            "speedup_vs_disk": round(disk.seconds / row.seconds, 2) if disk else None,
        }
    _add_dense_ratios(rows)
    _add_quantized_ratios(rows)


def _add_dense_ratios(rows: list[Row]) -> None:
    for row in rows:
        if row.delta is not None:  # the same backend and bucket with delta off, same run
            dense = next(
                (r for r in rows if (r.backend, r.bucket_mb, r.delta) == (row.backend, row.bucket_mb, "off")),
                None,
            )
            row.ratios["speedup_vs_dense"] = round(dense.seconds / row.seconds, 2) if dense else None


def _add_quantized_ratios(rows: list[Row]) -> None:
    """An FP8 row against the plain row of the same backend, bucket and delta (same run):
    seconds, wire bytes, and the trainer's quantizing against the plain sync's seconds."""
    for row in rows:
        plain = next(
            (
                r
                for r in rows
                if r.quantize is None
                and (r.backend, r.bucket_mb, r.delta) == (row.backend, row.bucket_mb, row.delta)
            ),
            None,
        )
        if row.quantize is None or plain is None:
            continue
        quantize_s = (row.phases or {}).get("quantize_s")
        row.ratios |= {
            "seconds_vs_plain": round(row.seconds / plain.seconds, 3),
            "wire_vs_plain": round(row.wire_bytes / plain.wire_bytes, 3)
            if row.wire_bytes and plain.wire_bytes
            else None,
            "quantize_vs_plain_sync": round(quantize_s / plain.seconds, 3)
            if quantize_s is not None
            else None,
        }
