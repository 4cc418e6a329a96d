"""Delta sync (``delta=auto`` or ``on``): a version sent relative to the base a receiver holds.

The codec (``weightsync.delta``) turns one tensor into a small payload against its base;
this module makes a whole sync of it, as plan-level data: a delta sync is an ordinary plan
over *wire entries* plus a ``DeltaHeader`` saying how each model tensor travels. Engines
still move bytes; they never know a sync is relative.

Wire entries, in plan order:

1. the delta section, one entry per model tensor: the tensor itself (kind DENSE, where no
   delta pays) or its delta payload (1-D uint8, kinds INDEX, BITMASK, GAPS, EMPTY);
2. the dense section, only when some receiver does not hold the base: every tensor that
   travels as a delta above, whole again (named ``<name>@dense``).

A receiver that holds the base (same version, same digest over its bytes) takes the delta
section and skips the dense one; any other receiver skips the deltas and takes the rest,
so both get the version in the same sync. On a broadcast transport every receiver carries
both sections then; a sync where every receiver holds the base carries deltas only.

The sender keeps a base: its copy of the last version some receiver took, in the wire
dtype, in host memory (``SenderBase``); during a sync it also holds the new version's
tensors (references to the source's; copies only where ``wire_dtype`` casts). The base
advances only once a receiver confirmed the new version (its changed tensors copied in, or
where few elements changed, the sync's own deltas applied). Whether a sync tries deltas at
all is ``delta_policy``'s call. Receivers that apply deltas stage the payloads (their size is the
sync's wire bytes) and apply them once every byte arrived and, with ``verify``, the
reconstructed tensors checked, so a delta sync that fails midway leaves their base intact
(not torn) and the next sync can be a delta again.

The stage is one object on each side, under the stage contracts of ``weightsync.stages``:
the sender's ``DeltaSend`` (here) and the receiver's
``weightsync.delta.receive_stage.DeltaReceive``, whose ``Incoming`` routes, stages and applies.
``Sender`` and ``Receiver`` hold no delta rules of their own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.delta.decoder import apply_many
from weightsync.delta.encoder import Encoded, encode
from weightsync.delta.format import Kind
from weightsync.delta.header import DENSE_SUFFIX, DeltaHeader, base_digest
from weightsync.delta.policy import DeltaPolicy, Probe
from weightsync.plan import TensorSpec, as_bytes, make_plan
from weightsync.sources import WeightSource
from weightsync.stages import Answer, Members, Outgoing, SendStage
from weightsync.stats import SyncStats
from weightsync.verify import checksum_fn

log = logging.getLogger("weightsync.delta")

#: at this density or more, the sender's base takes the new version by a copy (memory
#: speed) rather than by applying the deltas (a scattered write per changed element)
COPY_ABOVE = 1 / 128
#: the most bytes of one tensor the probe of a delta sync encodes
PROBE_SLICE = 4 << 20


class _Background:
    """``fn(*args)`` computed in a thread of its own; ``result()`` waits for it."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self.seconds: float | None = None  # how long ``fn`` took, once it returned
        self._thread = threading.Thread(
            target=self._run, args=(fn, args), name="weightsync-digest", daemon=True
        )
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn(*args)
            self.seconds = time.perf_counter() - t0
        except BaseException as e:  # re-raised by result()
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class Encoding:
    """The sender's side of one sync under ``delta`` auto or on."""

    header: DeltaHeader | None  # None: a plain dense sync
    source: WeightSource  # the wire entries, in plan order
    model_bytes: int
    wire_bytes: int
    changed: int = 0
    elements: int = 0

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 1.0


class _Entries(WeightSource):
    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.items = items

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, t) for n, t in self.items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.items)


