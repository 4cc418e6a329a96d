"""``weightsync gpu-check``: one prepared run on a GPU machine (the NCCL probe, the cuda
tests, bench rows) and its report.
"""

from weightsync.gpucheck.driver import (
    EXIT_FAILED,
    EXIT_NO_CUDA,
    EXIT_PASSED,
    FILES,
    NCCL_BLOCKED_ENV,
    REPO,
    SHARED_GPU_NCCL_ENV,
    TEST_DEVICE_ENV,
    TEST_FILE,
    Check,
    Options,
    Result,
    add_arguments,
    add_ceiling_ratios,
    bench_command,
    codec_command,
    codec_size_mb,
    dry_run_text,
    environment,
    main,
    no_cuda_message,
    options_from,
    parse_junit,
    parse_verbose,
    planned_checks,
    run,
    run_checks,
    text_report,
    write_report,
)
from weightsync.gpucheck.probe import PROBE_BYTES, PROBE_ROUNDS, nccl_blocked_reason, probe_nccl

__all__ = ["Check", "EXIT_FAILED", "EXIT_NO_CUDA", "EXIT_PASSED", "FILES", "NCCL_BLOCKED_ENV", "Options", "PROBE_BYTES", "PROBE_ROUNDS", "REPO", "Result", "SHARED_GPU_NCCL_ENV", "TEST_DEVICE_ENV", "TEST_FILE", "add_arguments", "add_ceiling_ratios", "bench_command", "codec_command", "codec_size_mb", "dry_run_text", "environment", "main", "nccl_blocked_reason", "no_cuda_message", "options_from", "parse_junit", "parse_verbose", "planned_checks", "probe_nccl", "run", "run_checks", "text_report", "write_report"]
