"""vLLM replicas as weightsync receivers: the worker side.

Every vLLM worker process of a replica joins the weightsync session as one receiver and
streams each version, bucket by bucket, through vLLM's in-place reload path
(``model_runner.reload_weights(weights_iterator=...)``). That path runs the model's own
``load_weights`` (which fuses q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, ...)
and redoes the post-load processing layer by layer (the CPU backend's repacking of linear
weights, quantization), so no second full copy of the model is ever held: at most the
tensors of the layers still being completed, plus weightsync's two transfer buckets.

Two ways in, both from vLLM's own extension points:

- ``worker_extension_cls="weightsync.integrations.vllm.WeightsyncWorkerExtension"``: methods
  reached through ``LLM.collective_rpc`` (or the server's ``/collective_rpc``). The trainer
  side in ``weightsync.integrations.vllm_rollout`` drives replicas this way.
- ``weight_transfer_config={"backend": "weightsync"}``: vLLM's weight-transfer engine
  registry (``vllm.distributed.weight_transfer``), reached through vLLM's RL API
  (``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update``, also as HTTP routes of the OpenAI-compatible server). The
  engine is registered by this module's import and by the ``vllm.general_plugins`` entry
  point, so every vLLM process knows it. The trainer side of that API
  (``WeightTransferTrainerFactory``) is registered too: ``WeightsyncTrainerInitInfo`` and
  ``WeightsyncTrainerEngine``, re-exported here from ``weightsync.integrations.vllm_trainer``.

Version semantics (reported by ``weightsync_status`` and after every receive) are the
receiver's own (``weightsync.state``): ``version`` is the version whose weights the replica
fully serves. A sync that fails before any tensor was applied leaves the weights and
``version`` as they were (``failed_version`` names the attempt). A sync that fails after
some tensors were applied leaves a mix of two versions (the receiver is ``torn``): the
status then says ``version`` None and ``mixed`` True until a later sync completes; such a
replica should not serve (the trainer side keeps it paused).

Both ways in take their configuration from whoever calls the RPC. Keys that would make the
replica import code (``custom_backend_module``) or use a path of its file system
(``engine_kwargs.disk.path``: weights are read there and acknowledgements written) are
refused from that caller unless the replica's own environment sets
``WEIGHTSYNC_ALLOW_REMOTE_CONFIG=1`` (``check_remote_overrides``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.integrations.replicas.receiver import ReplicaReceiver, tensor_digests
from weightsync.integrations.replicas.staging import Reload
from weightsync.integrations.vllm_caches import reset_caches_after_updates
from weightsync.integrations.vllm_lora import AdapterSlots, start_for_rank
from weightsync.integrations.vllm_reload import (
    checked_load,
    cpu_experts_repacked,
    finalize_reload,
    full_version_vet,
    reprocess_tied,
    restore_adapters,
    update_vet,
    worker_reload,
)
from weightsync.integrations.vllm_slices import derive_slices
from weightsync.plan import TensorSpec

log = logging.getLogger("weightsync.vllm")

#: The name of weightsync in vLLM's weight-transfer engine registry.
BACKEND_NAME = "weightsync"
#: ``update_weights(update_info={"phase": ...})`` of the weight-transfer engine
UPDATE_PHASES = ("stream", "stage", "staged", "commit")


def _where(state: ReplicaReceiver, worker_rank: int) -> str:
    """This worker, as a failed update's error names it."""
    rank = state.receiver.rank if state.receiver is not None else None
    return f"worker {worker_rank} (receiver rank {rank})"


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker class via ``worker_extension_cls``; call through
    ``llm.collective_rpc("weightsync_...", args=(...))``. Every method runs in every worker
    of the replica; results come back one per worker."""

    def _weightsync(self) -> ReplicaReceiver:
        state = getattr(self, "_weightsync_state", None)
        if state is None:
            state = self._weightsync_state = ReplicaReceiver()
            state.derive = lambda specs: derive_slices(self.model_runner.get_model(), self.vllm_config, specs)
        return state

    def weightsync_init(
        self, address: str, rank_offset: int, overrides: list[str] | dict[str, Any], warm_up: bool = False
    ) -> dict[str, Any]:
        """Join the sender at ``address`` as receiver ``rank_offset + this worker's rank``;
        ``warm_up``: join its data plane now, while the trainer runs ``Sender.warm_up``."""
        return self._weightsync().open(
            address, rank_offset + int(getattr(self, "rank", 0)), overrides, warm_up
        )

    def weightsync_receive(self, version: int, partial: bool = False) -> dict[str, Any]:
        """Receive ``version`` into the running model; return this worker's status. The
        update fails naming every tensor the engine did not take and, unless ``partial``,
        every parameter it left unwritten (``checked_load``)."""
        vet = update_vet(self.model_runner, self.vllm_config, partial)
        return self._weightsync().receive(version, self._reload(partial), vet)

    def _reload(self, partial: bool) -> Reload:
        """This worker's checked reload (``vllm_reload.worker_reload``), its errors naming it."""
        where = functools.partial(_where, self._weightsync(), int(getattr(self, "rank", 0)))
        return worker_reload(self, where, partial)

    def weightsync_stage(self, version: int) -> dict[str, Any]:
        """Start staging ``version`` in host memory while the engine serves; returns at once."""
        return self._weightsync().stage(version)

    def weightsync_staged(self, wait_s: float = 1.0) -> dict[str, Any]:
        """Wait up to ``wait_s`` for the stage in progress; this worker's status."""
        return self._weightsync().staged(wait_s)

    def weightsync_commit(self, version: int, partial: bool = False) -> dict[str, Any]:
        """Load the staged ``version`` into the running model (between a pause and a
        resume), checked as ``weightsync_receive`` is: before anything moves, and after the load."""
        vet = update_vet(self.model_runner, self.vllm_config, partial)
        return self._weightsync().commit(version, self._reload(partial), vet)

    def weightsync_status(self) -> dict[str, Any]:
        """The version this worker serves, the last failed one, and the last sync's figures."""
        return self._weightsync().status()

    def weightsync_close(self) -> None:
        """Leave the session (the engine keeps serving its current weights)."""
        self._weightsync().close()

    def weightsync_digests(self) -> dict[str, str]:
        """Digests of the running model's parameters and buffers, as vLLM holds them."""
        return tensor_digests(self.model_runner.get_model())

    def _adapters(self) -> AdapterSlots:
        slots = getattr(self, "_weightsync_adapters", None)
        if slots is None:
            slots = self._weightsync_adapters = AdapterSlots(self)
        return slots

    def weightsync_lora_limits(self, rank: int | None = None) -> dict[str, Any]:
        """This engine's LoRA limits (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``);
        with an adapter's ``rank``, ``start``: what to start an engine with for it."""
        limits = self._adapters().limits()
        return limits if rank is None else {**limits, "start": start_for_rank(rank)}

    def weightsync_lora_check_base(self, digests: dict[str, str]) -> dict[str, Any]:
        """Check the trainer's base weights (their ``named_digests``) against this replica's
        checkpoint; raises naming the tensors that differ."""
        return self._adapters().check_base(digests)

    def weightsync_stage_adapter(self, version: int) -> dict[str, Any]:
        """Start receiving the LoRA adapter of ``version`` while the engine serves; returns at once."""
        return self._weightsync().stage_adapter(version)

    def weightsync_load_adapter(
        self, version: int, name: str, lora_id: int, config: dict[str, Any], wait_s: float = 0.0
    ) -> dict[str, Any]:
        """Wait up to ``wait_s`` for the adapter stage of ``version`` (called once the sender
        sent it: it ends at once), then load it into vLLM's LoRA manager as ``name`` in slot
        ``lora_id`` (replacing what the slot held); this worker's status."""
        slots = self._adapters()
        figures: dict[str, Any] = {}

        def load(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
            figures.update(slots.load(name, lora_id, config, list(tensors)))

        return {**self._weightsync().load_adapter(version, load, wait_s), **figures}

    def weightsync_slices(self, specs: list[Any]) -> dict[str, Any]:
        """Learn which box of each checkpoint tensor (``specs``: ``TensorSpec.to_wire()``
        items) this worker keeps, by a dry run of its model's loaders
        (``weightsync.integrations.vllm_slices``); a ``backend=sharded`` sync then brings only
        those. Returns the boxes, the tensors taken whole and why, and the bytes kept."""
        return self._weightsync().learn_slices([TensorSpec.from_wire(s) for s in specs])

    def weightsync_reload_from_path(self, path: str) -> float:
        """vLLM's own reload from a weights directory on disk; returns its seconds (the
        baseline that weightsync's sync is measured against), with the CPU experts repacked as
        weightsync's own reload does (vLLM's alone fails or serves garbled experts there)."""
        t0 = time.perf_counter()
        with cpu_experts_repacked(self.model_runner.get_model(), self.vllm_config):
            self.reload_weights(weights_path=path)
        seconds = time.perf_counter() - t0
        restore_adapters(self)
        return seconds


# ------------------------------------------------------------- weight-transfer engine
@functools.cache
def _engine_classes() -> tuple[type, type, type]:
    """Built on first use: vLLM is imported only where it is installed and wanted."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class WeightsyncInitInfo(WeightTransferInitInfo):
        """``init_weight_transfer_engine(init_info={...})``: where the sender listens,
        this replica's first receiver rank, weightsync configuration overrides, and
        whether to join the sender's data plane now (the trainer then runs
        ``Sender.warm_up`` meanwhile)."""

        address: str
        rank_offset: int = 0
        overrides: list[str] = field(default_factory=list)
        warm_up: bool = False

    @dataclass
    class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
        """``update_weights(update_info={"version": N, "phase": ...})``: the version, and
        what to do with it (``UPDATE_PHASES``): ``stream`` it into the running model (the
        default), ``stage`` it into host memory (returns at once; the engine keeps
        serving), wait until it is ``staged`` (fails if the stage did), or ``commit`` the
        staged version into the model."""

        version: int
        phase: str = "stream"
        #: ``stream``/``commit``: the version may leave parameters as they are (otherwise a
        #: parameter it left unwritten fails the update)
        partial: bool = False
        #: ``staged``: how long to wait for the stage (the call holds the engine's loop)
        wait_s: float = 60.0

        def __post_init__(self) -> None:
            if self.phase not in UPDATE_PHASES:
                raise ValueError(
                    f"weightsync: phase={self.phase!r}: expected one of {', '.join(UPDATE_PHASES)}"
                )

    class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
        """vLLM weight-transfer engine ``weightsync``: one ``update_weights`` call receives a
        whole version through weightsync and reloads it in place (layerwise), so
        ``start_weight_update`` and ``finish_weight_update`` have nothing to do."""

        init_info_cls = WeightsyncInitInfo
        update_info_cls = WeightsyncUpdateInfo
        supports_draft_weight_update = False

        def __init__(
            self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
        ) -> None:
            super().__init__(config, vllm_config, device, model)
            self.state = ReplicaReceiver()
            self.state.derive = lambda specs: derive_slices(self.model, self.vllm_config, specs)

        def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
            import torch.distributed as dist

            local = dist.get_rank() if dist.is_initialized() else 0  # this worker in its replica
            self.state.open(
                init_info.address, init_info.rank_offset + local, init_info.overrides, init_info.warm_up
            )

        def start_weight_update(self) -> None:
            pass

        def finish_weight_update(self) -> None:
            pass

        def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
            import torch.distributed as dist
            from vllm.model_executor.model_loader.reload.inplace import reload_weights

            local = dist.get_rank() if dist.is_initialized() else 0
            where = _where(self.state, local)

            def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
                try:
                    with (
                        checked_load(self.model, self.vllm_config, where=where, partial=update_info.partial),
                        cpu_experts_repacked(self.model, self.vllm_config),
                    ):
                        reload_weights(
                            self.vllm_config,
                            self.model,
                            weights_iterator=weights,
                            weights_path=None,
                            is_checkpoint_format=True,
                        )
                except BaseException:
                    finalize_reload(self.model, self.vllm_config)
                    raise
                reprocess_tied(self.model, self.vllm_config)

            version, phase = update_info.version, update_info.phase
            if phase == "stage":
                self.state.stage(version)
                return
            if phase == "staged":
                status = self.state.staged(update_info.wait_s)
                if status["staging"] or status["staged"] != version:
                    why = "still staging" if status["staging"] else status.get("stage_error") or "not staged"
                    raise RuntimeError(f"weightsync: version {version} is not staged: {why}")
                return
            vet = None if update_info.partial else full_version_vet(self.model, self.vllm_config)
            status = (
                self.state.commit(version, reload, vet)
                if phase == "commit"
                else self.state.receive(version, reload, vet)
            )
            if not status["ok"]:
                raise RuntimeError(f"weightsync: version {version} failed: {status['error']}")

        def shutdown(self) -> None:
            self.state.close()

    return WeightsyncInitInfo, WeightsyncUpdateInfo, WeightsyncTransferEngine


#: vLLM's trainer side (``weightsync.integrations.vllm_trainer``), re-exported here
_TRAINER_NAMES = ("WeightsyncTrainerInitInfo", "WeightsyncTrainerEngine", "TrainerRoundError")


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:  # imported on first use: it imports vLLM
        from weightsync.integrations import vllm_trainer

        return getattr(vllm_trainer, name)
    engine_names = ("WeightsyncInitInfo", "WeightsyncUpdateInfo", "WeightsyncTransferEngine")
    if name in engine_names:  # any other name is not here: asking must not import vLLM
        return dict(zip(engine_names, _engine_classes()))[name]
    raise AttributeError(name)


#: vLLM's weight-transfer calls that wait for a transfer (for the sender's warm-up, or a
#: version): the engine core waits idle for them too where weightsync is the backend
_TRANSFER_CALLS = ("init_weight_transfer_engine", "update_weights")


def _idle_waits_for_weightsync_calls() -> None:
    """Make the engine core wait for the workers' answer to a ``weightsync_*`` call (and
    to vLLM's weight-transfer calls with weightsync as their backend) without spinning
    (idempotent).

    vLLM's engine core reads its workers' answers from a shared-memory queue that spins
    (``sched_yield``) for 1 s after its last read (``SpinCondition.busy_loop_s``): right for
    a model step, but an update lasts longer, and where the replicas share the trainer's
    cores (the CPU backend) the spinning engine cores take the cores the transfer and the
    workers' loading need. During our calls the queues wait on their notification socket
    instead (every write notifies); the model's steps keep spinning as before.
    """
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError:
        return
    original = MultiprocExecutor.collective_rpc
    if getattr(original, "weightsync_idle", False):
        return

    def ours(executor: Any, method: Any) -> bool:
        if not isinstance(method, str):
            return False
        transfer = getattr(getattr(executor, "vllm_config", None), "weight_transfer_config", None)
        return method.startswith("weightsync_") or (
            method in _TRANSFER_CALLS and getattr(transfer, "backend", None) == BACKEND_NAME
        )

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if not ours(self, method) or kwargs.get("non_block"):
            return original(self, method, *args, **kwargs)
        waits = [
            c
            for mq in getattr(self, "response_mqs", None) or ()
            # vLLM 0.32's queue has no public handle on its spin: see DEVELOPERS.md, "Private APIs"
            if hasattr(c := getattr(mq, "_spin_condition", None), "busy_loop_s")
        ]
        spins = [c.busy_loop_s for c in waits]
        for c in waits:
            c.busy_loop_s = 0
        try:
            return original(self, method, *args, **kwargs)
        finally:
            for c, s in zip(waits, spins):
                c.busy_loop_s = s

    collective_rpc.weightsync_idle = True  # type: ignore[attr-defined]
    MultiprocExecutor.collective_rpc = collective_rpc  # type: ignore[method-assign]


def register() -> None:
    """Register ``weightsync`` in vLLM's weight-transfer engine registries (the workers'
    ``WeightTransferEngineFactory`` and the trainer's ``WeightTransferTrainerFactory``), let
    vLLM's engine core wait idle for our calls (``_idle_waits_for_weightsync_calls``) and
    reset its caches after every call that changed the served weights
    (``vllm_caches.reset_caches_after_updates``); idempotent.

    Run by this module's import and by vLLM's plugin loader (``vllm.general_plugins``) in
    each of vLLM's processes, so workers know the backend before they build their engine.
    The trainer engine is registered by module name (loaded when the factory builds one).
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # vLLM not installed: weightsync's own trainer side does not need it
        return
    # vLLM's register_engine raises ValueError for a name it has (its documented contract;
    # the registry itself is private): ignoring that keeps this idempotent
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, "WeightsyncTransferEngine")
    with contextlib.suppress(ValueError):
        WeightTransferTrainerFactory.register_engine(
            BACKEND_NAME, "weightsync.integrations.vllm_trainer", "WeightsyncTrainerEngine"
        )
    _idle_waits_for_weightsync_calls()
    reset_caches_after_updates(BACKEND_NAME)


register()
