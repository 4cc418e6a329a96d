"""What a ``VLLMRollout`` call reports: each replica's account of an update (or of its
state), the update's timing and outcome, and the error an update that did not reach every
replica raises (carrying the report)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import SyncError
from weightsync.stats import SyncStats


@dataclass
class ReplicaReport:
    """One replica's account of an update (or of its current state)."""

    name: str
    #: the version whose weights it fully serves (None: never synced, or a mix after a failure)
    version: int | None
    ok: bool
    error: str | None = None
    #: the version of the last failed attempt, if the latest attempt failed
    failed_version: int | None = None
    #: weights are a mix of two versions (a sync failed after applying some tensors)
    mixed: bool = False
    #: whether generation was resumed after the update
    resumed: bool = False
    #: seconds the replica spent receiving and reloading
    seconds: float = 0.0
    bytes: int = 0
    #: the version complete in its workers' staging copies (staged updates), if any
    staged: int | None = None
    #: host bytes of its workers' staging copies, and how much of it the last stage allocated
    staging_bytes: int = 0
    staging_allocated_bytes: int = 0
    #: the version of the LoRA adapter it serves (LoRA updates), if any
    adapter: int | None = None
    #: bytes each worker (tensor-parallel rank) received in the update
    worker_bytes: list[int] = field(default_factory=list)
    #: bytes each worker's transport handed over in its last streamed update, and in its
    #: last stage (staged updates), buckets' alignment included: counted off the wire
    worker_wire_bytes: list[int] = field(default_factory=list)
    worker_stage_wire_bytes: list[int] = field(default_factory=list)
    #: ``backend=sharded``: the bytes of the slices each worker keeps (its loaders' boxes)
    worker_kept_bytes: list[int] = field(default_factory=list)
    #: its engine reset the caches computed with the old weights (prefix cache, encoder cache)
    #: after loading this update, before serving again (every worker's status says so)
    caches_reset: bool = False
    #: it left the rollout after this update: the sender dropped it as lost
    #: (``drop_lost_receivers``); ``VLLMRollout.add_replica`` takes it back
    left: bool = False

    @classmethod
    def of_workers(cls, name: str, status: list[dict[str, Any]] | None, failure: str | None) -> ReplicaReport:
        """Replica ``name``'s report from its workers' ``weightsync_status`` (one per worker;
        None or empty where it did not answer) and the failure seen calling it, if any."""
        if not status:
            return cls(name, version=None, ok=False, error=failure or "no status")
        # One status per worker; the replica serves a version only if all its workers do.
        versions = {s.get("version") for s in status}
        errors = [s["error"] for s in status if s.get("error")]
        mixed = any(s.get("mixed") for s in status) or len(versions) > 1
        return cls(
            name,
            version=None if mixed else versions.pop(),
            ok=failure is None and all(s.get("ok", True) for s in status),
            error=failure or "; ".join(errors) or None,
            failed_version=next(
                (s["failed_version"] for s in status if s.get("failed_version") is not None), None
            ),
            mixed=mixed,
            seconds=max(s.get("seconds", 0.0) for s in status),
            bytes=sum(s.get("bytes", 0) for s in status),
            staged=staged.pop() if len(staged := {s.get("staged") for s in status}) == 1 else None,
            staging_bytes=sum(s.get("staging_bytes", 0) for s in status),
            staging_allocated_bytes=sum(s.get("staging_allocated_bytes", 0) for s in status),
            worker_bytes=[s.get("bytes", 0) for s in status],
            worker_wire_bytes=[s.get("wire_bytes", 0) for s in status],
            worker_stage_wire_bytes=[s.get("stage_wire_bytes", 0) for s in status],
            worker_kept_bytes=[s["kept_bytes"] for s in status if s.get("kept_bytes") is not None],
            caches_reset=all(s.get("caches_reset") for s in status),
        )

    @classmethod
    def of_adapter(
        cls, name: str, status: list[dict[str, Any]], error: str | None, version: int
    ) -> ReplicaReport:
        """Replica ``name``'s report of a LoRA update to ``version`` from its workers'
        answers to ``weightsync_load_adapter`` and the error seen, if any."""
        versions = {s.get("adapter_version") for s in status}
        return cls(
            name,
            version=None,
            ok=error is None and versions == {version},
            error=error,
            adapter=versions.pop() if len(versions) == 1 else None,
            bytes=sum(s.get("stage_bytes", 0) for s in status),
            seconds=max((s.get("stage_s", 0.0) + s.get("lora_load_s", 0.0) for s in status), default=0.0),
        )


