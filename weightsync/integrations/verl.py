"""weightsync as a verl checkpoint-engine backend.

Importing this module registers backend ``weightsync`` in verl's
``CheckpointEngineRegistry``. In a verl config::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.integrations.verl
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.transport=auto

verl's ``CheckpointEngineManager`` drives it (``verl/checkpoint_engine/base.py``): every
update it calls ``prepare`` on every actor and rollout worker, the classmethod
``build_topology`` on the driver, ``init_process_group`` everywhere, ``send_weights`` on the
actor ranks and ``receive_weights`` on the rollout workers, then ``finalize``. Here those
per-step calls are idempotent: actor rank 0 keeps one ``weightsync.Sender`` per transport
and each rollout worker one ``weightsync.Receiver``, with their connections, process groups
and buffers, across updates; they are changed only when the topology changes (a rollout
worker added, removed, or moved to another transport by ``auto``), and only once no update
is in flight on that worker: verl's manager gives up at the first failed worker while the
others may still be finishing, so a topology is applied at the next transfer.

Receiver ranks are stable: each engine instance has an id, actor rank 0 reports the
assignment (id -> receiver rank) it holds, and ``build_topology`` keeps it, giving workers
that joined the lowest free ranks; actor rank 0 then adds and removes receivers to match.

Versions: ``global_steps`` is the version; when verl passes None this counts on from the
newest version any rollout worker holds. A version older than one a rollout worker holds
(the trainer resumed from an older checkpoint while rollout kept serving) is sent with
``force=True``: the trainer is authoritative. Rollout workers report the version they hold
in ``prepare``, so this holds across trainer restarts too.

Only weightsync's public API is used: ``EngineConfig``, ``Sender``, ``Receiver``, errors.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from weightsync.config.backends import VERL_BACKEND
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import ConfigError
from weightsync.config.verl import ALL_RANKS_SEND, VerlOptions, parse_verl_kwargs
from weightsync.errors import SyncError
from weightsync.receiver.receiver import Receiver
from weightsync.sender.sender import Sender

try:
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
except ImportError as e:  # pragma: no cover - exercised only without verl
    raise ImportError(
        f"weightsync.integrations.verl needs verl's checkpoint-engine API ({e}); install it with "
        "pip install 'weightsync[verl]' (verl 0.9.1 with uvicorn, fastapi and pyzmq)"
    ) from e

log = logging.getLogger("weightsync.verl")

__all__ = ["WeightsyncCheckpointEngine", "resolve_transport"]

#: what ``auto`` chooses between
_AUTO = ("shm", "nccl")


def _ray_node() -> tuple[str, str]:
    """(node id, node IP) of this process as Ray reports them; outside Ray, the host name
    and the address it resolves to."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address().strip("[]")
    except Exception:
        pass
    host = socket.gethostname()
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        ip = "127.0.0.1"
    return host, ip


def _advertised(address: str, node_ip: str) -> str:
    """The address rollout workers connect to: a sender bound to every interface
    (``host: 0.0.0.0``) is reached at the node IP Ray reports."""
    host, _, port = address.rpartition(":")
    return f"{node_ip}:{port}" if host.strip("[]") in ("", "0.0.0.0", "::") else address


def resolve_transport(transport: str, trainer_node: str, rollout_nodes: list[str]) -> str:
    """The weightsync backend for this topology. ``auto``: ``shm`` when every rollout worker
    runs on the trainer's Ray node (same node id), else ``nccl``. ``shm`` across nodes is
    refused here, before anything starts."""
    away = [i for i, node in enumerate(rollout_nodes) if node != trainer_node]
    if transport == "auto":
        return "nccl" if away else "shm"
    if transport == "shm" and away:
        raise ConfigError(
            f"transport=shm needs every rollout worker on the trainer's node ({trainer_node}), but rollout "
            f"worker(s) {away} run on other Ray nodes ({sorted({rollout_nodes[i] for i in away})}); use "
            "transport=nccl, or transport=auto to pick shm only when they are all local"
        )
    return transport


