"""A vLLM worker extension for the tests of real replicas: weightsync's, plus plants (a load
step that no box describes; updates without the check before anything moves), imported by
vLLM's worker processes by name (``EXTENSION``, with ``importable`` around the start)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from weightsync.integrations.vllm import WeightsyncWorkerExtension

EXTENSION = "vllm_planted.PlantedExtension"


@contextlib.contextmanager
def importable() -> Iterator[None]:
    """This folder on the ``PYTHONPATH`` of the engine processes started meanwhile."""
    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


class PlantedExtension(WeightsyncWorkerExtension):
    def plant_unreducible_load(self, name: str) -> None:
        """From now on the model's ``load_weights`` computes with checkpoint tensor ``name``
        whole (``* 1``) before its loader narrows it: same values, but the dry run cannot
        reduce that to a box. The slices learned so far are forgotten."""
        model = self.model_runner.get_model()
        load = model.load_weights

        def planted(weights):
            return load((n, t * 1 if n == name else t) for n, t in weights)

        model.load_weights = planted
        self._weightsync().slices = None

    def plant_no_vet(self, on: bool = True) -> None:
        """While ``on``, updates skip the check of the offered tensors before anything moves
        (``update_vet``): what the check after the load must then catch alone."""
        self._no_vet = on

    def weightsync_receive(self, version: int, partial: bool = False):
        if getattr(self, "_no_vet", False):
            return self._weightsync().receive(version, self._reload(partial), None)
        return super().weightsync_receive(version, partial)
