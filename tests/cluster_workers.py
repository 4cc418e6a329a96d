"""Process bodies of the emulated-cluster tests (importable under ``spawn``): each moves
itself onto its host (a network namespace) first, then runs the body it was given."""

import socket
import time

import torch

from weightsync import EngineConfig, Sender
from weightsync.bench.cluster import enter
from weightsync.session import Channel, SyncError

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


def partition_weights(version: int) -> dict[str, torch.Tensor]:
    """64 MiB of bf16 in 32 tensors, different for every version: a sync of it takes about
    a second through a 1 Gbit/s chain, long enough to be cut in the middle."""
    g = torch.Generator().manual_seed(7000 + version)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(32)}


def run_commanded_sender(host, overrides, num_receivers, commands, queue, weights="big_weights"):
    """A sender that sends each version the test asks for (``("send", v)`` on ``commands``;
    ``("remove", rank)`` drops a receiver; None ends): reports ``("sending", v)`` as it
    starts, then ``("sent", v, seconds)`` or ``("failed", v, seconds, message, ranks)``."""
    torch.set_num_threads(1)
    make = getattr(workers, weights, None) or globals()[weights]
    with Sender(EngineConfig.from_overrides(overrides), f"{host}:0", num_receivers) as sender:
        queue.put(("listening", sender.address))
        while (command := commands.get(timeout=300)) is not None:
            kind, arg = command
            if kind == "remove":
                sender.remove_receiver(arg)
                continue
            payload = make(arg)
            queue.put(("sending", arg))
            t0 = time.monotonic()
            try:
                sender.send(payload, version=arg)
                queue.put(("sent", arg, time.monotonic() - t0))
            except SyncError as e:
                queue.put(("failed", arg, time.monotonic() - t0, str(e), e.ranks))


def run_quiet_listener(host, queue, commands):
    """Accept one connection on ``host`` and hold it open, saying nothing, until told to end."""
    with socket.create_server((host, 0)) as server:
        queue.put(("listening", server.getsockname()[1]))
        conn, _ = server.accept()
        with conn:
            commands.get(timeout=120)


def run_heartbeat_watcher(address, grace_s, queue, commands):
    """Connect to ``address``, probe the connection with ``grace_s`` and report
    ``(seems_silent, unheard_s)`` each time the test asks (any item on ``commands``; None ends)."""
    ch = Channel(socket.create_connection(address, timeout=10), "listener")
    ch.probe(grace_s)
    while commands.get(timeout=120) is not None:
        queue.put((ch.seems_silent(), ch.unheard_s()))
    ch.close()
