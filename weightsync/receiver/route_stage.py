"""The receiver's route stage: which wire entries this receiver takes and how they land.

The counterpart of ``weightsync.sender.route_stage``. ``Receiver`` chooses one stage when
it is made and reads the same for every transport; it asks the stage, in the order of a
sync:

1. ``sink``: what ``load_into`` lands tensors in (a module by name, or the slices it keeps);
2. ``accept``: from the sender's offer, this receiver's plan and the fields of its ready
   answer (no plan and another round where the offer lacks this receiver's layout);
3. ``agreed`` / ``join``: after the go, whether its part is known, and its links in the
   data plane's ``Join`` record;
4. ``wholes``: the entries as the consumer takes them (fragments put back together into
   whole tensors, where the receiver declared nothing to keep).

``DenseReceive`` takes every tensor whole by the sender's one plan; ``ShardedReceive``
(``weightsync.receiver.sharded_route``) its part of the route agreed in the handshake.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join
from weightsync.plan import Plan, TensorSpec
from weightsync.receiver.admission import agreed_plan
from weightsync.sharding.layout import Box
from weightsync.sinks import ModuleSink

#: a receive hook's answer: what this receiver keeps of the offered tensors, as a box per
#: tensor name (None: every tensor whole)
Needs = Callable[[Sequence[TensorSpec]], Mapping[str, Box] | None]
#: a check of a dense sync's tensors before anything moves (raising ValueError refuses it)
Vet = Callable[[Sequence[TensorSpec]], None]
#: a sync's entries as the session hands them out (a generator: a failing consumer is thrown in)
Entries = Generator[tuple[str, torch.Tensor], None, None]


class ReceiveRoute:
    """The contract, with the dense plan's answers as its defaults (``DenseReceive``)."""

    def sink(self, module: torch.nn.Module | ModuleSink) -> ModuleSink:
        """What ``load_into`` lands tensors in."""
        return module if isinstance(module, ModuleSink) else ModuleSink(module)

    def owned(self, owned: bool, landing: Any) -> bool:
        """``receive``'s arguments as this stage takes them: whether entries are received
        into tensors the consumer may keep. Raises ValueError for what it cannot do."""
        return owned

    def accept(
        self,
        msg: dict[str, Any],
        sink: ModuleSink | None,
        held: Plan | None,
        config: EngineConfig,
        max_tensor_bytes: int | None,
        host: str,
        needs: Needs | None,
    ) -> tuple[Plan | None, str | None, dict[str, Any]]:
        """This receiver's plan of the offered sync (None: streamed, or another round is
        needed), what is wrong with the offer (None: nothing) and the fields of the ready
        answer. May raise ValueError, KeyError or TypeError for an offer that does not parse."""
        plan, problem = agreed_plan(msg, held, config, max_tensor_bytes)
        return plan, problem, {}

    def agreed(self) -> bool:
        """After the go: whether this receiver knows its part of the sync."""
        return True

    def join(self, join: Join) -> Join:
        """This receiver's ``Join`` record with its links (where the stage has any)."""
        return join

    def wholes(self, entries: Entries) -> Iterator[tuple[str, torch.Tensor]]:
        """The received entries as the consumer of ``receive`` takes them."""
        return entries

    def reset(self) -> None:
        """A new session (a restarted sender): nothing agreed carries over."""


class DenseReceive(ReceiveRoute):
    """Every tensor whole, by the sender's one plan (every transport but ``sharded``)."""
