"""A vLLM engine as the trainer side drives it: the ``Replica`` protocol, ``LLMReplica``
over vLLM's offline ``LLM``, the pause modes, and engine calls with a deadline (an engine
whose worker died may never answer). ``VLLMRollout`` and vLLM's trainer factory use them."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from weightsync.integrations.vllm_versions import VersionedOutput

EXTENSION = "weightsync.integrations.vllm.WeightsyncWorkerExtension"

PauseMode = Literal["abort", "keep", "wait"]
PAUSE_MODES: tuple[str, ...] = ("abort", "keep", "wait")


class Replica(Protocol):
    """One inference engine, as the update call needs it. ``LLMReplica`` wraps vLLM's
    offline ``LLM``; a server-backed replica implements the same methods over HTTP.

    A replica whose ``weightsync_receive`` or ``weightsync_commit`` (both called while it is
    paused) brought every worker to the version labels what it samples from then on with
    that version, before it answers (``LLMReplica``: vLLM's weight-version label,
    ``weightsync.integrations.vllm_versions``)."""

    name: str

    def workers(self) -> int: ...
    def pause(self, mode: PauseMode) -> None: ...
    def resume(self) -> None: ...
    def release_kv_cache(self) -> None: ...
    def restore_kv_cache(self) -> None: ...
    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]: ...


class LLMReplica:
    """A ``vllm.LLM`` (started with ``worker_extension_cls=EXTENSION``) as a replica.

    Pausing is vLLM's level-0 sleep (scheduling only: weights and KV cache stay, and it
    clears no cache: the engine core resets the prefix cache as the load returns,
    ``weightsync.integrations.vllm_caches.reset_served_caches``); ``release_kv_cache`` frees the
    KV cache memory until ``restore_kv_cache``.

    Every token the engine samples carries the version that sampled it: a version loaded
    by ``weightsync_receive`` or ``weightsync_commit`` becomes the engine's weight-version
    label before the rollout resumes it, and ``generate`` returns each request's version
    spans (``weightsync.integrations.vllm_versions``). One thread may generate while
    another updates the replica (the engine's client is shared, ``share_client``).
    """

    def __init__(self, llm: Any, name: str | None = None) -> None:
        from weightsync.integrations.vllm_versions import share_client

        self.llm = llm
        self.name = name or f"vllm-{id(llm):x}"
        share_client(llm)

    def workers(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def pause(self, mode: PauseMode) -> None:
        self.llm.sleep(level=0, mode=mode)

    def resume(self) -> None:
        self.llm.wake_up(tags=["scheduling"])

    def release_kv_cache(self) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM 0.32's CPU worker refuses it ("Selective discard is not supported on
            # CPU") and the engine then stops scheduling: refuse before touching it.
            raise NotImplementedError("vLLM cannot release the KV cache on the CPU backend")
        self.llm.release_kv_cache_memory()

    def restore_kv_cache(self) -> None:
        self.llm.wake_up(tags=["kv_cache"])

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        statuses = self.llm.collective_rpc(method, timeout=timeout, args=args)
        if method in LOADS and loaded(statuses, args[0]):
            # Paused, between the load and the resume: the first token the new weights
            # sample is the first one labelled with their version.
            from weightsync.integrations.vllm_versions import label_engine

            label_engine(self.llm, args[0])
        return statuses

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[VersionedOutput]:
        """``LLM.generate`` with the versions that sampled every request's tokens
        (``VersionedOutput``: vLLM's output and its spans ``[(first_token_index, version)]``);
        ``kwargs`` go to ``LLM.generate``."""
        from weightsync.integrations.vllm_versions import generate

        return generate(self.llm, prompts, sampling_params, **kwargs)


#: the worker calls that load a version into the weights the engine serves
LOADS = ("weightsync_receive", "weightsync_commit")


def loaded(statuses: list[Any], version: int) -> bool:
    """Every worker answered that it serves ``version``, whole."""
    return bool(statuses) and all(
        isinstance(s, dict) and s.get("version") == version and not s.get("mixed") and s.get("ok", True)
        for s in statuses
    )


def check_mode(mode: str) -> None:
    """Refuse a pause mode vLLM does not have."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(PAUSE_MODES)}")


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
