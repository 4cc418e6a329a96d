"""Process bodies of the benchmark (importable under ``spawn``).

Every row runs in fresh processes, so each one's peak RSS belongs to that row alone. Each
body reports on a queue: ``("ready", rank, info)`` when peers may join, ``("tick", rank, n)``
after each timed repetition, and finally ``("result", rank, dict)`` or ``("error", rank, text)``.
The timed part of a repetition starts when every process is set up and ends when every
receiver holds the whole version. A result's ``digests`` hold one digest per version of the
model's bytes after that version (sender and receivers alike): the runner compares each
version, not only the last. They are taken outside the timed part: every process of a row
waits for the others (``Job.between``) before the next version starts.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.bench import models
from weightsync.config.engine import EngineConfig
from weightsync.engines import rendezvous
from weightsync.plan import TensorSpec, as_bytes
from weightsync.sharding import typical as shards
from weightsync.sharding.fragments import region


@dataclass
class Job:
    """What one row's processes need to know."""

    kind: str  # a weightsync backend, or an alternative ("per-tensor-broadcast", ...)
    specs: list[TensorSpec]
    receivers: int
    repeats: int  # timed repetitions, after one untimed warm-up
    overrides: list[str] = field(default_factory=list)
    model_dir: str | None = None
    work_dir: str | None = None
    timeout_s: float = 300.0
    trainers: int = 1  # trainer processes that send (paired); the others' results are keyed receivers + rank
    #: ``sharded``: tensor-parallel ranks per replica (receiver r is rank r % tp of replica r // tp)
    tp: int = 1
    #: ``sharded``: expert-parallel ranks per replica (receiver r is rank r % max(tp, ep))
    ep: int = 1
    update: str = "bump"  # how versions differ: "bump" (every tensor, cheaply) or "adamw" (an RL step)
    lr: float = 1e-6  # the AdamW learning rate of update="adamw"
    device: str = "cpu"  # where every process holds the model (and the transfer buffers, when not "cpu")
    #: on an emulated cluster (``--hosts``): each process's host (network namespace) by
    #: result key, and trainer rank 0's address there
    netns: dict[int, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    #: an event the driver sets once it has read the NICs' counters after the warm-up, for
    #: which trainer rank 0 waits (it says ``("warm", 0, 1)``): the counts cover the timed
    #: syncs only (a delta row's warm-up is a dense sync). None: nothing is counted.
    counted: Any = None
    #: a barrier of every process of a weightsync row, passed between versions once each
    #: has taken its digest of the last one (a slow digest never counts in a sync's time)
    between: Any = None
    #: the driver's process id: the disk path's files carry it (cleaned up after the row)
    driver_pid: int = 0
    #: "fp8": receivers hold the decoder layers' matrices in FP8 blocks (``weightsync.quant``)
    quantize: str | None = None
    #: the model holds finite values and versions differ by a scaling (quantizing arbitrary
    #: bytes would read NaNs); both rows of a ``--quantize`` run, so they move the same model
    values: bool = False

    def enter_host(self, key: int) -> None:
        """Move this process onto its emulated host, first thing (threads follow)."""
        if self.netns:
            from weightsync.bench.cluster import enter

            enter(self.netns[key])

    def sender_state(self) -> dict[str, torch.Tensor]:
        if self.model_dir:
            return {n: t.to(self.device) for n, t in models.load_directory(self.model_dir).items()}
        if self.values:
            return models.filled_values(self.specs, device=self.device)
        return models.filled(self.specs, device=self.device)

    def next_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The trainer's next version of ``state`` (in place; not part of a sync's time)."""
        if self.values:
            models.scale_values(state)
        else:
            models.bump(state, version)

    def held(self, state: dict[str, torch.Tensor]) -> str:
        """The digest of what every receiver holds once ``state`` reached it."""
        if self.quantize is None:
            return models.digest(state)
        from weightsync.quant.replica import fp8_expected

        return models.digest(fp8_expected(state))

    def endpoint_kwargs(self) -> dict[str, Any]:
        """``device=`` for ``Sender``/``Receiver`` on a device; on "cpu" their own default
        (as before the option existed)."""
        return {} if self.device == "cpu" else {"device": self.device}

    @property
    def versions(self) -> range:
        return range(1, self.repeats + 2)

    def next_version(self, version: int) -> None:
        """After ``version`` (and its digest): wait until every process of the row is there."""
        if self.between is not None and version < self.versions[-1]:
            self.between.wait(self.timeout_s)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _memory(baseline_mb: float) -> dict[str, float]:
    peak = _peak_rss_mb()
    return {"peak_rss_mb": round(peak, 1), "overhead_mb": round(peak - baseline_mb, 1)}


def _guard(queue, rank: int, body) -> None:
    torch.set_num_threads(1)  # N+1 processes share this host's cores
    try:
        queue.put(("result", rank, body()))
    except BaseException as e:  # the runner reports it and stops the row
        queue.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


# ---------------------------------------------------------------------------- weightsync
def sync_sender(job: Job, queue, rank: int = 0, address: str | None = None) -> None:
    """Trainer rank ``rank``: rank 0 listens (on ``job.host``) and times the syncs; with
    ``paired`` the other trainer ranks (``job.trainers``) connect to it and send their shares."""
    from weightsync.sender.sender import Sender

    job.enter_host(0 if rank == 0 else job.receivers + rank)
    address = address or f"{job.host}:0"

    def body() -> dict[str, Any]:
        updates = None
        if job.update == "adamw":  # fp32 masters stepped by AdamW, sent as their bf16 copy
            from weightsync.bench.updates import AdamWUpdates

            updates = AdamWUpdates(job.specs, lr=job.lr, seed=0)
            state = updates.tensors
        else:
            state = job.sender_state()
        if job.kind == "ipc":  # receivers read the trainer's own tensors: they live in shared memory
            from weightsync.engines.shared_tensors import share_tensors

            share_tensors(state)
        source: Any = state
        if job.kind == "sharded":  # this rank's FSDP2-like shard: views, updated in place
            source = shards.held(state, shards.trainer_boxes(job.specs, job.trainers, rank))
        baseline = _rss_mb()
        config = EngineConfig.from_overrides([f"backend={job.kind}", *job.overrides])
        seconds, wire, density, phases, digests = [], [], [], [], []
        with Sender(
            config, address, job.receivers, rank=rank, num_trainers=job.trainers, **job.endpoint_kwargs()
        ) as sender:
            if rank == 0:
                queue.put(("ready", 0, sender.address))
            for v in job.versions:
                if updates is not None:
                    updates.step()  # the trainer's step: not part of the sync's time
                else:
                    job.next_weights(state, v)
                stats = sender.send(source, version=v)
                if v == 1 and rank == 0 and job.counted is not None:
                    queue.put(("warm", 0, v))
                    if not job.counted.wait(job.timeout_s):
                        raise RuntimeError("the bench driver did not read the NIC counters after the warm-up")
                if v > 1 and rank == 0:  # the first sync also sets up groups and touches buffers
                    seconds.append(stats.seconds)
                    wire.append(stats.wire_bytes)
                    density.append(stats.density)
                    phases.append(
                        {
                            "encode_s": stats.encode_s,
                            "quantize_s": stats.quantize_s,  # inside transfer_s
                            "handshake_s": stats.handshake_s - stats.encode_s,
                            "transfer_s": stats.transfer_s,
                            "rest_s": stats.seconds - stats.handshake_s - stats.transfer_s,
                        }
                    )
                    queue.put(("tick", 0, v))
                digests.append(job.held(state))
                job.next_version(v)
            return {
                "seconds": seconds,
                "wire_bytes": wire,
                "density": density,
                "phases": phases,
                "digests": digests,
                "buckets": stats.buckets,
                **_memory(baseline),
            }

    _guard(queue, 0 if rank == 0 else job.receivers + rank, body)


def sync_receiver(job: Job, address: str, rank: int, queue) -> None:
    from weightsync.receiver.receiver import Receiver

    job.enter_host(rank + 1)

    if job.kind == "sharded":
        _guard(queue, rank + 1, lambda: _sharded_receiver(job, address, rank))
        return

    def body() -> dict[str, Any]:
        from weightsync.quant.replica import fp8_holding
        from weightsync.sinks import ModuleSink

        state = (
            fp8_holding(job.specs, device=job.device) if job.quantize else models.zeros(job.specs, job.device)
        )
        module = ModuleSink(state) if job.quantize else models.module_of(state)
        baseline = _rss_mb()
        config = EngineConfig.from_overrides([f"backend={job.kind}", *job.overrides])
        digests = []
        with Receiver(config, address, rank, **job.endpoint_kwargs()) as receiver:
            for v in job.versions:
                receiver.load_into(module, version=v)
                digests.append(models.digest(state))
                job.next_version(v)
        return {"digests": digests, **_memory(baseline)}

    _guard(queue, rank + 1, body)


def _sharded_receiver(job: Job, address: str, rank: int) -> dict[str, Any]:
    """Receiver rank ``rank`` of a ``sharded`` row: tensor-parallel rank ``rank % tp`` of
    its replica, holding only its slices. Each version's slices are compared (untimed) with
    the same version made here whole; the digest is that version's when all match."""
    from weightsync.receiver.receiver import Receiver
    from weightsync.receiver.sharded_sink import FragmentSink

    boxes = shards.replica_boxes(job.specs, job.tp, rank % max(job.tp, job.ep), job.ep)
    mine = shards.kept(job.specs, boxes, job.device)
    sink = FragmentSink(mine)
    baseline = _rss_mb()
    reference = job.sender_state()
    config = EngineConfig.from_overrides([f"backend={job.kind}", *job.overrides])
    digests = []
    with Receiver(config, address, rank, **job.endpoint_kwargs()) as receiver:
        for v in job.versions:
            receiver.load_into(sink, version=v)
            models.bump(reference, v)
            # bytes, not values: the bench's arbitrary bytes hold NaNs, which never equal themselves
            wrong = [
                n
                for n, s in mine.items()
                if not torch.equal(as_bytes(s.tensor), as_bytes(region(reference[n], s.box)))
            ]
            digests.append(models.digest(reference) if not wrong else f"slices differ: {wrong[:3]}")
            job.next_version(v)
    return {"digests": digests, **_memory(baseline)}


