"""Cutting a host of an emulated cluster (``weightsync.bench.cluster``) in the middle of a
transfer, found on the NICs' counters rather than guessed with a sleep: the transfer is
started, and the host is cut once the watched hosts' NICs show that part of it arrived,
and not all of it (so it is under way, whatever the machine's load)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def cut_mid_transfer(
    cluster,
    host: int,
    start: Callable[[], object],
    *,
    watch: Sequence[int] | None = None,
    arrived: int,
    total: int,
    timeout: float = 60,
) -> float:
    """Call ``start()`` (which sets a transfer going), wait until each of the ``watch`` hosts'
    NICs (default: ``host``'s) received at least ``arrived`` bytes since just before it, then
    cut ``host``. Fails if that takes over ``timeout`` s, or if by the cut a watched host
    received ``total`` bytes (the whole transfer may have arrived: the cut would not be mid-
    transfer; read just after the cut). Returns the moment of the cut (``time.monotonic()``)."""
    watch = [host] if watch is None else list(watch)
    assert arrived < total, (arrived, total)
    before = cluster.counters()
    start()
    end = time.monotonic() + timeout
    while True:
        now = cluster.counters()
        got = {h: now[h]["rx_bytes"] - before[h]["rx_bytes"] for h in watch}
        if all(n >= arrived for n in got.values()):
            break
        assert time.monotonic() < end, f"within {timeout} s the transfer reached the hosts only so far: {got}"
        time.sleep(0.02)
    cluster.cut(host)
    at = time.monotonic()
    now = cluster.counters()  # a cut host receives nothing more
    got = {h: now[h]["rx_bytes"] - before[h]["rx_bytes"] for h in watch}
    assert all(n < total for n in got.values()), (
        f"by the cut the hosts had received {got} bytes: the whole transfer ({total}) may have arrived"
    )
    return at
