"""A vLLM worker extension for tests/test_vllm_tp.py: weightsync's, plus a way to plant a
load step that no box describes (imported by vLLM's worker processes by name)."""

from __future__ import annotations

from weightsync.integrations.vllm import WeightsyncWorkerExtension


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
