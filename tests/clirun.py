"""Run the ``weightsync`` command line the way a user does, for the tests.

A command that outlives its timeout fails the test with every process's Python stacks:
it runs in a session of its own with ``PYTHONFAULTHANDLER`` set, so a ``SIGABRT`` to that
session makes the command and the workers it spawned print where they are waiting.
A hang in CI then says where it hangs instead of only that it did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def weightsync(
    *args: str, timeout: float, env: dict[str, str] | None = None, cwd: Path | str = ROOT
) -> subprocess.CompletedProcess:
    """``python -m weightsync.cli *args``; its output, or a test failure with stacks at ``timeout``."""
    argv = [sys.executable, "-m", "weightsync.cli", *args]
    full = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=full,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_session(proc.pid, signal.SIGABRT)  # faulthandler prints each process's stacks
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        _signal_session(proc.pid, signal.SIGKILL)  # whatever of ours is left
        if proc.poll() is None:
            proc.kill()
            out2, err2 = proc.communicate()
            out, err = out + out2, err + err2
        pytest.fail(
            f"`weightsync {' '.join(args)}` did not end within {timeout:.0f} s\n"
            f"--- stdout (tail)\n{out[-4000:]}\n--- stderr with the stacks (tail)\n{err[-20000:]}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _signal_session(pid: int, sig: int) -> None:
    # The session's id is our child's pid: only processes this test started are in it.
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