# ---------------------------------------------------------------------------- alternatives
# What a group's rendezvous needs for as long as the group lives (this process's).
_RENDEZVOUS: list[Any] = []


def _group(
    rank: int, world: int, queue, where: tuple[int, str] | None, timeout_s: float
) -> dist.ProcessGroup:
    """A Gloo group over weightsync's rendezvous store on loopback: rank 0 hosts it and
    announces its port and token."""
    if rank == 0:
        server = rendezvous.serve("127.0.0.1", timeout_s)
        token = server.new_group()
        store = server.store()
        _RENDEZVOUS.append(server)
        queue.put(("ready", 0, (server.port, token)))
    else:
        assert where is not None
        store = rendezvous.connect("127.0.0.1", where[0], where[1], timeout_s)
    _RENDEZVOUS.append(store)
    return platform.new_process_group("gloo", store, rank, world, timeout_s, bind_host="127.0.0.1")


def _barrier(group: dist.ProcessGroup) -> None:
    group.allreduce([torch.zeros(1)]).wait()


def alternative(job: Job, rank: int, where: tuple[int, str] | None, queue) -> None:
    """One process of an alternative path; rank 0 is the trainer (``where``: its
    rendezvous store's port and token, for the others)."""

    def body() -> dict[str, Any]:
        sender = rank == 0
        state = job.sender_state() if sender else models.zeros(job.specs)
        total = sum(s.nbytes for s in job.specs)
        flat = None
        if job.kind == "broadcast-ceiling":  # the same bytes as one buffer: the transport's best
            flat = torch.zeros(total, dtype=torch.uint8)
        baseline = _rss_mb()
        group = _group(rank, job.receivers + 1, queue, where, job.timeout_s)
        seconds, digests = [], []
        for v in job.versions:
            if sender:
                models.bump(state, v)
            _barrier(group)
            t0 = time.perf_counter()
            if job.kind == "per-tensor-broadcast":
                for t in state.values():  # what many RL frameworks do: one call per tensor
                    group.broadcast(t, 0).wait()
            elif job.kind == "broadcast-ceiling":
                group.broadcast(flat, 0).wait()
            elif job.kind == "safetensors-reload":
                _disk_round(job, state, v, sender, group)
            else:
                raise ValueError(f"unknown alternative {job.kind!r}")
            _barrier(group)
            if v > 1:
                seconds.append(time.perf_counter() - t0)
                if sender:
                    queue.put(("tick", 0, v))
            if job.kind != "broadcast-ceiling":  # untimed: the next version starts at a barrier
                digests.append(models.digest(state))
        out: dict[str, Any] = {"seconds": seconds, **_memory(baseline)}
        if digests:
            out["digests"] = digests
        return out

    _guard(queue, rank, body)


