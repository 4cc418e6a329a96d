"""The trainer's update call over a set of replicas of any engine.

    rollout = VLLMRollout([LLMReplica(llm_a), LLMReplica(llm_b)], ["backend=nccl"])
    report = rollout.update(model, version=step, mode="keep")   # pause, sync, resume
    rollout.stage(model, version=step + 1)   # into host memory while the replicas generate
    rollout.commit(step + 1)                 # pause, load locally, resume

``Rollout`` drives replicas through the ``Replica`` protocol alone (``replica``);
``VLLMRollout`` and ``SGLangRollout`` are this class under their engines' names. Each
worker of each replica is one weightsync receiver. ``update`` pauses every replica, syncs
the version through one ``Sender`` while every replica receives it, and resumes; each
engine drops the caches computed with the old weights as the load returns, and one that did
not stays paused and failed. A failed update raises ``ReplicaUpdateError`` naming each
failed replica: replicas whose weights are intact are resumed, replicas left with a mix of
two versions stay paused until a later update succeeds. Staged updates (``stage`` +
``commit``) and LoRA-only updates (``update_lora``) go to replicas that declare them
(``Replica.capabilities``); an update that needs more than a replica declares is refused
before anything moves, naming the replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from weightsync.config.engine import EngineConfig
from weightsync.integrations.replicas.replica import PauseMode, Replica, check_mode, lacking, within
from weightsync.integrations.replicas.reports import ReplicaReport, ReplicaUpdateError, UpdateReport
from weightsync.sender.sender import Sender

log = logging.getLogger("weightsync.rollout")


class Rollout:
    """The trainer side for a set of replicas: one ``Sender``, one receiver per worker.

    Args:
        replicas: the engines (``Replica``: ``LLMReplica`` for vLLM, started with
            ``worker_extension_cls=EXTENSION``; ``SGLangReplica``).
        config: weightsync configuration (an ``EngineConfig`` or overrides such as
            ``["backend=nccl", "update_weights_bucket_megabytes=256"]``); the replicas get
            the same. The colocated ``naive`` backend cannot reach other processes.
        address: where the sender listens (``host:port``; port 0 picks a free one).
        wire_dtype: cast floating weights to this dtype for the wire (e.g. bf16 replicas
            fed from fp32 master weights).
        model: the trainer's weights as ``update`` will get them (an ``nn.Module`` or a
            state dict). The data plane that every worker joins here gets buffers sized by
            their names, shapes and dtypes, as a sync would size them; without it, the
            first update sizes them.
        initial_version: sync ``model``'s weights as this version before returning (an
            ``update`` with ``mode="keep"``; its report is ``initial_report``), verl's habit
            of filling replicas started from dummy or stale weights at init. It also pays
            vLLM's first ``reload_weights`` in each worker (kernels and memory set up for
            the first time: 2.7x a steady update at 392 MB in BENCHMARKS.md), which the
            first training step's update would otherwise pay. A failure raises
            ``ReplicaUpdateError``.
        lora_keep: LoRA updates keep the adapters of this many earlier versions loaded
            beside the new one (requests holding them finish with them); 0 replaces the
            adapter in place. The replicas need ``max_loras`` and ``max_cpu_loras`` of at
            least ``lora_keep + 1`` (checked at the first LoRA update).
        lora_name: LoRA updates name each version's adapter ``{lora_name}-v{version}``.
        num_trainers: trainer ranks that send (``backend=sharded``, ``paired``): this object is
            trainer rank 0; every other rank sends its shards in step with a
            ``Sender(config, rollout.sender.address, rollout.num_receivers, rank=r,
            num_trainers=M)``. By default the world size of ``torch.distributed`` (1 without).

    ``backend=sharded`` with tensor-parallel replicas: each worker takes only the slices its
    own loaders keep (``weightsync.integrations.vllm_slices``: learned here when ``model``
    is given, else at the first streamed update), straight from the trainer ranks that hold
    them.

    Creating it connects every worker and forms the data plane (``weightsync_init`` with
    ``warm_up`` while the sender runs ``Sender.warm_up``), so the first update pays for
    neither.
    """

    def __init__(
        self,
        replicas: list[Replica],
        config: EngineConfig | list[str],
        *,
        address: str = "127.0.0.1:0",
        wire_dtype: Any = None,
        model: Any = None,
        initial_version: int | None = None,
        lora_keep: int = 1,
        lora_name: str = "weightsync-lora",
        num_trainers: int | None = None,
    ) -> None:
        if lora_keep < 0:
            raise ValueError(f"lora_keep={lora_keep}: expected 0 (in place) or more earlier versions kept")
        self.lora_keep, self.lora_name = lora_keep, lora_name
        #: the replicas whose base weights are known to be the trainer's: reached by a full
        #: update (``initial_version`` too), or checked by digest at a LoRA update
        self._base_known: set[str] = set()
        self._lora_loads = 0  # LoRA versions loaded: the next one's slot
        if initial_version is not None and model is None:
            raise ValueError("initial_version needs model: the weights to sync as that version")
        if not replicas:
            raise ValueError("a rollout needs at least one replica")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.from_overrides(config)
        if self.config.backend == "naive":
            raise ValueError(
                "backend 'naive' hands tensors over inside one process; an engine's workers are other "
                "processes: use backend=nccl (Gloo on CPU) or another transport"
            )
        self.replicas = list(replicas)
        if self.config.update_mode == "staged":
            self._require("staged", "update_mode=staged (staged updates; update_mode=stream streams them)")
        self._first_rank: dict[str, int] = {}
        rank = 0
        for r in self.replicas:
            self._first_rank[r.name] = rank
            rank += r.workers()
        # every worker is a receiver rank: replica r's TP rank k is ``_first_rank[r] + k``
        self._next_rank = rank  # an added replica's first; a rank is never given twice
        self.sender = Sender(
            self.config, address, num_receivers=rank, rank=0, num_trainers=num_trainers, wire_dtype=wire_dtype
        )
        # A thread per replica's call, and one for the sender's warm-up
        self._pool = ThreadPoolExecutor(
            max_workers=len(self.replicas) + 1, thread_name_prefix="weightsync-replica"
        )
        # The secret never travels over the engine's RPC (and to_flat masks it): each replica takes
        # it from its own WEIGHTSYNC_SECRET, as the trainer should.
        flat = {k: v for k, v in self.config.to_flat().items() if k != "auth_secret"}
        self._overrides = overrides = [f"{k}={'null' if v is None else v}" for k, v in flat.items()]
        self._paused: set[str] = set()
        # Every worker connects and joins the data plane now, while the sender warms up:
        # the first update pays for neither.
        calls = [
            self._pool.submit(
                r.call,
                "weightsync_init",
                self.sender.address,
                self._first_rank[r.name],
                overrides,
                True,
                timeout=self.config.timeout_s * 2 + 30,
            )
            for r in self.replicas
        ]
        calls.append(self._pool.submit(self.sender.warm_up, model))
        # The first failure ends the wait (a replica refusing its configuration does not
        # leave the sender waiting for it until timeout_s).
        done, pending = wait(calls, timeout=self.config.timeout_s * 2 + 40, return_when=FIRST_EXCEPTION)
        failed = [f for f in calls if f in done and f.exception() is not None]
        if failed or pending:
            self.close()
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            raise TimeoutError(
                f"weightsync_init of the replicas did not return within {self.config.timeout_s * 2 + 40:.0f} s"
            )
        #: ``backend=sharded``: each worker's slices, by replica (``weightsync_slices``'s summary)
        self.slices: dict[str, list[dict[str, Any]]] = {}
        if (
            model is not None
            and getattr(self.sender.engine_cls, "sharded", False)
            and not lacking(self.replicas, "slices")
        ):
            try:
                self.learn_slices(model)
            except BaseException:
                self.close()
                raise
        #: the report of the ``initial_version`` sync (None without one)
        self.initial_report: UpdateReport | None = None
        if initial_version is not None:
            try:
                self.initial_report = self.update(model, initial_version, mode="keep")
            except BaseException:
                self.close()
                raise

    def learn_slices(self, model: Any) -> dict[str, list[dict[str, Any]]]:
        """``backend=sharded``: have every worker derive the slices it keeps of ``model``'s
        tensors (a dry run of its loaders, ``weightsync.integrations.vllm_slices``); by
        replica, each worker's boxes, bytes kept and the tensors it takes whole, and why."""
        from weightsync.sharding.agreement import ShardSource

        self._require("slices", "learning the slices each worker keeps")
        specs = [s.to_wire() for s in ShardSource.of(model, form=self.sender.form).specs()]
        futures = {
            r.name: self._pool.submit(r.call, "weightsync_slices", specs, timeout=self.config.timeout_s)
            for r in self.replicas
        }
        self.slices = {name: fut.result() for name, fut in futures.items()}
        for name, workers in self.slices.items():
            for rank, w in enumerate(workers):
                if w["whole_tensors"]:
                    log.info(
                        "replica %s TP rank %d takes %d tensor(s) whole: %s",
                        name,
                        rank,
                        len(w["whole_tensors"]),
                        w["whole_tensors"],
                    )
        return self.slices

    # ------------------------------------------------------------------ the update
    def update(
        self,
        source: Any,
        version: int,
        *,
        mode: PauseMode = "keep",
        release_kv_cache: bool = False,
        staged: bool | None = None,
        lora: bool = False,
        partial: bool = False,
    ) -> UpdateReport:
        """Bring every replica to ``version`` from ``source``; return the report.

        Streamed (``update_mode=stream``, the default): pause every replica, stream the
        version into the running models, resume. Staged (``update_mode=staged`` or
        ``staged=True``): ``stage`` while the replicas generate, then ``commit`` (generation
        pauses only for the local load); a failed stage raises before anything is paused.

        ``source``: an ``nn.Module``, a state dict or ``(name, tensor)`` iterable in
        checkpoint (Hugging Face) names. ``mode``: ``keep`` freezes in-flight requests and
        continues them after the resume, ``abort`` drops them, ``wait`` lets them finish
        first. Raises ``ReplicaUpdateError`` (naming every failed replica) if any replica
        does not end on ``version``.

        ``lora=True``: ``source`` is a PEFT model (or a ``weightsync.lora.LoRAAdapter``) and
        only its LoRA adapter moves (``update_lora``); ``mode`` and ``staged`` do not apply,
        nothing is paused.

        Every worker checks the update against what its loader reports it loaded: a tensor
        the engine did not take (an unknown name, a name or layout its loader skips) fails
        it, and so does a parameter the version left unwritten unless ``partial=True`` (the
        caller sends only some tensors; the others stay as they are). The error names the
        replica, the worker and the tensors; the replica then holds a mix and stays paused.
        """
        if lora:
            return self.update_lora(source, version)
        self._check_pause(mode, release_kv_cache)
        if self.config.update_mode == "staged" if staged is None else staged:
            staging = self.stage(source, version)
            report = self.commit(version, mode=mode, release_kv_cache=release_kv_cache, partial=partial)
            report.phase, report.stage_s, report.stats = "staged", staging.sync_s, staging.stats
            return report
        return self._pause_around(
            version,
            mode,
            release_kv_cache,
            "update",
            lambda failures: self._stream(source, version, failures, partial),
        )

    def update_lora(self, source: Any, version: int) -> UpdateReport:
        """Load the LoRA adapter of ``source`` (a PEFT model or ``LoRAAdapter``) as
        ``version`` into every replica, from memory, while they generate; the report's
        ``lora_request`` is the ``LoRARequest`` to generate with.

        The adapter's tensors are staged in every worker (the engine keeps stepping), then
        each worker builds vLLM's adapter from them and puts it in the next of
        ``lora_keep + 1`` slots (the adapter of version N - lora_keep - 1 leaves). It checks
        the replicas' LoRA limits and, for each replica no full update (``initial_version``
        too) reached and none checked before, that its checkpoint holds the trainer's base
        weights (by value, in whatever dtype each side holds them, ``base_difference`` of
        ``weightsync.lora``; a mismatch is refused before any adapter moves). A failure
        raises ``ReplicaUpdateError``; a replica whose load failed serves its previous adapters.
        """
        from weightsync.lora import lora_adapter

        self._require("lora", "LoRA updates")
        if getattr(self.sender.engine_cls, "sharded", False):
            raise ValueError(
                "LoRA updates send the adapter whole to every worker: use another backend than sharded "
                "(nccl, shm, mooncake, paired) for a rollout that updates adapters"
            )
        adapter = lora_adapter(source)
        unknown = [r for r in self.replicas if r.name not in self._base_known]
        if unknown and adapter is source:
            raise ValueError(
                f"the base weights of replica(s) {', '.join(repr(r.name) for r in unknown)} are not known to "
                "be the trainer's: a LoRA update checks them against their checkpoint, so pass the PEFT "
                "model (a LoRAAdapter carries no base), or send the base once as a full update, e.g. "
                f"{type(self).__name__}(..., model=dict(weightsync.lora.base_weights(peft_model)), initial_version=0)"
            )
        self._check_lora(adapter, source if unknown else None, unknown)
        self._base_known.update(r.name for r in unknown)
        report = UpdateReport(version, phase="lora")
        slot = 1 + self._lora_loads % (self.lora_keep + 1)
        name = f"{self.lora_name}-v{version}"
        t0 = time.perf_counter()
        failures, sync_error = self._stage_and_send(
            "weightsync_stage_adapter", adapter.tensors, version, report
        )
        # each worker waits for its stage to end (the sender is done: at once), then loads
        calls = self._start_each(
            "weightsync_load_adapter",
            version,
            name,
            slot,
            adapter.config,
            self.config.timeout_s,
            skip=failures,
        )
        statuses = self._results(calls, failures)
        report.sync_s = time.perf_counter() - t0
        for r in self.replicas:
            status = statuses.get(r.name) or []
            error = failures.get(r.name) or next((s["error"] for s in status if s.get("error")), None)
            report.replicas.append(ReplicaReport.of_adapter(r.name, status, error, version))
        serving = [r for r in self.replicas if any(rep.ok and rep.name == r.name for rep in report.replicas)]
        if serving:  # the replicas that serve it: generate with it there
            self._lora_loads += 1
            report.lora_request = serving[0].lora_request(name, slot)
        self._leave_lost(report)
        if not report.ok:
            self._raise(report, sync_error, "LoRA update to", "its previous adapters")
        log.info("%s", report.summary())
        return report

    def _check_lora(self, adapter: Any, base: Any, unknown: list[Replica]) -> None:
        """The replicas' LoRA limits against ``adapter`` and ``lora_keep``; with ``base``, the
        trainer's base weights against the checkpoint of each replica in ``unknown``."""
        from weightsync.lora import base_weights
        from weightsync.verify import named_digests

        need = self.lora_keep + 1
        for r in self.replicas:
            for limits in r.call("weightsync_lora_limits", adapter.rank, timeout=self.config.timeout_s):
                short = [k for k in ("max_loras", "max_cpu_loras") if (limits.get(k) or need) < need]
                if short:
                    raise ValueError(
                        f"replica {r.name!r}: {', '.join(f'{k}={limits[k]}' for k in short)}, but lora_keep="
                        f"{self.lora_keep} keeps {need} adapters loaded: start it with max_loras >= {need} "
                        f"(and max_cpu_loras >= {need}), or lower lora_keep"
                    )
                if adapter.rank > limits["max_lora_rank"]:
                    raise ValueError(
                        f"replica {r.name!r}: the adapter's rank {adapter.rank} is above its max_lora_rank "
                        f"{limits['max_lora_rank']}: {limits['start']}"
                    )
        if base is None:
            return
        digests = named_digests(base_weights(base))
        for r in unknown:
            r.call("weightsync_lora_check_base", digests, timeout=self.config.timeout_s * 4 + 60)

    def stage(self, source: Any, version: int) -> UpdateReport:
        """Move ``version`` from ``source`` into every worker's staging copy (host memory,
        allocated at the first stage and reused) while the replicas keep generating; return
        once it is complete and checked (``verify``) on every worker.

        Nothing the replicas serve changes, and nothing is paused: a stage that fails (the
        source raising, a lost or silent peer, a refused version) raises
        ``ReplicaUpdateError`` with every replica still serving its current version.
        ``commit`` then loads the staged version. With ``delta`` on, the staging copies are
        the delta base: later stages apply deltas into them.
        """
        self._require("staged", "staged updates")
        report = UpdateReport(version, phase="stage")
        t0 = time.perf_counter()
        failures, sync_error = self._stage_and_send("weightsync_stage", source, version, report)
        statuses = {r.name: self._staged(r, failures) for r in self.replicas}
        report.sync_s = time.perf_counter() - t0
        for r in self.replicas:
            rep = ReplicaReport.of_workers(r.name, statuses[r.name], failures.get(r.name))
            rep.ok = rep.ok and rep.staged == version
            if not rep.ok and rep.error is None:
                rep.error = next(
                    (s.get("stage_error") for s in statuses[r.name] or () if s.get("stage_error")), None
                )
            report.replicas.append(rep)
        self._leave_lost(report)
        if not report.ok:
            self._raise(report, sync_error, "stage of", "untouched, generating")
        log.info("%s", report.summary())
        return report

    def _stage_and_send(
        self, method: str, source: Any, version: int, report: UpdateReport
    ) -> tuple[dict[str, str], Exception | None]:
        """Start a background stage (``method``) in every replica, then send ``version``
        (its stats into ``report``); the replicas whose stage did not start, and the
        sender's error."""
        failures: dict[str, str] = {}
        for r in self.replicas:
            try:
                r.call(method, version, timeout=self.config.timeout_s)
            except Exception as e:
                failures[r.name] = f"staging did not start: {type(e).__name__}: {e}"
        if failures:  # the others wait for a sync that will not come: end their wait
            self.sender.cancel(version, "; ".join(failures.values()))
            return failures, None
        try:
            report.stats = self.sender.send(source, version)
        except Exception as e:
            return failures, e
        return failures, None

    def _staged(self, replica: Replica, failures: dict[str, str]) -> list[dict[str, Any]] | None:
        """The replica's status once its workers' stage ended (polled: a call that waited in
        the workers would hold the engine's step loop)."""
        deadline = time.monotonic() + self.config.timeout_s * 2 + 30  # the receivers' own deadlines end first
        while True:
            try:
                status = replica.call("weightsync_staged", 0.0, timeout=self.config.timeout_s)
            except Exception as e:
                failures.setdefault(replica.name, f"{type(e).__name__}: {e}".strip())
                return None
            if not any(s.get("staging") for s in status):
                return status
            if time.monotonic() > deadline:
                failures.setdefault(replica.name, "its workers were still staging at the deadline")
                return status
            time.sleep(0.05)

    def commit(
        self, version: int, *, mode: PauseMode = "keep", release_kv_cache: bool = False, partial: bool = False
    ) -> UpdateReport:
        """Pause every replica, load the staged ``version`` from host memory through the
        engine's own reload (vLLM's ``reload_weights``), resume. Refused before pausing anything unless every replica
        holds ``version`` staged and complete. A replica whose load fails is left a mix of
        two versions and paused (as a failed streamed update leaves it); the others serve
        ``version``. Checked as ``update`` is (``partial``: the staged version may leave
        parameters as they are)."""
        self._require("staged", "staged updates")
        self._check_pause(mode, release_kv_cache)
        missing = [
            f"replica {rep.name!r} has {'no complete version' if rep.staged is None else f'version {rep.staged}'} staged"
            for rep in self.status()
            if rep.staged != version
        ]
        if missing:
            raise ValueError(f"cannot commit version {version}: " + "; ".join(missing) + " (stage it first)")

        def load(failures: dict[str, str]) -> tuple[dict[str, Any], Exception | None]:
            statuses = self._results(self._start_each("weightsync_commit", version, partial), failures)
            for r in self.replicas:
                if r.name in failures:
                    statuses[r.name] = self._ask_status(r)
            return statuses, None

        return self._pause_around(version, mode, release_kv_cache, "commit", load)

    def _stream(
        self, source: Any, version: int, failures: dict[str, str], partial: bool = False
    ) -> tuple[dict[str, Any], Exception | None]:
        """Stream ``version`` into the paused replicas' running models."""
        futures = self._start_each("weightsync_receive", version, partial)
        sync_error: Exception | None = None
        try:
            self._last_stats = self.sender.send(source, version)
        except Exception as e:
            sync_error = e
        return self._results(futures, failures), sync_error

    def _start_each(self, method: str, *args: Any, skip: Container[str] = ()) -> dict[str, Future]:
        """``method`` called in every replica (but those in ``skip``) at once, a thread each,
        with a deadline past the receivers' own."""
        timeout = self.config.timeout_s * 2 + 30
        return {
            r.name: self._pool.submit(r.call, method, *args, timeout=timeout)
            for r in self.replicas
            if r.name not in skip
        }

    def _results(self, futures: dict[str, Future], failures: dict[str, str]) -> dict[str, Any]:
        """Each call's result; a replica that went away or timed out goes into ``failures``."""
        statuses = {}
        for name, fut in futures.items():
            try:
                statuses[name] = fut.result(timeout=self.config.timeout_s * 2 + 40)
            except Exception as e:
                failures[name] = f"{type(e).__name__}: {e}".strip()
        return statuses

    def _pause_around(
        self,
        version: int,
        mode: PauseMode,
        release_kv_cache: bool,
        phase: str,
        middle: Callable[[dict[str, str]], tuple[dict[str, Any], Exception | None]],
    ) -> UpdateReport:
        """Pause every replica, run ``middle`` (it fills ``failures``; returns each
        replica's status and the sender's error), resume the replicas left whole."""
        report = UpdateReport(version, phase=phase)
        failures: dict[str, str] = {}
        self._last_stats = None
        t0 = paused_at = time.perf_counter()
        for r in self.replicas:
            step = "pause"
            try:
                within(lambda r=r: r.pause(mode), self.config.timeout_s, f"pausing replica {r.name!r}")
                self._paused.add(r.name)
                if release_kv_cache:
                    step = "releasing the KV cache"
                    r.release_kv_cache()
            except Exception as e:
                failures[r.name] = f"{step} failed: {type(e).__name__}: {e}"
        report.pause_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        sync_error: Exception | None = None
        statuses: dict[str, Any] = {}
        started = not failures
        if started:
            statuses, sync_error = middle(failures)
            report.stats = self._last_stats
        report.sync_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        for r in self.replicas:
            status = statuses.get(r.name)
            if status is None and r.name in failures and not started:
                status = self._ask_status(r)  # stopped before the sync: weights untouched
            rep = ReplicaReport.of_workers(r.name, status, failures.get(r.name))
            if rep.ok and sync_error is not None and rep.version != version:
                rep.ok = False
            # New weights, old caches: the engine drops them as the load returns and says so
            # (``caches_reset``); one that did not would serve KV blocks of the old version,
            # so it stays paused.
            stale = started and rep.ok and rep.version == version and not rep.caches_reset
            if stale:
                rep.ok = False
                rep.error = rep.error or (
                    f"its engine did not reset its prefix cache after loading version {version} (vLLM: is "
                    "the weightsync plugin, entry point vllm.general_plugins, loaded in its engine core?): "
                    "kept paused"
                )
            # Resume only a replica whose workers answered and hold one whole version; one
            # that did not answer (its worker died) would not answer the resume either.
            if status is not None and not rep.mixed and not stale and r.name in self._paused:
                try:
                    if release_kv_cache and r.name not in failures:
                        within(
                            r.restore_kv_cache, self.config.timeout_s, f"restoring the KV cache of {r.name!r}"
                        )
                    within(r.resume, self.config.timeout_s, f"resuming replica {r.name!r}")
                    self._paused.discard(r.name)
                    rep.resumed = True
                except Exception as e:
                    rep.ok, rep.error = False, rep.error or f"resume failed: {type(e).__name__}: {e}"
            report.replicas.append(rep)
            if rep.ok and rep.version == version:
                self._base_known.add(r.name)
            elif rep.mixed or status is None:
                self._base_known.discard(r.name)
        report.resume_s = time.perf_counter() - t0
        report.paused_s = time.perf_counter() - paused_at
        self._leave_lost(report)
        if not report.ok:
            self._raise(report, sync_error, "update to" if phase == "update" else "commit of", "")
        log.info("%s", report.summary())
        return report

    def _require(self, capability: str, what: str) -> None:
        """Refuse, before anything moves, what a replica does not declare it takes."""
        missing = lacking(self.replicas, capability)
        if missing:
            raise ValueError(
                f"{what}: replica(s) {', '.join(map(repr, missing))} do not take them (capabilities "
                f"{sorted(next(r for r in self.replicas if r.name == missing[0]).capabilities)})"
            )

    def _check_pause(self, mode: str, release_kv_cache: bool) -> None:
        check_mode(mode)
        modes = [r.name for r in self.replicas if mode not in r.pause_modes]
        if modes:
            raise ValueError(
                f"mode={mode!r}: replica(s) {', '.join(map(repr, modes))} have no such pause mode"
            )
        if release_kv_cache:
            self._require("release_kv_cache", "release_kv_cache=True")

    def _raise(self, report: UpdateReport, sync_error: Exception | None, what: str, intact: str) -> None:
        """Raise ``ReplicaUpdateError`` naming every replica that did not end where asked."""
        workers = {r.name: (self._first_rank[r.name], r.workers()) for r in self.replicas}
        raise ReplicaUpdateError.of(report, sync_error, what, intact, self._first_rank, workers)

    def _ask_status(self, replica: Replica) -> list[dict[str, Any]] | None:
        try:
            return replica.call("weightsync_status", timeout=self.config.timeout_s)
        except Exception:
            return None

    # ------------------------------------------------------------------ membership
    def add_replica(self, replica: Replica) -> None:
        """Take ``replica`` into every later update. Its workers get receiver ranks no
        replica had before and join at the next update, which brings it to that version (a
        delta sync goes dense to it); until then it serves what it holds. A LoRA update
        first checks its checkpoint against the trainer's base, unless a full update reached
        it."""
        if any(r.name == replica.name for r in self.replicas):
            raise ValueError(f"a replica named {replica.name!r} is in the rollout already")
        if self.config.update_mode == "staged" and "staged" not in replica.capabilities:
            raise ValueError(f"update_mode=staged: replica {replica.name!r} does not take staged updates")
        first = self._next_rank
        replica.call(
            "weightsync_init",
            self.sender.address,
            first,
            self._overrides,
            False,
            timeout=self.config.timeout_s,
        )
        self._next_rank += replica.workers()
        for rank in range(first, first + replica.workers()):
            self.sender.add_receiver(rank)
        self._first_rank[replica.name] = first
        self.replicas.append(replica)
        self._membership_changed()

    def remove_replica(self, name: str) -> Replica:
        """Leave replica ``name`` out of every later update (scaled down, or lost) and return
        it. It keeps serving what it holds (one left paused with a mix of versions stays
        paused); its workers close their session where they still answer (waiting at most
        30 s, less with a shorter ``timeout_s``). ``add_replica`` takes it back."""
        replica = next((r for r in self.replicas if r.name == name), None)
        if replica is None:
            raise ValueError(
                f"no replica {name!r} in the rollout (replicas: {[r.name for r in self.replicas]})"
            )
        if len(self.replicas) == 1:
            raise ValueError(f"replica {name!r} is the rollout's last: an update needs at least one")
        self._leave(replica)
        wait_s = min(self.config.timeout_s, 30.0)  # a lost replica may never answer
        try:
            within(
                lambda: replica.call("weightsync_close", timeout=wait_s),
                wait_s,
                f"closing the session of replica {name!r}",
            )
        except Exception as e:  # lost: nothing there to close
            log.warning("replica %r left without closing its session: %s", name, e)
        return replica

    def _leave(self, replica: Replica) -> None:
        first = self._first_rank[replica.name]  # kept: a report may still name its ranks
        for rank in range(first, first + replica.workers()):
            self.sender.remove_receiver(rank)
        self.replicas.remove(replica)
        self.slices.pop(replica.name, None)
        self._paused.discard(replica.name)
        self._base_known.discard(replica.name)
        self._membership_changed()

    def _leave_lost(self, report: UpdateReport) -> None:
        """``drop_lost_receivers``: a replica the sender dropped (a worker lost mid-sync)
        leaves the rollout, so later updates go to the others instead of calling it and
        failing again; its report says so."""
        dropped = set(self.sender.dropped)
        for rep in report.replicas:
            replica = next((r for r in self.replicas if r.name == rep.name), None)
            if replica is None or len(self.replicas) == 1:
                continue
            first = self._first_rank[rep.name]
            if dropped & set(range(first, first + replica.workers())):
                self._leave(replica)
                rep.left = True

    def _membership_changed(self) -> None:
        self._pool.shutdown(wait=False)  # a thread per replica's call, as at the start
        self._pool = ThreadPoolExecutor(len(self.replicas) + 1, thread_name_prefix="weightsync-replica")

    # ------------------------------------------------------------------ state
    @property
    def num_receivers(self) -> int:
        """Receiver ranks every update goes to: one per worker of every replica."""
        return self.sender.num_receivers

    def status(self) -> list[ReplicaReport]:
        """Every replica's current version (asked from its workers)."""
        out = []
        for r in self.replicas:
            try:
                st = r.call("weightsync_status", timeout=self.config.timeout_s)
                rep = ReplicaReport.of_workers(r.name, st, None)
                rep.ok = rep.version is not None and not rep.mixed
                out.append(rep)
            except Exception as e:
                out.append(ReplicaReport(r.name, version=None, ok=False, error=f"{type(e).__name__}: {e}"))
        return out

    def close(self) -> None:
        """Close the sender; replicas keep serving their current weights."""
        self.sender.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
