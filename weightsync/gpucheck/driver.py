"""``weightsync gpu-check``: every CUDA path of weightsync in one short, prepared run.

A GPU machine is at hand now and then, for minutes, so this runs everything that needs one
in a single call and brings the results back as files in one directory:

1. ``environment``: torch and the CUDA and NCCL it uses, the GPU (``platform.device_report``),
   ``nvidia-smi`` where present.
2. ``nccl-multi-rank``: 1 + receivers processes on one GPU build an NCCL group and broadcast
   64 MiB. The checks below put several processes on ``cuda:0``: NCCL before 2.30 refuses that
   ("Duplicate GPU detected"); 2.30 and later allow it with ``NCCL_MULTI_RANK_GPU_ENABLE=1``,
   set here (with ``NCCL_NVLS_ENABLE=0``) for every process started, unless already set. Where
   the probe fails or hangs, ``nccl``, ``paired`` and ``sharded`` checks are *blocked*, with its error.
3. ``pytest -m cuda`` (``tests/test_cuda.py``): ``nccl``, ``shm`` (CUDA IPC), ``paired`` and
   ``sharded`` between processes on ``cuda:0``; each test is a check of its own.
4. ``weightsync bench --device cuda``: the ``d2d-ceiling`` row (device-to-device copy of the
   bytes every receiver needs) and ``shm``, then ``nccl``, 1 sender -> 3 receivers, a
   ~4 GiB bf16 LLM-shaped model. ``bench-codec``: the delta codec on the device (GB/s).

It writes ``OUT/gpu-check.json`` (everything), ``OUT/gpu-check.txt`` (a short report) and
``OUT/gpu-check.log`` (the output of every step). Exit status: 0 when every check passed, 1
when any failed, was blocked or was not run, 3 when there is no CUDA device (the report
says so too). ``--dry-run`` lists the checks and runs nothing. ``--device cpu`` rehearses
the same run on a machine without a GPU (Gloo and host shared memory), to test this script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as pyplatform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weightsync.gpucheck.probe import PROBE_BYTES, PROBE_ROUNDS, nccl_blocked_reason, probe_nccl
from weightsync.gpucheck.report import (
    EXIT_PASSED,
    FILES,
    Check,
    Result,
    parse_junit,
    parse_verbose,
    text_report,
    write_report,
)

#: set in every process this run starts (unless already set): several NCCL ranks share one GPU
SHARED_GPU_NCCL_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
#: tells tests/test_cuda.py that NCCL cannot put several ranks on one GPU here (and why)
NCCL_BLOCKED_ENV = "WEIGHTSYNC_GPU_CHECK_NCCL_BLOCKED"
#: the device tests/test_cuda.py puts every tensor on (cuda:0 unless rehearsing on the CPU)
TEST_DEVICE_ENV = "WEIGHTSYNC_TEST_DEVICE"

REPO = Path(__file__).resolve().parents[2]  # the checkout: weightsync/gpucheck/driver.py
TEST_FILE = REPO / "tests" / "test_cuda.py"


@dataclass
class Options:
    out: str = "gpu-check-out"
    dry_run: bool = False
    quick: bool = False
    device: str = "cuda"  # "cpu": a rehearsal of this script without a GPU
    size_mb: float | None = None  # bench model size (default 4096, --quick 512)
    repeats: int | None = None  # timed syncs per bench row (default 3, --quick 1)
    bucket_mb: int = 256
    receivers: int = 3
    budget_s: float = 270.0  # the whole run; a step that would start past it is not run
    tests: str | None = None  # only the cuda tests matching this pytest -k expression
    bench: bool = True  # False: no bench rows (the tests alone)

    @property
    def bench_size_mb(self) -> float:
        return self.size_mb if self.size_mb is not None else (512 if self.quick else 4096)

    @property
    def bench_repeats(self) -> int:
        return self.repeats if self.repeats is not None else (1 if self.quick else 3)

    @property
    def test_device(self) -> str:
        return "cpu" if self.device == "cpu" else "cuda:0"


# ---------------------------------------------------------------------------- the plan
def planned_checks(opts: Options) -> list[Check]:
    """The checks a run makes, in order (``--dry-run`` prints them)."""
    dev = opts.test_device
    ceiling = "the d2d-ceiling row and " if dev != "cpu" else ""
    checks = [
        Check(
            "nccl-multi-rank",
            "probe",
            f"{1 + opts.receivers} processes on {dev} build an {_library(opts)} group and broadcast "
            f"{PROBE_BYTES >> 20} MiB {PROBE_ROUNDS} times: can several ranks share one GPU? "
            "(where not, the nccl, paired and sharded checks are reported blocked)",
        ),
        Check(
            "pytest-cuda",
            "tests",
            f"pytest -m cuda {_rel(TEST_FILE)}: nccl, shm (CUDA IPC), paired, sharded between processes on {dev}: "
            "3 versions "
            "bit-exact, 1 MiB buckets under a 1.4 MB tensor, 3 receivers, host tensors into device buckets with crc32, "
            "a SIGKILLed receiver failing the sync within its deadline; the FP8 block quantizer on the device "
            "making the CPU's bytes and scales; each test reported as a check",
            command=f"python -m pytest -m cuda {_rel(TEST_FILE)}"
            + (f" -k {opts.tests!r}" if opts.tests else ""),
        ),
        Check(
            "bench-shm",
            "bench",
            f"{ceiling}the shm row (1 -> {opts.receivers} receivers, "
            f"{opts.bench_size_mb:g} MiB bf16 LLM-shaped)",
            command=" ".join(bench_command(opts, "shm")),
        ),
        Check(
            "bench-ipc",
            "bench",
            "the ipc row (receivers read the trainer's own tensors through CUDA IPC handles, one "
            "synchronize per sync), the same model" + (", against the same ceiling" if ceiling else ""),
            command=" ".join(bench_command(opts, "ipc")),
        ),
        Check(
            "bench-nccl",
            "bench",
            "the nccl row, the same model" + (", against the same ceiling" if ceiling else ""),
            command=" ".join(bench_command(opts, "nccl")),
        ),
        Check(
            "bench-codec",
            "bench",
            f"the delta codec on {dev}: encode and apply of an AdamW step of a "
            f"{codec_size_mb(opts):g} MiB bf16 model against the element-compare floor",
            command=" ".join(codec_command(opts)),
        ),
    ]
    return checks if opts.bench else [c for c in checks if c.kind != "bench"]


def bench_command(opts: Options, backend: str) -> list[str]:
    """``weightsync bench`` arguments of one bench check. On a device the shm run also
    measures the d2d-ceiling row (its only alternative there), which bounds nccl too; the
    rehearsal on the CPU leaves out the CPU's alternatives."""
    cmd = [
        "weightsync",
        "bench",
        "--device",
        opts.test_device,
        "--backend",
        backend,
        "--receivers",
        str(opts.receivers),
        "--size-mb",
        f"{opts.bench_size_mb:g}",
        "--repeats",
        str(opts.bench_repeats),
        "--bucket-mb",
        str(opts.bucket_mb),
        "--json",
    ]
    if backend != "shm" or opts.device == "cpu":
        cmd.append("--no-alternatives")
    return cmd


