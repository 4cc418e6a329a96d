"""Backend names: the built-in ones, those plugins register, and verl's that weightsync lacks.

The name table alone, importing nothing of weightsync: ``config`` validates a backend name
against it, and ``weightsync.engines.get_engine`` turns a name into its class (importing
the module on first use, so optional dependencies stay optional). A backend whose import
failed is recorded here, so asking for it again says what is missing without retrying.
"""

from __future__ import annotations

# name -> "module:Class"; imported on first use by ``weightsync.engines.get_engine``.
_BUILTIN: dict[str, str] = {
    "naive": "weightsync.engines.naive:NaivePublisher",
    "nccl": "weightsync.engines.nccl:CollectiveEngine",
    "shm": "weightsync.engines.shm:ShmEngine",
    "ipc": "weightsync.engines.ipc:IpcEngine",
    "paired": "weightsync.engines.paired:PairedEngine",
    "sharded": "weightsync.engines.sharded:ShardedEngine",
    "disk": "weightsync.engines.disk:DiskPublisher",
    "mooncake": "weightsync.engines.mooncake:MooncakeEngine",
}
#: name -> the engine class, or "module:Class" until it is first asked for
_registry: dict[str, type | str] = dict(_BUILTIN)
#: name -> why its module could not be imported
_failed: dict[str, str] = {}

#: the backend name weightsync's adapter registers in verl's ``CheckpointEngineRegistry``
VERL_BACKEND = "weightsync"
#: the module verl imports through ``custom_backend_module`` to register it
VERL_MODULE = "weightsync.integrations.verl"

#: verl 0.9.1 backend names weightsync does not provide, and what to use instead
VERL_ONLY_BACKENDS = {
    "hccl": (
        "weightsync has no backend of that name: use backend=nccl, which runs on HCCL on Ascend NPUs "
        "(and on Gloo on CPU); verl registers its own HCCL engine under `nccl` too"
    ),
    "nixl": (
        "verl's NIXL engine is not provided by weightsync; for point-to-point transfers use "
        "backend=mooncake (RDMA, or TCP), for a broadcast backend=nccl"
    ),
    "kimi_ckpt_engine": (
        "verl's engine over Moonshot's checkpoint-engine is not provided by weightsync; use "
        "backend=nccl (broadcast), backend=shm (one host; CUDA IPC on GPUs) or backend=mooncake"
    ),
    "delta_sharded": (
        "verl's delta engine (sparse byte differences, NCCL and CUDA only) is not provided by "
        "weightsync; use backend=nccl with delta=auto, weightsync's own delta sync (every session "
        "backend, exact, whole versions to receivers without the base)"
    ),
    VERL_BACKEND: (
        "that is the name weightsync's adapter registers in verl (custom_backend_module: "
        f"{VERL_MODULE}); in weightsync's own configuration name the transport instead: "
        "backend=nccl, shm, paired, mooncake or disk"
    ),
}


def register_engine(name: str, engine: type | str) -> None:
    """Register a backend under ``name``: a ``Transport`` or ``Publisher`` subclass, or
    ``"module:Class"`` to import lazily."""
    if not name or not isinstance(name, str):
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    _registry[name] = engine
    _failed.pop(name, None)


def known_backends() -> list[str]:
    """Names of all registered backends (loadable or not)."""
    return sorted(_registry)


def builtin_backends() -> list[str]:
    """Names of the backends weightsync ships, in the order the docs list them."""
    return list(_BUILTIN)


# For ``weightsync.engines.get_engine``, which resolves entries (it knows the contracts).
def entry(name: str) -> type | str | None:
    """What ``name`` is registered as (a class, or "module:Class"), or None."""
    return _registry.get(name)


def failure(name: str) -> str | None:
    """Why ``name``'s module could not be imported, if it could not."""
    return _failed.get(name)


def resolved(name: str, engine: type | None, failed: str | None = None) -> None:
    """Record what ``name`` resolved to: its class, or why its import failed."""
    if engine is not None:
        _registry[name] = engine
    if failed is not None:
        _failed[name] = failed
