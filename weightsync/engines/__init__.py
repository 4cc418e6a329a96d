"""Engine registry: backends by name, imported lazily.

A backend is one module defining a subclass of one of the two contracts in
``engines/base.py`` (``Transport`` or ``Publisher``). Built-in backends are listed here
by module path and imported on first use; plugins call ``register_engine`` (typically from
the module named by ``custom_backend_module``). A backend whose import fails is recorded,
so asking for it says which module is missing and why.
"""

from __future__ import annotations

import importlib

from weightsync.engines.base import Engine, EngineUnavailable, Publisher, Transport

__all__ = ["Engine", "EngineUnavailable", "Publisher", "Transport", "register_engine", "get_engine", "known_backends", "builtin_backends"]

# name -> "module:Class"; imported on first use so optional dependencies stay optional.
_BUILTIN: dict[str, str] = {
    "naive": "weightsync.engines.naive:NaivePublisher",
    "nccl": "weightsync.engines.nccl:CollectiveEngine",
    "shm": "weightsync.engines.shm:ShmEngine",
    "paired": "weightsync.engines.paired:PairedEngine",
    "disk": "weightsync.engines.disk:DiskPublisher",
    "mooncake": "weightsync.engines.mooncake:MooncakeEngine",
}
_registry: dict[str, type | str] = dict(_BUILTIN)
_failed: dict[str, str] = {}


def register_engine(name: str, engine: type | str) -> None:
    """Register a backend under ``name``: a ``Transport`` or ``Publisher`` subclass, or
    ``"module:Class"`` to import lazily."""
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    _registry[name] = engine
    _failed.pop(name, None)


def known_backends() -> list[str]:
    """Names of all registered backends (loadable or not)."""
    return sorted(_registry)


def builtin_backends() -> list[str]:
    return list(_BUILTIN)


def get_engine(name: str) -> type[Transport] | type[Publisher]:
    """The engine class for ``name``; raises ``EngineUnavailable`` saying why it can't load."""
    if name in _failed:
        raise EngineUnavailable(_failed[name])
    try:
        entry = _registry[name]
    except KeyError:
        raise EngineUnavailable(
            f"backend {name!r} is not registered; known backends: {', '.join(known_backends())}"
        ) from None
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            missing = getattr(e, "name", None) or module_name
            _failed[name] = (
                f"backend {name!r} cannot be loaded: importing {module_name} failed because "
                f"module {missing!r} is missing ({e})"
            )
            raise EngineUnavailable(_failed[name]) from e
        _registry[name] = entry
    if not (isinstance(entry, type) and issubclass(entry, (Transport, Publisher))):
        raise EngineUnavailable(
            f"backend {name!r} is registered as {entry!r}, not a subclass of "
            "weightsync.engines.base.Transport or Publisher"
        )
    return entry
