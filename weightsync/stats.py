"""``SyncStats``: what one sync moved and how long it took.

Below the session and the engines, so both report in it (a publisher returns one from
``publish``; the session fills one per sync) without importing each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SyncStats:
    """What one sync moved and how long it took."""

    version: int
    tensors: int = 0
    #: the model's bytes in this version
    bytes: int = 0
    #: the bytes the transport carried for the payload: for a dense sync ``bytes`` plus the
    #: buckets' alignment padding, less for a delta sync (``delta`` auto or on), 0 where
    #: nothing travels (``naive``)
    wire_bytes: int = 0
    buckets: int = 0
    receivers: int = 0
    #: from the start to the end of the handshake and of joining the data-plane group
    #: (seconds; a delta sync's encoding and the receivers' base digests included)
    handshake_s: float = 0.0
    #: a delta sync, on the sender: encoding the version against the base, before the
    #: handshake (seconds, part of ``handshake_s``)
    encode_s: float = 0.0
    #: moving the buckets (seconds)
    transfer_s: float = 0.0
    #: the whole sync, from the handshake to the last acknowledgement (seconds)
    seconds: float = 0.0
    #: receivers that got the full plan in this sync's handshake (others got only its hash)
    plan_sent_to: int = 0
    #: model names the sync did not carry (``Receiver.load_into`` only)
    missing: list[str] = field(default_factory=list)
    #: a delta sync: the version its deltas applied to (None: the version went whole)
    delta_base: int | None = None
    #: a delta sync, on the sender: the fraction of elements that changed since the base
    density: float | None = None
    #: ``ipc``, on the sender: payload bytes receivers read straight from the trainer's
    #: tensors, and those staged into its ring first (not shareable, or packed small tensors)
    shared_bytes: int = 0
    staged_bytes: int = 0
    #: quantized forms (``weightsync.quant``), on the sender: tensors quantized for the
    #: receivers that hold them so, and the quantizer's seconds (during ``transfer_s``, one
    #: tensor ahead of the packing in a thread where the source keeps its tensors)
    quantized: int = 0
    quantize_s: float = 0.0
    #: receivers lost in this sync and dropped (``drop_lost_receivers``), on the sender
    dropped: list[int] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """Payload GB/s (10^9 bytes per second) over the whole sync."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}
