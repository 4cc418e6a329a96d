"""Presenting benchmark rows: a table for people, JSON for machines, a plot."""

from __future__ import annotations

import json
from collections.abc import Sequence

from weightsync.bench.runner import Row


def to_json(rows: Sequence[Row]) -> str:
    return json.dumps([r.to_dict() for r in rows], indent=2)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ceiling_cell(r: Row) -> str:
    """A row's ratio to its ceiling, marked where that ceiling's repeats spread too far; a
    ceiling row's own spread."""
    if r.bucket_mb is None:
        return "-" if r.spread is None else f"spread {r.spread:.0%}"
    cell = _fmt(r.ratios.get("ratio_to_ceiling"), ".2f")
    return cell + " (noisy ceiling)" if r.ratios.get("ceiling_noisy") else cell


def table(rows: Sequence[Row], title: str):
    """A rich ``Table`` of the rows."""
    from rich.table import Table

    t = Table(title=title)
    deltas = any(r.delta is not None for r in rows)
    links = any(r.nic_bytes is not None for r in rows)
    cols = ["backend", "bucket MiB", "seconds", "GB/s", "sender peak MB (+over)", "receiver peak MB (+over)"]
    cols += (
        ["link ceiling s", "x link ceiling", "predicted s", "NIC MB out per sync (host 0, 1, ...)"]
        if links
        else ["x ceiling", "x per-tensor", "x disk"]
    )
    if deltas:
        cols += ["delta", "density", "wire MB", "x dense"]
    for col in cols:
        t.add_column(col, justify="left" if col == "backend" else "right")
    for r in rows:
        extra = []
        if deltas:
            extra = [
                r.delta or "-",
                _fmt(r.density, ".2%"),
                _fmt(None if r.wire_bytes is None else r.wire_bytes / 1e6, ".1f"),
                _fmt(r.ratios.get("speedup_vs_dense"), ".2f"),
            ]
        if links:
            nics = " ".join(f"{n['tx_bytes'] / 1e6:.0f}" for n in r.nic_bytes or [])
            ratios = [
                _fmt(r.ratios.get("link_ceiling_s"), ".3f"),
                _fmt(r.ratios.get("ratio_to_link_ceiling"), ".2f"),
                _fmt(r.ratios.get("predicted_s"), ".3f"),  # weightsync estimate's, same flags
                nics,
            ]
        else:
            ratios = [
                _ceiling_cell(r),
                _fmt(r.ratios.get("speedup_vs_per_tensor"), ".1f"),
                _fmt(r.ratios.get("speedup_vs_disk"), ".1f"),
            ]
        t.add_row(
            r.backend,
            _fmt(r.bucket_mb, "d"),
            f"{r.seconds:.3f}",
            f"{r.gbps:.2f}",
            f"{r.sender_peak_rss_mb:.0f} (+{r.sender_overhead_mb:.0f})",
            "-"
            if r.receiver_peak_rss_mb is None
            else f"{r.receiver_peak_rss_mb:.0f} (+{r.receiver_overhead_mb:.0f})",
            *ratios,
            *extra,
        )
    return t


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """GB/s against bucket size per backend; alternatives as horizontal lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'weightsync[bench]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    backends = dict.fromkeys(r.backend for r in rows if r.bucket_mb is not None)
    for b in backends:
        points = sorted((r.bucket_mb, r.gbps) for r in rows if r.backend == b)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=b)
    for i, r in enumerate(r for r in rows if r.bucket_mb is None):
        ax.axhline(r.gbps, linestyle="--", color=f"C{len(backends) + i}", label=f"{r.backend} ({r.gbps:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("payload GB/s (model bytes / seconds)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
