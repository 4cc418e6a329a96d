"""The receiver's quantized-forms stage: declare the forms it holds, take its own entries.

A receiver answers a sync whose message serves it other forms than it holds (the first
sync, or a module that changed) with its declaration instead of taking the plan, and the
sender offers the sync again encoded for it (``weightsync.quant.send_stage``). Once served,
it takes, of each tensor, the entries of its own form and skips the others: a module
holding ``P`` in FP8 lands ``P@<tag>`` in ``P`` and ``P_scale_inv@<tag>`` in its scales, and
skips ``P`` as the trainer holds it; a receiver without forms skips every tagged entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.errors import ProtocolError
from weightsync.plan import Plan
from weightsync.stages import Entries, Offered, ReceiveStage
from weightsync.wire.forms import Form, is_tagged, offered, wire_name


class QuantReceive(ReceiveStage):
    """A receiver's forms stage: its declaration where the offer does not serve the forms
    its sink holds, the go checked against it, ``receive``'s entries untagged."""

    def __init__(self) -> None:
        self._declared = False  # the answer in progress declared forms

    def accept(self, offered: Offered) -> None:
        fields = accept(offered.msg, offered.rank, offered.plan, offered.sink)
        self._declared = bool(fields)
        if fields:  # the sync comes again, encoded for them: later stages need not check this one
            offered.fields |= fields
            offered.declared = True

    def go(self, peer: str, version: int) -> None:
        served(self._declared, peer, version)

    def entries(self, entries: Entries) -> Entries:
        return untagged(entries)


def accept(msg: Mapping[str, Any], rank: int, plan: Plan | None, sink: Any) -> dict[str, Any]:
    """How receiver ``rank`` (its ``ModuleSink``, or None for ``receive()``) takes the sync
    offered in ``msg``: the ready answer's fields (its declaration, where the sync does not
    serve the forms it holds), and the sink told which entries to skip."""
    forms = sink.forms if sink is not None else {}
    declared = declaration(msg, rank, plan, forms)
    if sink is not None:
        sink.skipped = skipped(plan, forms) if plan is not None and declared is None else set()
    return {"forms": declared} if declared is not None else {}


def served(declared: bool, peer: str, version: int) -> None:
    """The go of a sync to which this receiver declared its forms: a protocol error (the
    sender offers such a sync again, encoded for them, or refuses it)."""
    if declared:
        raise ProtocolError(f"{peer} gave the go of version {version} without the quantized forms declared")


def declaration(
    msg: Mapping[str, Any], rank: int, plan: Plan | None, forms: Mapping[str, Form]
) -> dict[str, Any] | None:
    """The forms to declare in the ready answer (None: the sync serves these ``forms``)."""
    served = offered(msg, rank)
    if served == {n: f.tag for n, f in forms.items()} and (plan is not None or not forms):
        return None
    return {n: f.to_wire() for n, f in forms.items()}


def skipped(plan: Plan, forms: Mapping[str, Form]) -> set[str]:
    """The wire entries of ``plan`` that are not for a receiver holding ``forms``: other
    forms' entries, and a tensor it holds quantized as the trainer holds it."""
    mine = {wire_name(n, f) for n, f in forms.items()} | {wire_name(f.scale_name, f) for f in forms.values()}
    return {s.name for s in plan.tensors if (is_tagged(s.name) and s.name not in mine) or s.name in forms}


def untagged(entries: Entries) -> Entries:
    """``receive()``'s entries without the quantized forms' (a streaming receiver declares
    none: it takes every tensor as the trainer holds it). As the session's own generator:
    what a consumer throws in reaches the session (it drains and tells the sender), and a
    consumer that stops early closes it."""
    try:
        item = next(entries)
        while True:
            if is_tagged(item[0]):
                item = next(entries)
                continue
            try:
                yield item
            except GeneratorExit:
                entries.close()
                raise
            except BaseException as e:  # the consumer's error, thrown into the session
                item = entries.throw(e)
            else:
                item = next(entries)
    except StopIteration:
        return
