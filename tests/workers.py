"""Child-process bodies for the multi-process tests (importable under spawn)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import traceback

import pytest
import torch

from weightsync import EngineConfig, Receiver, Sender, SyncError
from weightsync.plan import TensorSpec, as_bytes
from weightsync.sources import StateDictSource

# The mooncake-transfer-engine-non-cuda wheel (make install-mooncake) runs over TCP here.
# conftest.py skips a test with this marker where the wheel is missing (fails it in CI).
needs_mooncake = pytest.mark.mooncake


def digest(t: torch.Tensor) -> str:
    host = t if t.device.type == "cpu" else t.cpu()  # device tensors: hashed from a host copy
    return (
        f"{t.dtype}|{tuple(t.shape)}|" + hashlib.blake2b(as_bytes(host).numpy(), digest_size=16).hexdigest()
    )


def _check_device(name: str, t: torch.Tensor, device) -> None:
    if device is not None and t.device != torch.device(device):
        raise AssertionError(f"{name!r} arrived on {t.device}, expected {device}")


def make_weights(version: int) -> dict[str, torch.Tensor]:
    """Weights of every kind, different for every version; one larger than a 1 MiB bucket."""
    g = torch.Generator().manual_seed(1000 + version)
    base = torch.randn(96, 64, generator=g)
    return {
        "embed.weight": torch.randn(700, 512, generator=g),  # 1.4 MB > 1 MiB bucket
        "layers.0.norm.weight": torch.randn(512, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv.bias": torch.randn(96, generator=g).half(),
        "layers.0.attn.proj.weight": base.t(),  # non-contiguous
        "layers.0.mlp.fp8": torch.randn(4000, generator=g).to(torch.float8_e4m3fn),
        "layers.0.mask": torch.rand(333, generator=g) > 0.5,
        "layers.0.empty": torch.empty(0, 16),
        "step": torch.tensor(version, dtype=torch.int64),  # scalar
        "lm_head.weight": torch.randn(300, 512, generator=g),
    }


def expected_digests(version: int) -> dict[str, str]:
    return {n: digest(t.contiguous()) for n, t in make_weights(version).items()}


def run_receiver(
    address,
    rank,
    overrides,
    versions,
    queue,
    die_after_tensors=None,
    owned=False,
    keep_going=False,
    die_in_version=None,
    device=None,
    warm_up=False,
):
    """Receive each version and report ``(rank, version, digests, receiver.version)``;
    on error report ``(rank, "error", message, receiver.version)`` and stop (or, with
    ``keep_going``, go on with the next version); ``die_after_tensors`` (in version
    ``die_in_version``, or any): exit abruptly mid-sync. ``owned``: keep every tensor received
    and take the digests only at the end (proving none was overwritten). ``device``: the
    receiver's transfer buffers there, and every tensor must arrive there. ``warm_up``: take
    part in the sender's warm-up first (``Receiver.warm_up``), reported as ``(rank, "warm")``."""
    torch.set_num_threads(1)
    receiver = None
    try:
        receiver = Receiver(EngineConfig.from_overrides(overrides), address, rank, device=device)
        if warm_up:
            receiver.warm_up()
            queue.put((rank, "warm"))
        for v in versions:
            got, kept = {}, {}
            try:
                for name, t in receiver.receive(version=v, owned=owned):
                    _check_device(name, t, device)
                    if owned:
                        kept[name] = t
                    got[name] = digest(t)
                    if (
                        die_after_tensors is not None
                        and len(got) >= die_after_tensors
                        and die_in_version in (None, v)
                    ):
                        os._exit(9)  # a crash in the middle of a sync
            except Exception as e:
                if not keep_going:
                    raise
                queue.put((rank, "error", f"{type(e).__name__}: {e}", receiver.version))
                continue
            if owned:
                got = {name: digest(t) for name, t in kept.items()}
            queue.put((rank, v, got, receiver.version))
    except Exception as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}", receiver.version if receiver else None))
        traceback.print_exc()
    finally:
        if receiver is not None:
            receiver.close()


