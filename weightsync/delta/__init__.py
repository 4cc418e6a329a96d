"""Delta sync: the exact per-tensor codec (its byte format, encoder and decoder), the header
both sides read with the base digest it carries, when deltas pay (the policy), and the
sender's and the receiver's stage of a delta sync.
"""

from weightsync.delta.decoder import apply, apply_many
from weightsync.delta.encoder import Encoded, encode
from weightsync.delta.format import (
    FORMAT,
    GAP_WIDTHS,
    HEADER,
    HEADER_BYTES,
    INT_OF_SIZE,
    MAGIC,
    Kind,
    flat_ints,
    gap_section_bytes,
    index_dtype,
    index_width,
    indices,
    int_view,
    pad8,
    upper_changed,
)
from weightsync.delta.header import DENSE_SUFFIX, DeltaHeader, base_digest, digest
from weightsync.delta.policy import NOTICE_S, PROBE, RETRY_AFTER, SLOWER, DeltaPolicy, Probe
from weightsync.delta.receive_stage import (
    DeltaReceive,
    Incoming,
    Route,
    apply_staged,
    keep,
    route,
    verify_tensors,
)
from weightsync.delta.send_stage import COPY_ABOVE, PROBE_SLICE, DeltaSend, Encoding, SenderBase

__all__ = [
    "COPY_ABOVE",
    "DENSE_SUFFIX",
    "DeltaReceive",
    "DeltaSend",
    "DeltaHeader",
    "DeltaPolicy",
    "Encoded",
    "Encoding",
    "FORMAT",
    "GAP_WIDTHS",
    "HEADER",
    "HEADER_BYTES",
    "INT_OF_SIZE",
    "Incoming",
    "Kind",
    "MAGIC",
    "NOTICE_S",
    "PROBE",
    "PROBE_SLICE",
    "Probe",
    "RETRY_AFTER",
    "Route",
    "SLOWER",
    "SenderBase",
    "apply",
    "apply_many",
    "apply_staged",
    "base_digest",
    "digest",
    "encode",
    "flat_ints",
    "gap_section_bytes",
    "index_dtype",
    "index_width",
    "indices",
    "int_view",
    "keep",
    "pad8",
    "route",
    "upper_changed",
    "verify_tensors",
]
