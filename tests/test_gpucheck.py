"""`weightsync gpu-check` without a GPU: its own logic (no CUDA device: a distinct exit status
and a message; the dry run; the report; reading pytest's results), the bench's device rows,
and a short rehearsal of the whole run on the CPU."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import weightsync

from weightsync import gpucheck, platform
from weightsync.bench.runner import (
    BenchOptions,
    Row,
    _add_ratios,
    _device,
    ceiling_of,
    ceiling_repeats,
    merge_ceiling_runs,
    plan_rows,
)
from weightsync.gpucheck.driver import Options
from weightsync.gpucheck.report import Check, Result

REPO = Path(__file__).resolve().parent.parent


def cli(*args, env=None, timeout=120):
    return weightsync(*args, timeout=timeout, env={"PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO)


def test_no_cuda_device_exits_3_says_so_and_still_writes_the_report(tmp_path):
    out = tmp_path / "gpu-out"
    # WEIGHTSYNC_PLATFORM=cpu: the same answer on a machine that has a GPU
    done = cli("gpu-check", "--out", str(out), env={"WEIGHTSYNC_PLATFORM": "cpu"})
    assert done.returncode == gpucheck.EXIT_NO_CUDA == 3, done.stderr
    assert "gpu-check: no CUDA device" in done.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert (report["status"], report["exit_code"], report["checks"]) == ("no-cuda", 3, [])
    assert report["environment"]["platform"] == "cpu" and "no CUDA device" in report["message"]
    text = (out / "gpu-check.txt").read_text()
    assert text.startswith("weightsync gpu-check: NO-CUDA (no CUDA device")
    assert "torch " in text and "exit code 3" in text


def test_no_cuda_message_tells_a_cpu_build_from_a_missing_device():
    cpu_build = gpucheck.no_cuda_message({"torch": "2.13.0+cpu", "torch_cuda": None})
    assert "CPU build" in cpu_build and "make gpu-check TORCH=" in cpu_build
    unseen = gpucheck.no_cuda_message({"torch": "2.13.0", "torch_cuda": "13.0", "platform": "cpu"})
    assert "sees none" in unseen and "nvidia-smi" in unseen


def test_dry_run_lists_the_checks_and_writes_nothing(tmp_path):
    out = tmp_path / "never"
    done = cli("gpu-check", "--out", str(out), "--dry-run", env={"WEIGHTSYNC_PLATFORM": "cpu"})
    assert done.returncode == 0, done.stderr
    for name in (
        "environment",
        "nccl-multi-rank",
        "pytest-cuda",
        "bench-shm",
        "bench-ipc",
        "bench-nccl",
        "bench-codec",
    ):
        assert f"  {name}" in done.stdout
    assert "$ weightsync bench --device cuda:0 --backend ipc --receivers 3" in done.stdout
    assert "$ python -m pytest -m cuda tests/test_cuda.py" in done.stdout
    assert (
        "$ weightsync bench --device cuda:0 --backend shm --receivers 3 --size-mb 4096 --repeats 3"
        in done.stdout
    )
    assert "--backend nccl" in done.stdout and "d2d-ceiling" in done.stdout
    assert "$ weightsync bench --codec --device cuda:0 --size-mb 512 --repeats 3 --json" in done.stdout
    assert "3 no CUDA device" in done.stdout
    assert not out.exists()


def test_quick_and_k_change_what_would_run():
    text = gpucheck.dry_run_text(Options(quick=True, tests="shm"))
    assert "--size-mb 512 --repeats 1" in text and "tests/test_cuda.py -k 'shm'" in text


def fake_result(*statuses):
    result = Result(
        options={"out": "x"},
        environment={
            "platform": "cuda",
            "torch": "2.13.0+cu130",
            "torch_cuda": "13.0",
            "nccl": "2.30.7",
            "python": "3.12.3",
            "devices": [
                {
                    "index": 0,
                    "name": "NVIDIA H200",
                    "capability": "9.0",
                    "memory_gib": 139.8,
                    "multiprocessors": 132,
                }
            ],
            "cpus": 16,
            "host": "gpu",
            "nccl_env": {"NCCL_MULTI_RANK_GPU_ENABLE": "1"},
            "nvidia_smi": {"query": "name, driver_version\nNVIDIA H200, 580.159.04"},
        },
    )
    result.checks = [
        Check(f"check-{i}", "test", status=s, seconds=1.5, message=f"why {i}\nmore")
        for i, s in enumerate(statuses)
    ]
    result.bench_rows = [
        {
            "backend": "d2d-ceiling",
            "bucket_mb": None,
            "seconds": 0.006,
            "gbps": 740.0,
            "sender_peak_rss_mb": 900.0,
        },
        {
            "backend": "shm",
            "bucket_mb": 256,
            "seconds": 0.05,
            "gbps": 88.6,
            "sender_peak_rss_mb": 950.0,
            "ratio_to_ceiling": 0.12,
        },
        {"backend": "nccl", "bucket_mb": 256, "seconds": 0.06, "gbps": 73.8, "sender_peak_rss_mb": 951.0},
    ]
    result.bench_title = "synthetic llm 4096 MiB bfloat16"
    result.decide()
    return result


def test_report_from_a_result_set_is_valid_json_and_text(tmp_path):
    result = fake_result("passed", "failed", "blocked")
    gpucheck.add_ceiling_ratios(result.bench_rows, "cuda:0")
    json_path, text_path = gpucheck.write_report(result, tmp_path / "out")
    report = json.loads(json_path.read_text())
    assert (report["status"], report["exit_code"]) == ("failed", 1)
    assert [c["status"] for c in report["checks"]] == ["passed", "failed", "blocked"]
    assert report["environment"]["devices"][0]["name"] == "NVIDIA H200"
    rows = {r["backend"]: r for r in report["bench"]["rows"]}
    assert (
        rows["nccl"]["ratio_to_ceiling"] == 0.1 and rows["shm"]["ratio_to_ceiling"] == 0.12
    )  # kept, not recomputed
    text = text_path.read_text()
    assert text.startswith("weightsync gpu-check: FAILED")
    assert "NVIDIA H200 (cc 9.0, 139.8 GiB, 132 SMs)" in text and "NCCL 2.30.7" in text
    assert "nvidia-smi: NVIDIA H200, 580.159.04" in text
    assert (
        "  blocked  check-2" in text and "why 2" in text and "more" not in text
    )  # first line of each message
    assert "  nccl                    0.0600    73.80     0.100" in text


def test_only_every_check_passed_is_a_pass():
    assert fake_result("passed", "passed").exit_code == 0
    for bad in ("failed", "blocked", "skipped", "not-run"):
        assert fake_result("passed", bad).exit_code == 1, bad
    assert fake_result().exit_code == 1  # no checks at all is no pass
    no_cuda = Result(options={}, status="no-cuda")
    no_cuda.decide()
    assert no_cuda.exit_code == 3


def test_pytest_results_become_checks_and_blocked_skips_are_not_passes(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
 <testcase classname="tests.test_cuda" name="test_a[shm]" time="3.25"/>
 <testcase classname="tests.test_cuda" name="test_a[nccl]" time="0.01">
  <skipped type="pytest.skip" message="blocked: NCCL 2.29.7 refuses several ranks on one GPU">skip</skipped></testcase>
 <testcase classname="tests.test_cuda" name="test_b" time="9.0"><failure message="AssertionError: differs">tb</failure></testcase>
 <testcase classname="tests.test_cuda" name="test_c" time="0"><skipped message="something else"/></testcase>
</testsuite></testsuites>""")
    checks = gpucheck.parse_junit(xml)
    assert [(c.name, c.status) for c in checks] == [
        ("test_cuda::test_a[shm]", "passed"),
        ("test_cuda::test_a[nccl]", "blocked"),
        ("test_cuda::test_b", "failed"),
        ("test_cuda::test_c", "skipped"),
    ]
    assert checks[0].seconds == 3.2 and checks[2].message == "AssertionError: differs"


