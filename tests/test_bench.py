"""`weightsync bench` end to end: every row measured for real, bytes checked, JSON and plot.

The README's bench lines run in tests/test_doc_commands.py (`--update adamw` with its rows
for delta off, auto and on is checked there)."""

import json

import pytest
import torch
from clirun import weightsync

from weightsync.bench import models

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SYNC_KEYS = {
    "backend",
    "bucket_mb",
    "receivers",
    "bytes",
    "seconds",
    "gbps",
    "sender_peak_rss_mb",
    "receiver_peak_rss_mb",
}
RATIO_KEYS = {"ratio_to_ceiling", "speedup_vs_per_tensor", "speedup_vs_disk"}


def bench(*args):
    return weightsync("bench", *args, timeout=380)


def test_bench_json_has_every_row_of_all_five_transports_with_ratios_and_a_plot(tmp_path):
    # The smallest synthetic model (149 MB) has a 64 MiB embedding: paired needs 64 MiB
    # buckets. Several bucket sizes per backend: the README's `--bucket-mb 16,64,256` line.
    plot = tmp_path / "bench.png"
    backends = ["mooncake", "paired", "disk", "nccl", "shm"]
    out = bench(
        "--backend",
        ",".join(backends),
        "--size-mb",
        "16",
        "--receivers",
        "2",
        "--repeats",
        "1",
        "--bucket-mb",
        "64",
        "--work-dir",
        str(tmp_path),
        "--json",
        "--plot",
        str(plot),
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    kinds = [(r["backend"], r["bucket_mb"]) for r in rows]
    assert kinds[:4] == [
        ("per-tensor-broadcast", None),
        ("safetensors-reload", None),
        ("broadcast-ceiling", None),
        ("memcpy-ceiling", None),
    ]
    assert sorted(kinds[4:]) == sorted((b, 64) for b in backends)
    expected_bytes = sum(s.nbytes for s in models.synthetic_specs("llm", 16, "bfloat16"))
    for r in rows:
        assert set(r) >= SYNC_KEYS and r["bytes"] == expected_bytes and r["receivers"] == 2, r["backend"]
        assert r["seconds"] > 0 and r["gbps"] > 0
        if r["bucket_mb"] is not None:  # weightsync's own rows carry the ratios
            assert set(r) >= RATIO_KEYS and r["speedup_vs_disk"] > 0 and r["speedup_vs_per_tensor"] > 0, r[
                "backend"
            ]
        if r["backend"] in ("nccl", "shm", "paired"):  # the broadcast (or memcpy) ceiling bounds these
            assert r["ratio_to_ceiling"] > 0, r["backend"]
    assert plot.stat().st_size > 10_000
    assert list(tmp_path.glob("weightsync-bench-*")) == []  # the disk path cleaned up


def test_bench_reads_a_model_directory_and_explains_a_bad_one(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"w": torch.randn(300, 500), "b": torch.zeros(7, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    out = bench(
        "--model",
        str(tmp_path),
        "--receivers",
        "1",
        "--repeats",
        "1",
        "--bucket-mb",
        "1",
        "--backend",
        "shm",
        "--no-alternatives",
    )
    assert out.returncode == 0, out.stderr
    assert "shm" in out.stdout and "2 tensors" in out.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    out = bench("--model", str(empty), "--backend", "shm")
    assert out.returncode == 1 and "no *.safetensors files" in out.stderr
