"""A CPU platform for verl 0.9.1, through verl's own platform plugin point.

verl 0.9.1 registers nvidia, huawei and amd platforms only; with no accelerator it falls
back to nvidia (``verl/plugin/platform/platform_manager.py``, ``_detect_platform_name``), so
``get_device_id()`` is ``torch.cuda.current_device()`` and its FSDP engine cannot start on a
CPU-only torch. ``install`` sets this platform (``set_platform``) in a process before verl's
engine modules are imported (``verl/workers/engine/fsdp/transformer_impl.py`` reads the
device name at import): then verl's own FSDP engine builds, shards (FSDP2 over Gloo) and
exports its weights on the CPU. It is the device layer verl lacks here, not a stand-in for
verl's trainer code, which runs unchanged.
"""

from __future__ import annotations

import contextlib
import os

import torch
from verl.plugin.platform.platform_base import PlatformBase


class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self):
        # verl passes it to ``.to(device=...)``: an int would name accelerator 0
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def communication_backend_name(self) -> str:
        return "gloo"

    def cudart(self):
        return None

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, *args):
        return (0, 0)

    def is_ipc_supported(self) -> bool:
        return False

    def nvtx_range(self, *args, **kwargs):
        return contextlib.nullcontext()

    def profiler_start(self, *args, **kwargs) -> None:
        pass

    def profiler_stop(self, *args, **kwargs) -> None:
        pass

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_name(self) -> str:
        return "CPU"

    def visible_devices_envvar(self) -> str:
        return "CPU_VISIBLE_DEVICES"


def install() -> None:
    """Ray's ``worker_process_setup_hook``: runs in the worker before the actor class (and so
    verl's engine modules) is imported."""
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(PlatformCPU())
    # verl registers its FSDP engine for cuda and npu only (transformer_impl.py:1143); its
    # own override of the device used to pick an engine (engine/base.py:405) selects it.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
