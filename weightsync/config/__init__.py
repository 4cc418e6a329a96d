"""The configuration: the keys users know (verl's ``checkpoint_engine`` section), YAML and
dotted overrides, validation, verl's own files, backend names and the generated reference.
"""

from weightsync.config.backends import (
    VERL_BACKEND,
    VERL_MODULE,
    VERL_ONLY_BACKENDS,
    builtin_backends,
    entry,
    failure,
    known_backends,
    register_engine,
    resolved,
)
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import (
    DELTA_MODES,
    DISK_MIN_KEEP,
    MOONCAKE_DEVICES,
    PREFIX,
    SECRET_ENV,
    TRAINER_MODE_ALIASES,
    TRAINER_MODES,
    UPDATE_MODES,
    VERIFY_MODES,
    ConfigError,
    DiskKwargs,
    EngineKeys,
    EngineKwargs,
    Key,
    MooncakeKwargs,
    NcclKwargs,
    TrainerKeys,
    all_keys,
    canonical_key,
    coerce,
    flatten,
    parse_overrides,
    suggest,
)
from weightsync.config.reference import docs_markdown
from weightsync.config.scratch import scratch_overrides
from weightsync.config.verl import (
    VERL_KEYS,
    VERL_ONLY_KWARGS,
    VERL_TRANSPORTS,
    VerlKey,
    VerlOptions,
    parse_verl_kwargs,
    read_verl,
    verl_settable_keys,
)

__all__ = ["ConfigError", "DELTA_MODES", "DISK_MIN_KEEP", "DiskKwargs", "EngineConfig", "EngineKeys", "EngineKwargs", "Key", "MOONCAKE_DEVICES", "MooncakeKwargs", "NcclKwargs", "PREFIX", "SECRET_ENV", "TRAINER_MODES", "TRAINER_MODE_ALIASES", "TrainerKeys", "UPDATE_MODES", "VERIFY_MODES", "VERL_BACKEND", "VERL_KEYS", "VERL_MODULE", "VERL_ONLY_BACKENDS", "VERL_ONLY_KWARGS", "VERL_TRANSPORTS", "VerlKey", "VerlOptions", "all_keys", "builtin_backends", "canonical_key", "coerce", "docs_markdown", "entry", "failure", "flatten", "known_backends", "parse_overrides", "parse_verl_kwargs", "read_verl", "register_engine", "resolved", "scratch_overrides", "suggest", "verl_settable_keys"]
