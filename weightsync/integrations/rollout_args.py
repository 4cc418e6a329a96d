"""Rollout configuration (verl's ``actor_rollout_ref`` keys) -> inference engine arguments.

One table serves every engine: each row names the rollout key, the vLLM engine argument and
the SGLang server argument it becomes (None: that engine has no such argument). Pure data
and plain functions, no engine import, so a trainer can validate its configuration before
starting anything.

    >>> vllm_engine_args({"model.path": "/m", "rollout.tensor_model_parallel_size": 2})["tensor_parallel_size"]
    2

Unknown keys, values of the wrong type and contradictions (say, a tensor parallel size that
is not a multiple of the data parallel size) raise ``RolloutArgsError`` naming the key.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class RolloutArgsError(ValueError):
    """A rollout key that is unknown, of the wrong type, or contradicts another."""


@dataclass(frozen=True)
class ArgMapping:
    """One row: rollout key -> vLLM engine arg / SGLang server arg."""

    key: str
    vllm: str | None
    sglang: str | None
    type: type | tuple[type, ...]
    default: Any
    doc: str


# The rollout keys as users write them (prefix ``actor_rollout_ref.`` optional). SGLang-only
# settings that have no rollout key (enable_memory_saver on, log_level error,
# skip_server_warmup on, attention_backend "ascend" on NPU) are in ``SGLANG_FIXED``.
TABLE: tuple[ArgMapping, ...] = (
    ArgMapping("model.path", "model", "model_path", str, None, "model directory or hub id (required)"),
    ArgMapping(
        "model.trust_remote_code",
        "trust_remote_code",
        "trust_remote_code",
        bool,
        False,
        "run the model repository's own code",
    ),
    ArgMapping(
        "rollout.gpu_memory_utilization",
        "gpu_memory_utilization",
        "mem_fraction_static",
        float,
        0.5,
        "fraction of accelerator memory for weights and KV cache, in (0, 1]",
    ),
    ArgMapping(
        "rollout.enforce_eager",
        "enforce_eager",
        "disable_cuda_graph",
        bool,
        True,
        "no CUDA graphs / compilation",
    ),
    ArgMapping(
        "rollout.free_cache_engine",
        None,
        None,
        bool,
        True,
        "release the KV cache around each weight update (the update call's release_kv_cache)",
    ),
    ArgMapping("rollout.max_model_len", "max_model_len", "context_length", int, None, "longest sequence"),
    ArgMapping(
        "rollout.tensor_model_parallel_size",
        "tensor_parallel_size",
        "tp_size",
        int,
        1,
        "devices per replica; the engine's tensor parallel size is this times data_parallel_size",
    ),
    ArgMapping(
        "rollout.data_parallel_size",
        "data_parallel_size",
        "dp_size",
        int,
        1,
        "attention data parallelism inside one replica",
    ),
    ArgMapping(
        "rollout.expert_parallel_size",
        "enable_expert_parallel",
        "ep_size",
        int,
        1,
        "expert parallel size (vLLM: on when > 1; its size follows tp x dp)",
    ),
    ArgMapping(
        "rollout.max_num_seqs", "max_num_seqs", "max_running_requests", int, 1024, "sequences per batch"
    ),
    ArgMapping(
        "rollout.max_num_batched_tokens",
        "max_num_batched_tokens",
        "chunked_prefill_size",
        int,
        8192,
        "tokens per batch",
    ),
    ArgMapping(
        "rollout.enable_prefix_caching",
        "enable_prefix_caching",
        "disable_radix_cache",
        bool,
        True,
        "reuse KV cache across requests with a common prefix (SGLang: negated)",
    ),
    ArgMapping(
        "rollout.skip_tokenizer_init",
        "skip_tokenizer_init",
        "skip_tokenizer_init",
        bool,
        True,
        "prompts and outputs as token ids (no tokenizer in the engine)",
    ),
    ArgMapping(
        "rollout.load_format",
        "load_format",
        "load_format",
        str,
        "dummy",
        "how the engine loads its first weights; 'dummy' when the trainer syncs them anyway",
    ),
    ArgMapping(
        "rollout.quantization",
        "quantization",
        "quantization",
        (str, type(None)),
        None,
        "quantization method, e.g. 'fp8'; None for none",
    ),
    ArgMapping(
        "rollout.disable_log_stats", "disable_log_stats", None, bool, True, "no periodic stats logging"
    ),
    ArgMapping("rollout.dtype", "dtype", "dtype", str, "bfloat16", "weight and activation dtype"),
    ArgMapping("rollout.seed", "seed", "random_seed", int, 0, "sampling seed"),
)

SGLANG_FIXED: dict[str, Any] = {"enable_memory_saver": True, "log_level": "error", "skip_server_warmup": True}

#: rollout keys whose SGLang value is the negation of the rollout value
_SGLANG_NEGATED = {"rollout.enable_prefix_caching"}
_BY_KEY = {m.key: m for m in TABLE}
_PREFIX = "actor_rollout_ref."
_LOAD_FORMATS = ("auto", "dummy", "safetensors", "pt", "npcache", "runai_streamer")


def _normalize(config: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten nested dicts, drop the ``actor_rollout_ref.`` prefix, check keys and types."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, Mapping):
                walk(f"{key}.", v)
            else:
                flat[key.removeprefix(_PREFIX)] = v

    walk("", config)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        m = _BY_KEY.get(key)
        if m is None:
            close = difflib.get_close_matches(key, _BY_KEY, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RolloutArgsError(f"unknown rollout key {key!r}{hint}; known: {', '.join(_BY_KEY)}")
        types = m.type if isinstance(m.type, tuple) else (m.type,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise RolloutArgsError(f"{key}={value!r}: expected {want}")
        out[key] = value
    return out


def resolve(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every rollout key with its value (given or default), checked for contradictions."""
    given = _normalize(config)
    values = {m.key: m.default for m in TABLE} | given
    if not values["model.path"]:
        raise RolloutArgsError("model.path is required")
    for key in (
        "rollout.tensor_model_parallel_size",
        "rollout.data_parallel_size",
        "rollout.expert_parallel_size",
        "rollout.max_num_seqs",
        "rollout.max_num_batched_tokens",
        "rollout.max_model_len",
    ):
        if values[key] is not None and values[key] < 1:
            raise RolloutArgsError(f"{key}={values[key]}: must be >= 1")
    util = values["rollout.gpu_memory_utilization"]
    if not 0 < util <= 1:
        raise RolloutArgsError(f"rollout.gpu_memory_utilization={util}: must be in (0, 1]")
    tp, dp, ep = (
        values[f"rollout.{k}"]
        for k in ("tensor_model_parallel_size", "data_parallel_size", "expert_parallel_size")
    )
    if ep > 1 and ep != tp * dp:
        raise RolloutArgsError(
            f"rollout.expert_parallel_size={ep} contradicts tensor_model_parallel_size x data_parallel_size = "
            f"{tp} x {dp} = {tp * dp}: experts are spread over all of a replica's devices"
        )
    if values["rollout.load_format"] not in _LOAD_FORMATS:
        raise RolloutArgsError(
            f"rollout.load_format={values['rollout.load_format']!r}: expected one of {', '.join(_LOAD_FORMATS)}"
        )
    return values


