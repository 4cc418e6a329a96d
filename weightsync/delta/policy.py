"""When a delta sync pays (``delta=auto``): the sender's cost model.

A delta sync saves wire bytes and spends CPU: encoding reads the whole version and the
base, receivers apply the changes. Whether that pays depends on the link: across hosts it
does, over loopback memory it may not. So the sender measures what each kind of sync costs
(encoding, transfer, applying; not the handshake, the same either way) and, before
committing to a delta sync, predicts it from a *probe*: the first tensors encoded, about
``PROBE`` of the last dense sync's time.

The prediction for the whole version, from the probe:

- encoding: the probe's time, scaled to the model's bytes;
- the wire: the last dense sync's cost times the fraction of the bytes the payloads take;
- applying: the last delta sync's cost per changed element once one was measured, else as
  much as encoding (on the safe side: measured here, receivers applied in about half the
  encoding's time).
- the receivers' base digest (each hashes its base in the handshake of a delta sync, which
  the sync's measured cost leaves out): as long as the sender's own digest of the base took,
  added by the caller to the prediction and to each measured delta sync.

A delta sync goes on while it is predicted (and, once done, measured) to cost no more than
``SLOWER`` times the last dense sync plus ``NOTICE_S``. Otherwise the next ``RETRY_AFTER``
syncs go whole, and keep no base copy (a copy of the model per sync) but for the one before
the next try: the wire or the density may have changed by then. With ``delta=on``
(``always``) none of this applies: deltas go wherever a receiver holds the base.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("weightsync.delta")

#: a delta sync predicted or measured to take longer than this times the last dense one
#: (and NOTICE_S more) sends dense a while. Below NOTICE_S differences are noise, not a verdict.
SLOWER = 1.0
NOTICE_S = 0.1
#: dense syncs before deltas are tried again after they lost
RETRY_AFTER = 8
#: the probe's share of the last dense sync's time (at least one batch of tensors is encoded)
PROBE = 0.05


@dataclass
class Probe:
    """The tensors encoded before a delta sync is committed to."""

    seconds: float = 0.0
    bytes: int = 0  # their dense bytes
    payload: int = 0  # the bytes they travel as (their own where a delta does not pay)
    elements: int = 0
    changed: int = 0


@dataclass
class DeltaPolicy:
    """What each kind of sync cost lately, and whether the next one tries deltas."""

    dense_s: float | None = None  # the last dense sync
    delta_s: float | None = None  # the last delta sync, measured or predicted
    apply_s_per_change: float | None = None  # measured on the last delta sync
    dense_runs: int = 0  # dense syncs since deltas last lost
    #: ``delta=on``: deltas wherever a receiver holds the base, whatever they cost
    always: bool = False

    def probes(self) -> bool:
        """Whether a delta sync is probed before it is committed to (once a dense sync was
        measured to compare with)."""
        return not self.always and self.dense_s is not None

    def probe_budget(self) -> float:
        """Seconds to spend encoding before deciding (0: one batch)."""
        return PROBE * (self.dense_s or 0.0)

    def trying(self) -> bool:
        """Whether the next sync may go as deltas (they did not lose lately)."""
        if self.always or not self._lost():
            return True
        if self.dense_runs >= RETRY_AFTER:
            self.dense_runs = 0
            self.delta_s = None  # forget the verdict: the probe decides afresh
            return True
        return False

    def resting(self) -> bool:
        """Deltas lost lately and the next sync does not try them again: a dense sync then
        keeps no base (it costs a copy of the model); the one before a try does."""
        return not self.always and self._lost() and self.dense_runs < RETRY_AFTER - 1

    def predict(self, probe: Probe, model_bytes: int, elements: int) -> float:
        """A delta sync's cost, from the probe."""
        if not probe.bytes:
            return 0.0
        encode_s = probe.seconds * model_bytes / probe.bytes
        wire_s = (self.dense_s or 0.0) * probe.payload / probe.bytes
        changes = probe.changed * elements / max(probe.elements, 1)
        apply_s = encode_s if self.apply_s_per_change is None else self.apply_s_per_change * changes
        return encode_s + wire_s + apply_s

    def go(self, predicted_s: float, probe: Probe) -> bool:
        """Whether a delta sync predicted to cost ``predicted_s`` goes on; if not, deltas
        count as lost (the next ``RETRY_AFTER`` syncs go whole)."""
        if not self._slower(predicted_s):
            return True
        log.info(
            "a delta sync would take about %.3f s (probe: %.1f MB encoded in %.3f s), a dense one "
            "%.3f s: sending whole",
            predicted_s,
            probe.bytes / 1e6,
            probe.seconds,
            self.dense_s,
        )
        self.delta_s, self.dense_runs = predicted_s, 0
        return False

    def dense_done(self, seconds: float) -> None:
        self.dense_s = seconds
        self.dense_runs += 1

    def delta_done(
        self, seconds: float, encode_s: float, wire_fraction: float, changed: int, digest_s: float = 0.0
    ) -> None:
        """A delta sync (no dense section) took ``seconds``, ``encode_s`` of them encoding,
        and its receivers' base digests about ``digest_s`` more (in the handshake)."""
        self.delta_s = seconds + digest_s
        wire_s = (self.dense_s or 0.0) * wire_fraction
        self.apply_s_per_change = max(seconds - encode_s - wire_s, 0.0) / max(changed, 1)
        if self._slower(self.delta_s):
            log.info(
                "a delta sync took %.3f s (%.3f s of it the receivers' digest), a dense one %.3f s: sending "
                "whole for a while",
                self.delta_s,
                digest_s,
                self.dense_s,
            )
            self.dense_runs = 0

    def _slower(self, seconds: float) -> bool:
        return self.dense_s is not None and seconds > SLOWER * self.dense_s + NOTICE_S

    def _lost(self) -> bool:
        return self.delta_s is not None and self._slower(self.delta_s)
