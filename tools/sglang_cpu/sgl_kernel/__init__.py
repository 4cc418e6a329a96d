"""A placeholder for SGLang's ``sgl_kernel`` on a CPU without a build of it (test and demo
environment only; ``make install-sglang`` puts this folder on ``.venv-sglang``'s path).

PyPI has no CPU build of ``sgl_kernel`` and the CUDA wheel cannot load beside CPU torch.
SGLang 0.5.23 imports names from it (KV-cache copies, request pools, speculative decoding)
that it never calls on a CPU without AMX: norms, activations, RoPE, linear layers and
attention run in plain torch there. Every name here, in any submodule, is a stand-in that
raises when called, so a call that would need the real kernels fails loudly (and fails a
test) instead of running anything. A caller could catch that and fall back unseen, so
every call is also appended to the file ``$WEIGHTSYNC_SGL_KERNEL_CALLS`` names (where set:
tests/sglang's session fails when it is not empty).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

__version__ = "0.0.0+weightsync.placeholder"


class KernelMissing(RuntimeError):
    """A kernel of ``sgl_kernel`` was called: this environment has only its placeholder."""


class _Missing:
    """Stands for ``sgl_kernel.<name>``: raises when called, and so does anything reached
    through it (``sgl_kernel.ops.x(...)``)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        log = os.environ.get("WEIGHTSYNC_SGL_KERNEL_CALLS")
        if log:
            with open(log, "a") as f:
                f.write(f"{self._name} (pid {os.getpid()})\n")
        raise KernelMissing(
            f"{self._name} was called, but this environment has only a placeholder sgl_kernel "
            "(tools/sglang_cpu: SGLang on a CPU without AMX must not need it)"
        )

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<placeholder {self._name}>"


def _module_getattr(module_name: str) -> Any:
    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{module_name}.{attr}")

    return __getattr__


__getattr__ = _module_getattr(__name__)
__path__: list[str] = []  # a package: its submodules come from the finder below


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``sgl_kernel.<sub>`` is a placeholder module like this one."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        module.__path__ = []  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Submodules())
