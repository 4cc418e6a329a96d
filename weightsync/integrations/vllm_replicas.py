"""A vLLM engine as the trainer side drives it: ``LLMReplica`` over vLLM's offline ``LLM``
(the ``Replica`` protocol of ``weightsync.integrations.replicas.replica``), and the worker
extension it is started with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.integrations.replicas.replica import PAUSE_MODES, PauseMode, loaded

if TYPE_CHECKING:
    from weightsync.integrations.replicas.versions import VersionedOutput

EXTENSION = "weightsync.integrations.vllm.WeightsyncWorkerExtension"


class LLMReplica:
    """A ``vllm.LLM`` (started with ``worker_extension_cls=EXTENSION``) as a replica.

    Pausing is vLLM's level-0 sleep (scheduling only: weights and KV cache stay, and it
    clears no cache: the engine core resets the prefix cache as the load returns,
    ``weightsync.integrations.vllm_caches.reset_served_caches``); ``release_kv_cache`` frees the
    KV cache memory until ``restore_kv_cache``.

    Every token the engine samples carries the version that sampled it: a version loaded
    by ``weightsync_receive`` or ``weightsync_commit`` becomes the engine's weight-version
    label before the rollout resumes it, and ``generate`` returns each request's version
    spans (``weightsync.integrations.vllm_versions``). One thread may generate while
    another updates the replica (the engine's client is shared, ``share_client``).
    """

    #: vLLM has every pause mode
    pause_modes = PAUSE_MODES

    def __init__(self, llm: Any, name: str | None = None) -> None:
        from vllm.platforms import current_platform

        from weightsync.integrations.vllm_versions import share_client

        self.llm = llm
        self.name = name or f"vllm-{id(llm):x}"
        share_client(llm)
        # vLLM 0.32's CPU worker refuses to release the KV cache ("Selective discard is not
        # supported on CPU") and then stops scheduling: not declared there.
        self.capabilities = frozenset(
            {"staged", "lora", "slices"} | (set() if current_platform.is_cpu() else {"release_kv_cache"})
        )

    def workers(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def pause(self, mode: PauseMode) -> None:
        self.llm.sleep(level=0, mode=mode)

    def resume(self) -> None:
        self.llm.wake_up(tags=["scheduling"])

    def release_kv_cache(self) -> None:
        if "release_kv_cache" not in self.capabilities:  # the CPU backend: see __init__
            raise NotImplementedError("vLLM cannot release the KV cache on the CPU backend")
        self.llm.release_kv_cache_memory()

    def restore_kv_cache(self) -> None:
        self.llm.wake_up(tags=["kv_cache"])

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        statuses = self.llm.collective_rpc(method, timeout=timeout, args=args)
        if method in LOADS and loaded(statuses, args[0]):
            # Paused, between the load and the resume: the first token the new weights
            # sample is the first one labelled with their version.
            from weightsync.integrations.vllm_versions import label_engine

            label_engine(self.llm, args[0])
        return statuses

    def lora_request(self, name: str, slot: int) -> Any:
        """The ``LoRARequest`` to generate with the adapter a LoRA update loaded as ``name``
        in ``slot``."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, slot, lora_path=f"weightsync://{name}")

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[VersionedOutput]:
        """``LLM.generate`` with the versions that sampled every request's tokens
        (``VersionedOutput``: vLLM's output and its spans ``[(first_token_index, version)]``);
        ``kwargs`` go to ``LLM.generate``."""
        from weightsync.integrations.vllm_versions import generate

        return generate(self.llm, prompts, sampling_params, **kwargs)


#: the worker calls that load a version into the weights the engine serves
LOADS = ("weightsync_receive", "weightsync_commit")
