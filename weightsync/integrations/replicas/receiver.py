"""One engine worker's weightsync receiver and the version state of the weights it
serves, whatever the engine: the worker side that vLLM's worker extension and
weight-transfer engine (``weightsync.integrations.vllm``) and SGLang's loader
(``weightsync.integrations.sglang_worker``) each hold one of, passing their own reload
(a call that loads ``(name, tensor)`` pairs in checkpoint names into the running model).

Version semantics (reported by ``status`` and after every receive) are the receiver's own
(``weightsync.state``): ``version`` is the version whose weights the replica fully serves.
A sync that fails before any tensor was applied leaves the weights and ``version`` as they
were (``failed_version`` names the attempt). A sync that fails after some tensors were
applied leaves a mix of two versions (the receiver is ``torn``): the status then says
``version`` None and ``mixed`` True until a later sync completes; such a replica should
not serve (the trainer side keeps it paused).

The configuration comes from whoever calls the worker. Keys that would make the replica
import code (``custom_backend_module``) or use a path of its file system
(``engine_kwargs.disk.path``: weights are read there and acknowledgements written) are
refused from that caller unless the replica's own environment sets
``WEIGHTSYNC_ALLOW_REMOTE_CONFIG=1`` (``check_remote_overrides``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.config.keys import ConfigError, canonical_key, flatten, parse_overrides
from weightsync.errors import HandshakeError
from weightsync.integrations.replicas.slices import Slices
from weightsync.integrations.replicas.staging import Reload, Stager
from weightsync.plan import TensorSpec
from weightsync.receiver.landing import LandingPool
from weightsync.receiver.prefetch import receive_into
from weightsync.receiver.receiver import Receiver
from weightsync.receiver.route_stage import Vet
from weightsync.sharding.layout import Box
from weightsync.state import VersionState
from weightsync.verify import named_digests

log = logging.getLogger("weightsync.replica")


class NotTaken(RuntimeError):
    """An update the engine did not wholly take: a tensor its loader wrote nothing of, or
    (a full version) a parameter no tensor wrote. The replica holds what the loader did
    write: a mix of two versions, reported as such."""


#: Set to 1 in a replica's environment to let the remote caller choose the keys below.
REMOTE_CONFIG_ENV = "WEIGHTSYNC_ALLOW_REMOTE_CONFIG"
#: Keys a remote caller may not set (to anything but their default) without that consent.
LOCAL_ONLY_KEYS = {
    "custom_backend_module": "names a module this replica would import",
    "engine_kwargs.disk.path": "names a directory of this replica's file system (weights are read there and "
    "acknowledgements written)",
}


def check_remote_overrides(overrides: list[str] | Mapping[str, Any]) -> None:
    """Refuse configuration from a remote caller that would make this replica import a
    module or use a path of its file system (``LOCAL_ONLY_KEYS``), unless this replica's
    own environment sets ``WEIGHTSYNC_ALLOW_REMOTE_CONFIG=1``. Runs before the
    configuration is built (building it imports ``custom_backend_module``)."""
    if os.environ.get(REMOTE_CONFIG_ENV) == "1":
        return
    items = list(flatten(overrides)) if isinstance(overrides, Mapping) else parse_overrides(list(overrides))
    scratch, default = EngineConfig(), EngineConfig()
    named: dict[str, str] = {}  # key path -> the name the caller used
    for key, value in items:
        try:
            path = canonical_key(key)
        except ConfigError:
            continue  # reported when the configuration is built
        if path in LOCAL_ONLY_KEYS:
            scratch.set(key, value)  # the last value given counts, as when building
            named[path] = key
    for path, key in named.items():
        if scratch.get(path) != default.get(path):
            raise PermissionError(
                f"weightsync: {key}={scratch.get(path)!r} came from the remote caller (weightsync_init / "
                f"init_weight_transfer_engine) and {LOCAL_ONLY_KEYS[path]}; a remote caller may choose it only "
                f"if this replica's own environment sets {REMOTE_CONFIG_ENV}=1"
            )


class ReplicaReceiver:
    """One engine worker's receiver and the version state of the weights it serves.

    Independent of the engine and of how it is called: vLLM's worker extension and
    weight-transfer engine, and SGLang's loader, each hold one and pass their own
    ``reload`` (a call that loads an iterator of checkpoint-format ``(name, tensor)`` into
    the running model).
    """

    def __init__(self) -> None:
        self.receiver: Receiver | None = None
        #: the weights this worker serves; survives a new receiver (a new sender address)
        self.state = VersionState()
        self.last: dict[str, Any] = {}
        #: landing memory of received tensors, kept across versions (and receivers)
        self.pool = LandingPool()
        #: the staging copy of staged updates (``weightsync.integrations.replicas.staging``)
        self.stager = Stager()
        #: LoRA syncs: the adapter's tensors arrive here, then load into the engine's LoRA manager
        #: (vLLM: ``weightsync.integrations.vllm_lora``); its version state is the adapters'
        self.adapter_stager = Stager()
        self.adapter_state = VersionState()
        #: ``backend=sharded``: the boxes this worker keeps, and how to derive them from the
        #: running model (set by whoever holds the worker; used only while nothing else uses
        #: the model: in ``learn_slices`` and streamed syncs, not in a stage)
        self.slices: Slices | None = None
        self.derive: Callable[[list[TensorSpec]], Slices] | None = None
        self._may_derive = False

    def learn_slices(self, specs: list[TensorSpec]) -> dict[str, Any]:
        """Derive (or keep, for the same specs) the boxes this worker keeps; their summary."""
        self._may_derive = True
        try:
            self._needs(specs)
        finally:
            self._may_derive = False
        assert self.slices is not None
        return {**self.slices.summary(), "boxes": {n: b.to_wire() for n, b in self.slices.boxes.items()}}

    def _needs(self, specs: Sequence[TensorSpec]) -> dict[str, Box] | None:
        """``Receiver.needs``: the boxes this worker keeps of the offered tensors; None (every
        tensor whole) where they are not known and cannot be derived now."""
        if self.slices is None or self.slices.specs != tuple(specs):
            if self.derive is None or not self._may_derive:
                log.info("weightsync: the slices of these tensors are not known yet: taking them whole")
                return None
            self.slices = self.derive(list(specs))
        return self.slices.boxes

    def open(
        self, address: str, rank: int, overrides: list[str] | dict[str, Any], warm_up: bool = False
    ) -> dict[str, Any]:
        """Create the receiver. Idempotent for one address/rank. ``overrides`` come from the
        remote caller: see ``check_remote_overrides``.

        ``warm_up``: connect and join the sender's data plane now, while the trainer runs
        ``Sender.warm_up`` (``VLLMRollout`` does), so the first update pays for neither;
        otherwise the receiver connects at the first sync."""
        check_remote_overrides(overrides)
        config = (
            EngineConfig.from_dict(overrides)
            if isinstance(overrides, dict)
            else EngineConfig.from_overrides(list(overrides))
        )
        if self.receiver is not None and (self.receiver.address, self.receiver.rank) != (address, rank):
            self.receiver.close()
            self.receiver = None
        if self.receiver is None:
            self.receiver = Receiver(config, address, rank)
            self.receiver.state = self.state  # one version state for the weights this worker serves
            self.receiver.needs = self._needs
        if warm_up:
            t0 = time.perf_counter()
            self.receiver.warm_up()
            plan = self.receiver.plan  # sent by a sender warmed up with the model
            reserved = 0
            if plan is not None:  # the first version's landing memory, faulted in now
                cfg = self.receiver.config
                reserved = self.pool.reserve(
                    plan, cfg.receive_buckets_in_flight * cfg.bucket_bytes, self.receiver.device
                )
            self.last = {"warm_up_s": time.perf_counter() - t0, "landing_reserved_bytes": reserved}
        return self.status()

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        self.pool.close()

    def _routed(self) -> bool:
        """The backend routes fragments (``sharded``): the receiver puts them together."""
        return self.receiver is not None and getattr(self.receiver.engine_cls, "sharded", False)

    def status(self) -> dict[str, Any]:
        return {
            "rank": self.receiver.rank if self.receiver is not None else None,
            "pid": os.getpid(),
            "version": self.state.serving,
            "failed_version": self.state.failed_version,
            "mixed": self.state.torn,
            **self.last,
            **self.stager.status(),
        }

    def _open_receiver(self) -> Receiver:
        if self.receiver is None:
            raise RuntimeError("weightsync receiver not initialized: call weightsync_init first")
        if self.stager.busy or self.adapter_stager.busy:
            raise RuntimeError("weightsync: a version is being staged; wait for it (weightsync_staged) first")
        return self.receiver

    def stage_adapter(self, version: int) -> dict[str, Any]:
        """Start receiving the LoRA adapter of ``version`` in the background; return at once."""
        self.adapter_stager.begin(self._open_receiver(), version, self.state)
        return self.adapter_status()

    def adapter_status(self) -> dict[str, Any]:
        """The adapter stage's status (``staging`` while it runs) and the adapter version served."""
        return {
            "rank": self.receiver.rank if self.receiver is not None else None,
            "pid": os.getpid(),
            "adapter_version": self.adapter_state.serving,
            **self.adapter_stager.status(),
            **self.adapter_stager.last,
        }

    def load_adapter(self, version: int, load: Reload, wait_s: float = 0.0) -> dict[str, Any]:
        """Wait up to ``wait_s`` for the adapter stage, then load the staged adapter of
        ``version`` through ``load``; the status (``ok``, ``error``)."""
        self.adapter_stager.wait(wait_s)
        self._open_receiver()
        if self.adapter_stager.store.state.serving != version:  # the stage failed: say why
            error = self.adapter_stager.last.get("stage_error") or f"adapter version {version} was not staged"
            return {**self.adapter_status(), "ok": False, "error": error}
        # an adapter is built whole before the engine's manager is touched: a failed load changes nothing
        result = self.adapter_stager.commit(version, load, self.adapter_state, atomic=True)
        return {**self.adapter_status(), **result}

    def stage(self, version: int) -> dict[str, Any]:
        """Start receiving ``version`` into the staging copy in the background (the engine
        keeps serving its weights); return the status at once."""
        self.stager.begin(self._open_receiver(), version, self.state, self.slices)
        # the status now gives the stage's account: the last update's outcome (a failed one
        # would fail the stage's report) is not the stage's; ``mixed`` still tells its effect
        self.last = {}
        return self.status()

    def staged(self, wait_s: float) -> dict[str, Any]:
        """Wait up to ``wait_s`` for the stage in progress; the status (``staging`` while it runs)."""
        self.stager.wait(wait_s)
        return self.status()

    def commit(self, version: int, reload: Reload, vet: Vet | None = None) -> dict[str, Any]:
        """Load the staged ``version`` into the running model; the status (``ok``, ``error``).
        ``vet``: the staged tensors checked first, as ``receive``'s (a refusal loads nothing)."""
        self._open_receiver()
        self.last = self.stager.commit(version, reload, self.state, vet=vet)
        return self.status()

    def receive(self, version: int, reload: Reload, vet: Vet | None = None) -> dict[str, Any]:
        """Receive ``version`` and load it through ``reload``; return the status. ``vet``: the
        offered tensors checked before anything moves (a full version's, ``full_version_vet``).

        Pipelined (``weightsync.receiver.prefetch``): the transfer runs in a background thread ahead
        of ``reload``, and tensors land in this worker's landing arena of
        ``receive_buckets_in_flight`` buckets, reused across versions. Never raises for a
        failed sync: the status says what happened (``ok``, ``error``), so the trainer gets
        every replica's account, not just the first exception.
        """
        self._open_receiver()
        assert self.receiver is not None
        start = time.perf_counter()
        config = self.receiver.config
        allocated = self.pool.allocated_bytes
        self._may_derive = True  # the engine waits for this call: the model is ours
        self.receiver.vet = vet
        try:
            result = receive_into(
                self.receiver,
                version,
                reload,
                pool=None if self._routed() else self.pool,
                in_flight_bytes=config.receive_buckets_in_flight * config.bucket_bytes,
                timeout_s=config.timeout_s,
            )
        finally:
            self._may_derive = False
            self.receiver.vet = None
        error, applied = result.error, result.applied
        stats = self.receiver.last_stats
        if error is not None:
            if not isinstance(error, HandshakeError):  # a refusal leaves the state as it was
                # The receiver recorded the failure already; a model that applied some
                # tensors is a mix whatever the transfer saw.
                self.state.failed(version, delivered=applied > 0)
            log.warning("weightsync: version %s failed after %d tensor(s): %s", version, applied, error)
        self.last = {
            "ok": error is None,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "applied": applied,
            "tensors": stats.tensors if stats is not None and error is None else applied,
            "bytes": stats.bytes if stats is not None and error is None else 0,
            # the buckets this worker's transport handed over (alignment included)
            "wire_bytes": stats.wire_bytes if stats is not None and error is None else 0,
            "seconds": time.perf_counter() - start,
            "load_s": result.load_s,
            "first_s": result.first_s,
            "wait_s": result.wait_s,
            "landing_bytes": self.pool.bytes,
            "landing_allocated_bytes": self.pool.allocated_bytes - allocated,
            "queued_peak_bytes": result.queued_peak_bytes,
            "landing_peak_bytes": result.landing_peak_bytes,
            "landing_wait_s": result.landing_wait_s,
            "landing_copied_bytes": result.landing_copied_bytes,
            "landing_lent_bytes": result.landing_lent_bytes,
        }
        if self._routed():
            slices = self.slices.summary() if self.slices is not None else {"kept_bytes": None}
            self.last |= {
                "kept_bytes": slices["kept_bytes"],
                "whole_tensors": slices.get("whole_tensors", {}),
            }
        return self.status()


def tensor_digests(model: torch.nn.Module) -> dict[str, str]:
    """``dtype|shape|blake2b`` of every tensor in ``model``'s state dict (parameters and
    persistent buffers), by name.

    Non-persistent buffers are left out: they are caches the engine computes for itself
    (rotary tables), which no checkpoint carries and no sync or reload writes. Two engines'
    copies have been seen to differ after a reload from disk (CI, once in many runs)."""
    return named_digests(model.state_dict(keep_vars=True).items())
