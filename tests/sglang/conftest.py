"""tests/sglang: SGLang 0.5.23 replicas (its CPU engine) as the rollout side.

They run in the SGLang environment (.venv-sglang, `make install-sglang`; `make test` runs
them there). The main pytest run leaves this folder out (pyproject addopts:
--ignore=tests/sglang); run without SGLang they fail at collection, they are never skipped.
"""

from __future__ import annotations

import os
import sys
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
if str(HERE.parent) not in sys.path:  # the main tests' helpers (procs, workers)
    sys.path.insert(0, str(HERE.parent))
