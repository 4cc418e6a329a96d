"""Staged updates on a vLLM worker: the next version lands in host memory while the
replica keeps generating; a commit loads it locally, between a pause and a resume.

``Stager`` holds one worker's staging copy (``StagingStore``: one host tensor per
checkpoint name, pinned on CUDA/NPU, allocated at the first stage and reused by every later
one) and the version state of that copy, separate from the state of the weights the worker
serves. A stage is a normal weightsync sync from the sender's side; on the worker it runs in
a background thread (``begin``), so the RPC that starts it returns at once and vLLM's
engine goes on stepping the model while the bytes arrive. With ``delta`` on, deltas apply
to the staging copy in place: it is the delta base, no third copy is kept.

A stage that fails (the source raising, a lost sender, a refused version, a digest or
checksum mismatch) leaves the staging copy torn and the served weights untouched: the
worker never loads from a torn copy. ``commit`` loads a complete staged version through the
engine's own ``reload_weights``; a load that raises leaves the served weights a mix, as a
failed streamed update does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from weightsync.integrations.replicas.slices import Slices
from weightsync.plan import TensorSpec, dtype_from_name, dtype_name
from weightsync.platform import host_empty
from weightsync.receiver.route_stage import Vet
from weightsync.receiver.sharded_sink import FragmentSink
from weightsync.sharding.reads import in_full_shape
from weightsync.sharding.typical import kept
from weightsync.sinks import ModuleSink
from weightsync.state import VersionState

log = logging.getLogger("weightsync.replica")

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class StagingStore(ModuleSink):
    """A sink over host tensors it allocates itself: a tensor a sync announces that the
    store lacks (or holds with another shape or dtype) is allocated when the sync is
    checked, before anything is written; every other sync reuses what it holds."""

    def __init__(self) -> None:
        super().__init__({})
        self.state = VersionState()
        #: bytes allocated over the store's life (a steady stage adds nothing)
        self.allocated_bytes = 0

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for t in self.targets.values())

    def check(self, specs: Sequence[TensorSpec]) -> None:
        for spec in specs:
            held = self.targets.get(spec.name)
            if held is None or tuple(held.shape) != tuple(spec.shape) or dtype_name(held.dtype) != spec.dtype:
                self.targets[spec.name] = host_empty(tuple(spec.shape), dtype_from_name(spec.dtype))
                self.allocated_bytes += self.targets[spec.name].nbytes
        super().check(specs)

    def start(self) -> None:
        """Before a sync: which names it carries is counted anew."""
        self._loaded.clear()

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """The staged version, as the engine's loader takes it: the names the last sync carried."""
        return [(n, t) for n, t in self.targets.items() if id(t) in self._loaded]


class SliceStore:
    """``backend=sharded``: the staging copy of the boxes this worker keeps (``Slices``),
    compact, landed by fragment; a commit hands each tensor to the loader in its full
    shape, the box holding the staged bytes (``in_full_shape``)."""

    def __init__(self, slices: Slices) -> None:
        self.slices = slices
        self.sink = FragmentSink(kept(slices.specs, slices.boxes))
        self.bytes = slices.kept_bytes()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.slices.specs:
            box = self.slices.boxes[spec.name]
            yield spec.name, in_full_shape(spec, box, self.sink.shards[spec.name].tensor)


