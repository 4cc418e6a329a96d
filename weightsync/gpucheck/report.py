"""What a ``weightsync gpu-check`` run found, and how it is written: its checks (``Check``:
one line of the report each, read from pytest's JUnit XML or, for a run killed before
writing it, from ``pytest -v`` lines), the whole run (``Result``: ``gpu-check.json``), the
short report people read (``gpu-check.txt``) and the exit status. The steps that produce
them are in ``weightsync.gpucheck.driver``.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_NO_CUDA = 3

FILES = ("gpu-check.json", "gpu-check.txt", "gpu-check.log")


@dataclass
class Check:
    """One line of the report."""

    name: str
    kind: str  # "probe", "tests", "test" (one pytest test), "bench"
    what: str = ""
    status: str = "not-run"  # passed | failed | blocked | skipped | not-run
    seconds: float = 0.0
    message: str = ""
    command: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Result:
    """Everything a run found; ``to_json`` is ``gpu-check.json``."""

    options: dict[str, Any]
    environment: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    bench_rows: list[dict[str, Any]] = field(default_factory=list)
    bench_title: str = ""
    codec: dict[str, Any] = field(default_factory=dict)  # the bench-codec row
    status: str = "failed"  # passed | failed | no-cuda
    started_at: str = ""
    seconds: float = 0.0
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.status == "no-cuda":
            return EXIT_NO_CUDA
        return EXIT_PASSED if self.status == "passed" else EXIT_FAILED

    def decide(self) -> None:
        """passed only when there were checks and every one passed."""
        if self.status == "no-cuda":
            return
        self.status = "passed" if self.checks and all(c.passed for c in self.checks) else "failed"

    def to_json(self) -> str:
        return json.dumps(
            {
                "tool": "weightsync gpu-check",
                "format": 1,
                "status": self.status,
                "exit_code": self.exit_code,
                "message": self.message,
                "started_at": self.started_at,
                "seconds": round(self.seconds, 1),
                "options": self.options,
                "environment": self.environment,
                "checks": [asdict(c) for c in self.checks],
                "bench": {"title": self.bench_title, "rows": self.bench_rows},
                "codec": self.codec,
            },
            indent=2,
        )


def parse_junit(path: str | Path) -> list[Check]:
    """One check per test case of a pytest JUnit XML file. A skip whose reason starts with
    ``blocked:`` is *blocked*; any other skip is *skipped* (neither counts as passed)."""
    checks = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}" if module else str(case.get("name"))
        status, message = "passed", ""
        for child in case:
            tag = child.tag
            text = (child.get("message") or child.text or "").strip()
            if tag in ("failure", "error"):
                status, message = "failed", text
                break
            if tag == "skipped":
                blocked = text.startswith("blocked:")
                status, message = ("blocked" if blocked else "skipped"), text
        checks.append(
            Check(
                name,
                "test",
                status=status,
                seconds=round(float(case.get("time") or 0), 1),
                message=message[:2000],
            )
        )
    return checks


_VERBOSE = re.compile(r"^(?:\S*/)?(test_\w+\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)(?: \((.*)\))?", re.M)


def parse_verbose(out: str) -> list[Check]:
    """Checks from ``pytest -v`` lines (``path::test STATUS``), for a run killed before it
    wrote its XML; the test running when it was killed is not among them."""
    checks = []
    for module, test, status, reason in _VERBOSE.findall(out):
        reason = reason or ""
        state = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed"}.get(
            status, "blocked" if reason.startswith("blocked:") else "skipped"
        )
        checks.append(Check(f"{module[:-3]}::{test}", "test", status=state, message=reason))
    return checks


# ---------------------------------------------------------------------------- the report
def text_report(result: Result) -> str:
    """The short report people read (``gpu-check.txt``)."""
    env = result.environment
    lines = [
        f"weightsync gpu-check: {result.status.upper()} ({result.message})",
        f"started {result.started_at}, took {result.seconds:.0f} s, exit code {result.exit_code}",
    ]
    devices = (
        ", ".join(
            f"{d['name']} (cc {d['capability']}, {d['memory_gib']} GiB, {d['multiprocessors']} SMs)"
            for d in env.get("devices", [])
        )
        or "no CUDA device"
    )
    lines.append(
        f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}, NCCL {env.get('nccl')}), python "
        f"{env.get('python')}, weightsync {env.get('weightsync')} {env.get('commit') or ''}".rstrip()
    )
    lines.append(f"GPUs: {devices}; {env.get('cpus')} CPUs; host {env.get('host')}")
    smi = (env.get("nvidia_smi") or {}).get("query")
    if smi:
        lines += ["nvidia-smi: " + line for line in smi.splitlines()]
    nccl_env = " ".join(f"{k}={v}" for k, v in (env.get("nccl_env") or {}).items() if v is not None)
    if nccl_env:
        lines.append(f"NCCL settings for every process: {nccl_env}")
    if result.checks:
        lines += ["", "checks:"]
        width = max(len(c.name) for c in result.checks)
        for c in result.checks:
            first = c.message.strip().splitlines()[0] if c.message.strip() else ""
            lines.append(f"  {c.status:<8} {c.name:<{width}} {c.seconds:6.1f} s  {first[:300]}".rstrip())
    if result.bench_rows:
        lines += [
            "",
            f"bench: {result.bench_title}",
            f"  {'row':<20} {'seconds':>9} {'GB/s':>8} {'x ceiling':>9} {'sender RSS MB':>13}",
        ]
        for r in result.bench_rows:
            ratio = r.get("ratio_to_ceiling")
            lines.append(
                f"  {r['backend']:<20} {r['seconds']:>9.4f} {r['gbps']:>8.2f} "
                f"{'-' if ratio is None else format(ratio, '.3f'):>9} {r['sender_peak_rss_mb']:>13.0f}"
            )
    lines += ["", f"files: {', '.join(FILES)}"]
    return "\n".join(lines) + "\n"


def write_report(result: Result, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, text_path = out / FILES[0], out / FILES[1]
    json_path.write_text(result.to_json())
    text_path.write_text(text_report(result))
    return json_path, text_path
