"""The first step of ``weightsync gpu-check``: can several processes on one GPU share an
NCCL group here? (NCCL before 2.30 refuses them; see README "GPU check".)"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue as queue_mod
import socket
import time

PROBE_BYTES = 64 << 20  # more than NCCL's staging buffers: peers must progress together
PROBE_ROUNDS = 4  # one warm-up, then timed


def _probe_rank(rank: int, world: int, port: int, device: str, queue, timeout_s: float) -> None:
    """One rank of the probe: a group of our own, broadcasts from rank 0, every byte checked."""
    try:
        import torch
        import torch.distributed as dist

        from weightsync import platform

        dev = torch.device(device)
        library = platform.collective_backend("nccl", dev.type)
        store = dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
        )
        group = platform.new_process_group(library, store, rank, world, timeout_s, bind_host="127.0.0.1")
        t = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=dev)
        seconds = []
        for round_ in range(PROBE_ROUNDS):
            t.fill_(round_ + 1 if rank == 0 else 0)
            platform.synchronize(dev)
            t0 = time.perf_counter()
            group.broadcast(t, 0).wait()
            platform.synchronize(dev)  # the collective was only queued
            seconds.append(time.perf_counter() - t0)
            if not bool((t == round_ + 1).all()):
                queue.put((rank, "wrong", f"broadcast {round_ + 1} delivered wrong bytes", None))
                return
        timed = sorted(seconds[1:])
        queue.put((rank, "ok", "", timed[len(timed) // 2]))
    except BaseException as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}", None))


def probe_nccl(receivers: int, device: str, timeout_s: float) -> tuple[str, str]:
    """("passed" | "failed", message): 1 + receivers processes on one device build a group
    and broadcast ``PROBE_BYTES`` from rank 0, as the nccl checks will."""
    world = 1 + receivers
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_probe_rank, args=(r, world, port, device, q, timeout_s), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, str, float | None]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                rank, status, message, seconds = q.get(timeout=1.0)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            reports[rank] = (status, message, seconds)
    finally:
        for p in procs:  # only the processes started here
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if len(reports) == world and all(status == "ok" for status, _, _ in reports.values()):
        seconds = reports[0][2] or 0.0
        rate = f" ({PROBE_BYTES / seconds / 1e9:.1f} GB/s payload)" if seconds else ""
        return "passed", (
            f"{world} ranks on {device}: {PROBE_BYTES >> 20} MiB broadcast in "
            f"{seconds * 1e3:.1f} ms{rate}, median of {PROBE_ROUNDS - 1}"
        )
    timed_out = time.monotonic() >= deadline
    errors = [f"rank {r}: {m}" for r, (s, m, _) in sorted(reports.items()) if s != "ok"]
    missing = [
        f"rank {r}: no report (exit code {p.exitcode})" for r, p in enumerate(procs) if r not in reports
    ]
    if timed_out and missing:
        missing.insert(0, f"no result within {timeout_s:.0f} s (hung?)")
    if len(errors) > 1 and len({m for _, (s, m, _) in reports.items() if s != "ok"}) == 1:
        errors = [
            f"ranks {', '.join(str(r) for r, (s, _, _) in sorted(reports.items()) if s != 'ok')}: "
            f"{next(m for s, m, _ in reports.values() if s != 'ok')}"
        ]
    return "failed", "; ".join(errors + missing) or f"no result within {timeout_s:.0f} s"


def nccl_blocked_reason(probe_message: str, nccl_version: str | None) -> str:
    """Why the nccl, paired and sharded checks cannot run here, with the way out."""
    reason = f"the nccl-multi-rank probe failed: {probe_message}"
    keys = ("duplicate gpu", "same gpu", "multi_rank")
    said = [line.strip() for line in probe_message.splitlines() if any(k in line.lower() for k in keys)]
    if said:
        reason = (
            f"NCCL {nccl_version or '?'} refuses several ranks on one GPU ({said[0][:200]}). NCCL >= 2.30 "
            "allows it with NCCL_MULTI_RANK_GPU_ENABLE=1 (set by this run): torch >= 2.14 ships it, or install it "
            "under this torch (make gpu-check GPU_NCCL=nvidia-nccl-cu13==2.30.7)"
        )
    return reason
