"""Backends by name: the two contracts (``Transport``, ``Publisher``), the registry that
imports them lazily, and one module per backend (imported on first use, not here).
"""

from weightsync.config.backends import builtin_backends, known_backends, register_engine
from weightsync.engines.base import (
    Engine,
    EngineUnavailable,
    Join,
    Landing,
    NextBucket,
    Offer,
    Producer,
    Publisher,
    Transport,
)
from weightsync.engines.registry import get_engine

__all__ = [
    "Engine",
    "Landing",
    "NextBucket",
    "Producer",
    "EngineUnavailable",
    "Join",
    "Offer",
    "Publisher",
    "Transport",
    "builtin_backends",
    "get_engine",
    "known_backends",
    "register_engine",
]