def test_a_killed_pytest_still_reports_the_tests_it_finished():
    out = """tests/test_cuda.py::test_a[nccl] SKIPPED (blocked: NCCL 2.29.7 refuses ...) [ 33%]
tests/test_cuda.py::test_a[shm] PASSED                                      [ 66%]
tests/test_cuda.py::test_f FAILED                                           [100%]
FAILED tests/test_cuda.py::test_f - assert 0
"""
    assert [(c.name, c.status) for c in gpucheck.parse_verbose(out)] == [
        ("test_cuda::test_a[nccl]", "blocked"),
        ("test_cuda::test_a[shm]", "passed"),
        ("test_cuda::test_f", "failed"),
    ]


def test_a_refused_multi_rank_group_names_the_nccl_that_allows_it():
    message = (
        "rank 1: DistBackendError: NCCL error ... invalid usage, NCCL version 2.29.7\n"
        "ncclInvalidUsage: ...\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"
    )
    reason = gpucheck.nccl_blocked_reason(message, "2.29.7")
    assert reason.startswith("NCCL 2.29.7 refuses several ranks on one GPU")
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in reason and "GPU_NCCL=nvidia-nccl-cu13==2.30.7" in reason
    assert (
        gpucheck.nccl_blocked_reason("no result within 45 s", "2.30.7")
        == "the nccl-multi-rank probe failed: no result within 45 s"
    )


