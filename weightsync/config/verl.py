"""The verl side of the configuration: reading verl's own trainer configs as verl does, and
the keys of weightsync's verl adapter (``engine_kwargs.weightsync``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.config.backends import VERL_BACKEND, VERL_MODULE
from weightsync.config.keys import PREFIX, ConfigError, EngineKwargs, all_keys, flatten, suggest

#: values of ``engine_kwargs.weightsync.transport``: weightsync backends that carry weights
#: between processes, or ``auto`` (``shm`` when every rollout worker is on the trainer's Ray
#: node, else ``nccl``)
#: transports where every actor rank sends (over ``nccl``'s kind of two-rank groups)
ALL_RANKS_SEND = ("paired", "sharded")
VERL_TRANSPORTS = ("nccl", "shm", "paired", "sharded", "mooncake", "disk", "auto")

#: keys verl's own engines take that weightsync's backend of the same name does not read
VERL_ONLY_KWARGS = {
    "nccl": ("rollout_dtype", "multi_sender"),
    "mooncake": ("rollout_dtype", "rebuild_group"),
}

#: weightsync keys verl sets itself, so ``engine_kwargs.weightsync`` must not
_VERL_FIXED = {
    "backend": "name the weightsync backend with `transport`",
    "update_weights_bucket_megabytes": f"verl passes {PREFIX}update_weights_bucket_megabytes as the bucket size",
    "custom_backend_module": f"verl's {PREFIX}custom_backend_module loads the adapter",
}


@dataclass(frozen=True)
class VerlKey:
    """A key of ``engine_kwargs.weightsync`` that belongs to the verl adapter itself."""

    name: str
    default: Any
    help: str
    help_zh: str
    choices: tuple[str, ...] | None = None


VERL_KEYS = (
    VerlKey(
        "transport",
        "nccl",
        "The weightsync backend that carries the weights: `nccl` (broadcast; NCCL, HCCL on "
        "Ascend, Gloo on CPU), `shm` (every rollout worker on the trainer's node), `paired`, "
        "`sharded` (every actor rank sends a balanced share of verl's whole tensors), `mooncake`, `disk` (needs `engine_kwargs.disk.path`), or `auto`: `shm` when every rollout "
        "worker runs on the trainer's Ray node (decided by Ray node id at every update), else `nccl`.",
        "承载权重的 weightsync 后端：`nccl`（广播；NCCL，昇腾上为 HCCL，CPU 上为 Gloo）、`shm`"
        "（所有推理 worker 与训练端在同一节点）、`paired`、`sharded`（每个 actor rank 发送 verl 所给完整张量中均衡的一份）、`mooncake`、`disk`（需要 "
        "`engine_kwargs.disk.path`），或 `auto`：所有推理 worker 都在训练端所在的 Ray 节点上时用 `shm`"
        "（每次更新时按 Ray 节点 ID 判断），否则用 `nccl`。",
        VERL_TRANSPORTS,
    ),
    VerlKey(
        "host",
        None,
        "Address the trainer's sender binds and advertises to the rollout workers. Default: the "
        "node IP Ray reports for the trainer's node, so workers on other nodes reach it; `0.0.0.0` "
        "binds every interface and advertises that node IP.",
        "训练端发送方绑定并告知推理 worker 的地址。默认：Ray 报告的训练端节点 IP，其他节点上的 worker "
        "可据此连接；`0.0.0.0` 绑定所有网卡，并告知该节点 IP。",
    ),
)


@dataclass
class VerlOptions:
    """``engine_kwargs.weightsync`` read: the adapter's own keys and weightsync settings."""

    transport: str = "nccl"
    host: str | None = None
    settings: list[tuple[str, Any]] = field(default_factory=list)  # (short weightsync key, value)


def verl_settable_keys() -> list[str]:
    """weightsync keys ``engine_kwargs.weightsync`` may set (short form)."""
    return [
        k.display for k in all_keys() if k.display not in _VERL_FIXED and not k.path.startswith("trainer.")
    ]


