"""tests/verl: weightsync as a verl checkpoint engine, driven by verl 0.9.1's own manager on Ray.

They run in the verl environment (.venv-verl, `make install-verl`; `make test` runs them
there). The main pytest run leaves this folder out (pyproject addopts: --ignore=tests/verl);
run here without verl they fail at collection, they are never skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Before Ray is imported anywhere: stay on this host's loopback, and let Ray's worker
# processes import the helpers module (actor classes and closures are pickled by reference).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ["RAY_DEDUP_LOGS"] = "0"
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import verl
    import verl.checkpoint_engine  # noqa: F401
    from tests.checkpoint_engine.test_utils import CheckpointEngineWorkerTest, MockReplica  # noqa: F401  (verl's wheel)
except ImportError as e:  # fail, never skip: these tests exist to run against verl
    raise ImportError(
        f"tests/verl need verl 0.9.1 and its checkpoint-engine test helpers ({e}); run them in the verl "
        "environment: make install-verl && .venv-verl/bin/python -m pytest tests/verl"
    ) from e

if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
