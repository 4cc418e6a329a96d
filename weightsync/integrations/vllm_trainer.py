"""vLLM's trainer-side RL API with weightsync as the backend.

vLLM 0.32 builds the trainer side of a weight transfer from an init-info class:

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    info = WeightsyncTrainerInitInfo(master_address="10.0.0.1", master_port=29600, world_size=2,
                                     rank=0, overrides=["backend=nccl"])
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient("http://10.0.0.2:8000"), source=ModuleSource(model))
    engine.send_weights()          # one whole round; version counted (or send_weights(version=step))

The server runs with ``--weight-transfer-config '{"backend": "weightsync"}'`` and needs no
other call than vLLM's own: ``init_weight_transfer_engine`` (at ``trainer_init``), then per
round ``start_weight_update``, ``update_weights`` (beside the trainer's transfer) and
``finish_weight_update`` (with the version as ``weight_version``).

This module imports vLLM; ``weightsync.integrations.vllm`` re-exports its two classes and
registers ``WeightsyncTrainerEngine`` in ``WeightTransferTrainerFactory`` (lazily, by name),
so it does not import this module itself: the two stay one-way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.base import WeightSource as VLLMWeightSource

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Transport
from weightsync.engines.registry import get_engine
from weightsync.errors import SyncError
from weightsync.integrations.replicas.replica import within
from weightsync.plan import TensorSpec, dtype_name
from weightsync.sender.sender import Sender
from weightsync.sources import WeightSource, as_source
from weightsync.stats import SyncStats

log = logging.getLogger("weightsync.vllm")

#: The name of weightsync in vLLM's trainer-side registry (the same as the worker side's).
TRAINER_BACKEND = "weightsync"


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """``WeightTransferTrainerFactory.trainer_init(info, client=..., source=...)`` with
    weightsync as the backend. The fields mean what vLLM's ``NCCLTrainerInitInfo``'s do:

    - ``master_address``, ``master_port``: where trainer rank 0's weightsync sender
      listens (the inference workers connect there; port 0 picks a free one);
    - ``world_size``: the trainer ranks that send (1; with ``backend=paired`` or
      ``sharded`` every trainer rank) plus the inference workers that receive (with
      ``sharded``, each worker of a tensor-parallel server takes only its slices, and each
      trainer rank sends its own shards of ``ModuleSource(model)``'s parameters);
    - ``rank`` (keyword): this trainer process; rank 0 sends and drives the client, the
      other ranks only iterate the source (materializing shards is a collective);
    - ``overrides``: any weightsync configuration key (``["backend=shm", "timeout_s=60"]``
      or a dict), validated by ``weightsync.config`` as everywhere (``backend``
      defaults to ``nccl``: Gloo on CPU, HCCL on Ascend). The workers get the
      same configuration, but the shared secret, which each process takes from its own
      ``WEIGHTSYNC_SECRET``.
    """

    backend: ClassVar[str] = TRAINER_BACKEND

    master_address: str
    master_port: int
    world_size: int
    overrides: list[str] | dict[str, Any] = field(default_factory=list)

    def config(self) -> EngineConfig:
        """The weightsync configuration these overrides give (``ConfigError`` names a bad
        key). The backend defaults to ``nccl`` here, not ``naive``: vLLM's workers are
        other processes, which ``naive`` (a hand-over inside one process) cannot reach."""
        base = EngineConfig.from_overrides(["backend=nccl"])
        if isinstance(self.overrides, dict):
            return EngineConfig.from_dict(self.overrides, base=base)
        return EngineConfig.from_overrides(list(self.overrides), base=base)


class TrainerRoundError(SyncError):
    """A ``send_weights`` round that failed; the message names the step (a client call or
    the transfer), the version and the inference side (the client's server or actors)."""

    def __init__(self, message: str, *, version: int, ranks: list[int] | None = None) -> None:
        super().__init__(message, ranks=ranks)
        self.version = version


def describe_client(client: Any) -> str:
    """Who the client talks to, for messages: a server's URL, Ray actors' ids."""
    url = getattr(client, "base_url", None)
    if url:
        return f"vLLM server {url}"
    handles = getattr(client, "handles", None)
    if handles:
        ids = [getattr(getattr(h, "_actor_id", None), "hex", lambda: "?")()[:12] for h in handles]
        return f"vLLM Ray actor{'s' if len(ids) > 1 else ''} {', '.join(ids)}"
    return f"vLLM client {type(client).__name__}"


class _FromVLLMSource(WeightSource):
    """A vLLM ``WeightSource`` as weightsync's source: specs from ``metadata()`` (no
    gather), tensors from a fresh iteration, each materialized once (``full_tensor()``)."""

    def __init__(self, source: VLLMWeightSource) -> None:
        self.source = source

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(m.name, tuple(m.shape), dtype_name(m.dtype)) for m in self.source.metadata()]

    def tensors(self) -> Any:
        for name, tensor in self.source:
            yield name, materialize_full_tensor(tensor).detach()


def _as_weightsync_source(source: Any, sharded: bool = False, form: str = "module") -> WeightSource:
    """``source`` as the sender sends it. Over ``sharded``: each trainer rank's local shards,
    never gathered, of the module itself, so that ``form="checkpoint"`` can name them as the
    checkpoint the engine's loaders take (a Mixtral's fused expert stacks as per-expert
    matrices)."""
    if sharded:
        from weightsync.sharding.agreement import ShardSource

        module = getattr(source, "_module", None)  # vLLM's ModuleSource: the module it wraps
        if isinstance(source, VLLMWeightSource) and not isinstance(module, torch.nn.Module):
            raise ValueError(
                f"backend=sharded sends each rank's local shards: pass ModuleSource(model), the module or a state "
                f"dict, not a {type(source).__name__} (it yields gathered tensors)"
            )
        return ShardSource.of(module if module is not None else source, form=form)
    if isinstance(source, VLLMWeightSource):
        return _FromVLLMSource(source)
    return as_source(source)  # a module or a state dict works too


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """vLLM trainer engine ``weightsync``: one weightsync ``Sender`` per trainer rank.

    ``trainer_init`` (every trainer rank): rank 0 opens the sender at
    ``master_address:master_port`` and calls the client's ``init_weight_transfer_engine``
    beside the sender's warm-up, so every worker connects and joins the data plane before
    the first round. ``send_weights`` (every trainer rank): one round. Every client call
    has the configuration's deadline (``timeout_s``), every wait of the transfer too, and a
    failure raises ``TrainerRoundError`` naming the step, the version and the inference
    side. The next round after a failure reconnects.
    """

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(
        self, *, client: Any, source: Any = None, is_sender: bool = True, config: EngineConfig, sender: Sender
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.config = config
        self.sender = sender
        #: the version of the last round attempted (None before the first)
        self.version: int | None = None
        #: the sender's figures of the last round that completed
        self.last_stats: SyncStats | None = None
        self.where = describe_client(client)
        self._sharded = bool(getattr(get_engine(config.backend), "sharded", False))
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightsync-vllm-trainer")

    @classmethod
    def trainer_init(
        cls, init_info: WeightsyncTrainerInitInfo, *, client: Any, source: Any = None
    ) -> WeightsyncTrainerEngine:
        if source is None:
            raise ValueError(
                "the weightsync trainer engine sends full versions: pass source= "
                "(vLLM's ModuleSource(model), a WeightSource, a module or a state dict)"
            )
        config = init_info.config()
        if config.backend == "naive":
            raise ValueError(
                "backend 'naive' hands tensors over inside one process; vLLM workers are other "
                "processes: use backend=nccl (Gloo on CPU) or another transport"
            )
        engine_cls = get_engine(config.backend)
        all_send = issubclass(engine_cls, Transport) and engine_cls.all_ranks_send
        import torch.distributed as dist

        senders = (dist.get_world_size() if dist.is_initialized() else 1) if all_send else 1
        receivers = init_info.world_size - senders
        if receivers < 1:
            raise ValueError(
                f"world_size={init_info.world_size}: the {senders} trainer rank(s) that send plus at "
                "least one inference worker"
            )
        address = f"{init_info.master_address}:{init_info.master_port}"
        sender = Sender(
            config,
            address,
            num_receivers=receivers,
            rank=init_info.rank,
            num_trainers=senders if all_send else None,
        )
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, config=config, sender=sender
        )
        try:
            engine._rendezvous()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _rendezvous(self) -> None:
        """Every worker joins the sender (and its data plane) in ``init_weight_transfer_engine``
        while the sender warms up beside it; the first failure ends the wait."""
        src = _as_weightsync_source(self.source, self._sharded, self.sender.form)
        if not self.is_sender:
            self.sender.warm_up(src)  # paired: connects this rank to rank 0; else nothing
            return
        # The secret never travels through vLLM's RPC: each worker takes its own WEIGHTSYNC_SECRET.
        flat = {k: v for k, v in self.config.to_flat().items() if k != "auth_secret"}
        init_info = {
            "address": self.sender.address,
            "rank_offset": 0,
            "warm_up": True,
            "overrides": [f"{k}={'null' if v is None else v}" for k, v in flat.items()],
        }
        budget = self.config.timeout_s
        calls = [
            self._pool.submit(
                within,
                lambda: self.client.init_weight_transfer_engine(init_info),
                budget,
                f"init_weight_transfer_engine on {self.where}",
            ),
            self._pool.submit(self.sender.warm_up, src),
        ]
        done, pending = wait(calls, timeout=budget + 10, return_when=FIRST_EXCEPTION)
        failed = [f for f in calls if f in done and f.exception() is not None]
        if failed or pending:
            error = failed[0].exception() if failed else TimeoutError(f"no answer within {budget + 10:.0f} s")
            what = "init_weight_transfer_engine" if not failed or failed[0] is calls[0] else "the warm-up"
            raise TrainerRoundError(
                f"weightsync trainer_init: {what} with {self.where} failed: "
                f"{type(error).__name__}: {self._name(str(error))}",
                version=0,
                ranks=getattr(error, "ranks", None),
            ) from error
        log.info(
            "weightsync: %d worker(s) of %s joined the sender at %s",
            self.sender.num_receivers,
            self.where,
            self.sender.address,
        )

    def send_weights(self, version: int | None = None, *, force: bool = False) -> SyncStats:  # type: ignore[override]
        """One round on every trainer rank: ``start_weight_update``, ``update_weights``
        beside the transfer, ``finish_weight_update(weight_version=str(version))``.

        ``version``: the weight version (default: one more than this engine's last, from
        1). A worker refuses a version older than the one it holds unless ``force`` (a
        restarted trainer that goes back on purpose). Returns the sender's figures (on
        ranks that do not send, a count of the tensors drained). Raises
        ``TrainerRoundError`` naming the step, the version and the inference side.
        """
        version = (self.version or 0) + 1 if version is None else int(version)
        self.version = version
        src = _as_weightsync_source(self.source, self._sharded, self.sender.form)
        if not self.is_sender:  # the others drain (or, with paired, send their share)
            return self.sender.send(src, version, force=force)
        budget = self.config.timeout_s
        self._call("start_weight_update", version, lambda: self.client.start_weight_update())
        t0 = time.perf_counter()
        # update_weights returns when the workers loaded the version: it runs beside the send.
        update: Future = self._pool.submit(self.client.update_weights, {"version": version})
        try:
            stats = self.sender.send(src, version, force=force)  # each of its waits: timeout_s
        except SyncError as e:
            self._fail(
                f"the transfer of version {version} to {self.where} failed: {self._name(str(e))}",
                version,
                e,
                update,
            )
        try:
            update.result(timeout=budget)  # the workers confirmed the version: this answer follows
        except Exception as e:
            self._fail(
                f"update_weights on {self.where} failed for version {version}: {type(e).__name__}: {e}",
                version,
                e,
            )
        self._call(
            "finish_weight_update",
            version,
            lambda: self.client.finish_weight_update(weight_version=str(version)),
        )
        self.last_stats = stats
        log.info("weightsync: version %d reached %s in %.3f s", version, self.where, time.perf_counter() - t0)
        return stats

    def stage_weights(self, version: int | None = None, *, force: bool = False) -> SyncStats:
        """The first half of a staged round, while the server keeps generating (place no
        pause around it): ``update_weights`` with phase ``stage`` (returns at once: each
        worker receives into its staging copy in the background), the transfer, then
        ``update_weights`` with phase ``staged`` (fails unless every worker holds the
        version complete), each call in its own ``start_weight_update`` /
        ``finish_weight_update`` (without a version), so no vLLM round stays open across the
        transfer (a trainer killed meanwhile leaves the server free for the next). A
        failure raises ``TrainerRoundError``; the server serves its weights untouched.
        Then pause, ``commit_weights``, resume."""
        version = (self.version or 0) + 1 if version is None else int(version)
        self.version = version
        src = _as_weightsync_source(self.source, self._sharded, self.sender.form)
        if not self.is_sender:
            return self.sender.send(src, version, force=force)
        self._round(version, {"version": version, "phase": "stage"})
        try:
            stats = self.sender.send(src, version, force=force)
        except SyncError as e:
            # Wait for the workers' stage to end (it failed too), so the next round finds them free.
            with contextlib.suppress(Exception):
                self._round(version, {"version": version, "phase": "staged", "wait_s": self.config.timeout_s})
            self._fail(f"staging version {version} on {self.where} failed: {self._name(str(e))}", version, e)
        self._round(version, {"version": version, "phase": "staged", "wait_s": self.config.timeout_s})
        self.last_stats = stats
        return stats

    def _round(self, version: int, update_info: dict[str, Any], weight_version: str | None = None) -> None:
        """One vLLM weight-update round of a single ``update_weights`` call."""
        self._call("start_weight_update", version, lambda: self.client.start_weight_update())
        self._call(
            f"update_weights ({update_info['phase']})",
            version,
            lambda: self.client.update_weights(update_info),
        )
        self._call(
            "finish_weight_update",
            version,
            lambda: self.client.finish_weight_update(weight_version=weight_version),
        )

    def commit_weights(self, version: int | None = None) -> None:
        """The second half, between the caller's ``/pause`` and ``/resume``: load the staged
        ``version`` (default: the last staged) into the server's model from host memory,
        and make it the server's ``weight_version``."""
        version = self.version if version is None else int(version)
        if version is None:
            raise ValueError("commit_weights: nothing was staged (call stage_weights first)")
        if not self.is_sender:
            return
        self._round(version, {"version": version, "phase": "commit"}, weight_version=str(version))

    def _call(self, method: str, version: int, fn: Any) -> None:
        try:
            within(fn, self.config.timeout_s, f"{method} on {self.where}")
        except Exception as e:
            self._fail(
                f"{method} on {self.where} failed for version {version}: {type(e).__name__}: {e}", version, e
            )

    def _fail(self, message: str, version: int, error: Exception, update: Future | None = None) -> None:
        if update is not None and update.done() and update.exception() is not None:
            message += f" (update_weights: {type(update.exception()).__name__}: {update.exception()})"
        raise TrainerRoundError(
            f"weightsync: {message}", version=version, ranks=getattr(error, "ranks", None)
        ) from error

    def _name(self, message: str) -> str:
        """``receiver rank N`` in a sender error is worker N of the client's engine(s)."""
        for k in range(self.sender.num_receivers):
            message = message.replace(
                f"receiver rank {k} ", f"receiver rank {k} (worker {k} of {self.where}) "
            )
        return message

    def shutdown(self) -> None:
        """Close the sender (telling the workers the session ends); the workers keep serving
        their weights, and a later ``trainer_init`` at any address finds them again."""
        self.sender.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "TRAINER_BACKEND",
    "TrainerRoundError",
    "WeightsyncTrainerEngine",
    "WeightsyncTrainerInitInfo",
    "describe_client",
]
