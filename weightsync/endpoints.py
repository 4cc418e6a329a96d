"""Compatibility: ``Sender`` and ``Receiver`` live in ``weightsync.sender`` and
``weightsync.receiver``; import them from ``weightsync``."""

from weightsync.receiver.receiver import Receiver
from weightsync.sender.sender import Sender

__all__ = ["Receiver", "Sender"]