def codec_size_mb(opts: Options) -> float:
    return min(512.0, opts.bench_size_mb)  # its AdamW steps run on the host (16 bytes per parameter)


def codec_command(opts: Options) -> list[str]:
    return [
        "weightsync",
        "bench",
        "--codec",
        "--device",
        opts.test_device,
        "--size-mb",
        f"{codec_size_mb(opts):g}",
        "--repeats",
        str(max(3, opts.bench_repeats)),
        "--json",
    ]


def _library(opts: Options) -> str:
    return "NCCL (Gloo on the CPU)" if opts.device == "cpu" else "NCCL"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------------------- environment
def environment(opts: Options) -> dict[str, Any]:
    """torch, CUDA, NCCL, the GPU, nvidia-smi, this checkout and host."""
    from weightsync import __version__, platform

    env: dict[str, Any] = platform.device_report()
    env.update(
        {
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "weightsync": __version__,
            "commit": _git_commit(),
            "host": socket.gethostname(),
            "os": pyplatform.platform(),
            "cpus": os.cpu_count(),
            "nccl_env": {k: os.environ.get(k) for k in SHARED_GPU_NCCL_ENV},
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvidia_smi": _nvidia_smi(),
        }
    )
    return env


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def _nvidia_smi() -> dict[str, Any] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out: dict[str, Any] = {}
    for key, args in (
        (
            "query",
            [
                "--query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,"
                "temperature.gpu,power.draw,compute_mode",
                "--format=csv",
            ],
        ),
        ("full", []),
    ):
        try:
            done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
            out[key] = (done.stdout or done.stderr).strip()
        except (OSError, subprocess.SubprocessError) as e:
            out[key] = f"failed: {e}"
    return out


