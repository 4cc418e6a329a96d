"""The ``weightsync`` command line: ``demo``, ``bench``, ``estimate``, ``config`` and
``gpu-check`` (``python -m weightsync.cli`` or the ``weightsync`` script): parser.py builds
the arguments, commands.py runs them."""

from weightsync.cli.commands import main
from weightsync.cli.parser import CALIBRATION_FILE, build_parser

__all__ = ["CALIBRATION_FILE", "build_parser", "main"]
