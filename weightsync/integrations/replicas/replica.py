"""An inference engine as the trainer side drives it, whatever the engine: the ``Replica``
protocol, the capabilities a replica declares, the pause modes, and engine calls with a
deadline (an engine whose worker died may never answer). ``Rollout`` drives replicas
through this alone; ``weightsync.integrations.vllm_replicas`` and
``weightsync.integrations.sglang`` implement it."""

from __future__ import annotations

import threading
from typing import Any, Literal, Protocol

PauseMode = Literal["abort", "keep", "wait"]
PAUSE_MODES: tuple[str, ...] = ("abort", "keep", "wait")

#: What a replica may declare beyond streamed updates (``Replica.capabilities``):
#: ``staged``: ``weightsync_stage``/``weightsync_staged``/``weightsync_commit`` (a version
#: staged in host memory while the engine generates, then loaded locally);
#: ``lora``: the ``weightsync_*adapter`` and ``weightsync_lora_*`` calls, and a method
#: ``lora_request(name, slot)`` giving the request to generate with a loaded adapter;
#: ``release_kv_cache``: ``release_kv_cache``/``restore_kv_cache`` around an update;
#: ``slices``: ``weightsync_slices`` (a dry run of its loaders: ``backend=sharded`` brings
#: each worker only what it keeps).
CAPABILITIES: tuple[str, ...] = ("staged", "lora", "release_kv_cache", "slices")


class Replica(Protocol):
    """One inference engine, as the update call needs it. Every replica takes streamed
    updates through its workers' ``weightsync_init``/``weightsync_receive``/
    ``weightsync_status``/``weightsync_close`` calls (``call``); what else it takes, it
    declares in ``capabilities`` (``CAPABILITIES``) and ``pause_modes``, and the rollout
    refuses an update that needs more before anything moves.

    A replica whose ``weightsync_receive`` or ``weightsync_commit`` (both called while it is
    paused) brought every worker to the version labels what it samples from then on with
    that version, before it answers, and reports ``caches_reset`` once its engine dropped
    every cache computed with the old weights."""

    name: str
    #: the calls it takes beyond streamed updates (``CAPABILITIES``)
    capabilities: frozenset[str]
    #: the pause modes its engine has
    pause_modes: tuple[str, ...]

    def workers(self) -> int: ...
    def pause(self, mode: PauseMode) -> None: ...
    def resume(self) -> None: ...
    def release_kv_cache(self) -> None: ...
    def restore_kv_cache(self) -> None: ...
    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]: ...


def check_mode(mode: str) -> None:
    """Refuse a pause mode no engine has."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(PAUSE_MODES)}")


def lacking(replicas: list[Replica], capability: str) -> list[str]:
    """The names of the replicas that do not declare ``capability``."""
    return [r.name for r in replicas if capability not in r.capabilities]


def loaded(statuses: list[Any], version: int) -> bool:
    """Every worker answered that it serves ``version``, whole."""
    return bool(statuses) and all(
        isinstance(s, dict) and s.get("version") == version and not s.get("mixed") and s.get("ok", True)
        for s in statuses
    )


def within(fn: Any, timeout_s: float, what: str) -> Any:
    """Run an engine call with a deadline: an engine whose worker died may never answer.
    The call runs in a daemon thread, which is left behind if it does not return."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, name="weightsync-engine-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not return within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")
