"""Run at interpreter start in ``.venv-sglang`` (through ``weightsync_sglang_cpu.pth``):
before ``torchvision`` is first imported, define the ``torchvision::nms`` and ``qnms`` op
schemas that its compiled extension would define.

PyPI's torchvision is a CUDA build whose extension cannot load beside CPU torch; its
``_meta_registrations`` then registers fake kernels for ops that do not exist and the import
fails. SGLang imports ``torchvision.transforms`` from a multimodal module. The ops get a
schema only (no kernel): calling them fails. Test and demo environment only.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                try:
                    lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                except RuntimeError:  # the real extension loaded after all: keep its schema
                    pass
            _LIBS.append(lib)  # a Library un-defines its ops when collected
        return None


_LIBS: list[Any] = []
sys.meta_path.insert(0, _BeforeTorchvision())
