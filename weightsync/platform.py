"""Everything that knows which accelerator we run on: CUDA, Ascend NPU or plain CPU, and
how this OS starts weightsync's own worker processes.

No other module calls ``torch.cuda`` or ``torch_npu`` directly; they ask this one.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import logging
import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("weightsync.platform")


@dataclass(frozen=True)
class Platform:
    """The accelerator kind of this process: ``"cuda"``, ``"npu"`` or ``"cpu"``."""

    kind: str

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"


@functools.lru_cache(maxsize=1)
def current_platform() -> Platform:
    """Detect the platform once per process.

    ``WEIGHTSYNC_PLATFORM=cpu`` forces CPU, e.g. to test the CPU path on a GPU host.
    """
    forced = os.environ.get("WEIGHTSYNC_PLATFORM")
    if forced:
        return Platform(forced)
    if torch.cuda.is_available():
        return Platform("cuda")
    try:  # torch_npu registers torch.npu when imported; absence is the common case.
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return Platform("npu")
    except ImportError:
        pass
    return Platform("cpu")


def device_report() -> dict:
    """What this process sees of its accelerator, for reports (``weightsync gpu-check``):
    the platform, torch with the CUDA and NCCL it was built with or loaded, and per device
    its name, compute capability, memory and multiprocessors. JSON-safe."""
    plat = current_platform()
    report: dict = {
        "platform": plat.kind,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # None: a CPU build of torch
        "nccl": None,
        "devices": [],
    }
    if torch.version.cuda:
        try:  # the NCCL torch loaded (a newer libnccl may sit under torch's pin)
            version = torch.cuda.nccl.version()
            report["nccl"] = ".".join(str(x) for x in version) if isinstance(version, tuple) else str(version)
        except Exception as e:
            report["nccl"] = f"unknown ({type(e).__name__}: {e})"
    if plat.kind == "cuda":
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            report["devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "multiprocessors": props.multi_processor_count,
                }
            )
    return report


def _accelerator_module(kind: str):
    return getattr(torch, kind)  # torch.cuda or torch.npu: the same API shape


def local_device(device: str | torch.device | None = None) -> torch.device:
    """The device for transfer buffers of this process.

    An explicit ``device`` wins. Otherwise the accelerator's current device; a rollout
    worker on a non-CUDA platform may have none set, so fall back to its LOCAL_RANK
    (as launchers export it), and to CPU on CPU.
    """
    if device is not None:
        return torch.device(device)
    plat = current_platform()
    if not plat.is_accelerator:
        return torch.device("cpu")
    mod = _accelerator_module(plat.kind)
    try:
        index = mod.current_device()
    except Exception:  # no device set in this worker yet
        index = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(plat.kind, index)


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` finished (no-op on CPU).

    A collective returning only means its kernel was queued: buffers may be reused or
    handed out only after this.
    """
    if device.type in ("cuda", "npu"):
        _accelerator_module(device.type).synchronize(device)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for the sender's copies into the wire's buffers (packing a
    bucket, a bucket into a shared-memory or Mooncake slot).

    Between contiguous host tensors of one dtype and size: one ``memmove`` in this thread
    (the GIL released). torch spreads a large copy over its intra-op threads, whose barrier
    waits for a thread the scheduler put aside when the cores are shared (a trainer beside
    its rollout engines): with 2 vLLM replicas on 2 cores that cost the trainer 3x the CPU
    for the same bytes, and every other 7 MB update twice the time. Receivers keep torch's
    copy: where a worker's landing copies went through ``memmove`` its CPU per update
    doubled (not traced; likely: the engine's loader reads the bytes right after they
    land, and glibc's ``memmove`` writes large copies around the cache)."""
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.dtype == src.dtype
        and dst.numel() == src.numel()
    ):
        if dst.nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
        return
    dst.copy_(src)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor for memory kept across versions (a vLLM worker's
    staging copy): pinned where an accelerator copies from it, so its loads into the
    device are DMA transfers, not staged through pageable memory."""
    return torch.empty(shape, dtype=dtype, pin_memory=current_platform().is_accelerator)


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device`` (host RAM for CPU): a tensor larger than this can never
    be held there, so a receiver refuses one announced from the wire."""
    if device.type in ("cuda", "npu"):
        return int(_accelerator_module(device.type).mem_get_info(device)[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# The configuration name users write (``backend=nccl``) and the library that serves the
# collective differ by platform. This table is the one place that maps them.
_COLLECTIVE_LIBRARY = {
    # CUDA GPUs: NVIDIA's collective library itself.
    "cuda": "nccl",
    # Ascend NPUs: HCCL (from torch_npu) is the NCCL-equivalent and takes the same config.
    "npu": "hccl",
    # CPU: Gloo runs the same broadcast design over TCP.
    "cpu": "gloo",
}


@functools.cache
def collective_backend(requested: str = "nccl", kind: str | None = None) -> str:
    """Resolve the configured collective name to the library serving it on this platform.

    ``collective_backend("nccl")`` is ``"nccl"`` on CUDA, ``"hccl"`` on Ascend and
    ``"gloo"`` on CPU. Logged once per process and platform.
    """
    kind = kind or current_platform().kind
    if requested != "nccl":
        return requested
    library = _COLLECTIVE_LIBRARY[kind]
    log.info("backend 'nccl' on platform %s is served by %s", kind, library)
    return library


# Mooncake Transfer Engine names its transports by protocol; which one moves the bytes
# follows the device the buffers live on. This table is the one place that maps them.
_MOONCAKE_PROTOCOL = {
    # CUDA GPUs: RDMA (GPUDirect where the NIC supports it; device_name picks the NICs).
    "cuda": "rdma",
    # Ascend NPUs: Mooncake's own transport for NPU memory.
    "npu": "ascend_direct",
    # CPU: plain TCP, also the way to run it on a machine without RDMA NICs.
    "cpu": "tcp",
}


def mooncake_protocol(device: str = "auto") -> str:
    """The Mooncake protocol for ``engine_kwargs.mooncake.device``: ``cpu`` -> ``tcp``,
    ``cuda`` -> ``rdma``, ``npu`` -> ``ascend_direct``; ``auto`` uses this process's
    platform. Logged, so the transport in use is visible."""
    kind = current_platform().kind if device == "auto" else device
    if kind not in _MOONCAKE_PROTOCOL:
        raise ValueError(
            f"engine_kwargs.mooncake.device={device!r}: expected one of auto, {', '.join(_MOONCAKE_PROTOCOL)}"
        )
    protocol = _MOONCAKE_PROTOCOL[kind]
    log.info("backend 'mooncake' with device %s uses Mooncake protocol %s", device, protocol)
    return protocol


def new_process_group(
    library: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    bind_host: str | None = None,
) -> dist.ProcessGroup:
    """A process group of our own over ``store``; never touches the default group.

    The trainer usually has its own default group (FSDP, Megatron); weight sync must
    not join or disturb it, so the group is built directly from a store. ``bind_host``:
    the local address Gloo listens on (by default Gloo takes the address the machine's
    hostname resolves to, which may not be the interface the user chose).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if library == "gloo":
        if bind_host is None:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        opts = dist.ProcessGroupGloo._Options()  # noqa: SLF001 -- torch 2.13: no public Gloo options with devices
        opts._timeout = timeout  # noqa: SLF001 -- torch 2.13: Backend.Options has the timeout only as _timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]  # noqa: SLF001 -- torch 2.13, as above
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if library == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout  # noqa: SLF001 -- torch 2.13: Backend.Options has the timeout only as _timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if library == "hccl":
        import torch_npu  # noqa: F401  (registers torch.distributed.ProcessGroupHCCL)

        return dist.ProcessGroupHCCL(store, rank, world_size, timeout)  # type: ignore[attr-defined]
    raise ValueError(f"no process group implementation for collective library {library!r}")


def empty_cache() -> None:
    """Return cached accelerator memory to the driver (no-op on CPU)."""
    plat = current_platform()
    if plat.is_accelerator:
        _accelerator_module(plat.kind).empty_cache()


def share_device_buffer(buffer: torch.Tensor) -> dict:
    """A msgpack-safe handle through which another process on this host maps ``buffer``
    (accelerator memory: CUDA IPC). Host memory is shared by file descriptor instead
    (see ``engines/shm.py``)."""
    if buffer.device.type != "cuda":
        raise NotImplementedError(f"sharing {buffer.device.type} memory between processes is not supported")
    # The storage's IPC handle (device, handle, size, offset, ref-counter and event handles):
    # plain ints, bytes and bools, so it travels in the handshake without pickle.
    fields = buffer.untyped_storage()._share_cuda_()
    return {"kind": "cuda_ipc", "fields": list(fields), "nbytes": buffer.numel()}


def open_device_buffer(handle: dict, device: torch.device) -> torch.Tensor:
    """Map a buffer shared by ``share_device_buffer`` in another process (a uint8 tensor)."""
    if handle.get("kind") != "cuda_ipc":
        raise ValueError(f"unknown shared buffer kind {handle.get('kind')!r}")
    with torch.cuda.device(device):
        # torch.multiprocessing's own CUDA IPC path; its public form needs pickle
        storage = torch.UntypedStorage._new_shared_cuda(*handle["fields"])  # noqa: SLF001 -- torch 2.13
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage)
    return flat[: int(handle["nbytes"])]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a rendezvous that needs its port named before it
    listens; another process may take it in between, so use it at once)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ worker processes
# A fresh interpreter that imports torch and weightsync costs 1.2-1.4 s of CPU on a 2-core
# machine, more than many of the syncs it then runs. Where the OS has it, weightsync's own
# workers (the demos' rollouts, the bench's rows) start from a fork server instead: one
# process imports the workers' modules once and every worker is forked from it (12 starts:
# 14.4 s spawned, 1.4 s forked, on 2 loaded cores). Each is still its own process with its
# own memory, sockets and process group. The server only imports (no accelerator touched,
# no thread started), so its children may still initialise CUDA, NPU or OpenMP themselves.


def process_context(preload: Sequence[str] = ()) -> Any:
    """The multiprocessing context for worker processes: ``forkserver`` where the OS has it,
    its server importing torch and ``preload`` (module names) once; ``spawn`` elsewhere. The
    server starts once per process, with the first caller's ``preload``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload])
    return ctx


def _with_environ(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    os.environ.clear()
    os.environ.update(environ)
    return target(*args)


def start_process(ctx: Any, target: Callable[..., Any], *args: Any, daemon: bool = True) -> Any:
    """Start ``target(*args)`` in a new process of ``ctx`` (``process_context``), with the
    caller's environment of now: a forked worker would otherwise see the fork server's, from
    when the server started, where a spawned one inherits the caller's."""
    proc = ctx.Process(target=_with_environ, args=(dict(os.environ), target, *args), daemon=daemon)
    proc.start()
    return proc