def no_cuda_message(env: dict[str, Any]) -> str:
    """Why there is no CUDA device, and what to do."""
    if not env.get("torch_cuda"):
        return (
            f"no CUDA device: torch {env.get('torch')} is a CPU build. On a GPU machine install a CUDA build: "
            "make clean && make gpu-check TORCH=torch==2.13.0 (or GPU_PYTHON=python3 to use an interpreter "
            "that has one)"
        )
    return (
        f"no CUDA device: torch {env.get('torch')} (CUDA {env.get('torch_cuda')}) sees none "
        f"(platform {env.get('platform')}; CUDA_VISIBLE_DEVICES={env.get('cuda_visible_devices')!r}; "
        f"WEIGHTSYNC_PLATFORM={os.environ.get('WEIGHTSYNC_PLATFORM')!r}); is the driver there (nvidia-smi)?"
    )


# ---------------------------------------------------------------------------- steps
def _child_env(opts: Options, blocked: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env[TEST_DEVICE_ENV] = opts.test_device
    # A test the NCCL probe blocked skips, and gpu-check reports it as blocked (never as
    # passed): the suite-wide rule that turns every skip into a failure does not apply here.
    env.pop("WEIGHTSYNC_REQUIRE_ALL", None)
    env.pop("CI", None)
    if blocked:
        env[NCCL_BLOCKED_ENV] = blocked
    else:
        env.pop(NCCL_BLOCKED_ENV, None)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout_s: float, log) -> tuple[int | None, str, str, float]:
    """Run a command in a process group of its own, killed (the whole group) past its time;
    (exit code or None when killed, stdout, stderr, seconds). Both streams go to the log."""
    log.write(f"\n===== $ {' '.join(cmd)}  (timeout {timeout_s:.0f} s)\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=env,
        cwd=str(REPO),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, children included
        out, err = proc.communicate()
        code = None
    seconds = time.monotonic() - t0
    log.write(out or "")
    if err:
        log.write("\n----- stderr\n" + err)
    log.write(f"\n===== exit {code if code is not None else 'killed: past its time'} after {seconds:.1f} s\n")
    log.flush()
    return code, out or "", err or "", seconds


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _bench_rows(out: str) -> list[dict[str, Any]]:
    start = out.find("[")
    return json.loads(out[start:]) if start >= 0 else []


def add_ceiling_ratios(rows: list[dict[str, Any]], device: str) -> None:
    """``ratio_to_ceiling`` (ceiling seconds / row seconds) for rows of separate bench runs
    that lack it, from the ceiling row another run measured."""
    from weightsync.bench.runner import ceiling_of

    ceilings = {r["backend"]: r for r in rows if r["bucket_mb"] is None}
    for row in rows:
        ceiling = ceilings.get(ceiling_of(row["backend"], device) or "")
        if row["bucket_mb"] is not None and row.get("ratio_to_ceiling") is None and ceiling is not None:
            row["ratio_to_ceiling"] = round(ceiling["seconds"] / row["seconds"], 3)


# ---------------------------------------------------------------------------- the run
def run_checks(opts: Options, log) -> Result:
    t_start = time.monotonic()
    result = Result(
        options=asdict(opts),
        started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    for key, value in SHARED_GPU_NCCL_ENV.items():
        os.environ.setdefault(key, value)  # every process started below inherits them
    env = environment(opts)
    result.environment = env
    if opts.device != "cpu" and env.get("platform") != "cuda":
        result.status = "no-cuda"
        result.message = no_cuda_message(env)
        result.seconds = time.monotonic() - t_start
        return result

    def left() -> float:
        return opts.budget_s - (time.monotonic() - t_start)

    checks = {c.name: c for c in planned_checks(opts)}
    # 1. NCCL with several ranks on one GPU
    probe = checks["nccl-multi-rank"]
    t0 = time.monotonic()
    probe.status, probe.message = probe_nccl(
        opts.receivers, opts.test_device, timeout_s=min(45.0, max(10.0, left()))
    )
    probe.seconds = round(time.monotonic() - t0, 1)
    log.write(f"\n===== nccl-multi-rank probe: {probe.status} {probe.message}\n")
    blocked = None if probe.passed else nccl_blocked_reason(probe.message, env.get("nccl"))
    result.checks.append(probe)

    # 2. the cuda tests
    tests = checks["pytest-cuda"]
    result.checks.append(tests)
    if not TEST_FILE.exists():
        tests.status, tests.message = (
            "failed",
            f"{TEST_FILE} not found: run gpu-check from a checkout of weightsync",
        )
    elif left() - 80 < 20:
        tests.message = "not run: the time budget (--budget-s) was spent"
    else:
        with tempfile.TemporaryDirectory(prefix="weightsync-gpu-check-") as tmp:
            junit = Path(tmp) / "junit.xml"
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "cuda",
                str(TEST_FILE),
                "-v",
                "-rfEs",
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                "-o",
                "junit_family=xunit1",
                *(["-k", opts.tests] if opts.tests else []),
            ]
            tests.command = " ".join(cmd[2:])
            # at most 180 s, leaving the bench rows 80 s
            code, out, err, seconds = _run(cmd, _child_env(opts, blocked), min(180.0, left() - 80), log)
            tests.seconds = round(seconds, 1)
            # pytest writes its XML at the end: killed before, the verbose lines tell what had finished
            per_test = parse_junit(junit) if junit.exists() else parse_verbose(out)
            result.checks.extend(per_test)
            not_passed = [c for c in per_test if not c.passed]
            if code == 0 and per_test and not not_passed:
                tests.status = "passed"
            elif code == 0 and per_test and all(c.status == "blocked" for c in not_passed):
                tests.status = "blocked"
                tests.message = f"{len(not_passed)} of {len(per_test)} tests blocked, the others passed"
            else:
                tests.status = "failed"
                why = "killed: past its time" if code is None else f"exit code {code}"
                tests.message = f"pytest {why}; {len(not_passed)} of {len(per_test)} tests did not pass"
                if not per_test:
                    tests.message += "\n" + _tail(out + "\n" + err)

    # 3. bench rows on the device
    for name, backend in (("bench-shm", "shm"), ("bench-ipc", "ipc"), ("bench-nccl", "nccl")):
        if name not in checks:  # --no-bench
            continue
        check = checks[name]
        result.checks.append(check)
        if backend == "nccl" and blocked:
            check.status, check.message = "blocked", f"blocked: {blocked}"
            continue
        if left() < 20:
            check.message = "not run: the time budget (--budget-s) was spent"
            continue
        cmd = [sys.executable, "-m", "weightsync.cli", *bench_command(opts, backend)[1:]]
        # at most 100 s each (ipc 60 s), shm and ipc leaving nccl 35 s
        cap = left() - (35 if name != "bench-nccl" and not blocked else 0)
        most = 60.0 if name == "bench-ipc" else 100.0
        code, out, err, seconds = _run(cmd, _child_env(opts, blocked), min(most, cap), log)
        check.seconds = round(seconds, 1)
        try:
            rows = _bench_rows(out) if code == 0 else []
        except json.JSONDecodeError as e:
            rows, err = [], f"{err}\nbench output is not JSON: {e}"
        if code == 0 and rows:
            check.status = "passed"
            result.bench_rows.extend(rows)
            add_ceiling_ratios(result.bench_rows, opts.test_device)
            check.message = ", ".join(f"{r['backend']} {r['gbps']:.1f} GB/s" for r in rows)
        else:
            check.status = "failed"
            why = "killed: past its time" if code is None else f"exit code {code}"
            check.message = f"bench {why}\n{_tail(err, 15)}"
    if "bench-codec" in checks:
        _codec_check(opts, checks["bench-codec"], result, left(), log)
    if result.bench_rows:
        first = result.bench_rows[0]
        result.bench_title = (
            f"synthetic llm {opts.bench_size_mb:g} MiB bfloat16, {first['bytes'] / 1e9:.2f} GB in "
            f"{first['tensors']} tensors, 1 sender -> {opts.receivers} receivers, every process on "
            f"{first.get('device', opts.test_device)}, {opts.bucket_mb} MiB buckets, median of "
            f"{opts.bench_repeats} after a warm-up"
        )
    result.seconds = time.monotonic() - t_start
    result.decide()
    bad = [c for c in result.checks if not c.passed]
    result.message = (
        "every check passed" if not bad else f"{len(bad)} of {len(result.checks)} checks did not pass"
    )
    return result


def _codec_check(opts: Options, check: Check, result: Result, left_s: float, log) -> None:
    result.checks.append(check)
    if left_s < 20:
        check.message = "not run: the time budget (--budget-s) was spent"
        return
    code, out, err, seconds = _run(
        [sys.executable, "-m", "weightsync.cli", *codec_command(opts)[1:]],
        _child_env(opts, None),
        min(150.0, left_s),
        log,
    )
    check.seconds = round(seconds, 1)
    try:
        rows = json.loads(out) if code == 0 else []
    except json.JSONDecodeError as e:
        rows, err = [], f"{err}\nbench output is not JSON: {e}"
    if not rows:
        check.status = "failed"
        check.message = (
            f"bench {'killed: past its time' if code is None else f'exit code {code}'}\n{_tail(err, 15)}"
        )
        return
    result.codec, check.status, row = rows[0], "passed", rows[0]
    check.message = (
        f"encode {row['encode_gbps']:.1f} GB/s ({row['encode_vs_floor']:.2f}x the floor), apply "
        f"{row['apply_gbps']:.1f} GB/s ({row['apply_vs_floor']:.2f}x), floor {row['floor_gbps']:.1f} GB/s, "
        f"{100 * row['density']:.2f}% changed, wire {100 * row['wire_fraction']:.2f}%"
    )


def dry_run_text(opts: Options) -> str:
    lines = [
        f"weightsync gpu-check would run, on {opts.test_device} (budget {opts.budget_s:.0f} s), and write "
        f"{', '.join(str(Path(opts.out) / f) for f in FILES)}:",
        "  environment      torch, CUDA, NCCL, the GPU's properties, nvidia-smi",
    ]
    for c in planned_checks(opts):
        lines.append(f"  {c.name:<16} {c.what}")
        if c.command:
            lines.append(f"  {'':<16} $ {c.command}")
    lines.append("exit status: 0 every check passed, 1 any failed / blocked / not run, 3 no CUDA device")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        metavar="DIR",
        default="gpu-check-out",
        help="directory for gpu-check.json, gpu-check.txt and gpu-check.log (default: gpu-check-out)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list the checks and exit; runs nothing, writes nothing"
    )
    p.add_argument(
        "--quick", action="store_true", help="a 512 MiB bench model and 1 timed repeat (a smoke run)"
    )
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default); cpu rehearses the same run without a GPU (Gloo, host shared memory), "
        "to test this script",
    )
    p.add_argument("--size-mb", type=float, help="bench model size in MiB (default: 4096; --quick 512)")
    p.add_argument(
        "--repeats", type=int, help="timed syncs per bench row after a warm-up (default: 3; --quick 1)"
    )
    p.add_argument("--bucket-mb", type=int, default=256, help="bench bucket size in MiB (default: 256)")
    p.add_argument(
        "--receivers",
        type=int,
        default=3,
        help="receiver processes of the probe and the bench rows (default: 3; the tests use their own)",
    )
    p.add_argument(
        "-k",
        dest="tests",
        metavar="EXPR",
        help="run only the cuda tests matching this pytest -k expression (default: all)",
    )
    p.add_argument(
        "--no-bench", dest="bench", action="store_false", help="no bench rows: the probe and the tests alone"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="seconds for the whole run, shared out among the steps; a step left without time is "
        "reported not run (default: 270)",
    )


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        out=args.out,
        dry_run=args.dry_run,
        quick=args.quick,
        device=args.device,
        size_mb=args.size_mb,
        repeats=args.repeats,
        bucket_mb=args.bucket_mb,
        receivers=args.receivers,
        budget_s=args.budget_s,
        tests=args.tests,
        bench=args.bench,
    )


def run(args: argparse.Namespace) -> int:
    opts = options_from(args)
    if opts.dry_run:
        sys.stdout.write(dry_run_text(opts))
        return EXIT_PASSED
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / FILES[2], "w") as log:
        result = run_checks(opts, log)
    write_report(result, out)
    report = text_report(result)
    sys.stdout.write(report)
    if result.status == "no-cuda":
        print(f"gpu-check: {result.message}", file=sys.stderr)
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weightsync.gpucheck", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