def _disk_round(job: Job, state: dict[str, torch.Tensor], version: int, sender: bool, group) -> None:
    """The reload-from-disk path: the trainer saves safetensors, flushes them to storage
    (as a shared file system must before other hosts can read them) and publishes them by
    rename; every receiver reads them and copies into its model."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(job.work_dir or tempfile.gettempdir())
    path = directory / f"weightsync-bench-{job.driver_pid}-v{version}.safetensors"
    if sender:
        tmp = path.with_suffix(".tmp")
        save_file(state, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers never see a partial file
        _remove_stale(directory, job.driver_pid, version)
    _barrier(group)
    if not sender:
        with safe_open(str(path), framework="pt") as f:
            for name, t in state.items():
                t.copy_(f.get_tensor(name))


def _remove_stale(directory: Path, driver_pid: int, version: int) -> None:
    old = directory / f"weightsync-bench-{driver_pid}-v{version - 1}.safetensors"
    old.unlink(missing_ok=True)


def cleanup_disk(job: Job) -> None:
    for path in Path(job.work_dir or tempfile.gettempdir()).glob(f"weightsync-bench-{job.driver_pid}-v*"):
        path.unlink(missing_ok=True)


def memcpy_ceiling(job: Job, queue) -> None:
    """One process copying the bytes every receiver needs (receivers x model bytes): the
    reading work a shared-memory sync cannot avoid, at single-process memcpy speed. On a
    device (the ``d2d-ceiling`` row) the copies run device to device."""

    def body() -> dict[str, Any]:
        torch.set_num_threads(os.cpu_count() or 1)  # a single process may use every core
        device = torch.device(job.device)
        total = sum(s.nbytes for s in job.specs)
        src = torch.ones(total, dtype=torch.uint8, device=device)
        dst = torch.zeros(total, dtype=torch.uint8, device=device)
        baseline = _rss_mb()
        queue.put(("ready", 0, None))
        seconds = []
        for v in job.versions:
            platform.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(job.receivers):
                dst.copy_(src)
            platform.synchronize(device)  # the copies were only queued
            if v > 1:
                seconds.append(time.perf_counter() - t0)
                queue.put(("tick", 0, v))
        return {"seconds": seconds, **_memory(baseline)}

    try:
        queue.put(("result", 0, body()))
    except BaseException as e:
        queue.put(("error", 0, f"{type(e).__name__}: {e}"))
