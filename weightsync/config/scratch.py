"""A scratch directory for one-machine runs (``weightsync demo``, ``weightsync bench``).

Below the command line and the tools it starts, so the demo and the bench take it from here
rather than from ``cli``, which imports them.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

from weightsync.config.engine import EngineConfig


@contextlib.contextmanager
def scratch_overrides(overrides: list[str], parent: str | None = None) -> Iterator[list[str]]:
    """``overrides`` as they are, or, when they select ``backend=disk`` without a path,
    with ``engine_kwargs.disk.path`` set to a new temporary directory (under ``parent``)
    that is removed on exit. For the demo and the bench, which run on one machine."""
    config = EngineConfig()
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep:  # malformed ones are reported where the overrides are validated
            config.set(key.strip(), value.strip())
    if config.backend != "disk" or config.engine_kwargs.disk.path:
        yield list(overrides)
        return
    path = tempfile.mkdtemp(prefix="weightsync-disk-", dir=parent)
    try:
        yield [*overrides, f"engine_kwargs.disk.path={path}"]
    finally:
        shutil.rmtree(path, ignore_errors=True)