def _sync_iter(weights: Any, loop: asyncio.AbstractEventLoop | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (a sync or async iterable of ``(name, tensor)``) as a sync iterator, for
    a worker thread; an async one is stepped on ``loop``."""
    if hasattr(weights, "__aiter__"):
        assert loop is not None
        agen = weights.__aiter__()
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(agen.__anext__(), loop).result()
            except StopAsyncIteration:
                return
    else:
        yield from weights


class WeightsyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over ``weightsync.Sender`` / ``Receiver``.

    Args:
        bucket_size: bucket size in bytes (verl passes ``update_weights_bucket_megabytes << 20``).
        is_master: True on actor rank 0, the sender; rollout workers pass nothing.
        **engine_kwargs: ``engine_kwargs.weightsync``: ``transport`` (``nccl`` default,
            ``shm``, ``paired``, ``sharded``, ``mooncake``, ``disk`` or ``auto``), ``host`` (what the sender
            binds and advertises; default: the node IP Ray reports) and any weightsync key
            (``timeout_s``, ``verify``, ``auth_secret``, ``engine_kwargs.nccl.group_name``, ...).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.options: VerlOptions = parse_verl_kwargs(engine_kwargs)
        if bucket_size <= 0:
            raise ConfigError(f"bucket_size={bucket_size}: must be a positive number of bytes")
        self.bucket_size = bucket_size
        self.bucket_mb = max(1, math.ceil(bucket_size / 2**20))
        self.is_master = is_master
        self.id = uuid.uuid4().hex
        candidates = _AUTO if self.options.transport == "auto" else (self.options.transport,)
        self._configs = {t: self._config(t) for t in candidates}  # fails here on a bad key or value
        # sender side (actor ranks)
        self._senders: dict[str, Sender] = {}  # transport -> Sender of this actor rank
        self._members: dict[str, dict[str, int]] = {}  # transport -> {engine id: receiver rank}
        self._version: int | None = None  # version of the last send (attempted)
        self._rollback_warned: set[tuple[int, int]] = set()
        # receiver side (rollout workers)
        self._receiver: Receiver | None = None
        self._receiver_key: tuple[str, str, int] | None = None
        self._held: int | None = None  # version this worker holds (its last complete one)
        # the topology in place (applied from init_process_group's at the next transfer)
        self.rank: int | None = None
        self.world_size: int | None = None
        self._topology: dict[str, Any] | None = None
        self._role: str | None = None  # sender, receiver or drain, from the topology
        self._pending: dict[str, Any] | None = None  # taken by init_process_group, not yet applied
        self._lock: asyncio.Lock | None = None

    def _config(self, transport: str) -> EngineConfig:
        config = EngineConfig()
        config.set("backend", transport)
        config.set("update_weights_bucket_megabytes", self.bucket_mb)
        for key, value in self.options.settings:
            config.set(key, value)
        config.validate()
        return config

    # ------------------------------------------------------------------ verl's per-step calls
    def prepare(self) -> dict[str, Any]:
        """Metadata for ``build_topology``: this engine's id, Ray node, and on actor rank 0
        the sender's address per transport and the receiver ranks it holds. Actor rank 0
        starts listening on the first call; nothing else happens on later calls."""
        node_id, node_ip = _ray_node()
        meta: dict[str, Any] = {
            "id": self.id,
            "node_id": node_id,
            "ip": node_ip,
            "pid": os.getpid(),
            "master": self.is_master,
            "held": self._held,
        }
        if self.is_master:
            host = self.options.host or node_ip
            for transport, config in self._configs.items():
                if transport not in self._senders:
                    self._senders[transport] = Sender(config, f"{host}:0", num_receivers=1, rank=0)
                    self._members[transport] = {}
            meta.update(
                transport=self.options.transport,
                addresses={t: _advertised(s.address, node_ip) for t, s in self._senders.items()},
                members=self._members,
                version=self._version,
            )
        return meta

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Decide the transport, keep receiver ranks stable, and hand every worker its part."""
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size:
            raise ValueError(
                f"metadata of {len(metadata)} workers for {actor_wg_world_size} actor + {rollout_world_size} rollout"
            )
        master = actors[0] if actors else None
        if not master or not master.get("master"):
            raise ValueError(
                "actor rank 0 must be the weightsync sender: construct its engine with is_master=True "
                "(verl's actor workers do: is_master=(rank == 0))"
            )
        transport = resolve_transport(
            master["transport"], master["node_id"], [m["node_id"] for m in rollouts]
        )
        previous = master["members"].get(transport, {})
        ids = [m["id"] for m in rollouts]
        if len(set(ids)) != len(ids):
            raise ValueError("two rollout workers report the same weightsync engine id")
        assignment = {i: previous[i] for i in ids if i in previous}
        free = (r for r in itertools.count() if r not in assignment.values())
        for i in ids:
            if i not in assignment:
                assignment[i] = next(free)
        held = [m["held"] for m in rollouts if m.get("held") is not None]
        workers = [
            {"index": n, "rank": assignment[m["id"]], "node_id": m["node_id"], "ip": m["ip"], "pid": m["pid"]}
            for n, m in enumerate(rollouts)
        ]
        topology = {
            "transport": transport,
            "address": master["addresses"][transport],
            "members": assignment,
            "workers": workers,
            "held": max(held) if held else None,
            "trainers": actor_wg_world_size if transport in ALL_RANKS_SEND else 1,
        }
        if transport in ALL_RANKS_SEND:  # every actor rank sends a share
            actor_ranks = list(range(actor_wg_world_size))
        else:  # actor rank 0 sends, the others only drain their generator
            actor_ranks = [0] + [-1] * (actor_wg_world_size - 1)
        world_size = topology["trainers"] + rollout_world_size
        actor_kwargs = {
            "rank": actor_ranks,
            "world_size": [world_size] * actor_wg_world_size,
            "topology": [topology] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": [assignment[i] for i in ids],
            "world_size": [world_size] * rollout_world_size,
            "topology": [topology] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, topology: dict[str, Any]) -> None:
        """Take this step's topology. It is applied by the next ``send_weights`` /
        ``receive_weights``, once an update still in flight (verl's manager returns at the
        first failure, while other workers may still be finishing theirs) has ended; applying
        a topology already in place changes nothing."""
        self.rank, self.world_size = rank, world_size
        self._pending = topology
        if self.is_master:
            self._role = "sender"
            self._members[topology["transport"]] = dict(topology["members"])  # reported by prepare
        elif self.id in topology["members"]:
            self._role = "receiver"
        elif rank >= 0:  # paired, sharded: actor rank > 0 sends its share, joining rank 0's session
            self._role = "sender"
        else:  # an actor rank that only walks its generator
            self._role = "drain"

    def _apply(self) -> dict[str, Any]:
        """Bring the sender(s) or receiver in line with the newest topology; return it."""
        topology, self._pending = self._pending, None
        if topology is None:
            if self._topology is None:
                raise RuntimeError("weights sent or received before init_process_group")
            return self._topology
        self._topology = topology
        transport, rank = topology["transport"], self.rank
        if self._role == "sender" and self.is_master:
            sender = self._senders[transport]
            if transport in ALL_RANKS_SEND:  # its rank 0 waits for every other actor rank
                sender.num_trainers = topology["trainers"]
            wanted = set(topology["members"].values())
            for r in sorted(wanted - set(sender.receivers)):  # add first: a sync needs a receiver
                sender.add_receiver(r)
            for r in sorted(set(sender.receivers) - wanted):
                sender.remove_receiver(r)
        elif self._role == "sender":
            sender = self._senders.get(transport)
            if sender is None or sender.address != topology["address"] or sender.rank != rank:
                self._close_senders()
                self._senders[transport] = Sender(
                    self._configs[transport],
                    topology["address"],
                    num_receivers=1,
                    rank=rank,
                    num_trainers=topology["trainers"],
                )
        elif self._role == "receiver":
            key = (transport, topology["address"], rank)
            if self._receiver_key != key:
                if self._receiver is not None:
                    self._receiver.close()
                self._receiver = Receiver(self._configs[transport], topology["address"], rank)
                self._receiver_key = key
        return topology

    def _busy(self) -> asyncio.Lock:
        """One update at a time on this engine (created on the actor's event loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def describe(self) -> dict[str, Any]:
        """Where this engine stands, for logs and tests: role, transport, rank, address,
        receiver ranks (sender), versions."""
        topology = self._topology or {}
        sender = self._senders.get(topology.get("transport", "")) if self._role == "sender" else None
        return {
            "role": self._role,
            "transport": topology.get("transport"),
            "rank": self.rank,
            "address": topology.get("address"),
            "receivers": sender.receivers if sender is not None and self.is_master else None,
            "version": self._version,
            "held": self._held,
        }

    def finalize(self) -> None:
        """Nothing to free: connections, groups and buffers persist until the topology changes."""

    # ------------------------------------------------------------------ transfer
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Send one version (``global_steps``, or the next count) to every rollout worker;
        returns verl metrics. Actor ranks that do not send walk the generator (producing
        full tensors is collective among actor ranks)."""
        loop = asyncio.get_running_loop()
        if self._role not in ("sender", "drain"):
            raise RuntimeError("send_weights before init_process_group, or on a rollout worker")
        if self._role == "drain":
            await asyncio.to_thread(lambda: sum(1 for _ in _sync_iter(weights, loop)))
            return {}
        async with self._busy():
            topology = self._apply()
            transport = topology["transport"]
            sender = self._senders[transport]
            held = topology.get("held")
            newest = max((v for v in (self._version, held) if v is not None), default=None)
            if global_steps is None:
                version = 1 if newest is None else newest + 1
            else:
                version = int(global_steps)
            force = newest is not None and version < newest
            if force and self.is_master and (version, newest) not in self._rollback_warned:
                self._rollback_warned.add((version, newest))
                log.warning(
                    "weightsync: the trainer's step went back to %d while version %d was already sent or held by "
                    "rollout workers (resumed from an older checkpoint?); the trainer is authoritative: sending "
                    "version %d with force=True",
                    version,
                    newest,
                    version,
                )
            self._version = version
            try:
                # paired plans the tensors up front, the same on every rank; sharded declares
                # them as every rank's layout (each holds every whole tensor: a balanced share each)
                if transport in ALL_RANKS_SEND:
                    source: Any = await asyncio.to_thread(lambda: dict(_sync_iter(weights, loop)))
                else:
                    source = _sync_iter(weights, loop)
                stats = await asyncio.to_thread(sender.send, source, version, force=force)
            except SyncError as e:
                raise self._explain(e, version, transport) from e
        if not self.is_master:
            return {}
        return {
            "weightsync/bytes": float(stats.bytes),
            "weightsync/seconds": float(stats.seconds),
            "weightsync/gbps": float(stats.gbps),
            "weightsync/version": float(version),
            "weightsync/forced": 1.0 if force else 0.0,
            "weightsync/receivers": float(sender.num_receivers),
            **({"weightsync/rollback_from": float(newest)} if force else {}),
        }

    def _explain(self, error: SyncError, version: int, transport: str) -> SyncError:
        """The weightsync error with verl's view of who failed: receiver rank, rollout
        worker index, Ray node and pid."""
        assert self._topology is not None
        by_rank = {w["rank"]: w for w in self._topology["workers"]}
        blamed = [
            f"receiver rank {r} = rollout worker {by_rank[r]['index']} (pid {by_rank[r]['pid']}, "
            f"node {str(by_rank[r]['node_id'])[:12]}, {by_rank[r]['ip']})"
            for r in error.ranks
            if r in by_rank
        ]
        message = (
            f"weightsync ({transport}{', chosen by auto' if self.options.transport == 'auto' else ''}): update to "
            f"version {version} for {len(by_rank)} rollout worker(s) failed: "
            f"{error}" + (f" [failed: {'; '.join(blamed)}]" if blamed else "")
        )
        explained = type(error)(message, ranks=error.ranks)
        return explained

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` of one version; each tensor is valid until the next item
        (verl's consumers copy them)."""
        if self._role != "receiver":
            raise RuntimeError("receive_weights before init_process_group, or on an actor worker")
        async with self._busy():
            self._apply()
            receiver = self._receiver
            assert receiver is not None
            items = receiver.receive(None if global_steps is None else int(global_steps))
            end = object()
            try:
                while (item := await asyncio.to_thread(next, items, end)) is not end:
                    yield item  # type: ignore[misc]
            except SyncError as e:
                what = global_steps if global_steps is not None else receiver.failed_version
                raise type(e)(
                    f"weightsync: rollout worker (receiver rank {receiver.rank}, pid {os.getpid()}) failed to "
                    f"receive version {what}: {e}",
                    ranks=e.ranks,
                ) from e
            finally:
                await asyncio.to_thread(items.close)  # a consumer that stopped early: drain, report
                if receiver.version is not None:  # what it holds now (after a rollback: the older one)
                    self._held = receiver.version

    # ------------------------------------------------------------------ teardown
    def _close_senders(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()

    def close(self) -> None:
        """Close the sender(s) or the receiver (also done when the engine is collected)."""
        self._close_senders()
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
            self._receiver_key = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


CheckpointEngineRegistry.register(VERL_BACKEND)(WeightsyncCheckpointEngine)
