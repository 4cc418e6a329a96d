"""Process bodies of the emulated-cluster tests (importable under ``spawn``): each moves
itself onto its host (a network namespace) first, then runs the body it was given."""

import time

import torch

from weightsync import EngineConfig, Sender
from weightsync.bench.cluster import enter
from weightsync.session import SyncError

import workers


def on_host(netns, body, *args):
    enter(netns)
    body(*args)


def run_failing_then_recovering_sender(host, overrides, num_receivers, queue):
    """Send version 1 (a receiver dies in it): report ``("failed", seconds, message,
    ranks)``; then drop receiver 0 and send version 2: report ``("sent", 2)``."""
    torch.set_num_threads(1)
    with Sender(EngineConfig.from_overrides(overrides), f"{host}:0", num_receivers) as sender:
        queue.put(("listening", sender.address))
        t0 = time.monotonic()
        try:
            sender.send(workers.big_weights(1), version=1)
            queue.put(("sent", 1))
        except SyncError as e:
            queue.put(("failed", time.monotonic() - t0, str(e), e.ranks))
        sender.remove_receiver(0)
        sender.send(workers.big_weights(2), version=2)
        queue.put(("sent", 2))
