"""What one worker keeps of each checkpoint tensor (``backend=sharded``): the boxes an
engine's own loaders read, learned by a dry run of them (vLLM:
``weightsync.integrations.vllm_slices``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box


@dataclass
class Slices:
    """What one worker keeps of each checkpoint tensor: its box (whole where ``whole``
    names why), for the specs the dry run saw."""

    specs: tuple[TensorSpec, ...]
    boxes: dict[str, Box]
    #: tensors taken whole although sliced loading might apply, and why
    whole: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def kept_bytes(self) -> int:
        """The bytes of every box this worker takes."""
        sizes = {s.name: s.torch_dtype.itemsize for s in self.specs}
        return sum(box.numel * sizes[name] for name, box in self.boxes.items())

    def summary(self) -> dict[str, Any]:
        return {
            "kept_bytes": self.kept_bytes(),
            "whole_tensors": dict(self.whole),
            "sliced_tensors": sum(
                1 for s in self.specs if self.boxes.get(s.name) not in (None, Box.whole(s.shape))
            ),
            "derive_s": self.seconds,
        }
