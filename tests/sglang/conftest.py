"""tests/sglang: SGLang 0.5.23 replicas (its CPU engine) as the rollout side.

They run in the SGLang environment (.venv-sglang, `make install-sglang`; `make test` runs
them there). The main pytest run leaves this folder out (pyproject addopts:
--ignore=tests/sglang); run without SGLang they fail at collection, they are never skipped.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

try:
    import sglang  # noqa: F401
except ImportError as e:  # fail, never skip: these tests exist to run against SGLang
    raise ImportError(
        f"tests/sglang need SGLang 0.5.23 ({e}); run them in the SGLang environment: "
        "make install-sglang && .venv-sglang/bin/python -m pytest tests/sglang"
    ) from e

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# Every call of the placeholder sgl_kernel (tools/sglang_cpu) is logged here, by this
# process and the engines' processes it starts; SGLang catching the placeholder's error and
# falling back would otherwise pass unseen.
KERNEL_CALLS = Path(tempfile.mkdtemp(prefix="weightsync-sgl-kernel-")) / "calls.log"
os.environ["WEIGHTSYNC_SGL_KERNEL_CALLS"] = str(KERNEL_CALLS)
if str(HERE.parent) not in sys.path:  # the main tests' helpers (procs, workers)
    sys.path.insert(0, str(HERE.parent))


def pytest_sessionfinish(session, exitstatus) -> None:
    calls = KERNEL_CALLS.read_text() if KERNEL_CALLS.exists() else ""
    shutil.rmtree(KERNEL_CALLS.parent, ignore_errors=True)
    if calls:
        sys.stderr.write(f"\nthe placeholder sgl_kernel was called (tools/sglang_cpu):\n{calls}")
        session.exitstatus = 1
