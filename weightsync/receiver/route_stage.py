"""The receiver's dense route stage: every tensor whole, by the sender's one plan.

The route stage is the first of the receiver's stages (``weightsync.stages``): it makes
``load_into``'s module a sink, reads the plan from the sender's offer, and, in a dense sync,
asks the receiver's ``vet`` hook before anything moves. ``DenseReceive`` serves every
transport but ``sharded`` (``weightsync.receiver.sharded_route.ShardedReceive``: its part of
the route agreed in the handshake).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weightsync.plan import TensorSpec
from weightsync.receiver.admission import agreed_plan
from weightsync.sharding.layout import Box
from weightsync.sinks import ModuleSink
from weightsync.stages import Offered, ReceiveStage
from weightsync.wire.forms import untagged_specs

#: a receive hook's answer: what this receiver keeps of the offered tensors, as a box per
#: tensor name (None: every tensor whole)
Needs = Callable[[Sequence[TensorSpec]], Mapping[str, Box] | None]
#: a check of a dense sync's tensors before anything moves (raising ValueError refuses it)
Vet = Callable[[Sequence[TensorSpec]], None]


class DenseReceive(ReceiveStage):
    """Every tensor whole, by the sender's one plan (every transport but ``sharded``)."""

    def sink(self, module: Any) -> ModuleSink:
        return module if isinstance(module, ModuleSink) else ModuleSink(module)

    def accept(self, offered: Offered) -> None:
        plan, problem = agreed_plan(offered.msg, offered.held, offered.config, offered.max_tensor_bytes)
        if problem is not None:
            raise ValueError(problem)
        offered.plan = plan
        if plan is not None and offered.vet is not None:  # the tensors as the trainer holds them
            offered.vet(untagged_specs(plan))