def vllm_engine_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs`` from a rollout config.

    vLLM's tensor parallel size is ``tensor_model_parallel_size x data_parallel_size``: the
    rollout's data parallelism splits attention inside one engine of that many devices.
    """
    values = resolve(config)
    out: dict[str, Any] = {}
    for m in TABLE:
        if m.vllm is None or values[m.key] is None:
            continue
        out[m.vllm] = values[m.key]
    tp, dp = values["rollout.tensor_model_parallel_size"], values["rollout.data_parallel_size"]
    out["tensor_parallel_size"] = tp * dp
    out.pop("data_parallel_size", None)  # folded into tensor_parallel_size above
    out["enable_expert_parallel"] = values["rollout.expert_parallel_size"] > 1
    return out


def sglang_server_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for SGLang's ``ServerArgs`` from a rollout config."""
    values = resolve(config)
    out: dict[str, Any] = dict(SGLANG_FIXED)
    for m in TABLE:
        if m.sglang is None or values[m.key] is None:
            continue
        value = values[m.key]
        out[m.sglang] = (not value) if m.key in _SGLANG_NEGATED else value
    out["tp_size"] = values["rollout.tensor_model_parallel_size"] * values["rollout.data_parallel_size"]
    return out


def table_markdown() -> str:
    """The mapping as a Markdown table (for the docs)."""
    rows = ["| rollout key | vLLM | SGLang | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for m in TABLE:
        rows.append(
            f"| `{m.key}` | {f'`{m.vllm}`' if m.vllm else '-'} | {f'`{m.sglang}`' if m.sglang else '-'} "
            f"| `{m.default}` | {m.doc} |"
        )
    return "\n".join(rows) + "\n"