@dataclass
class SenderBase:
    """The sender's base (its copy of the last version it sent, wire dtype, host memory),
    and the policy (``delta_policy``) that decides when deltas pay."""

    version: int | None = None
    specs: list[TensorSpec] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: receivers known to hold the base (they completed the sync that made it)
    holders: set[int] = field(default_factory=set)
    policy: DeltaPolicy = field(default_factory=DeltaPolicy)
    #: the sync in progress: (version, specs, wire entries of a delta sync, new tensors)
    _pending: tuple | None = None
    _digest: Any = None  # the base's digest, being computed
    _encode_s: float = 0.0  # the sync in progress: seconds spent encoding

    def base_digest(self) -> str:
        """The digest of the base (waits for its computation, started when it advanced)."""
        digest = self._digest.result() if self._digest is not None else None
        assert digest is not None, "no base"
        return digest

    def encode(
        self, source: WeightSource, specs: list[TensorSpec], version: int, receivers: Sequence[int]
    ) -> Encoding:
        """Read ``source`` once and say how the sync travels. The base does not change
        until ``finished`` says some receiver took the version."""
        t0 = time.perf_counter()
        model_bytes = sum(s.nbytes for s in specs)
        relative = (
            self.version is not None
            and self.specs == specs
            and any(r in self.holders for r in receivers)
            and self.policy.trying()
        )
        self._pending, self._encode_s = None, 0.0
        log.debug(
            "version %d may go %s (base %s, holders %s, receivers %s, same specs %s)",
            version,
            "as deltas" if relative else "whole",
            self.version,
            sorted(self.holders),
            list(receivers),
            self.specs == specs,
        )
        items = [(name, t.detach()) for name, t in source.tensors()]
        if not relative:
            return self._whole(version, specs, items, model_bytes)
        assert self.version is not None
        elements = sum(s.numel for s in specs)
        # torch releases the GIL in its kernels: tensors encode on every core at once (each
        # large op also spreads over the intra-op threads; measured faster than either alone).
        workers = os.cpu_count() or 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weightsync-delta") as pool:
            if self.policy.probes():  # would deltas pay? ask a sample
                probe = self._probe(dict(items), pool, workers)
                if not self.policy.go(
                    self.policy.predict(probe, model_bytes, elements) + self._digest_s(), probe
                ):
                    self._encode_s = time.perf_counter() - t0
                    return self._whole(version, specs, items, model_bytes)
            # The codec runs on host tensors (a dense fallback above sends the source's own).
            new = {name: t if t.device.type == "cpu" else t.cpu() for name, t in items}
            names = list(new)
            encoded = list(pool.map(lambda name: encode(self.tensors[name], new[name]), names))
        entries: list[tuple[str, torch.Tensor]] = []
        kinds: list[int] = []
        changed = 0
        for name, enc in zip(names, encoded):
            changed += enc.changed
            kinds.append(int(enc.kind))
            entries.append((name, new[name] if enc.kind == Kind.DENSE else enc.payload))
        header = DeltaHeader(self.version, self.base_digest(), tuple(specs), tuple(kinds), False)
        self._pending = (version, specs, entries, new)
        self._encode_s = time.perf_counter() - t0
        encoding = Encoding(header, _Entries(entries), model_bytes, 0, changed, elements)
        if any(r not in self.holders for r in receivers):
            return self.with_dense(encoding)
        encoding.wire_bytes = sum(t.numel() * t.element_size() for _, t in entries)
        return encoding

    def _probe(self, new: dict[str, torch.Tensor], pool: ThreadPoolExecutor, workers: int) -> Probe:
        """Encode the first ``PROBE_SLICE`` bytes of the tensors, largest first (they are
        most of the bytes), ``workers`` at a time, until the policy's budget is spent (at
        least one batch). Non-contiguous tensors are left out (slicing would copy them);
        only the slices of device tensors come to the host."""
        probe = Probe()
        budget, t0 = self.policy.probe_budget(), time.perf_counter()
        names = sorted(
            (name for name, t in new.items() if t.numel() and t.is_contiguous()),
            key=lambda name: -new[name].numel() * new[name].element_size(),
        )

        def sample(name: str) -> Encoded:
            base, now = self.tensors[name].reshape(-1), new[name].reshape(-1)
            n = max(PROBE_SLICE // now.element_size(), 1)
            return encode(base[:n], now[:n].cpu())

        for at in range(0, len(names), workers):
            for enc in pool.map(sample, names[at : at + workers]):
                probe.bytes += enc.dense_nbytes
                probe.payload += enc.nbytes
                probe.elements += enc.numel
                probe.changed += enc.changed
            probe.seconds = time.perf_counter() - t0
            if probe.seconds >= budget:
                break
        return probe

    def _whole(
        self, version: int, specs: list[TensorSpec], items: list[tuple[str, torch.Tensor]], model_bytes: int
    ) -> Encoding:
        """A dense sync, keeping its version as the next base unless deltas rest (they
        lost lately: no base to keep up until they are probed again)."""
        if self.policy.resting():
            self.version, self.holders = None, set()
        else:
            self._pending = (version, specs, None, dict(items))
        return Encoding(None, _Entries(items), model_bytes, model_bytes)

    def with_dense(self, encoding: Encoding) -> Encoding:
        """The same delta sync with a dense section (for receivers without the base)."""
        header = encoding.header
        assert header is not None and self._pending is not None
        new = self._pending[3]
        entries = list(self._pending[2] or [])
        entries += [
            (s.name + DENSE_SUFFIX, new[s.name])
            for s, k in zip(header.model, header.kinds)
            if k != Kind.DENSE
        ]
        wire = sum(t.numel() * t.element_size() for _, t in entries)
        return Encoding(
            DeltaHeader(header.base_version, header.base_digest, header.model, header.kinds, True),
            _Entries(entries),
            encoding.model_bytes,
            wire,
            encoding.changed,
            encoding.elements,
        )

    def checksums(self, mode: str) -> list[int]:
        """``verify`` checksums of every tensor of the version being sent, in order: what
        receivers must hold once they applied the deltas."""
        checksum = checksum_fn(mode)
        assert checksum is not None and self._pending is not None
        _, specs, _, new = self._pending
        return [checksum(as_bytes(new[s.name])) for s in specs]

    def finished(self, encoding: Encoding, seconds: float | None, ok_ranks: set[int]) -> None:
        # ``seconds``: what the sync's kind cost (encoding, transfer, applying), not set-up
        """After a sync: if any receiver took the version, it becomes the base (held by
        those receivers); else the base stays, and so do its holders (a failed delta sync
        leaves them their base). Also tells the policy what the sync cost, unless it
        failed (``seconds`` None: its time measures the failure, a grace or a deadline)."""
        pending, self._pending = self._pending, None
        digest_s = self._digest_s()  # this base's digest, before a new base replaces it
        if ok_ranks and pending is not None:
            version, specs, entries, new = pending
            header = encoding.header
            if header is None or self.specs != specs:
                for name, t in new.items():
                    self._store(name, t)
            else:  # only what changed: copied, or where little did, the deltas applied
                copy = encoding.density >= COPY_ABOVE
                deltas = []
                for (name, payload), kind in zip(entries or [], header.kinds):
                    if kind == Kind.DENSE or (copy and kind != Kind.EMPTY):
                        self._store(name, new[name])
                    elif kind != Kind.EMPTY:
                        deltas.append((self.tensors[name], kind, payload))
                apply_many(deltas)
            # A version taken again (re-routed around a lost receiver): who held it keeps it.
            kept = self.holders if self.version == version else set()
            self.version, self.specs = version, specs
            # Hashed in the background, while the trainer computes its next step.
            self._digest = _Background(base_digest, specs, self.tensors)
            self.holders = set(ok_ranks) | kept
        if seconds is None:
            return
        if encoding.header is None:
            self.policy.dense_done(seconds)
        elif not encoding.header.dense:  # one with a dense section says nothing of deltas
            wire_fraction = encoding.wire_bytes / max(encoding.model_bytes, 1)
            self.policy.delta_done(seconds, self._encode_s, wire_fraction, encoding.changed, digest_s)

    def _digest_s(self) -> float:
        """What a receiver's base digest costs a delta sync (it hashes its base before taking
        one), as the sender's own digest of the same base took."""
        return (self._digest.seconds or 0.0) if self._digest is not None else 0.0

    def _store(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.detach()
        held = self.tensors.get(name)
        if held is None or held.shape != t.shape or held.dtype != t.dtype:
            held = self.tensors[name] = torch.empty(t.shape, dtype=t.dtype)
        held.copy_(t)
        return held


# ------------------------------------------------------------------ the sender's delta stage
class DeltaSend(SendStage):
    """The sender's delta stage. Under ``delta`` auto or on, ``encode`` reads the version
    once and decides whether it goes whole or as deltas against the base each receiver
    holds (``SenderBase``, ``delta_policy``); the wire entries it returns are what the plan
    layer packs. Under ``delta=off``, or where it cannot apply (a streamed source, more
    than one sending trainer rank), the sync goes as it is."""

    def __init__(self, mode: str, bucket_bytes: int) -> None:
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        #: the last version sent, and the receivers that hold it
        self.base = SenderBase(policy=DeltaPolicy(always=mode == "on"))
        self._input: Outgoing | None = None  # what the sync in progress encoded, and into what
        self._output: Outgoing | None = None
        self._encoding: Encoding | None = None
        self._encode_s = 0.0  # seconds spent encoding (reading the version, computing deltas)

    @property
    def header(self) -> DeltaHeader | None:
        return self._encoding.header if self._encoding is not None else None

    def start(self, members: Members | None) -> None:
        self._input = self._output = self._encoding = None
        self._encode_s = 0.0

    def encode(self, out: Outgoing, members: Members) -> Outgoing:
        """What sync ``out.version`` packs for the receivers. Called before the handshake:
        the plan of a delta sync depends on what changed."""
        if out is self._input and self._output is not None:
            return self._output  # the same sync (with a dense section, if one was asked for)
        self._input, self._encoding, self._encode_s = out, None, 0.0
        if self.mode == "off" or out.plan is None or members.senders > 1:
            self._output = out
            return out
        t0 = time.perf_counter()
        encoding = self.base.encode(out.source, list(out.plan.tensors), out.version, members.receivers)
        self._encode_s = time.perf_counter() - t0
        self._encoding = encoding
        if encoding.header is None:  # whole: the entries the base read, by the source's plan
            self._output = Outgoing(encoding.source, out.plan, out.version)
        else:
            self._output = self._outgoing(encoding, out.version)
        return self._output

    def _outgoing(self, encoding: Encoding, version: int) -> Outgoing:
        """The wire entries of a delta sync: a plan of their own."""
        return Outgoing(encoding.source, make_plan(encoding.source.specs() or [], self.bucket_bytes), version)

    def offer(self, out: Outgoing, members: Members) -> dict[str, Any]:
        """What the sync message carries beside the plan: a delta sync's header."""
        return {"delta": self.header.to_wire()} if self.header is not None else {}

    def answered(self, out: Outgoing, answers: Sequence[Answer], members: Members) -> bool:
        """True when a receiver said it does not hold the base a delta sync without a dense
        section needs: the same sync goes again with one (``encode`` returns it)."""
        header = self.header
        if header is None or header.dense:
            return False
        lacking = [rank for side, rank, reply in answers if side == "receiver" and reply.get("dense") is True]
        if not lacking:
            return False
        assert self._encoding is not None
        log.info(
            "receiver(s) %s do not hold base version %d: version %d goes with a dense section",
            lacking,
            header.base_version,
            out.version,
        )
        self.base.holders -= set(lacking)  # who turned out not to hold the base
        self._encoding = self.base.with_dense(self._encoding)
        self._output = self._outgoing(self._encoding, out.version)
        return True

    def verify_fields(self, mode: str) -> dict[str, Any]:
        """A delta sync's checksums of the tensors receivers reconstruct."""
        return {"tensors": self.base.checksums(mode)} if self.header is not None else {}

    def account(self, stats: SyncStats) -> None:
        """A delta sync's figures in the stats: the encoding's seconds, the model's bytes
        and tensors (the wire's are the transport's), the density and the base."""
        stats.encode_s = self._encode_s  # a version auto sent whole counts its probe here
        if self._encoding is None or self.header is None:
            return
        stats.bytes, stats.tensors = self._encoding.model_bytes, len(self.header.model)
        stats.density, stats.delta_base = self._encoding.density, self.header.base_version

    def finished(self, seconds: float | None, ok_ranks: set[int]) -> None:
        """The base advances where some receiver took the version; the policy learns what
        the sync's kind cost (encoding, transfer and applying: the handshake and a group's
        set-up cost the same either way)."""
        if self._encoding is not None:
            spent = self._encode_s + seconds if seconds is not None else None
            self.base.finished(self._encoding, spent, ok_ranks)