def parse_verl_kwargs(kwargs: Mapping[str, Any] | None) -> VerlOptions:
    """Read verl's ``engine_kwargs.weightsync`` (what verl passes the adapter's constructor).

    Keys: ``transport``, ``host`` and any weightsync key (``timeout_s``, ``verify``,
    ``auth_secret``, ``engine_kwargs.nccl.group_name`` or ``nccl.group_name``, ...). An
    unknown key raises ``ConfigError`` naming the known ones.
    """
    where = f"{PREFIX}engine_kwargs.{VERL_BACKEND}."
    options = VerlOptions()
    settable = verl_settable_keys()
    groups = tuple(f.name for f in dataclasses.fields(EngineKwargs))
    for key, value in flatten(dict(kwargs or {})):
        if key == "transport":
            if value is None:
                continue
            if value not in VERL_TRANSPORTS:
                raise ConfigError(
                    f"{where}transport={value!r}: allowed values are {', '.join(VERL_TRANSPORTS)}"
                    f"{suggest(str(value), VERL_TRANSPORTS)}"
                )
            options.transport = value
        elif key == "host":
            options.host = None if value is None or str(value).strip() == "" else str(value).strip()
        elif key in _VERL_FIXED:
            raise ConfigError(f"{where}{key}: not set here; {_VERL_FIXED[key]}")
        else:
            short = f"engine_kwargs.{key}" if key.split(".", 1)[0] in groups else key
            if short not in settable:
                known = [k.name for k in VERL_KEYS] + settable
                raise ConfigError(
                    f"unknown key {where}{key}{suggest(key, known)}; known keys: {', '.join(known)}"
                )
            options.settings.append((short, value))
    return options


def read_verl(items: Iterable[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list[str]]:
    """Read a whole verl config's flattened items as verl does; return weightsync's items
    and notes on what was read differently from the file's face.

    Hydra's ``_target_`` is dropped; of ``engine_kwargs`` only the entry of the configured
    backend counts (verl hands a backend only its own; ``paired`` and ``sharded`` also read
    ``nccl``'s),
    the others are ignored with a note, as are keys only verl's own engines take. With
    ``backend: weightsync`` (weightsync's verl adapter) the weightsync configuration is
    ``engine_kwargs.weightsync``: its ``transport`` is the backend.
    """
    items = list(items)
    ours = {k.full for k in all_keys() if k.path.startswith("trainer.")}
    section = {k[len(PREFIX) :]: v for k, v in items if k.startswith(PREFIX)}
    backend = section.get("backend") or "naive"
    out: list[tuple[str, Any]] = [(k, v) for k, v in items if k in ours]
    notes: list[str] = []
    kwargs: dict[str, dict[str, Any]] = {}
    for key, value in section.items():
        if key == "_target_" or key.endswith("._target_"):
            continue  # Hydra's: the dataclass verl instantiates
        if key.startswith("engine_kwargs."):
            name, _, rest = key[len("engine_kwargs.") :].partition(".")
            if not rest:
                if value is None:
                    continue
                raise ConfigError(f"{PREFIX}{key}={value!r}: expected a mapping of the backend's options")
            kwargs.setdefault(name, {})[rest] = value
        elif backend == VERL_BACKEND and key == "backend":
            continue
        elif backend == VERL_BACKEND and key == "custom_backend_module" and value == VERL_MODULE:
            continue  # verl's plugin import, not a weightsync backend module
        else:
            out.append((PREFIX + key, value))
    if backend == VERL_BACKEND:
        options = parse_verl_kwargs(kwargs.pop(VERL_BACKEND, {}))
        out.append((PREFIX + "backend", "nccl" if options.transport == "auto" else options.transport))
        out.extend((PREFIX + k, v) for k, v in options.settings)
        if options.transport == "auto":
            notes.append(
                f"{PREFIX}engine_kwargs.{VERL_BACKEND}.transport=auto: chosen at every update (shm when "
                "every rollout worker is on the trainer's Ray node, else nccl); checked here as nccl"
            )
        readers: set[str] = set()
    else:
        readers = {backend} | ({"nccl"} if backend in ALL_RANKS_SEND else set())
    groups = {f.name for f in dataclasses.fields(EngineKwargs)}
    for name, entries in kwargs.items():
        if name not in readers:
            notes.append(
                f"{PREFIX}engine_kwargs.{name}: ignored, as verl does: backend={backend} reads "
                + (f"engine_kwargs.{VERL_BACKEND}" if backend == VERL_BACKEND else "only its own entry")
            )
            continue
        if name not in groups:
            continue  # a backend weightsync does not provide: validation says so
        for rest, value in entries.items():
            if rest in VERL_ONLY_KWARGS.get(name, ()):
                notes.append(
                    f"{PREFIX}engine_kwargs.{name}.{rest}: taken by verl's own {name} engine, "
                    f"not read by weightsync's; ignored"
                )
                continue
            out.append((f"{PREFIX}engine_kwargs.{name}.{rest}", value))
    return out, notes
