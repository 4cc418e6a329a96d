"""``Transfer``: one sync's data plane as a receiver walks it.

engine (buckets off the wire) -> plan (pieces merged: the assembler) -> the stages' intake
(``weightsync.stages.Intake``: what is taken, staged or skipped) -> the consumer; then the
sender's checksums (``verify``), what the intake hands out at the end, and the consumer's
last step (``settle``). It records what it saw
(the buckets received, whether any landed in the consumer's memory, the consumer's error,
the version's problem) and hands the end down to the sync's ``Outcome``
(``weightsync.receiver.outcome``): the acknowledgement and the version state, or the failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Transport
from weightsync.errors import SyncError
from weightsync.plan import Bucket, shortfall
from weightsync.receiver import admission
from weightsync.receiver.link import Agreed
from weightsync.receiver.outcome import Outcome
from weightsync.session.channel import Deadline
from weightsync.sinks import ModuleSink
from weightsync.stats import SyncStats
from weightsync.verify import Checks


class Transfer:
    """The data plane of the ``agreed`` sync, set up to receive by its plan (None: the
    sender announces each bucket's entries as it fills it) into ``sink``, ``landing`` or
    fresh tensors (``owned``). ``stats`` is the sync's, from the handshake's seconds on."""

    def __init__(
        self,
        transport: Transport,
        agreed: Agreed,
        sink: ModuleSink | None,
        *,
        owned: bool,
        landing: Any,
        config: EngineConfig,
        rank: int,
        device: torch.device,
        max_tensor_bytes: int | None,
    ) -> None:
        ch, version, plan, incoming = agreed.channel, agreed.version, agreed.plan, agreed.intake
        self.ch, self.version, self.plan, self.incoming = ch, version, plan, incoming
        self.stats = SyncStats(version, receivers=1, handshake_s=time.perf_counter() - agreed.start)
        self.rank = rank
        self.deadline = Deadline(config.timeout_s, f"in the transfer of version {version}")
        self._refused: list[BaseException] = []  # a streamed tensor the sink cannot take (nothing allocated)
        next_bucket = (
            admission.plan_reader(plan)
            if plan is not None
            else admission.stream_reader(
                ch, incoming.specs, self.deadline, sink, self._refused, config.bucket_bytes, max_tensor_bytes
            )
        )
        self._assembler = incoming.assembler(
            device, sink, owned, landing, plan.buckets if plan is not None else ()
        )
        # the consumer keeps what it gets: staged entries handed out are copies
        self._keep = owned or landing is not None
        # Buckets may land straight in the model's tensors: then whatever came off the wire
        # (a bucket not unpacked, drained ones, a receive cut short) is in the model.
        self.direct = self._assembler.destination is not None
        self._transport = transport
        self._buckets = transport.recv_buckets(next_bucket, self._assembler.landing if self.direct else None)
        self._checks = Checks(config.verify, f"receiver rank {rank}", version)
        #: what the transfer saw
        self.received: list[Bucket] = []
        self.landed = False
        self.consumer_error: BaseException | None = None
        self.problem: str | None = None

    def run(
        self, handed: set[str], settle: Callable[[], None] | None, outcome: Outcome
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The entries as the consumer takes them (names in ``handed``, handed out by an
        earlier attempt of the same version, are skipped; those handed out now are added).
        A consumer's failure or early stop is recorded and the rest drained, then
        ``outcome.ended`` reports the outcome and the consumer's error is raised again; a
        failure of the data plane drops the transport's pending receives and goes to
        ``outcome.failed``, which raises.

        One generator frame from the first bucket to the outcome: a consumer that stops
        early closes it, and the drain and the report must still run in it."""
        stats, incoming, specs = self.stats, self.incoming, self.incoming.specs
        entries = 0  # wire entries unpacked
        try:
            for bucket, buffer in self._buckets:
                self.landed = self.direct
                if self._refused:  # stop before unpacking anything of it, and drain
                    self.consumer_error = self._refused[0]
                    break
                self.received.append(bucket)
                self._checks.add(bucket, buffer)
                stats.wire_bytes += bucket.nbytes
                if self.plan is None:  # streamed: the reader announced new specs
                    incoming.grow()
                lent = self._transport.lends(bucket)
                for name, tensor in self._assembler.unpack(bucket, buffer, lent):
                    entries += 1
                    item = incoming.take(name, tensor, self._keep)
                    if item is None or item[0] in handed:
                        continue
                    self._count(item[1])
                    try:
                        yield item
                        handed.add(item[0])
                    except BaseException as e:  # the consumer failed or stopped early
                        self.consumer_error = e
                        break
                if self.consumer_error is not None:
                    break
            if self.consumer_error is not None:
                for _ in self._buckets:  # keep the transfer going so the sender is not stranded
                    self.landed = self.direct
            elif self._assembler.incomplete or entries != len(specs):
                lacking = shortfall(
                    specs,
                    self.plan.buckets if self.plan is not None else [],
                    (b.index for b in self.received),
                    self._assembler.incomplete,
                )
                raise SyncError(
                    f"version {self.version} ended with {entries} of {len(specs)} tensors: {lacking}"
                )
            sent = self._checks.sent(self.ch, self.deadline)
            if self.consumer_error is None:
                # a relative sync applies its deltas here
                self.problem, items = incoming.finish(sent, self._checks, stats)
                for name, tensor in items:
                    self._count(tensor)
                    try:
                        yield name, tensor.clone() if self._keep else tensor
                    except BaseException as e:
                        self.consumer_error = e
                        break
            if self.consumer_error is None and settle is not None and incoming.consumer_has_all:
                try:
                    settle()  # the consumer's last step
                except Exception as e:
                    self.consumer_error = e
            if self.consumer_error is not None:
                self.problem = f"receiver rank {self.rank} did not complete version {self.version}: {self.consumer_error!r}"
        except Exception as e:
            self._buckets.close()  # let the transport drop its pending receives now
            outcome.failed(e, self.delivered(bool(handed), failed=True))
        stats.buckets = len(self.received)
        outcome.ended(self.problem, self.delivered(), self.consumer_error is not None)
        if self.consumer_error is not None:
            raise self.consumer_error

    def _count(self, tensor: torch.Tensor) -> None:
        self.stats.tensors += 1
        self.stats.bytes += tensor.numel() * tensor.element_size()

    def delivered(self, handed_before: bool = False, failed: bool = False) -> bool:
        """Whether anything of this version reached the consumer (a model loaded in place
        is then torn where the version fails). A failed transfer counts buckets that may
        have landed directly even before the first was seen."""
        arrived = bool(self.received) or (self.direct if failed else self.landed)
        return self.incoming.delivered(arrived, self.stats.tensors > 0 or handed_before)
