"""The sender's quantized-forms stage: each declared tensor quantized once, before the wire.

Receivers declare the forms they hold (``weightsync.wire.forms``) in their answer to the
handshake; the sender keeps each receiver's declaration across syncs and offers every
sync with the forms it serves each receiver (``offer``), so a declaration costs one more
round once, when it is new. The sync's wire entries (``encode``) are then, per tensor, in
the source's order: the tensor as the trainer sends it, where some receiver holds it so,
and for each form some receiver holds it in, its FP8 bytes and scales (quantized on the
trainer's device as the packer pulls them, one tensor ahead in a thread where the source
keeps its tensors; the quantizer's seconds in ``SyncStats.quantize_s``). Where every
receiver holds a tensor in one form, only that form travels: half of bf16's bytes.

Forms need a source that announces its tensors (a module or a state dict) and one trainer
rank that sends (dense backends; ``sharded`` receivers declare forms in their layouts:
``weightsync.quant.sharded``); other syncs with declared forms are refused in the handshake
naming the receiver and the tensor, as is a form the trainer cannot produce.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync.plan import TensorSpec, make_plan
from weightsync.sources import WeightSource
from weightsync.stages import Answer, Members, Outgoing, SendStage
from weightsync.stats import SyncStats
from weightsync.wire.forms import Form, wire_name
from weightsync.wire.fp8 import quantize_blocks


class QuantizedSource(WeightSource):
    """``src``'s tensors with the quantized forms receivers hold (``wanted``: receiver ->
    tensor name -> form), each quantized once however many receivers hold it so."""

    def __init__(
        self, src: WeightSource, specs: Sequence[TensorSpec], wanted: Mapping[int, Mapping[str, Form]]
    ) -> None:
        self.src = src
        self.reiterable = src.reiterable
        self.forms: dict[str, dict[str, Form]] = {}  # tensor name -> tag -> form
        for forms in wanted.values():
            for name, form in forms.items():
                self.forms.setdefault(name, {})[form.tag] = form
        # a tensor goes as the trainer holds it too where some receiver did not declare it
        self.whole = {s.name for s in specs if any(s.name not in forms for forms in wanted.values())}
        self._specs = []
        for spec in specs:
            if spec.name in self.whole:
                self._specs.append(spec)
            for form in self.forms.get(spec.name, {}).values():
                self._specs += form.specs(spec)
        self.seconds = 0.0
        self.quantized = 0

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.seconds, self.quantized = 0.0, 0
        # Where the source keeps its tensors, one ahead: the next is quantized in a thread
        # while the last is packed and sent (over a link the quantizing hides behind the
        # wire); otherwise each tensor only until the next is requested.
        ahead = 1 if self.src.keeps_tensors else 0
        with ThreadPoolExecutor(1, thread_name_prefix="weightsync-quantize") as pool:
            pending: deque[tuple[str, torch.Tensor, list[Any]]] = deque()
            for name, tensor in self.src.tensors():
                pending.append(
                    (name, tensor, [pool.submit(self._quantize, tensor, f) for f in self._of(name)])
                )
                if len(pending) > ahead:
                    yield from self._entries(*pending.popleft())
            while pending:
                yield from self._entries(*pending.popleft())

    def _of(self, name: str) -> list[Form]:
        return list(self.forms.get(name, {}).values())

    def _quantize(self, tensor: torch.Tensor, form: Form) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        out = quantize_blocks(tensor, form.block, ue8m0=form.scale == "ue8m0")
        self.seconds += time.perf_counter() - t0
        self.quantized += 1
        return out

    def _entries(
        self, name: str, tensor: torch.Tensor, quantized: list[Any]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """One tensor's wire entries: itself where some receiver holds it so, then each form's."""
        if name in self.whole:
            yield name, tensor
        for form, pending in zip(self._of(name), quantized):
            q, scales = pending.result()
            yield wire_name(name, form), q
            yield wire_name(form.scale_name, form), scales


def refusal(backend: str, sharded: bool, all_send: bool) -> str | None:
    """Why a sender over ``backend`` serves no forms in a dense sync (None: it does)."""
    if sharded:
        return (
            "over backend 'sharded' a receiver declares its forms in its layout: load_into the module "
            "holding them (docs/quantized.md)"
        )
    if all_send:
        return (
            f"backend {backend!r} sends a share of a dense plan from every trainer rank; quantized "
            "forms go over a dense backend from one, or over sharded (docs/quantized.md)"
        )
    return None


class QuantSend(SendStage):
    """The sender's forms stage across syncs: what each receiver declared, and each sync's
    entries. ``refusal``: why this sender cannot serve forms (None: it can)."""

    def __init__(self, refusal: str | None = None) -> None:
        self.refusal = refusal
        #: receiver rank -> the forms it declared (absent: not heard from yet)
        self.known: dict[int, dict[str, Form]] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._source: QuantizedSource | None = None
        self._encoded: tuple[Outgoing, tuple[int, ...], Outgoing] | None = None  # (input, receivers, output)

    def start(self, members: Members | None) -> None:
        self._encoded = None

    def encode(self, out: Outgoing, members: Members) -> Outgoing:
        """This sync's wire entries and their plan, for the forms the receivers declared."""
        last = self._encoded
        if last is not None and last[0] is out and last[1] == members.receivers:
            return last[2]  # nothing declared since: the same entries
        plan = out.plan
        self._specs = {s.name: s for s in plan.tensors} if plan is not None else {}
        wanted = {r: self.known.get(r, {}) for r in members.receivers}
        self._source = None
        encoded = out
        if plan is not None and any(wanted.values()):
            self._source = QuantizedSource(out.source, plan.tensors, wanted)
            encoded = Outgoing(self._source, make_plan(self._source.specs(), plan.bucket_bytes), out.version)
        self._encoded = (out, members.receivers, encoded)
        return encoded

    def offer(self, out: Outgoing, members: Members) -> dict[str, Any]:
        """The sync message's field: the forms served to each receiver (when any are)."""
        served = {str(r): {n: f.tag for n, f in self.known.get(r, {}).items()} for r in members.receivers}
        return {"forms": served} if any(served.values()) else {}

    def answered(self, out: Outgoing, answers: Sequence[Answer], members: Members) -> bool:
        """Take a round's answers; True when a receiver declared forms other than those
        offered (the sync is encoded and offered again). Raises ``ValueError`` naming the
        receiver, the tensor and the form the trainer cannot produce."""
        again = False
        for side, rank, reply in answers:
            if side != "receiver":
                continue
            declared = reply.get("forms")
            if declared is None:
                self.known.setdefault(rank, {})
                continue
            if not isinstance(declared, Mapping):
                raise ValueError(f"receiver rank {rank} declared forms that do not parse: {declared!r}")
            forms = {str(n): Form.from_wire(f) for n, f in declared.items()}
            for name, form in forms.items():
                problem = self._problem(name, form)
                if problem is not None:
                    raise ValueError(
                        f"receiver rank {rank} holds tensor {name!r} as {form.describe()}, which this "
                        f"trainer cannot send: {problem}"
                    )
            self.known[rank] = forms
            again = True
        if again:
            self._encoded = None
        return again

    def _problem(self, name: str, form: Form) -> str | None:
        if self.refusal is not None:
            return self.refusal
        spec = self._specs.get(name)
        if spec is None:
            return (
                "the trainer's source does not announce its tensors (a bare iterator)"
                if not self._specs
                else "the trainer sends no tensor of that name"
            )
        return form.problem(spec)

    def account(self, stats: SyncStats) -> None:
        """The sync's quantizing in the stats."""
        if self._source is not None:
            stats.quantized = self._source.quantized
            stats.quantize_s = self._source.seconds