@dataclass
class UpdateReport:
    """Timing and outcome of one ``VLLMRollout.update``, ``stage`` or ``commit``."""

    version: int
    #: "update" (streamed), "stage", "commit", "staged" (an update as stage + commit), or
    #: "lora" (a LoRA adapter only)
    phase: str = "update"
    pause_s: float = 0.0
    #: the transfer (streamed update, stage) or the local load (commit)
    sync_s: float = 0.0
    resume_s: float = 0.0
    #: how long generation was paused: from the first pause call until the last resume
    #: returned (until the update returned, where a replica stays paused); 0 for a stage
    paused_s: float = 0.0
    #: a staged update's stage (generation running), before its commit
    stage_s: float = 0.0
    stats: SyncStats | None = None
    replicas: list[ReplicaReport] = field(default_factory=list)
    #: a LoRA update's ``vllm.lora.request.LoRARequest``: generate with it
    lora_request: Any = None

    @property
    def ok(self) -> bool:
        if self.phase == "lora":
            return bool(self.replicas) and all(r.ok and r.adapter == self.version for r in self.replicas)
        if self.phase == "stage":
            return bool(self.replicas) and all(r.ok and r.staged == self.version for r in self.replicas)
        return bool(self.replicas) and all(r.ok and r.version == self.version for r in self.replicas)

    @property
    def gbps(self) -> float:
        """Payload GB/s of the sync (bytes sent once, broadcast to every replica)."""
        return self.stats.bytes / self.sync_s / 1e9 if self.stats is not None and self.sync_s > 0 else 0.0

    def summary(self) -> str:
        if self.phase == "lora":
            name = getattr(self.lora_request, "lora_name", None)
            return (
                f"LoRA adapter version {self.version} ({name}) loaded in {self.sync_s:.3f} s, nothing paused; "
                + "; ".join(
                    f"{r.name}: "
                    + ("serves it" if r.ok else f"FAILED ({r.error}); serves adapter {r.adapter}")
                    for r in self.replicas
                )
            )
        if self.phase == "stage":
            parts = [
                f"version {self.version} staged in {self.sync_s:.3f} s while generating, {self.gbps:.2f} GB/s"
            ]
        else:
            staged = f"staged {self.stage_s:.3f} s, then " if self.phase == "staged" else ""
            load = "load" if self.phase in ("commit", "staged") else "sync"
            parts = [
                f"version {self.version}: {staged}paused {self.paused_s:.3f} s (pause {self.pause_s:.3f} s, "
                f"{load} {self.sync_s:.3f} s, resume {self.resume_s:.3f} s)"
                + (f", {self.gbps:.2f} GB/s" if self.phase == "update" else "")
            ]
        for r in self.replicas:
            parts.append(
                f"{r.name}: "
                + (f"serves version {r.version}" if r.ok else f"FAILED ({r.error}); serves {r.version}")
            )
        return "; ".join(parts)


class ReplicaUpdateError(SyncError):
    """An update that did not reach every replica; ``report`` has every replica's account."""

    def __init__(self, message: str, report: UpdateReport) -> None:
        super().__init__(message)
        self.report = report

    @classmethod
    def of(
        cls,
        report: UpdateReport,
        sync_error: Exception | None,
        what: str,
        intact: str,
        first_rank: dict[str, int],
        workers: dict[str, tuple[int, int]],
    ) -> ReplicaUpdateError:
        """The error naming every replica that did not end where asked, with what it serves
        (``intact``: what an untouched one still does), and the sender's error with each
        ``receiver rank N`` followed by the replica (and TP rank) it is. ``first_rank``: each
        replica's first receiver rank; ``workers``: the rollout's replicas' first receiver
        rank and worker count."""
        lora = report.phase == "lora"
        bad = [
            r
            for r in report.replicas
            if not r.ok or (r.version != report.version and report.phase not in ("stage", "lora"))
        ]
        lines = [
            f"replica {r.name!r} (receiver rank {first_rank[r.name]}): {r.error or 'not updated'}; "
            + (
                f"serves adapter version {r.adapter}"
                if lora
                else f"serves {'a mix of versions (kept paused)' if r.mixed else f'version {r.version}'}"
            )
            + (f" ({intact})" if intact and not r.mixed else "")
            + ("; it left the rollout (drop_lost_receivers: add_replica takes it back)" if r.left else "")
            for r in bad
        ]
        if sync_error is not None:
            lines.append(f"sender: {_name_ranks(str(sync_error), workers)}")
        return cls(f"{what} version {report.version} failed: " + "; ".join(lines), report)


def _name_ranks(message: str, ranks: dict[str, tuple[int, int]]) -> str:
    """Add the replica's name after every ``receiver rank N`` in a sender error."""
    for name, (first, workers) in ranks.items():
        for k in range(first, first + workers):
            where = f"replica {name!r}" + (f", TP rank {k - first}" if workers > 1 else "")
            message = message.replace(f"receiver rank {k} ", f"receiver rank {k} ({where}) ")
    return message
