"""The SGLang lines of README.md and docs/sglang.md, run here in the SGLang environment
(tests/test_doc_commands.py, in the main one, lists them as run here). Each doc line must
still be in the docs, and each run adjusted only as said."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# doc line -> (the argv run here, why it differs)
LINES = {
    "weightsync demo --rollout sglang": (
        ["demo", "--rollout", "sglang", "--receivers", "1", "--steps", "2"],
        "1 replica, 2 steps: an SGLang engine start is 20-30 s on 2 cores",
    ),
    "weightsync demo --rollout sglang --in-flight": (
        ["demo", "--rollout", "sglang", "--in-flight", "--receivers", "1", "--steps", "2"],
        "1 replica, 2 steps: an SGLang engine start is 20-30 s on 2 cores",
    ),
    "weightsync bench --rollout sglang --backend nccl,shm": (
        [
            "bench",
            "--rollout",
            "sglang",
            "--backend",
            "nccl,shm",
            "--receivers",
            "1",
            "--size-mb",
            "16",
            "--repeats",
            "1",
            "--json",
        ],
        "1 replica, the smallest Qwen2 shape, 1 timed update per row, JSON to check",
    ),
}


def _docs() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def _run(argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightsync.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_the_lines_are_in_the_docs() -> None:
    docs = " ".join(_docs().split())
    for line in LINES:
        assert line in docs, f"{line!r} is no longer in README.md or docs/*.md: update tests/sglang"


@pytest.mark.timeout(400)
def test_demo_greedy_parity_per_version() -> None:
    out = _run(LINES["weightsync demo --rollout sglang"][0], 380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK: 2 updates to 1 SGLang replicas" in out.stdout
    assert out.stdout.count("parity OK") == 2


@pytest.mark.timeout(400)
def test_in_flight_demo_replays_every_token_under_the_version_sglang_names() -> None:
    out = _run(LINES["weightsync demo --rollout sglang --in-flight"][0], 380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK: 2 updates to 1 SGLang replicas while they generated" in out.stdout
    assert "0 boundaries" not in out.stdout, out.stdout[-2000:]


@pytest.mark.timeout(400)
def test_bench_update_against_sglang_reload_from_disk() -> None:
    out = _run(LINES["weightsync bench --rollout sglang --backend nccl,shm"][0], 380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads(out.stdout)["rows"]
    assert [r["backend"] for r in rows] == ["nccl", "shm"]
    for r in rows:
        assert r["update_s"] > 0 and r["reload_from_disk_s"] > 0, r
        # each update's bytes were compared with SGLang's reload of the same version, before
        # that reload overwrote them (the bench raises on a difference or an unchanged replica)
        assert r["updates_checked_against_reload"] == 2, r
        assert r["update_vs_reload"] == pytest.approx(r["update_s"] / r["reload_from_disk_s"])
