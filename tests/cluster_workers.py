"""Process bodies of the emulated-cluster tests (importable under ``spawn``): each moves
itself onto its host (a network namespace) first, then runs the body it was given."""

import contextlib
import socket
import time

import torch
import workers

from weightsync import EngineConfig, Receiver, Sender
from weightsync.bench.cluster import enter
from weightsync.errors import SyncError
from weightsync.session.channel import Channel


def on_host(netns, body, *args):
    enter(netns)
    body(*args)


def run_failing_then_recovering_sender(host, overrides, num_receivers, queue, go=None):
    """Send version 1 (a receiver dies in it): report ``("failed", seconds, message,
    ranks, when)`` (``when``: ``time.monotonic()`` at the failure, a clock every process of
    this machine shares); then drop receiver 0 and send version 2: report ``("sent", 2)``.
    ``go``: an event to wait for (once listening) before sending."""
    torch.set_num_threads(1)
    with Sender(EngineConfig.from_overrides(overrides), f"{host}:0", num_receivers) as sender:
        queue.put(("listening", sender.address))
        if go is not None:
            go.wait(120)
        t0 = time.monotonic()
        try:
            sender.send(workers.big_weights(1), version=1)
            queue.put(("sent", 1))
        except SyncError as e:
            queue.put(("failed", time.monotonic() - t0, str(e), e.ranks, time.monotonic()))
        sender.remove_receiver(0)
        sender.send(workers.big_weights(2), version=2)
        queue.put(("sent", 2))


def partition_weights(version: int) -> dict[str, torch.Tensor]:
    """64 MiB of bf16 in 32 tensors, different for every version: a sync of it takes about
    a second through a 1 Gbit/s chain, long enough to be cut in the middle."""
    g = torch.Generator().manual_seed(7000 + version)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(32)}


