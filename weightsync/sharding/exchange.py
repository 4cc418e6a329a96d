"""Moving a route's fragments, pair by pair, through any point-to-point link.

Each (trainer rank, receiver rank) pair of a route has its own transfer plan
(``fragments.pair_plan``): the trainer rank packs that plan's buckets from its local
shards, the receiver rank unpacks them into the slices it keeps. What carries a bucket is
the caller's: ``send(dest, bytes)`` and ``recv(source, buffer)`` move one bucket's bytes
over a link of that pair (a two-rank process group, a socket, a one-sided write), and each
pair's buckets go in plan order, so a link needs no per-bucket metadata.

Every pair is served by a thread of its own on both ends, so all trainer ranks send and
all receiver ranks take at once, each link busy, none waiting on another pair's turn; a
pair's thread holds one bucket buffer. A failure on one pair is raised once every pair's
thread ended (each link's own deadline bounds it), naming the pair.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from weightsync.plan import Assembler, Bucket, as_bytes, capacity, pack_pieces
from weightsync.sharding.fragments import FragmentLanding, LocalShard, fragment_tensors, pair_plan
from weightsync.sharding.route import Route

#: Moves one bucket's bytes to receiver rank ``dest`` (blocks until they left this rank).
SendBytes = Callable[[int, torch.Tensor], None]
#: Fills ``buffer`` with one bucket's bytes from trainer rank ``source``.
RecvBytes = Callable[[int, torch.Tensor], None]


class PairFailed(RuntimeError):
    """A pair's transfer failed: ``source`` and ``dest`` name it."""

    def __init__(self, message: str, source: int, dest: int) -> None:
        super().__init__(message)
        self.source = source
        self.dest = dest


def payload(bucket: Bucket) -> int:
    """A bucket's fragment bytes (without the alignment gaps between packed pieces)."""
    return sum(p.length for p in bucket.pieces)


def _run_pairs(jobs: dict[tuple[int, int], Callable[[], int]]) -> dict[tuple[int, int], int]:
    """Run every pair's job in a thread of its own; the first failure, named, once all ended."""
    if not jobs:
        return {}
    results: dict[tuple[int, int], int] = {}
    errors: list[PairFailed] = []
    lock = threading.Lock()

    def run(pair: tuple[int, int], job: Callable[[], int]) -> None:
        try:
            done = job()
            with lock:
                results[pair] = done
        except Exception as e:
            failure = PairFailed(
                f"trainer rank {pair[0]} -> receiver rank {pair[1]}: {type(e).__name__}: {e}", *pair
            )
            failure.__cause__ = e
            with lock:
                errors.append(failure)

    with ThreadPoolExecutor(len(jobs), thread_name_prefix="weightsync-pair") as pool:
        for pair, job in jobs.items():
            pool.submit(run, pair, job)
    if errors:
        raise sorted(errors, key=lambda e: (e.source, e.dest))[0]
    return results


def send_fragments(
    route: Route, source: int, shards: Mapping[str, LocalShard], bucket_bytes: int, send: SendBytes
) -> dict[int, int]:
    """Trainer rank ``source``: every pair's buckets to its receiver rank, all pairs at once.
    Returns the fragment bytes sent to each receiver rank."""

    def pair_job(dest: int) -> Callable[[], int]:
        def job() -> int:
            plan = pair_plan(route, source, dest, bucket_bytes)
            buffer = torch.empty(capacity(plan, bucket_bytes), dtype=torch.uint8)
            tensors = dict(fragment_tensors(route, source, dest, shards))
            flat = {i: as_bytes(tensors[spec.name]) for i, spec in enumerate(plan.tensors)}
            sent = 0
            for bucket in plan.buckets:
                pack_pieces(bucket, buffer, flat)
                send(dest, buffer[: bucket.nbytes])
                sent += payload(bucket)
            return sent

        return job

    dests = sorted({f.dest for f in route.for_source(source)})
    done = _run_pairs({(source, d): pair_job(d) for d in dests})
    return {dest: n for (_, dest), n in done.items()}


def receive_fragments(
    route: Route, dest: int, landing: FragmentLanding, bucket_bytes: int, recv: RecvBytes
) -> dict[int, int]:
    """Receiver rank ``dest``: every pair's buckets into the slices ``landing`` holds, all
    pairs at once. Returns the fragment bytes taken from each trainer rank. Raises when a pair
    failed, or when a fragment did not land (naming it)."""

    def pair_job(source: int) -> Callable[[], int]:
        def job() -> int:
            plan = pair_plan(route, source, dest, bucket_bytes)
            buffer = torch.empty(capacity(plan, bucket_bytes), dtype=torch.uint8)
            assembler = Assembler(plan.tensors, buffer.device)
            taken = 0
            for bucket in plan.buckets:
                target = buffer[: bucket.nbytes]
                recv(source, target)
                for name, tensor in assembler.unpack(bucket, target):
                    landing.put(name, tensor)
                taken += payload(bucket)
            return taken

        return job

    sources = sorted({f.source for f in route.for_dest(dest)})
    done = _run_pairs({(s, dest): pair_job(s) for s in sources})
    if landing.missing:
        raise RuntimeError(f"receiver rank {dest}: fragment(s) {', '.join(landing.missing[:6])} did not land")
    return {source: n for (source, _), n in done.items()}
