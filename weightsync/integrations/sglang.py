"""SGLang replicas as the rollout side: the trainer's update call.

    engine = start_engine(model_dir)                      # custom_weight_loader=[LOADER]
    rollout = SGLangRollout([SGLangReplica(engine)], ["backend=nccl"])
    report = rollout.update(model, version=step)          # pause, sync, resume
    engine.get_model_info()["weight_version"]             # "step"

Each replica is an SGLang ``Engine`` started with ``custom_weight_loader=[LOADER]``; each of
its TP workers (a scheduler process) is one weightsync receiver and loads every version
through SGLang's own ``model.load_weights`` (``weightsync.integrations.sglang_worker`` says
why the custom loader is the way in). ``SGLangRollout`` is the engine-neutral ``Rollout``
(one ``Sender``, reports, ``add_replica``/``remove_replica``, deadlines, errors naming the
replica and its workers) over ``SGLangReplica``, which speaks SGLang's API:

- pause: ``pause_generation`` (``abort`` drops in-flight requests, ``keep`` retracts them to
  the waiting queue: they continue after the resume and their KV cache is recomputed with
  the new weights, since SGLang cannot flush a cache that running requests hold);
  resume: ``continue_generation``.
- every command runs between ``begin_weight_update()`` and ``end_weight_update()``; a
  version is loaded with ``flush_cache=True`` and SGLang's returned flag is checked: an
  update whose cache was not flushed fails (the replica would reuse KV computed with the
  old weights) and the replica stays paused, as a replica holding a mix does.
- the version goes to SGLang's ``weight_version`` (``get_model_info()``) once every worker
  reported it whole, never before.
- a worker process that dies mid-update is named at once (its replica's call stops
  waiting), not at the deadline.

Streamed updates only: the replica declares no staged, LoRA or KV-release updates, and the
rollout refuses them before anything moves, saying so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from weightsync.integrations.replicas.replica import PauseMode
from weightsync.integrations.replicas.rollout import Rollout
from weightsync.integrations.replicas.versions import VersionedOutput, spans_of_json, version_of
from weightsync.integrations.sglang_worker import LOADER

__all__ = ["LOADER", "SGLangReplica", "SGLangRollout", "cpu_engine_args", "start_engine", "versioned"]

log = logging.getLogger("weightsync.sglang")

#: SGLang's pause modes for weightsync's: ``keep`` retracts (see the module's docstring)
_PAUSE = {"abort": "abort", "keep": "retract"}


def cpu_engine_args() -> dict[str, Any]:
    """SGLang 0.5.23 engine arguments that run on a CPU without AVX-512/AMX (with
    ``SGLANG_USE_CPU_ENGINE=1``): torch-native attention, no CUDA graphs, no overlap
    scheduler, a capped KV cache (the default took 14 GB of RAM)."""
    return {
        "device": "cpu",
        "attention_backend": "torch_native",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
        "disable_overlap_schedule": True,
        "max_total_tokens": 4096,
        "mem_fraction_static": 0.05,
    }


def start_engine(model_dir: str, *, tp: int = 1, seed: int = 0, **kwargs: Any) -> Any:
    """An SGLang ``Engine`` for ``model_dir`` with weightsync's custom loader (float32, token
    ids in and out); on a machine without CUDA, with ``cpu_engine_args()``. ``kwargs`` go
    to ``Engine`` and win."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        if tp > 1:  # SGLang's CPU engine binds one NUMA node per rank unless told cores: one each
            cores = os.cpu_count() or 1
            os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(k % cores) for k in range(tp)))
    from sglang.srt.entrypoints.engine import Engine

    args: dict[str, Any] = {
        "model_path": model_dir,
        "dtype": "float32",
        "skip_tokenizer_init": True,
        "tp_size": tp,
        "random_seed": seed,
        "custom_weight_loader": [LOADER],
        "log_level": "error",
        "custom_sigquit_handler": _on_sigquit,
        **({} if torch.cuda.is_available() else cpu_engine_args()),
    }
    return Engine(**(args | kwargs))


