"""``weightsync bench``: measure syncs against the alternatives, in one run (see ``runner``)."""

from weightsync.bench.runner import BenchError, BenchOptions, Row, run_bench

__all__ = ["BenchError", "BenchOptions", "Row", "run_bench"]