def run_dying_in_warm_up(address, rank, overrides):
    """A receiver whose process dies the moment the sender's warm-up reaches it."""
    receiver = Receiver(EngineConfig.from_overrides(overrides), address, rank)
    receiver._warm = lambda ch, msg: os._exit(9)  # a crash at that point of the protocol
    receiver.warm_up()


class Small(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(600, 512)  # 1.2 MB > 1 MiB bucket
        self.block = torch.nn.Sequential(torch.nn.Linear(512, 64), torch.nn.LayerNorm(64))
        self.head = torch.nn.Linear(512, 600, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(seed))


def module_digests(module: torch.nn.Module) -> dict[str, str]:
    return {n: digest(t) for n, t in module.state_dict().items()}


def run_module_receiver(address, rank, overrides, versions, queue):
    """Load each version into a ``Small`` model; report ``(rank, version, digests, missing)``,
    or ``(rank, "error", message, receiver.version, receiver.failed_version,
    receiver.torn, digests)`` and go on with the next version."""
    torch.set_num_threads(1)
    model = Small(seed=100 + rank)
    with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
        for v in versions:
            try:
                stats = receiver.load_into(model, version=v)
                queue.put((rank, v, module_digests(model), stats.missing))
            except Exception as e:
                queue.put(
                    (
                        rank,
                        "error",
                        f"{type(e).__name__}: {e}",
                        receiver.version,
                        receiver.failed_version,
                        receiver.torn,
                        module_digests(model),
                    )
                )


def run_sharded_trainer(rank, store_port, address_queue, overrides, num_receivers, versions, result_queue):
    """Trainer rank of a 2-rank FSDP-like job: DTensor parameters sharded over a gloo
    default group; rank 0 sends, rank 1 only drains (full_tensor is a collective)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        config = EngineConfig.from_overrides(overrides)
        with Sender(config, "127.0.0.1:0", num_receivers) as sender:
            if rank == 0:
                address_queue.put(sender.address)
            for v in versions:
                state = {
                    n: distribute_tensor(t.contiguous(), mesh, [Shard(0)])
                    if t.dtype == torch.float32 and t.dim() >= 1
                    else t
                    for n, t in make_weights(v).items()
                }
                stats = sender.send(state, version=v)
                result_queue.put((rank, v, stats.bytes, stats.tensors))
        dist.destroy_process_group()
    except Exception as e:
        result_queue.put((rank, "error", f"{type(e).__name__}: {e}", None))
        traceback.print_exc()


def shared_memory_fds() -> list[str]:
    """This process's open descriptors of shared bucket memory (the shm backend's memfds;
    it never creates named segments in /dev/shm)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "weightsync" in target:
            out.append(target)
    return out


