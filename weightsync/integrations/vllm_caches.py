"""vLLM's caches after a weight update: what the engine computed with the old weights
(prefix-cached KV blocks, a multimodal model's encoder outputs) is dropped before it serves
again. docs/vllm.md, "Caches after an update", says why here and how.

Installed by ``weightsync.integrations.vllm.register`` in every vLLM process; it acts in the
engine core, the process that owns the scheduler and its caches."""

from __future__ import annotations

import functools
from typing import Any

#: worker-extension calls after which a worker may serve other weights than before
_WEIGHT_CALLS = ("weightsync_receive", "weightsync_commit", "weightsync_reload_from_path")
#: ``update_weights`` phases (weightsync as the backend) that load a version into the model
_LOADING_PHASES = ("stream", "commit")


def reset_served_caches(core: Any) -> None:
    """Invalidate what vLLM's engine core ``core`` cached with the weights it served before
    an update: its prefix cache (every cached KV block, and an external KV connector's), and
    the encoder cache of a multimodal model. Raises ``RuntimeError`` where vLLM refuses.

    Running requests (pause mode ``keep``, or an update while the engine generates) hold KV
    blocks, and vLLM resets its prefix cache only when no block is held; they are preempted
    instead (``reset_running_requests=True``): on resume each recomputes its KV, prompt and
    tokens generated so far, with the new weights. A request admitted after the update
    reuses no block of the old version."""
    if not core.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
        raise RuntimeError(
            "weightsync: vLLM did not reset its prefix cache after the weight update (its KV connector "
            "refused): requests would reuse KV computed with the old weights"
        )
    if getattr(core.vllm_config.model_config, "is_multimodal_model", False):
        core.reset_encoder_cache()  # encoder outputs (vision embeddings) of the old weights


def _changed_weights(
    core: Any, backend: str, method: Any, kwargs: dict[str, Any] | None, result: Any
) -> bool:
    """Whether a ``collective_rpc`` call that returned ``result`` changed the served weights."""
    if method in _WEIGHT_CALLS:
        statuses = result if isinstance(result, list) else []
        # a float (reload_from_path's seconds) or a status whose weights moved (whole or torn)
        return any(not isinstance(s, dict) or s.get("ok") or s.get("mixed") for s in statuses)
    if method == "weightsync_load_adapter":  # an adapter name served before, now other weights
        return any(isinstance(s, dict) and s.get("lora_name_reused") for s in result or ())
    if method == "update_weights":
        transfer = getattr(core.vllm_config, "weight_transfer_config", None)
        info = (kwargs or {}).get("update_info") or {}
        phase = info.get("phase", "stream") if isinstance(info, dict) else getattr(info, "phase", "stream")
        return getattr(transfer, "backend", None) == backend and phase in _LOADING_PHASES
    return False


def reset_caches_after_updates(backend: str) -> None:
    """Make vLLM's engine core reset its caches (``reset_served_caches``) as soon as a
    weightsync call that changed the served weights returns, before it schedules anything
    again (idempotent). ``backend``: weightsync's name in vLLM's weight-transfer registry.

    Where weightsync sees the end of an update is the worker's call that loaded the version
    (``weightsync_receive`` / ``weightsync_commit``, or ``update_weights`` in phase
    ``stream`` / ``commit`` of vLLM's weight-transfer API, whose ``finish_weight_update``
    has nothing left to do); the workers cannot reach the scheduler's cache, and vLLM 0.32
    resets nothing on that path (``finish_weight_update`` only sets the version; a level-0
    sleep clears nothing, the server's ``/pause`` clears before the update and only where
    it keeps no request). The engine core runs each such call between
    two scheduler steps and returns the workers' answer after the reset, so no request is
    scheduled between the load and the reset, whoever drives the engine (``VLLMRollout``,
    vLLM's trainer factory over HTTP or Ray, the OpenAI server's routes). A call that fails
    (it raises, or every worker kept its weights) resets nothing: the caches stay those of
    the version still served. Worker statuses come back with ``caches_reset`` set, which
    ``VLLMRollout`` requires before it resumes a replica.
    """
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return
    original = EngineCore.collective_rpc
    if getattr(original, "weightsync_resets", False):
        return

    @functools.wraps(original)
    def collective_rpc(
        self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = original(self, method, timeout, args, kwargs)
        if isinstance(method, str) and _changed_weights(self, backend, method, kwargs, result):
            reset_served_caches(self)
            for status in result if isinstance(result, list) else ():
                if isinstance(status, dict):
                    status["caches_reset"] = True
        return result

    collective_rpc.weightsync_resets = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc  # type: ignore[method-assign]