def _on_sigquit(signum: int, frame: Any) -> None:
    """SGLang's engine SIGQUITs its own process when one of its subprocesses dies, and by
    default then kills the whole process tree: the trainer's process, where the offline
    ``Engine`` lives. weightsync names the lost worker itself (``SGLangReplica`` watches
    its workers' processes), so the trainer only logs it and goes on with the others."""
    log.error(
        "weightsync: an SGLang subprocess died (SIGQUIT from its engine); the replica's next call names it"
    )


class _Loop:
    """Runs coroutines of SGLang's tokenizer manager on an engine's event loop, from any
    thread. Offline engines in one process share one event loop (the main thread's), and
    the replicas' calls come from a thread each and must run at once (one version reaches
    every replica in the same sync): the first thread runs the loop until every coroutine
    other threads handed it meanwhile has finished."""

    _lock = threading.Lock()
    _handed: dict[int, int] = {}  # id(loop) -> coroutines handed to the thread running it

    @classmethod
    def run(cls, loop: Any, coroutine: Any) -> Any:
        import asyncio

        key = id(loop)
        with cls._lock:
            running = key in cls._handed
            if running:
                cls._handed[key] += 1
                future = asyncio.run_coroutine_threadsafe(coroutine, loop)
            else:
                cls._handed[key] = 0
        if running:
            try:
                return future.result()
            finally:
                with cls._lock:
                    cls._handed[key] -= 1

        async def drive() -> Any:
            try:
                return await coroutine
            finally:
                while True:
                    with cls._lock:
                        if cls._handed[key] == 0:
                            del cls._handed[key]
                            break
                    with contextlib.suppress(asyncio.CancelledError):  # never leave the others' coroutines
                        await asyncio.sleep(0.005)

        while loop.is_running():  # the last driver is between its last check and its return
            time.sleep(0.001)
        return loop.run_until_complete(drive())


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a dead child not yet reaped by SGLang is a zombie: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class SGLangReplica:
    """An SGLang ``Engine`` (started with ``custom_weight_loader=[LOADER]``) as a replica of
    ``SGLangRollout`` (the ``Replica`` protocol of ``weightsync.integrations.replicas.replica``):
    streamed updates, paused with ``keep`` or ``abort``.

    Its workers' statuses come back through files in a directory of its own (SGLang's
    custom loader returns nothing); the engine runs on this host, as SGLang's offline
    ``Engine`` does."""

    def __init__(self, engine: Any, name: str | None = None) -> None:
        self.engine = engine
        self.name = name or f"sglang-{id(engine):x}"
        self.capabilities: frozenset[str] = frozenset()
        self.pause_modes = tuple(_PAUSE)
        self.status_dir = tempfile.mkdtemp(prefix="weightsync-sglang-")
        self._rank_offset = 0
        self._pids: list[int] = []
        self._lock = threading.Lock()  # one call into the engine's event loop at a time

    def workers(self) -> int:
        return int(self.engine.server_args.tp_size)

    # -------------------------------------------------------------- SGLang's own calls
    def _run(self, coroutine_fn: Any) -> Any:
        """``coroutine_fn(tokenizer_manager)`` run on the engine's loop (``_Loop``)."""
        return _Loop.run(self.engine.loop, coroutine_fn(self.engine.tokenizer_manager))

    def pause(self, mode: PauseMode) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        if mode not in _PAUSE:
            raise ValueError(
                f"SGLang replica {self.name!r}: mode={mode!r}: expected one of {', '.join(_PAUSE)}"
            )
        self._run(lambda tm: tm.pause_generation(PauseGenerationReqInput(mode=_PAUSE[mode])))

    def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._run(lambda tm: tm.continue_generation(ContinueGenerationReqInput()))

    def release_kv_cache(self) -> None:
        raise NotImplementedError("weightsync does not release SGLang's KV cache around an update (yet)")

    def restore_kv_cache(self) -> None:
        raise NotImplementedError("weightsync does not release SGLang's KV cache around an update (yet)")

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: Any = None,
        *,
        progress: Callable[[int, int], None] | None = None,
        **kwargs: Any,
    ) -> list[VersionedOutput]:
        """SGLang's ``generate(input_ids=..., sampling_params=...)`` with the versions that
        sampled each response's tokens (``versioned``); ``kwargs`` go to
        ``Engine.async_generate``. It runs on the engine's loop as the rollout's calls do, so
        one thread may generate while another updates the replica. ``progress(i, tokens)``:
        each request streamed, told the count of tokens prompt ``i`` has so far."""
        if progress is None:
            outs = self._run(
                lambda tm: self.engine.async_generate(
                    input_ids=input_ids, sampling_params=sampling_params, **kwargs
                )
            )
            return [versioned(o) for o in (outs if isinstance(outs, list) else [outs])]

        async def one(i: int, prompt: list[int]) -> dict[str, Any]:
            last: dict[str, Any] = {}
            stream = await self.engine.async_generate(
                input_ids=prompt, sampling_params=sampling_params, stream=True, **kwargs
            )
            async for chunk in stream:  # each chunk holds every token so far
                progress(i, len(chunk["output_ids"]))
                last = chunk
            return last

        async def every(tm: Any) -> list[dict[str, Any]]:
            import asyncio

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(input_ids))))

        return [versioned(o) for o in self._run(every)]

    def weight_version(self) -> str | None:
        """SGLang's own ``weight_version`` (``get_model_info()``)."""
        return self.engine.get_model_info()["weight_version"]

    def _set_weight_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        self._run(
            lambda tm: tm.update_weight_version(
                UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
            )
        )

    # -------------------------------------------------------------- weightsync's calls
    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """A ``weightsync_*`` call of the rollout in every TP worker; one status each."""
        if method == "weightsync_init":
            address, rank_offset, overrides, warm_up = args
            self._rank_offset = rank_offset
            return self._command(
                "init",
                {"address": address, "rank_offset": rank_offset, "overrides": overrides, "warm_up": warm_up},
                timeout,
            )
        if method == "weightsync_receive":
            version, partial = args
            args_ = {"version": version, "partial": partial, "rank_offset": self._rank_offset}
            statuses = self._command("receive", args_, timeout, flush=True)
            if all(s.get("ok") and s.get("version") == version for s in statuses):
                self._set_weight_version(str(version))
            return statuses
        if method == "weightsync_status":
            return self._read_statuses(missing_ok=True)
        if method == "weightsync_close":
            return self._command("close", {}, timeout)
        if method == "weightsync_digests":
            return [s["digests"] for s in self._command("digests", {}, timeout)]
        if method == "weightsync_reload_from_path":
            (path,) = args
            t0 = time.perf_counter()
            from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

            ok, message = self._run(
                lambda tm: tm.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=path), None)
            )[:2]
            if not ok:
                raise RuntimeError(
                    f"SGLang replica {self.name!r}: update_weights_from_disk failed: {message}"
                )
            return [time.perf_counter() - t0] * self.workers()
        raise NotImplementedError(
            f"SGLang replica {self.name!r}: {method} is not supported (SGLang replicas take streamed updates only)"
        )

    def _command(
        self, op: str, args: dict[str, Any], timeout: float | None, flush: bool = False
    ) -> list[dict[str, Any]]:
        """Run ``op`` in every TP worker through SGLang's custom loader, between
        ``begin_weight_update`` and ``end_weight_update``; the workers' statuses. Stops
        waiting, naming the worker, as soon as a worker process is gone, and at ``timeout``."""
        import torch

        for name in os.listdir(self.status_dir):
            os.remove(os.path.join(self.status_dir, name))
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        payload = [(json.dumps({"op": op, "args": args, "status_dir": self.status_dir}), torch.zeros(1))]
        # one serialized copy per TP rank, as Engine.update_weights_from_tensor sends it (a
        # tensor's shared memory can be fetched once per serialization)
        update = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[
                MultiprocessingSerializer.serialize(payload) for _ in range(self.workers())
            ],
            load_format=LOADER,
            flush_cache=flush,
        )
        result: dict[str, Any] = {}

        async def body(tm: Any) -> tuple[bool, str]:
            import asyncio

            ok, message = (await tm.begin_weight_update(BeginWeightUpdateReqInput(), None))[:2]
            if not ok:
                return False, f"begin_weight_update failed: {message}"
            try:
                out = tuple((await tm.update_weights_from_tensor(update, None))[:2])
            except asyncio.CancelledError:
                raise  # given up on (a worker is gone): nothing there would answer the end
            except BaseException:
                await tm.end_weight_update(EndWeightUpdateReqInput(), None)
                raise
            await tm.end_weight_update(EndWeightUpdateReqInput(), None)
            return out  # type: ignore[return-value]

        async def session(tm: Any) -> tuple[bool, str]:
            import asyncio

            task = asyncio.ensure_future(body(tm))  # what _abandon cancels
            result["task"] = (asyncio.get_running_loop(), task)
            return await task

        def run() -> None:
            try:
                result["sglang"] = self._run(session)
            except BaseException as e:
                result["error"] = e

        thread = threading.Thread(target=run, name=f"weightsync-sglang-{self.name}", daemon=True)
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        with self._lock:
            thread.start()
            while thread.is_alive():
                thread.join(0.2)
                dead = [(k, pid) for k, pid in enumerate(self._pids) if not _alive(pid)]
                if dead:
                    k, pid = dead[0]
                    self._abandon(result)
                    raise RuntimeError(
                        f"SGLang replica {self.name!r}: TP worker {k} (receiver rank {self._rank_offset + k}, "
                        f"pid {pid}) is gone (during {op})"
                    )
                if time.monotonic() > deadline:
                    self._abandon(result)
                    raise TimeoutError(
                        f"SGLang replica {self.name!r}: {op} did not return within {timeout:.0f} s"
                    )
        if "error" in result:
            raise result["error"]
        statuses = self._read_statuses()
        ok, message = result["sglang"]
        if not ok:
            # The weights may have changed, but SGLang did not finish (a cache it could not
            # flush would serve KV computed with the old weights): never reported whole.
            for s in statuses:
                s.update(ok=False, mixed=True, error=f"SGLang: {message}")
        elif flush:  # SGLang's flag: it flushed the cache the old weights produced
            for s in statuses:
                s["caches_reset"] = True
        return statuses

    @staticmethod
    def _abandon(result: dict[str, Any]) -> None:
        """Cancel a command given up on: its coroutine would wait for a dead worker forever
        and keep the event loop that every engine of this process shares running."""
        if "task" in result:
            loop, task = result["task"]
            loop.call_soon_threadsafe(task.cancel)

    def _read_statuses(self, missing_ok: bool = False) -> list[dict[str, Any]]:
        out = []
        for k in range(self.workers()):
            try:
                with open(os.path.join(self.status_dir, f"{k}.json")) as f:
                    out.append(json.load(f))
            except FileNotFoundError:
                if missing_ok:
                    out.append({"rank": None, "version": None, "mixed": False})
                    continue
                out.append({"ok": False, "version": None, "error": f"TP worker {k} wrote no status"})
        pids = [s.get("pid") for s in out]
        if all(isinstance(p, int) for p in pids):
            self._pids = pids
        return out

    def close(self) -> None:
        shutil.rmtree(self.status_dir, ignore_errors=True)


def versioned(output: dict[str, Any]) -> VersionedOutput:
    """One finished SGLang response (``{"output_ids": ..., "meta_info": ...}``) with the
    versions that sampled its tokens, read from SGLang's own account: its per-token spans
    (``meta_info["weight_versions"]``: SGLang records, at each ``weight_version`` change that
    weightsync makes after an update, how many tokens every live request holds), else the
    one ``weight_version`` it reports for the whole response."""
    meta, tokens = output["meta_info"], tuple(output["output_ids"])
    if meta.get("weight_versions"):
        spans = spans_of_json(meta["weight_versions"])
    else:
        spans = [(0, version_of(str(meta["weight_version"])))] if tokens else []
    return VersionedOutput(output, (tuple(spans),), (tokens,))


class SGLangRollout(Rollout):
    """``Rollout`` over SGLang replicas (``SGLangReplica``): ``update`` (``mode``: ``keep``
    or ``abort``), reports, ``add_replica``/``remove_replica``, deadlines,
    ``ReplicaUpdateError`` naming each failed replica. Streamed updates only: SGLang
    replicas declare no staged, LoRA or KV-release updates, and the rollout refuses them
    before anything moves."""