def resources() -> dict[str, float]:
    """This process's open descriptors, shared-memory descriptors among them, threads and
    resident memory (MB)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "shm_fds": len(shared_memory_fds()),
        "threads": len(os.listdir("/proc/self/task")),
        "rss_mb": rss,
    }


def rss_slope(samples: list[dict], key: str = "rss_mb") -> float:
    """How ``resources()`` samples' resident memory (``key``: or another figure) grows, per
    sample: the median of the pairwise slopes (Theil-Sen), so one step (the allocator's, a
    transport's pool started once) does not count as a leak while what is kept every sync
    does."""
    ys = [r[key] for r in samples]
    slopes = sorted((ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys)))
    return slopes[len(slopes) // 2] if slopes else 0.0


def run_resilient_receiver(address, rank, overrides, versions, queue, kill_at=None, device=None, go=None):
    """Like ``run_receiver``, but a failed sync is reported as ``(rank, "error", message,
    receiver.version, attempted, torn)`` and the next version is tried with the same
    ``Receiver``. ``kill_at=(version, n)``: SIGKILL itself after n tensors of that version.
    ``device``: as for ``run_receiver``. ``go``: an event; once started up (imports done),
    report ``(rank, "ready")`` and wait for it before connecting, so a caller can time
    the sync without the process's start-up."""
    import faulthandler
    import signal

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    if go is not None:
        queue.put((rank, "ready"))
        go.wait(120)
    with Receiver(EngineConfig.from_overrides(overrides), address, rank, device=device) as receiver:
        for v in versions:
            got = {}
            try:
                for name, t in receiver.receive(version=v):
                    _check_device(name, t, device)
                    assert name not in got, f"{name} handed out twice in version {v}"
                    got[name] = digest(t)
                    if kill_at == (v, len(got)):
                        os.kill(os.getpid(), signal.SIGKILL)
                queue.put((rank, v, got, receiver.version))
            except Exception as e:
                queue.put((rank, "error", f"{type(e).__name__}: {e}", receiver.version, v, receiver.torn))


def run_receiver_dying_in_the_handshake(address, rank, overrides, version, queue):
    """Load the versions before ``version`` into a copy of ``big_weights``, then SIGKILL
    itself in the handshake of ``version`` (as its sink checks the offered plan: after the
    sync message came, before its answer). Reports each version it took."""
    import signal

    from weightsync.sinks import ModuleSink

    torch.set_num_threads(1)

    class Dying(ModuleSink):
        def check(self, specs):
            if receiver.expected == version:
                os.kill(os.getpid(), signal.SIGKILL)
            super().check(specs)

    model = {n: t.contiguous().clone() for n, t in big_weights(0).items()}
    with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
        for v in range(1, version + 1):
            receiver.expected = v
            receiver.load_into(Dying(model), version=v)
            queue.put((rank, v, {n: digest(t) for n, t in model.items()}, receiver.version))


def run_soak_receiver(address, rank, overrides, versions, queue):
    """Load every version into a ``Small`` model; report its digests and this process's
    resources after each sync."""
    torch.set_num_threads(1)
    model = Small(seed=100 + rank)
    with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
        for v in versions:
            receiver.load_into(model, version=v)
            queue.put((rank, v, module_digests(model), resources()))


def big_weights(version):
    """make_weights plus 48 MB more: a peer can die while most buckets are still to come."""
    g = torch.Generator().manual_seed(version)
    return {**make_weights(version), **{f"extra.{i}": torch.randn(1 << 18, generator=g) for i in range(48)}}


def run_sender(address, overrides, num_receivers, versions, queue):
    """A trainer in its own process (so a test can kill it): send ``big_weights`` for each
    version, reporting ``("listening", address)`` and then ``("sent", version)``."""
    torch.set_num_threads(1)
    with Sender(EngineConfig.from_overrides(overrides), address, num_receivers) as sender:
        queue.put(("listening", sender.address))
        for v in versions:
            sender.send(big_weights(v), version=v)
            queue.put(("sent", v))


def bump_small(model: torch.nn.Module, version: int) -> None:
    """Deterministic new weights for a version, the same in every process."""
    g = torch.Generator().manual_seed(5000 + version)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
        model.count.fill_(version)


def run_paired_trainer(
    address, rank, num_trainers, overrides, num_receivers, versions, queue, weights=None, device=None
):
    """Trainer rank > 0 of the ``paired`` backend: send its share of each version; report
    ``(("trainer", rank), version, bytes sent, buckets sent)``, or an error and go on.
    ``device``: where its transfer buffers live (default: the process's accelerator, or CPU)."""
    torch.set_num_threads(1)
    try:
        config = EngineConfig.from_overrides(overrides)
        with Sender(
            config, address, num_receivers, rank=rank, num_trainers=num_trainers, device=device
        ) as sender:
            for v in versions:
                try:
                    stats = sender.send((weights or make_weights)(v), version=v)
                except SyncError as e:  # rank 0 decides what comes next; follow it
                    queue.put((("trainer", rank), "error", f"{type(e).__name__}: {e}", None))
                    continue
                queue.put((("trainer", rank), v, stats.bytes, stats.buckets))
    except Exception as e:
        queue.put((("trainer", rank), "error", f"{type(e).__name__}: {e}", None))
        traceback.print_exc()


def run_sharded_backend_trainer(
    address, rank, num_trainers, overrides, num_receivers, versions, queue, die_in_version=None
):
    """Trainer rank > 0 of ``sharded``, holding every whole tensor (as verl hands them):
    send its part of each version, report as ``run_paired_trainer`` does (the bytes its
    transport sent, counted on the wire: alignment included); in
    ``die_in_version``, exit abruptly after its third fragment (a crash mid-transfer)."""
    from weightsync.sharding.agreement import Part

    torch.set_num_threads(1)
    fragments = Part.tensors

    def dying(part, shards):
        for i, item in enumerate(fragments(part, shards)):
            if i == 3:
                os._exit(9)
            yield item

    config = EngineConfig.from_overrides(overrides)
    with Sender(config, address, num_receivers, rank=rank, num_trainers=num_trainers) as sender:
        for v in versions:
            Part.tensors = dying if v == die_in_version else fragments
            try:
                stats = sender.send(make_weights(v), version=v)
            except SyncError as e:
                queue.put((("trainer", rank), "error", f"{type(e).__name__}: {e}", None))
                continue
            queue.put((("trainer", rank), v, stats.wire_bytes, stats.buckets))


def slow_weights(version, queue, after=12):
    """``big_weights`` yielded one by one, stalling for a minute after ``after`` tensors
    (reported on ``queue`` as ``("writing", pid)``): a writer to kill mid-write."""
    import time

    for i, item in enumerate(big_weights(version).items()):
        if i == after:
            queue.put(("writing", os.getpid()))
            time.sleep(60)
        yield item


def run_slow_sender(overrides, num_receivers, version, queue):
    """A trainer that stalls in the middle of writing ``version`` (see ``slow_weights``)."""
    from weightsync.sources import IteratorSource

    torch.set_num_threads(1)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", num_receivers) as sender:
        sender.send(IteratorSource(slow_weights(version, queue)), version=version)


# ---------------------------------------------------------------------------- on a GPU (tests/test_cuda.py)
CUDA = "cuda:0"


def cuda_weights(version: int) -> dict[str, torch.Tensor]:
    """``make_weights`` on ``cuda:0`` (strides kept: the transposed one stays non-contiguous)."""
    return {n: t.to(CUDA) for n, t in make_weights(version).items()}


def cuda_big_weights(version: int) -> dict[str, torch.Tensor]:
    """``big_weights`` on ``cuda:0``."""
    return {n: t.to(CUDA) for n, t in big_weights(version).items()}


def run_device_sender(
    overrides, num_receivers, versions, queue, device=CUDA, weights="cuda_weights", rank=0, num_trainers=1
):
    """A trainer in its own process, its transfer buffers on ``device``, sending
    ``weights`` (the name of a function here: ``cuda_weights``, ``cuda_big_weights``, or
    ``make_weights`` for host tensors). In a process of its own so that a device collective
    left hanging dies with it, not with the test. Reports ``("listening", address)``, then per
    version ``("sent", version, stats)`` or ``("failed", version, message, ranks, seconds)``;
    after a failure it drops the receivers named and goes on with the next version."""
    torch.set_num_threads(1)
    make = globals()[weights]
    try:
        config = EngineConfig.from_overrides(overrides)
        with Sender(
            config, "127.0.0.1:0", num_receivers, rank=rank, num_trainers=num_trainers, device=device
        ) as sender:
            queue.put(("listening", sender.address))
            for v in versions:
                state = make(v)
                t0 = time.monotonic()
                try:
                    stats = sender.send(state, version=v)
                except SyncError as e:
                    queue.put(("failed", v, f"{type(e).__name__}: {e}", list(e.ranks), time.monotonic() - t0))
                    for r in e.ranks:
                        if r in sender.receivers and len(sender.receivers) > 1:
                            sender.remove_receiver(r)
                    continue
                queue.put(
                    (
                        "sent",
                        v,
                        {
                            "tensors": stats.tensors,
                            "buckets": stats.buckets,
                            "bytes": stats.bytes,
                            "seconds": stats.seconds,
                            "plan_sent_to": stats.plan_sent_to,
                        },
                    )
                )
    except Exception as e:
        queue.put(("error", None, f"{type(e).__name__}: {e}"))
        traceback.print_exc()


def run_paced_sender(overrides, num_receivers, versions, queue, go, num_trainers=1):
    """Trainer rank 0 in its own process (so a test can look at its sockets alone): report
    ``("listening", address)``; then, for each version, wait for a word on ``go``, send
    ``make_weights(version)`` and report ``("sent", version, error or None)``; then wait for
    a last word before leaving."""
    torch.set_num_threads(1)
    config = EngineConfig.from_overrides(overrides)
    with Sender(config, "127.0.0.1:0", num_receivers, rank=0, num_trainers=num_trainers) as sender:
        queue.put(("listening", sender.address))
        for v in versions:
            go.get(timeout=300)
            try:
                sender.send(make_weights(v), version=v)
                queue.put(("sent", v, None))
            except Exception as e:
                queue.put(("sent", v, f"{type(e).__name__}: {e}"))
        go.get(timeout=300)


class Background:
    """``sender.send`` in a thread: ``join`` asserts it ended and returns its result or
    raises its exception, so a publisher that raised or hung cannot pass unseen."""

    def __init__(self, sender, weights, version, **kwargs):
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(sender, weights, version, kwargs), daemon=True)
        self.thread.start()

    def _run(self, sender, weights, version, kwargs):
        try:
            self.result = sender.send(weights, version=version, **kwargs)
        except Exception as e:
            self.error = e

    def join(self, timeout=60):
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), "sender.send did not return"
        if self.error is not None:
            raise self.error
        return self.result