class Stager:
    """One worker's staging: a background stage at a time, then a commit."""

    def __init__(self) -> None:
        self.store = StagingStore()
        #: ``backend=sharded``: the slices' staging copy (kept while the slices stay the same)
        self.slice_store: SliceStore | None = None
        self._sliced = False  # whether the last stage went to ``slice_store``
        self._thread: threading.Thread | None = None
        self._version: int | None = None  # the version being (or last) staged
        self.last: dict[str, Any] = {}

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self, receiver: Any, version: int, served: VersionState, slices: Slices | None = None) -> None:
        """Start receiving ``version`` into the store in a background thread. ``receiver``
        (a session ``Receiver``) takes the store's version state for the sync (stale
        versions, the delta base) and gets ``served`` back afterwards. ``slices``: what
        this worker keeps, for a ``backend=sharded`` receiver (required there)."""
        if self.busy:
            raise RuntimeError(
                f"weightsync: version {self._version} is still being staged; wait for it first"
            )
        self._sliced = bool(getattr(receiver.engine_cls, "sharded", False))
        if self._sliced:
            if slices is None:
                raise RuntimeError(
                    "weightsync: backend=sharded stages only the slices this worker keeps, and they are not "
                    "known yet: learn them first (weightsync_slices; VLLMRollout does at construction when "
                    "given model=, or at the first streamed update)"
                )
            if self.slice_store is None or self.slice_store.slices is not slices:
                self.slice_store = SliceStore(slices)
        self._version = version
        self.last = {}

        def run() -> None:
            start = time.perf_counter()
            allocated = self.store.allocated_bytes
            error: BaseException | None = None
            receiver.state = self.store.state
            self.store.start()
            try:
                sink = self.slice_store.sink if self._sliced and self.slice_store else self.store
                stats = receiver.load_into(sink, version)
            except BaseException as e:  # reported by ``result``, never raised in the thread
                error, stats = e, None
                log.warning("weightsync: staging version %s failed: %s", version, e)
            finally:
                receiver.state = served
            self.last = {
                "stage_ok": error is None,
                "stage_error": None if error is None else f"{type(error).__name__}: {error}",
                "stage_bytes": stats.bytes if stats is not None else 0,
                "stage_wire_bytes": stats.wire_bytes if stats is not None else 0,
                "stage_s": time.perf_counter() - start,
                "staging_bytes": self.slice_store.bytes
                if self._sliced and self.slice_store
                else self.store.bytes,
                "staging_allocated_bytes": self.store.allocated_bytes - allocated,
            }

        self._thread = threading.Thread(target=run, name=f"weightsync-stage-{version}", daemon=True)
        self._thread.start()

    def wait(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the stage; whether it ended."""
        if self._thread is not None:
            self._thread.join(max(0.0, wait_s))
        return not self.busy

    def status(self) -> dict[str, Any]:
        state = self.store.state
        return {"staging": self.busy, "staged": state.serving, "stage_version": self._version, **self.last}

    def commit(
        self,
        version: int,
        reload: Reload,
        served: VersionState,
        *,
        atomic: bool = False,
        vet: Vet | None = None,
    ) -> dict[str, Any]:
        """Load the staged ``version`` into the running model through ``reload``; the
        served state follows (complete, or a mix if the load raised after starting, unless
        ``atomic``: a ``reload`` that changes nothing when it raises). ``vet``: the staged
        tensors' specs checked first, as a streamed update's are before anything moves (a
        full version's cover; the engine's experts where it placed them): a refusal leaves
        the model as it was."""
        if self.busy:
            raise RuntimeError(f"weightsync: version {self._version} is still being staged; cannot commit")
        if self.store.state.serving != version:
            held = self.store.state.serving
            raise RuntimeError(
                f"weightsync: version {version} is not staged here (staged: "
                f"{'none complete' if held is None else f'version {held}'})"
            )
        start = time.perf_counter()
        sliced = self.slice_store if self._sliced else None
        if vet is not None:
            try:
                vet(sliced.slices.specs if sliced else [TensorSpec.of(n, t) for n, t in self.store.items()])
            except Exception as e:
                served.failed(version, delivered=False)
                return {
                    "ok": False,
                    "error": f"commit refused before anything moved: {e}",
                    "commit_s": time.perf_counter() - start,
                }
        try:
            reload(sliced.items() if sliced else iter(self.store.items()))
        except BaseException as e:
            served.failed(version, delivered=not atomic)
            return {
                "ok": False,
                "error": f"commit failed: {type(e).__name__}: {e}",
                "commit_s": time.perf_counter() - start,
            }
        served.completed(version)
        return {"ok": True, "error": None, "commit_s": time.perf_counter() - start}
