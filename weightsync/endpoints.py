"""Compatibility: ``Sender`` and ``Receiver`` live in ``weightsync.sender`` and
``weightsync.receiver``; import them from ``weightsync``."""

from weightsync.receiver import Receiver
from weightsync.sender import Sender

__all__ = ["Receiver", "Sender"]
