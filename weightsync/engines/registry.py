"""Engine registry: backends by name, imported lazily.

A backend is one module defining a subclass of one of the two contracts in
``engines/base.py`` (``Transport`` or ``Publisher``). The names live in
``weightsync.config.backends`` (below ``config``, which validates against them): built-in backends
by module path, imported here on first use; plugins call ``register_engine`` (typically from
the module named by ``custom_backend_module``). A backend whose import fails is recorded,
so asking for it says which module is missing and why.
"""

from __future__ import annotations

import importlib

from weightsync.config import backends
from weightsync.config.backends import builtin_backends, known_backends, register_engine
from weightsync.engines.base import Engine, EngineUnavailable, Publisher, Transport

__all__ = [
    "Engine",
    "EngineUnavailable",
    "Publisher",
    "Transport",
    "register_engine",
    "get_engine",
    "known_backends",
    "builtin_backends",
]


def get_engine(name: str) -> type[Transport] | type[Publisher]:
    """The engine class for ``name``; raises ``EngineUnavailable`` saying why it can't load."""
    if (failed := backends.failure(name)) is not None:
        raise EngineUnavailable(failed)
    entry = backends.entry(name)
    if entry is None:
        raise EngineUnavailable(
            f"backend {name!r} is not registered; known backends: {', '.join(known_backends())}"
        )
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            missing = getattr(e, "name", None) or module_name
            failed = (
                f"backend {name!r} cannot be loaded: importing {module_name} failed because "
                f"module {missing!r} is missing ({e})"
            )
            backends.resolved(name, None, failed)
            raise EngineUnavailable(failed) from e
        backends.resolved(name, entry)
    if not (isinstance(entry, type) and issubclass(entry, (Transport, Publisher))):
        raise EngineUnavailable(
            f"backend {name!r} is registered as {entry!r}, not a subclass of "
            "weightsync.engines.base.Transport or Publisher"
        )
    return entry
