"""Typed configuration with the keys verl users know (``checkpoint_engine`` section).

Sources: defaults, a YAML file, Hydra-style dotted overrides (``key=value``), in the full
form (``actor_rollout_ref.rollout.checkpoint_engine.backend=nccl``) or the short form
(``backend=nccl``). The keys and their documentation are ``weightsync.config.keys`` (the
parameter reference in ``docs/`` is generated from it: ``weightsync config --docs``); this
module builds, reads and validates an ``EngineConfig`` of them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from weightsync.config.backends import VERL_ONLY_BACKENDS, known_backends
from weightsync.config.keys import (
    DISK_MIN_KEEP,
    PREFIX,
    SECRET_ENV,
    TRAINER_MODE_ALIASES,
    ConfigError,
    EngineKeys,
    all_keys,
    canonical_key,
    coerce,
    flatten,
    parse_overrides,
    suggest,
)
from weightsync.config.verl import read_verl


@dataclass
class EngineConfig(EngineKeys):
    """Configuration of a weight-sync engine (verl's ``checkpoint_engine`` section): the
    keys of ``EngineKeys``, read from YAML, mappings or overrides, and validated."""

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_overrides(cls, overrides: Iterable[str] = (), base: EngineConfig | None = None) -> EngineConfig:
        """Build a config from ``key=value`` strings (short or full key form), validated."""
        return cls._build(parse_overrides(overrides), base)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: EngineConfig | None = None) -> EngineConfig:
        """Build a config from a (nested) mapping, as read from YAML, validated."""
        return cls._build(flatten(data), base)

    @classmethod
    def from_yaml(
        cls, path: str | Path, overrides: Iterable[str] = (), notes: list[str] | None = None
    ) -> EngineConfig:
        """Read a YAML file, then apply ``overrides``; validated once, at the end.

        The file is either weightsync's own (nested or flat; full or short keys: every key
        must be known) or a whole verl config, read as verl reads it (see ``read_verl``):
        only its ``checkpoint_engine`` section and the trainer keys weightsync knows count,
        the rest is left to verl. What was read differently from the file's face (ignored
        ``engine_kwargs`` of other backends, verl-only keys) is appended to ``notes``.
        """
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        items = list(flatten(data))
        if any(k.startswith(PREFIX) for k, _ in items):  # a whole verl config
            items, found = read_verl(items)
            if notes is not None:
                notes.extend(found)
        return cls._build([*items, *parse_overrides(overrides)])

    @classmethod
    def _build(cls, items: Iterable[tuple[str, Any]], base: EngineConfig | None = None) -> EngineConfig:
        config = copy.deepcopy(base) if base is not None else cls()
        for key, value in items:
            config.set(key, value)
        config.validate()
        return config

    # ----------------------------------------------------------------- access
    def set(self, key: str, value: Any) -> None:
        """Set one key (short, full or trainer form) from a string or a typed value."""
        path = canonical_key(key)
        *parents, leaf = path.split(".")
        obj = self
        for part in parents:
            obj = getattr(obj, part)
        kind = get_type_hints(type(obj))[leaf]
        value = coerce(key, value, kind)
        if path == "trainer.trainer_mode":
            value = TRAINER_MODE_ALIASES.get(value, value)
        setattr(obj, leaf, value)

    def get(self, key: str) -> Any:
        obj: Any = self
        for part in canonical_key(key).split("."):
            obj = getattr(obj, part)
        return obj

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_flat(self, *, reveal_secrets: bool = False) -> dict[str, Any]:
        """``{user-facing key: value}`` for every key (a set secret shows as ``"<set>"``)."""
        flat = {k.display: self.get(k.path) for k in all_keys()}
        if not reveal_secrets and flat.get("auth_secret") is not None:
            flat["auth_secret"] = "<set>"
        return flat

    def secret(self) -> bytes | None:
        """The shared secret in effect: ``auth_secret``, else ``$WEIGHTSYNC_SECRET``, else None."""
        value = self.auth_secret if self.auth_secret is not None else os.environ.get(SECRET_ENV)
        return value.encode() if value else None

    @property
    def heartbeat_grace(self) -> float:
        """The silence on a control connection after which its peer counts as lost
        (``heartbeat_grace_s``, or derived from ``timeout_s``)."""
        if self.heartbeat_grace_s is not None:
            return float(self.heartbeat_grace_s)
        return min(self.timeout_s, max(2.0, min(10.0, self.timeout_s / 3)))

    @property
    def bucket_bytes(self) -> int:
        return int(self.update_weights_bucket_megabytes) << 20

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every value; import ``custom_backend_module`` first so its backend counts."""
        if self.update_weights_bucket_megabytes <= 0:
            raise ConfigError(
                f"update_weights_bucket_megabytes={self.update_weights_bucket_megabytes}: "
                "must be a positive number of MiB"
            )
        if not isinstance(self.receive_buckets_in_flight, int) or self.receive_buckets_in_flight < 1:
            raise ConfigError(
                f"receive_buckets_in_flight={self.receive_buckets_in_flight}: must be at least 1"
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s}: must be a positive number of seconds")
        if self.heartbeat_grace_s is not None and not self.heartbeat_grace_s >= 1.0:
            raise ConfigError(
                f"heartbeat_grace_s={self.heartbeat_grace_s}: must be at least 1 second "
                "(TCP keepalive probes a connection at most once a second)"
            )
        if not self.engine_kwargs.nccl.group_name:
            raise ConfigError("engine_kwargs.nccl.group_name='': must not be empty")
        if self.engine_kwargs.disk.keep < DISK_MIN_KEEP:
            raise ConfigError(
                f"engine_kwargs.disk.keep={self.engine_kwargs.disk.keep}: must be at least {DISK_MIN_KEEP}; "
                "with 1, publishing a version deletes the previous one while a reader may still read it"
            )
        for k in all_keys():
            choices = k.meta.get("choices")
            if isinstance(choices, tuple) and self.get(k.path) not in choices:
                raise ConfigError(
                    f"{k.display}={self.get(k.path)!r}: allowed values are {', '.join(choices)}"
                )
        if self.verify == "xxh3":
            try:
                import xxhash  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "verify=xxh3 needs the xxhash package: pip install 'weightsync[verify]'"
                ) from None
        if self.custom_backend_module:
            try:
                importlib.import_module(self.custom_backend_module)
            except ImportError as e:
                raise ConfigError(
                    f"custom_backend_module={self.custom_backend_module!r}: cannot import it: {e}"
                ) from e
        known = known_backends()
        if self.backend not in known and self.backend in VERL_ONLY_BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: {VERL_ONLY_BACKENDS[self.backend]}")
        if self.backend not in known:
            raise ConfigError(
                f"backend={self.backend!r} is not a known backend{suggest(self.backend, known)}; "
                f"known backends: {', '.join(known)}"
            )
        if self.backend == "sharded" and self.delta != "off":
            raise ConfigError(
                f"backend=sharded with delta={self.delta!r}: a sharded sync sends each rank's own fragments, "
                "which delta sync does not cover yet; set delta=off"
            )
        if self.backend == "disk" and not self.engine_kwargs.disk.path:
            raise ConfigError(
                "engine_kwargs.disk.path='': backend=disk needs a directory shared by the trainer and "
                "every receiver, e.g. engine_kwargs.disk.path=/mnt/shared/weights"
            )
        if self.trainer.trainer_mode == "separate_async" and self.backend == "naive":
            raise ConfigError(
                "trainer.v1.trainer_mode=separate_async with backend=naive: separate async mode "
                "runs trainer and rollout on different devices, so weights must travel over a "
                "transport; `naive` only hands tensors over inside one process. Choose a "
                "transport backend such as backend=nccl."
            )
