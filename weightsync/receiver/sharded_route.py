"""``ShardedReceive``: the receiver's route stage of ``backend=sharded``.

A receiver declares what it keeps (``weightsync.sharding.agreement``): the slices of the
module it loads into (``FragmentSink``), the boxes a ``needs`` hook names (an inference
engine's worker: ``weightsync.integrations.vllm_slices``), or nothing, and then takes every
tensor whole, put back together from its fragments (``Reassembly``). It checks the offered
tensors with the receiver's ``vet`` (before anything moves, as a dense plan is), answers
trainer rank 0's offer with its layout until the offer names it, then computes the route
itself, checks its hash and takes its part: its plan, its links, the rank it forwards to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from weightsync.engines.base import Join
from weightsync.errors import ProtocolError
from weightsync.receiver.sharded_sink import FragmentSink, Reassembly
from weightsync.sharding.agreement import RECEIVER, WHOLE, Agreement, Declared, Part
from weightsync.sharding.layout import Layout
from weightsync.sinks import ModuleSink
from weightsync.stages import Entries, Offered, ReceiveStage
from weightsync.wire.forms import is_tagged


class ShardedReceive(ReceiveStage):
    """A receiver's route stage under ``backend=sharded``."""

    def __init__(self, bucket_bytes: int) -> None:
        self._agreement = Agreement(RECEIVER, bucket_bytes)  # the route last agreed
        self._part: Part | None = None  # this receiver's part of the sync in progress

    def sink(self, module: torch.nn.Module | ModuleSink) -> ModuleSink:
        # the slices this rank keeps: a DTensor's local shard, a plain tensor whole (in the
        # quantized forms a ModuleSink declared)
        if isinstance(module, FragmentSink):
            return module
        if isinstance(module, ModuleSink):
            return FragmentSink(module.module, module.forms)
        return FragmentSink(module)

    def owned(self, owned: bool, landing: Any) -> bool:
        if landing is not None:
            raise ValueError("backend=sharded receives no prefetched landing: use load_into or receive")
        return False  # fragments are copied into whole tensors the consumer owns (``wholes``)

    def accept(self, offered: Offered) -> None:
        msg, sink, needs = offered.msg, offered.sink, offered.needs
        if sink is not None and not isinstance(sink, FragmentSink):
            raise ValueError("backend=sharded lands fragments: pass the module itself to load_into")
        own: Declared = WHOLE
        specs = self._agreement.specs(msg.get("route"))
        if specs is not None and offered.vet is not None:  # the tensors as the trainer ranks hold them
            offered.vet([s for s in specs if not is_tagged(s.name)])
        if sink is not None:
            own = sink.layout(offered.host, specs)
        elif needs is not None:
            if specs is None:  # offered the hash of a route this receiver does not hold
                self._part = None
                offered.fields["resend"] = True
                return
            if (boxes := needs(specs)) is not None:
                own = Layout(dict(boxes), offered.host)
        part, fields = self._agreement.answer(msg.get("route"), int(msg["engine"]["rank"]) - 1, own)
        self._part = part
        offered.fields |= fields
        if part is None:  # the offer lacks this layout: answered with it, offered again
            return
        if sink is not None:
            sink.bind(part)
        offered.plan = part.rank_plan.plan

    def go(self, peer: str, version: int) -> None:
        if self._part is None:
            raise ProtocolError(f"{peer} gave the go of version {version} before the route was agreed")

    def join(self, join: Join) -> Join:
        part = self._part
        if part is None:
            return join
        return dataclasses.replace(join, links=part.links, peer_of=part.peer_of, forward=part.forward)

    def entries(self, entries: Entries) -> Entries:
        """Each tensor handed out once its last fragment arrived (the caller owns it)."""
        whole: Reassembly | None = None
        for name, tensor in entries:
            if whole is None:
                assert self._part is not None  # agreed before the first fragment
                whole = Reassembly(self._part)
                done = [*whole.empty, whole.put(name, tensor)]
            else:
                done = [whole.put(name, tensor)]
            for item in done:
                if item is None:
                    continue
                try:
                    yield item
                except BaseException as e:
                    entries.throw(e)
                    raise
