"""The receiving side of the publisher family (``naive``, ``disk``): take the version the
publisher offers, under the same version rules as over a session, and acknowledge it
through the publisher."""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Publisher
from weightsync.errors import HandshakeError
from weightsync.sinks import ModuleSink, SinkError
from weightsync.state import VersionState
from weightsync.stats import SyncStats


def take(
    publisher: Publisher,
    rank: int,
    version: int | None,
    sink: ModuleSink | None,
    owned: bool,
    state: VersionState,
    config: EngineConfig,
    device: torch.device,
) -> Generator[tuple[str, torch.Tensor], None, SyncStats]:
    """Yield the offered version's tensors (checked against ``sink`` first, where it
    announced its specs), then acknowledge it; returns the sync's stats."""
    start = time.perf_counter()
    offer = publisher.offer(rank, version)
    v = offer.version
    problem = state.refusal(v, offer.force) or offer.refusal(config)
    if problem is None and sink is not None and offer.specs is not None:
        try:
            sink.check(offer.specs)  # before anything is written, as over a session
        except SinkError as e:
            problem = str(e)
    if problem is not None:  # a clean refusal: nothing read, the state stays
        offer.ack("refused", problem)
        raise HandshakeError(f"receiver rank {rank} refused version {v}: {problem}")
    offer.ack("reading")
    stats = SyncStats(v, receivers=1, buckets=offer.parts, handshake_s=time.perf_counter() - start)
    t0 = time.perf_counter()
    try:
        for name, tensor in offer.tensors(device, owned):
            stats.tensors += 1
            stats.bytes += tensor.nbytes
            yield name, tensor
    except BaseException as e:  # a damaged shard, a failed or stopped consumer
        state.failed(v, delivered=stats.tensors > 0)
        what = "stopped early" if isinstance(e, GeneratorExit) else repr(e)
        offer.ack("failed", f"receiver rank {rank} did not complete version {v}: {what}")
        raise
    offer.ack("ok")
    stats.transfer_s = time.perf_counter() - t0
    stats.seconds = time.perf_counter() - start
    state.completed(v)
    return stats