def test_a_refused_probe_blocks_the_nccl_tests_and_fails_the_run(monkeypatch, tmp_path):
    """In this process, on the CPU: the probe answers as NCCL 2.29 does on one GPU; the
    nccl test then reports blocked (not failed, not silently skipped) and the run fails."""
    refusal = (
        "rank 1: DistBackendError: ... Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"
    )
    monkeypatch.setattr(
        gpucheck.driver, "probe_nccl", lambda receivers, device, timeout_s: ("failed", refusal)
    )
    monkeypatch.delenv(gpucheck.NCCL_BLOCKED_ENV, raising=False)
    opts = Options(out=str(tmp_path), device="cpu", tests="three_versions and nccl", bench=False)
    assert [c.name for c in gpucheck.planned_checks(opts)] == ["nccl-multi-rank", "pytest-cuda"]
    with open(tmp_path / "gpu-check.log", "w") as log:
        result = gpucheck.run_checks(opts, log)
    statuses = {c.name: c.status for c in result.checks}
    assert statuses == {
        "nccl-multi-rank": "failed",
        "pytest-cuda": "blocked",
        "test_cuda::test_three_versions_reach_three_receivers_on_one_gpu_bit_exact[nccl]": "blocked",
    }
    blocked = result.checks[-1].message
    assert (
        blocked.startswith("blocked: NCCL ? refuses several ranks on one GPU") and "Duplicate GPU" in blocked
    )
    assert (result.status, result.exit_code, result.message) == ("failed", 1, "3 of 3 checks did not pass")


# ---------------------------------------------------------------------------- the bench on a device
def test_bench_on_a_device_measures_the_d2d_ceiling_instead_of_the_cpu_alternatives():
    # rows are (kind, bucket MiB, delta setting: None unless --update adamw)
    # each ceiling runs before every row it bounds and once after the last (issue 46)
    assert plan_rows(BenchOptions(device="cuda:0")) == [
        ("d2d-ceiling", None, None),
        ("nccl", 64, None),
        ("d2d-ceiling", None, None),
        ("shm", 64, None),
        ("d2d-ceiling", None, None),
    ]
    assert plan_rows(BenchOptions(device="cuda", alternatives=False, backends=["shm"])) == [("shm", 64, None)]
    assert plan_rows(BenchOptions(device="cuda", backends=["mooncake"])) == [
        ("mooncake", 64, None)
    ]  # no ceiling of its own
    assert plan_rows(BenchOptions()) == [
        ("per-tensor-broadcast", None, None),
        ("safetensors-reload", None, None),
        ("broadcast-ceiling", None, None),
        ("nccl", 64, None),
        ("broadcast-ceiling", None, None),
        ("memcpy-ceiling", None, None),
        ("shm", 64, None),
        ("memcpy-ceiling", None, None),
    ]
    assert [ceiling_of(b, "cuda:0") for b in ("nccl", "shm", "paired", "disk")] == ["d2d-ceiling"] * 3 + [
        None
    ]
    assert [ceiling_of(b) for b in ("nccl", "shm")] == ["broadcast-ceiling", "memcpy-ceiling"]


def _row(backend, seconds, bucket_mb=None):
    return Row(backend, bucket_mb, 3, 100, 1, statistics.median(seconds), 1.0, 1.0, 0.0, 0.0, list(seconds))