def drifting_weights(version: int) -> dict[str, torch.Tensor]:
    """``partition_weights(1)`` drifting, for delta syncs: from version 2 on, the first 16
    tensors have 3% of their elements redrawn (a sparse delta each), the other 16 are new
    (dense entries of the delta section, 32 MiB: still long enough to be cut mid-transfer)."""
    weights = partition_weights(1)
    if version == 1:
        return weights
    g = torch.Generator().manual_seed(9000 + version)
    for i, name in enumerate(weights):
        t = weights[name].view(-1)
        if i < 16:
            where = torch.randperm(t.numel(), generator=g)[: t.numel() * 3 // 100]
            t[where] = torch.randn(where.numel(), generator=g).to(torch.bfloat16)
        else:
            t.copy_(torch.randn(t.numel(), generator=g).to(torch.bfloat16))
    return weights


def run_commanded_sender(host, overrides, num_receivers, commands, queue, weights="big_weights", trainers=1):
    """A sender that sends each version the test asks for (``("send", v)`` on ``commands``;
    ``("remove", rank)`` drops a receiver, ``("add", rank)`` takes one back; None ends):
    reports ``("sending", v)`` as it starts, then ``("sent", v, seconds, dropped)`` or
    ``("failed", v, seconds, message, ranks)``. ``trainers``: trainer ranks in all (the
    others run ``run_following_trainer``)."""
    torch.set_num_threads(1)
    make = getattr(workers, weights, None) or globals()[weights]
    config = EngineConfig.from_overrides(overrides)
    with Sender(config, f"{host}:0", num_receivers, rank=0, num_trainers=trainers) as sender:
        queue.put(("listening", sender.address))
        while (command := commands.get(timeout=300)) is not None:
            kind, arg = command
            if kind in ("remove", "add"):
                getattr(sender, f"{kind}_receiver")(arg)
                continue
            payload = make(arg)
            queue.put(("sending", arg))
            t0 = time.monotonic()
            try:
                stats = sender.send(payload, version=arg)
                queue.put(("sent", arg, time.monotonic() - t0, stats.dropped))
            except SyncError as e:
                queue.put(("failed", arg, time.monotonic() - t0, str(e), e.ranks))


def run_following_trainer(address, rank, trainers, overrides, num_receivers, versions, queue, weights):
    """Trainer rank ``rank`` > 0 (``sharded``, ``paired``): send each version as rank 0 runs
    it, going on after a failure (rank 0 decides what comes next); reports nothing."""
    torch.set_num_threads(1)
    make = getattr(workers, weights, None) or globals()[weights]
    config = EngineConfig.from_overrides(overrides)
    with Sender(config, address, num_receivers, rank=rank, num_trainers=trainers) as sender:
        for v in versions:
            try:
                sender.send(make(v), version=v)
            except SyncError as e:
                queue.put(("trainer", rank, v, str(e)))


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


def run_rollout_across_hosts(hosts, model_dir, overrides, commands, queue):
    """Real vLLM replicas A (host 1) and B (host 2) behind a ``VLLMRollout`` on host 0.

    Each replica is started while this thread is in its host's namespace, so vLLM's engine
    core and worker (the weightsync receiver) live there; this driver talks to them over
    vLLM's IPC, which no cut reaches: what the cut takes is the replica's network, the path
    of its weights. Each command on ``commands`` is answered on ``queue``:
    ``"update"``: train, update, report ``("updated", report, greedy per replica, trainer's)``;
    ``"cut-update"``: train, start the update and, half the tensors in, report
    ``("streaming",)`` and wait for the test's ``"cut"``; then report ``("failed", seconds
    since the cut, message, report, greedy of the resumed replicas, old greedy, new
    greedy)``. None ends."""
    from transformers import AutoModelForCausalLM

    from weightsync.demo.vllm import (
        PROMPTS,
        replica_greedy,
        start_replica,
        train_until_changed,
        trainer_greedy,
        vllm_environment,
    )
    from weightsync.integrations.replicas.reports import ReplicaUpdateError
    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout
    from weightsync.sources import StateDictSource

    vllm_environment()
    torch.set_num_threads(1)
    llms = {}
    for name, host in (("A", hosts[1]), ("B", hosts[2])):
        enter(host.netns)
        llms[name] = start_replica(model_dir, max_model_len=256)
    enter(hosts[0].netns)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(11)
    pids = {n: llm.collective_rpc("weightsync_status")[0]["pid"] for n, llm in llms.items()}
    replicas = [LLMReplica(llm, n) for n, llm in llms.items()]

    def train():
        before = trainer_greedy(model, PROMPTS, 8)
        target = torch.randint(0, model.config.vocab_size, (8,), generator=gen).tolist()
        train_until_changed(model, optimizer, target, before, 8)
        return before, trainer_greedy(model, PROMPTS, 8)

    class CutMidStream(StateDictSource):
        def tensors(self):
            items = list(super().tensors())
            yield from items[: len(items) // 2]
            queue.put(("streaming",))
            assert commands.get(timeout=60) == "cut"
            self.cut_at = time.monotonic()
            yield from items[len(items) // 2 :]

    version = 0
    with contextlib.ExitStack() as stack:
        for llm in llms.values():  # vLLM leaves its engine processes running unless told
            stack.callback(llm.llm_engine.engine_core.shutdown)
        rollout = stack.enter_context(VLLMRollout(replicas, overrides, address=f"{hosts[0].address}:0"))
        while (command := commands.get(timeout=300)) is not None:
            version += 1
            old, new = train()
            if command == "update":
                report = rollout.update(model, version)
                greedy = {n: replica_greedy(llm, PROMPTS, 8) for n, llm in llms.items()}
                queue.put(("updated", report, greedy, new, pids))
                continue
            source = CutMidStream(dict(model.state_dict()))
            try:
                rollout.update(source, version)
                queue.put(("sent", version))
            except ReplicaUpdateError as e:
                seconds = time.monotonic() - source.cut_at
                greedy = {
                    r.name: replica_greedy(llms[r.name], PROMPTS, 8) for r in e.report.replicas if r.resumed
                }
                queue.put(("failed", seconds, str(e), e.report, greedy, old, new))


class PartitionModel(torch.nn.Module):
    """A model whose parameters are ``partition_weights``' tensors, by name."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(32))
        for layer in self.layers:
            layer.weight = torch.nn.Parameter(
                torch.zeros(1024, 1024, dtype=torch.bfloat16), requires_grad=False
            )


def run_resilient_loader(address, rank, overrides, versions, queue):
    """``workers.run_resilient_receiver`` with ``load_into`` a ``PartitionModel``: a tensor
    that fills a bucket's range lands in its parameter straight from the wire. Reports the
    model's digests after each version (and the base version of a delta sync, else None),
    or the error."""
    torch.set_num_threads(1)
    model = PartitionModel()
    with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
        for v in versions:
            try:
                stats = receiver.load_into(model, version=v)
                digests = {n: workers.digest(t) for n, t in model.state_dict().items()}
                queue.put((rank, v, digests, receiver.version, stats.delta_base))
            except Exception as e:
                queue.put((rank, "error", f"{type(e).__name__}: {e}", receiver.version, v, receiver.torn))
