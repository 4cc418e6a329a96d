"""``Receiver``: the rollout side of a weight sync.

One path per family, one version state for both (``weightsync.state``). With a transport
backend the receiver joins the sender's session, in phases (``_sync_session``): the sender's
offer (``SenderLink.await_sync``), the handshake (``_accept``: admission's checks, then the
stages of ``weightsync.stages``: the plan, the ready answer, the sync's ``Intake``), the data plane joined, then the transfer
(``weightsync.receiver.transfer``), which hands the end down to the sync's ``Outcome``
(``weightsync.receiver.outcome``: acknowledgement and version state). With a
publisher backend it takes the version the publisher offers and acknowledges it through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from weightsync import platform
from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join, Publisher, Transport
from weightsync.engines.registry import get_engine
from weightsync.errors import (
    HandshakeError,
    PeerLost,
    Rerouted,
    SyncError,
)
from weightsync.plan import Plan, capacity
from weightsync.receiver import admission
from weightsync.receiver.link import Agreed, SenderLink
from weightsync.receiver.outcome import Outcome
from weightsync.receiver.publication import take
from weightsync.receiver.route_stage import Needs, Vet
from weightsync.receiver.stages import receive_stages
from weightsync.receiver.transfer import Transfer
from weightsync.session import reroute
from weightsync.session.channel import Channel, Deadline
from weightsync.sinks import ModuleSink
from weightsync.stages import Intake, Offered
from weightsync.state import VersionState
from weightsync.stats import SyncStats

log = logging.getLogger("weightsync")


class Receiver:
    """The rollout side of a weight sync.

    Args:
        config: engine configuration; must agree with the sender's (backend, bucket size).
        address: the sender's ``host:port``.
        rank: this receiver's index, ``0 .. num_receivers-1``.
        device: device of the transfer buffers (default: this process's accelerator, or CPU).

    State after each sync (``state``, rules in ``weightsync.state``):

    - ``version``: the last version that arrived completely (None before the first); it
      advances only when every tensor of a version arrived (and passed ``verify``);
    - ``failed_version``: the version whose sync failed, if the latest attempt failed;
    - ``torn``: True when that failed sync had already delivered some tensors, so a model
      loaded in place holds a mix of ``version`` and ``failed_version``. A later complete
      sync (a retry of the same version, or a newer one) makes it whole again.

    A version older than ``version`` is refused unless the sender passes ``force=True``.
    Sizes from the wire are checked before memory is taken (``weightsync.plan.WireLimits``):
    a tensor larger than ``max_tensor_bytes`` (default: the memory of this receiver's
    device) is refused, as is a plan whose bucket size differs from ``bucket_bytes``.
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str,
        rank: int,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.address = address
        self.rank = rank
        self.device = platform.local_device(device)
        self.engine_cls = get_engine(config.backend)
        #: which weights this receiver holds (shared by every backend family)
        self.state = VersionState()
        #: the largest tensor accepted from the wire (settable; default: the device's memory)
        self.max_tensor_bytes = platform.device_memory_bytes(self.device)
        self.last_stats: SyncStats | None = None
        self._publisher: Publisher | None = None
        self._transport: Transport | None = None
        if issubclass(self.engine_cls, Publisher):
            self._publisher = self.engine_cls(config, self.device, address)
        else:
            self._transport = self.engine_cls(config, self.device)
        #: the control connection to the sender, and the plan last agreed over it
        self._link = SenderLink(config, address, rank, self._new_session)
        self._receiving: int | None = None  # the version in transfer, for messages
        self._reroutable = False  # the sync in transfer: the sender may route around a lost receiver
        #: which wire entries this receiver takes and how they reach it (``weightsync.stages``)
        self._stages = receive_stages(config, rank, self.engine_cls)
        #: a routing backend, ``receive``: the box kept of each offered tensor (a name left out:
        #: not needed; None, or a hook answering None: all whole), set by a worker
        #: (``weightsync.integrations.vllm_slices``)
        self.needs: Needs | None = None
        #: dense syncs: the offered tensors checked before anything moves (a worker's, ``Vet``)
        self.vet: Vet | None = None

    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def plan(self) -> Plan | None:
        """The plan last agreed with the sender (in a sync, or sent in its warm-up)."""
        return self._link.plan

    @property
    def failed_version(self) -> int | None:
        return self.state.failed_version

    @property
    def torn(self) -> bool:
        return self.state.torn

    # ------------------------------------------------------------------ lifecycle
    def connect(self, reach_s: float | None = None) -> None:
        """Connect to the sender (retrying for ``reach_s`` until it listens, by default for
        ``timeout_s``). ``receive`` calls it."""
        if self._transport is not None:
            self._link.connect(reach_s)

    def _new_session(self) -> None:
        assert self._transport is not None
        self._transport.reset()  # a restarted trainer: a new data plane

    def warm_up(self) -> None:
        """Connect to the sender and join its data plane while it runs ``Sender.warm_up``
        (waiting up to ``timeout_s`` for it), so the first ``receive`` pays for neither.
        Raises ``SyncError`` if the warm-up fails (the first sync then joins as usual)."""
        if self._transport is None:
            return  # a publisher has no session to join
        self._warm(*self._link.await_warmup())

    def _warm(self, ch: Channel, msg: dict[str, Any]) -> None:
        assert self._transport is not None
        self._link.answer_warmup(ch, msg, self._transport, self.max_tensor_bytes, self._join)

    def _join(self, ch: Channel, version: int, info: dict[str, Any], capacity_bytes: int) -> Join:
        """This receiver's ``Join`` record for the data plane ``info`` describes."""
        join = Join(
            version=version,
            rank=int(info["rank"]),
            world_size=int(info["world_size"]),
            senders=int(info.get("senders", 1)),
            capacity=capacity_bytes,
            name=f"receiver rank {self.rank}",
            receiver_rank=self.rank,
            local_host=ch.sock.getsockname()[0],
            sender_host=ch.sock.getpeername()[0],
            watch=self._watch_sender,
        )
        return self._stages.join(join)

    def _watch_sender(self) -> None:
        ch = self._link.channel
        if ch is not None and ch.is_dead(behind=True):  # a streamed sync's announcements may wait unread
            what = f"during the transfer of version {self._receiving}"
            raise PeerLost(ch.gone(what))
        if ch is not None and self._reroutable and (msg := ch.void_until("reroute")) is not None:
            raise Rerouted.said(ch.peer, msg)  # lost downstream of us, or upstream with our data

    def close(self) -> None:
        self._link.reset()
        for engine in (self._transport, self._publisher):
            if engine is not None:
                engine.close()
        self._transport = self._publisher = None

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ public sync API
    def receive(
        self,
        version: int | None = None,
        *,
        owned: bool = False,
        landing: Any = None,
        settle: Callable[[], None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive one weight version, yielding ``(name, tensor)``.

        ``version``: the version expected (a different one fails on both sides); None
        takes whatever the sender sends. A yielded tensor may be a view into a transfer
        buffer: it is valid until the next item is requested, so copy what you keep; or
        pass ``owned=True`` to get tensors you may keep (a large tensor is then received
        straight into a new tensor where the backend allows, not copied twice).
        Stopping early (``break``) drains the rest and marks the version as failed.

        Session transports only (used by ``weightsync.receiver.prefetch``): ``landing``, an object
        whose ``assembler(specs, device, buckets)`` returns the ``Assembler`` to unpack with
        (tensors land in its memory; ``buckets``: the plan's, empty when it streams);
        ``settle``, called after the last tensor was handed out and before the sender is
        told the version arrived: if it raises, the version fails as if the consumer had
        failed (the sender is told).
        """
        if self._publisher is not None:
            return self._take(self._publisher, version, None, owned)
        owned = self._stages.owned(owned, landing)
        return self._stages.entries(self._sync_session(version, None, owned, landing=landing, settle=settle))

    def load_into(self, module: torch.nn.Module | ModuleSink, version: int | None = None) -> SyncStats:
        """Receive one version and copy it in place into ``module`` by name (or into a sink's
        tensors: with ``delta`` on, deltas apply to them in place).

        Checks names, shapes and dtypes against the module before writing anything (when
        the sender's source announced its specs); in a streamed sync, each tensor as it is
        announced, before anything of it is allocated. Names the module has but the sync did
        not carry are logged and listed in ``stats.missing``.
        """
        sink = self._stages.sink(module)
        if self._publisher is not None:
            items = self._take(self._publisher, version, sink, False)
        else:
            items = self._sync_session(version, sink, False)
        for name, tensor in items:
            try:
                sink.load(name, tensor)
            except Exception as e:  # let the sync drain and report, then re-raise here
                items.throw(e)
        stats = self.last_stats
        assert stats is not None
        stats.missing = sink.missing()
        if stats.missing:
            log.warning(
                "receiver rank %d: %d model tensor(s) not carried by version %s: %s",
                self.rank,
                len(stats.missing),
                stats.version,
                ", ".join(stats.missing[:8]),
            )
        return stats

    async def receive_async(self, version: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``receive`` with each blocking step in a worker thread."""
        items = self.receive(version)
        end = object()
        while (item := await asyncio.to_thread(next, items, end)) is not end:
            yield item  # type: ignore[misc]

    async def load_into_async(self, module: torch.nn.Module, version: int | None = None) -> SyncStats:
        """``load_into`` in a worker thread."""
        return await asyncio.to_thread(self.load_into, module, version)

    # ------------------------------------------------------------------ publisher family
    def _take(
        self, publisher: Publisher, version: int | None, sink: ModuleSink | None, owned: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        self.last_stats = yield from take(
            publisher, self.rank, version, sink, owned, self.state, self.config, self.device
        )

    # ------------------------------------------------------------------ transport family
    def _sync_session(
        self,
        version: int | None,
        sink: ModuleSink | None,
        owned: bool,
        landing: Any = None,
        settle: Callable[[], None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """One sync over a session, in phases: the sender's offer, the handshake (plan and
        the stages agreed), the data plane joined, then the transfer and acknowledgement."""
        handed: set[str] = set()  # names handed out in attempts the sender re-routed
        retake = False
        while True:
            try:
                agreed = self._open(version, sink, retake)
                yield from self._transfer(agreed, sink, owned, landing, settle, handed)
                return
            except Rerouted as e:  # the same version again, without a lost receiver
                log.warning("receiver rank %d: %s; taking it again", self.rank, e)
                version, retake = e.version, True

    def _open(self, version: int | None, sink: ModuleSink | None, retake: bool = False) -> Agreed:
        """Wait for the sender's sync, agree on it and join its data plane; returns the
        sync as agreed."""
        transport = self._transport
        assert transport is not None
        ch = self._link.connect()
        try:
            msg = self._link.await_sync(version, self.state.version, self._warm)
            ch = self._link.channel  # joined again where the sender dropped us, or a new sender's
            assert ch is not None
            start = time.perf_counter()  # the sync starts when the sender starts it
            if isinstance(msg.get("version"), int):  # a failed sync's leftovers end before we are ready
                transport.settle(msg["version"], retake)
            v, plan, incoming, msg = self._handshake(ch, msg, version, sink)
            info, self._reroutable = msg["engine"], msg.get("reroute") is True
            transport.connect(self._join(ch, v, info, capacity(plan, self.config.bucket_bytes)), info)
        except HandshakeError:
            raise  # a clean refusal: both sides are between syncs, the connection stays
        except Rerouted as e:  # a receiver lost before the transfer: nothing moved here
            transport.finish(ok=False)  # as the sender does
            try:
                reroute.answer(ch, e.version, False, self.config.timeout_s)
            except SyncError:
                self._link.reset()  # the sender is gone too
                raise
            raise
        except SyncError:
            self._link.reset()
            raise
        except Exception as e:  # a bad engine description, a data plane that cannot be joined
            self._link.reset()
            raise SyncError(
                f"receiver rank {self.rank}: joining the sync from {ch.peer} failed: {type(e).__name__}: {e}"
            ) from e
        return Agreed(ch, v, plan, incoming, self._reroutable, start)

    def _handshake(
        self, ch: Channel, msg: dict[str, Any], version: int | None, sink: ModuleSink | None
    ) -> tuple[int, Plan | None, Intake, dict[str, Any]]:
        """Answer the sync (and, when the sender offers it again, the offer again) until
        the go; returns the version, plan, ``Intake`` and the message agreed on."""
        while True:
            v, plan, intake = self._accept(msg, version, sink)
            go = ch.recv(
                Deadline(self.config.timeout_s, f"for the go of version {v}"), expect=("go", "again")
            )
            if go["type"] == "go":
                self._stages.go(ch.peer, v)  # what the stages asked of the offer must hold
                return v, plan, intake, msg
            msg = ch.recv(Deadline(self.config.timeout_s, f"for version {v} again"), expect="sync")

    def _transfer(
        self,
        agreed: Agreed,
        sink: ModuleSink | None,
        owned: bool,
        landing: Any,
        settle: Callable[[], None] | None,
        handed: set[str],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The data plane (``weightsync.receiver.transfer``), which hands the end to the
        sync's ``Outcome`` (``weightsync.receiver.outcome``): the acknowledgement and the
        version state; a failed transfer explained, routed around where the sender may, or
        reported."""
        assert self._transport is not None
        self._receiving = agreed.version
        transfer = Transfer(
            self._transport,
            agreed,
            sink,
            owned=owned,
            landing=landing,
            config=self.config,
            rank=self.rank,
            device=self.device,
            max_tensor_bytes=self.max_tensor_bytes,
        )
        outcome = Outcome(
            self._link, self._transport, self.state, self.config, self.rank, agreed, transfer.stats
        )
        try:
            yield from transfer.run(handed, settle, outcome)
        finally:
            if outcome.reported:
                self.last_stats = outcome.stats

    def _accept(
        self, msg: dict[str, Any], expected: int | None, sink: ModuleSink | None
    ) -> tuple[int, Plan | None, Intake]:
        """Check the sender's sync message (``weightsync.receiver.admission``, then the
        stages); reply ready with the stages' fields, or error (and raise) naming both
        values. Returns the version, the plan and the sync's ``Intake``."""
        ch = self._link.channel
        assert ch is not None
        v = msg.get("version")
        offered = Offered(
            msg,
            sink,
            self._link.plan,
            self.config,
            self.state,
            self.rank,
            ch.sock.getsockname()[0],
            self.max_tensor_bytes,
            self.needs,
            self.vet,
        )
        intake: Intake | None = None
        try:
            problem = admission.sync_problem(msg, expected, self.state, self.config)
            if problem is None:
                intake = self._stages.accept(offered)
        except (ValueError, TypeError, KeyError) as e:
            problem = str(e)
        deadline = Deadline(self.config.timeout_s, f"answering the sync of version {v}")
        if problem is not None:
            self._link.refuse(problem, deadline)
            raise HandshakeError(f"receiver rank {self.rank} refused version {v}: {problem}")
        assert isinstance(v, int) and intake is not None
        if offered.plan is not None:  # a streamed sync leaves the agreed plan as it was
            self._link.plan = offered.plan
        ch.send({"type": "ready", **offered.fields}, deadline)
        return v, offered.plan, intake