def test_a_ceilings_interleaved_runs_make_one_row_whose_median_and_spread_the_ratios_use():
    runs = plan_rows(BenchOptions(backends=["nccl", "paired", "shm"], alternatives=True, repeats=1))
    assert [k for k, _, _ in runs].count("broadcast-ceiling") == 3  # before nccl, before paired, after
    assert ceiling_repeats(BenchOptions(repeats=1), runs, "broadcast-ceiling") == 2  # 3 runs x 2 >= 5
    assert ceiling_repeats(BenchOptions(repeats=3), runs, "memcpy-ceiling") == 3  # 2 runs x 3 >= 5
    rows = merge_ceiling_runs(
        [
            _row("broadcast-ceiling", [1.0, 1.1]),
            _row("nccl", [2.0], 64),
            _row("broadcast-ceiling", [0.9, 1.0]),
            _row("memcpy-ceiling", [0.5, 0.5, 0.5]),
            _row("shm", [1.0], 64),
            _row("memcpy-ceiling", [0.8, 0.9, 0.3]),
        ]
    )
    assert [(r.backend, r.bucket_mb) for r in rows] == [
        ("broadcast-ceiling", None),
        ("memcpy-ceiling", None),
        ("nccl", 64),
        ("shm", 64),
    ]
    broadcast, memcpy = rows[0], rows[1]
    assert broadcast.repeats == [1.0, 1.1, 0.9, 1.0] and broadcast.seconds == 1.0
    assert memcpy.seconds == 0.5 and memcpy.spread > 0.15 >= broadcast.spread
    _add_ratios(rows)
    nccl, shm = rows[2].ratios, rows[3].ratios
    assert nccl["ratio_to_ceiling"] == 0.5 and nccl["ceiling_noisy"] is False
    assert shm["ratio_to_ceiling"] == 0.5 and shm["ceiling_noisy"] is True
    assert shm["ceiling_spread"] == round(memcpy.spread, 3)


def test_bench_refuses_a_device_this_machine_lacks():
    assert _device("cpu") == "cpu"
    if platform.current_platform().kind == "cpu":
        with pytest.raises(ValueError, match="--device cuda: this machine has no cuda device"):
            _device("cuda")
    with pytest.raises(ValueError, match="--device 'tpu"):
        _device("tpu")
    done = cli("bench", "--device", "cuda", "--backend", "shm", env={"WEIGHTSYNC_PLATFORM": "cpu"})
    assert done.returncode == 1 and "this machine has no cuda device (platform: cpu)" in done.stderr


def test_device_report_on_the_cpu():
    report = platform.device_report()
    if report["platform"] == "cpu":
        assert report["devices"] == [] and report["torch"]
    json.dumps(report)


def test_the_cuda_tests_fail_loudly_without_a_gpu():
    """Run without a GPU (and outside make test's deselection), they fail naming the way to
    run them: never a silent skip."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_cuda.py",
            "-k",
            "three_versions",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "WEIGHTSYNC_PLATFORM": "cpu"},
    )
    assert done.returncode == 1, done.stdout
    assert (
        "no CUDA device: the tests marked cuda run on a GPU machine through `make gpu-check`" in done.stdout
    )
    assert "2 errors" in done.stdout


# ---------------------------------------------------------------------------- a rehearsal
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rehearsal_on_the_cpu_runs_every_step_and_passes(tmp_path):
    """``--device cpu``: the probe (Gloo), pytest -m cuda on the CPU (one test here), both
    bench runs (1 receiver), the report. The same script a GPU machine runs, minus the GPU."""
    out = tmp_path / "out"
    done = cli(
        "gpu-check",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--size-mb",
        "8",
        "--repeats",
        "1",
        "--receivers",
        "1",
        "-k",
        "platform",
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["status"] == "passed" and report["exit_code"] == 0
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {
        "nccl-multi-rank": "passed",
        "pytest-cuda": "passed",
        "test_cuda::test_platform_resolves_the_gpu": "passed",
        "bench-shm": "passed",
        "bench-ipc": "passed",
        "bench-nccl": "passed",
        "bench-codec": "passed",
    }
    codec = report["codec"]
    assert (
        codec["device"] == "cpu"
        and codec["encode_gbps"] > 0
        and codec["apply_gbps"] > 0
        and 0 < codec["density"] < 0.2
    )
    assert [r["backend"] for r in report["bench"]["rows"]] == ["shm", "ipc", "nccl"]
    assert all(r["device"] == "cpu" and r["gbps"] > 0 for r in report["bench"]["rows"])
    log = (out / "gpu-check.log").read_text()
    assert "pytest -m cuda" in log and "bench --device cpu --backend nccl" in log
    assert (out / "gpu-check.txt").read_text().startswith("weightsync gpu-check: PASSED")