class FailingSource(StateDictSource):
    """The weights of a version; the iterator raises ``error`` before yielding tensor ``after``
    (the trainer failed mid-transfer), noting when in ``raised_at`` (monotonic)."""

    def __init__(self, state, after):
        super().__init__(state)
        self.after = after
        self.raised_at = None
        self.error = RuntimeError("the trainer failed mid-transfer")

    def tensors(self):
        for i, item in enumerate(super().tensors()):
            if i == self.after:
                self.raised_at = time.monotonic()
                raise self.error
            yield item


class HeldSource(StateDictSource):
    """The trainer's weights, held after the first ``after`` tensors until ``release`` is set:
    a transfer kept under way, for as long as the test needs, at most ``hold_s`` (then it
    goes on, and ``held_out`` says so). ``holding`` is set once it waits, ``finished`` after
    the last tensor."""

    def __init__(self, state, after=3, hold_s=15.0):
        super().__init__(state)
        self.after, self.hold_s, self.held_out = after, hold_s, False
        self.holding, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()

    def tensors(self):
        for i, item in enumerate(super().tensors()):
            if i == self.after:
                self.holding.set()
                self.held_out = not self.release.wait(self.hold_s)
            yield item
        self.finished.set()


def tp_version_weights(model_dir: str, version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` of a saved model's weights, the same in every process: the
    checkpoint plus seeded noise large enough to change greedy outputs."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(2000 + version)
    return {n: state[n] + torch.randn(state[n].shape, generator=g) * 0.1 for n in sorted(state)}


def run_fsdp_like_trainer(
    address, rank, num_trainers, overrides, num_receivers, model_dir, versions, queue, go=None
):
    """Trainer rank ``rank`` > 0 of a ``sharded`` sync into vLLM replicas, holding
    ``Shard(0)`` of every tensor as FSDP2 would (``typical.trainer_boxes``): sends only its
    shards of each version; waits for ``go`` (an Event) before each send if given."""
    from weightsync.sharding.typical import held, trainer_boxes

    torch.set_num_threads(1)
    config = EngineConfig.from_overrides(overrides)
    with Sender(config, address, num_receivers, rank=rank, num_trainers=num_trainers) as sender:
        for v in versions:
            state = tp_version_weights(model_dir, v)
            shards = held(
                state, trainer_boxes([TensorSpec.of(n, t) for n, t in state.items()], num_trainers, rank)
            )
            if go is not None:
                go.wait(60)
            try:
                stats = sender.send(shards, version=v)
            except SyncError as e:
                queue.put((rank, v, f"{type(e).__name__}: {e}"))
                continue
            queue.put((rank, v, stats.bytes))


def slice_boxes(rank, tp=2):
    """Receiver rank ``rank``'s boxes of ``make_weights``' tensors as TP rank ``rank % tp``
    of a replica (``typical.replica_boxes``)."""
    from weightsync.sharding.typical import replica_boxes

    return replica_boxes([TensorSpec.of(n, t) for n, t in make_weights(0).items()], tp, rank % tp)


def slice_digests(version, rank, tp=2):
    """The digests of receiver rank ``rank``'s slices of version ``version``."""
    from weightsync.sharding.fragments import region

    weights = make_weights(version)
    return {n: digest(region(weights[n], box).contiguous()) for n, box in slice_boxes(rank, tp).items()}


def run_slice_receiver(address, rank, overrides, versions, queue, extra=None, tp=2):
    """A ``sharded`` receiver rank that keeps the slices of TP rank ``rank % tp``
    (``slice_boxes``, declared) and loads each version into them; reports ``(rank, version,
    slice digests, stats.missing, receiver.version, receiver.failed_version,
    receiver.torn)``, with ``"error"`` and the message in place of the version and the
    missing list after a failed sync, and goes on. ``extra``: ``{name: shape}`` of float32
    tensors it also keeps, which no trainer sends."""
    from weightsync import FragmentSink
    from weightsync.sharding import declared_shards
    from weightsync.sharding.layout import Box

    torch.set_num_threads(1)
    specs = {n: TensorSpec.of(n, t) for n, t in make_weights(0).items()}
    shards = {
        n: (specs[n].shape, box, torch.zeros(box.lengths, dtype=specs[n].torch_dtype))
        for n, box in slice_boxes(rank, tp).items()
    }
    for n, shape in (extra or {}).items():
        shards[n] = (tuple(shape), Box.whole(tuple(shape)), torch.zeros(shape))
    sink = FragmentSink(declared_shards(shards))
    with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
        for v in versions:
            try:
                stats = receiver.load_into(sink, version=v)
                outcome = (v, stats.missing)
            except Exception as e:
                outcome = ("error", f"{type(e).__name__}: {e}")
            digests = {n: digest(s.tensor.contiguous()) for n, s in sink.shards.items() if n in specs}
            queue.put(
                (
                    rank,
                    outcome[0],
                    digests,
                    outcome[1],
                    receiver.version,
                    receiver.failed_version,
                    receiver.torn,
                )
            )


def run_pooled_loader(address, rank, overrides, versions, queue):
    """An engine's loader fed by ``receive_into`` through a ``LandingPool`` (as a vLLM worker
    is): it holds every tensor until the end of the version (as a layerwise reload holds a
    layer's), then reports ``(rank, version, digests, names read in place, lent bytes,
    copied bytes)``; "in place": the tensor's memory is one of the trainer's shared regions
    this process maps (``/memfd:weightsync-ipc``), not the staging ring nor the pool."""
    from weightsync.receiver.landing import LandingPool
    from weightsync.receiver.prefetch import receive_into

    torch.set_num_threads(1)
    config = EngineConfig.from_overrides(overrides)
    pool = LandingPool()
    with Receiver(config, address, rank) as receiver:
        for v in versions:
            held = []

            def reload(tensors):
                held.extend(tensors)

            result = receive_into(
                receiver,
                v,
                reload,
                pool=pool,
                in_flight_bytes=4 * config.bucket_bytes,
                timeout_s=config.timeout_s,
            )
            if result.error is not None:
                queue.put((rank, "error", f"{type(result.error).__name__}: {result.error}", None, None, None))
                return
            regions = _trainer_regions()
            in_place = sorted(n for n, t in held if any(a <= t.data_ptr() < b for a, b in regions))
            digests = {n: digest(t) for n, t in held}
            queue.put((rank, v, digests, in_place, result.landing_lent_bytes, result.landing_copied_bytes))


def _trainer_regions() -> list[tuple[int, int]]:
    """The address ranges of the trainer's shared storages this process maps."""
    with open("/proc/self/maps") as f:
        lines = [line.split() for line in f if "/memfd:weightsync-ipc " in line]
    return [tuple(int(x, 16) for x in fields[0].split("-")) for fields in lines]


def emitting(model: torch.nn.Module, token: int) -> dict[str, torch.Tensor]:
    """``model``'s weights changed so that greedy decoding emits ``token`` whatever the
    prefix: no attention or MLP output reaches the residual stream (``o_proj``, ``down_proj``
    zero), every embedding is the same vector, so the last hidden state is the same for every
    prefix, and only ``token``'s row of the LM head sees it."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, t in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    state["model.embed_tokens.weight"].fill_(1.0)
    state["model.norm.weight"].fill_(1.0)
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][token] = 1.0
    return state
