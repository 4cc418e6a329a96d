"""LoRA adapters on a vLLM worker: each version lands from memory into vLLM's LoRA manager.

vLLM 0.32 loads an adapter only from a directory (``LoRARequest.lora_path``, read by the
worker's ``WorkerLoRAManager._load_adapter``). A LoRA sync writes no file: the adapter's
tensors arrive into a staging store (``Stager``, in the background while the engine
generates), then ``AdapterSlots.load`` builds vLLM's ``LoRAModel`` from them
(``LoRAModel.from_lora_tensors``, the same constructor its directory loader ends in), and
adds it to the worker's adapter manager under the id the trainer chose, pinned: vLLM's LRU
never evicts it, so a request that names it never makes vLLM look for ``lora_path`` on disk.
The ids rotate over ``keep + 1`` slots (``VLLMRollout``'s ``lora_keep``): loading version N
replaces only the adapter of version N - keep - 1, and requests still holding an adapter of
the last ``keep`` versions finish with it.

The new adapter is built completely (and checked against the engine's LoRA limits) before
the manager is touched, so a load that fails leaves the previous adapters serving.

A full update's reload makes vLLM drop every adapter (``reset_lora_state``: it would read
them again from their paths). There are no paths here, and a request naming a dropped
adapter ends the engine (``LoRAAdapterNotFoundError``), so each slot keeps its adapter's
tensors and ``restore`` adds them again after the reload: the adapters then apply to the
new base weights, as vLLM's own reload from a path would.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def engine_lora_rank(rank: int) -> int:
    """The ``max_lora_rank`` to start a vLLM engine with for adapters of rank up to
    ``rank``: the smallest value vLLM accepts that holds it. vLLM takes only some values
    (0.32: 1, 8, 16, 32, 64, 128, 256, 320, 512, its ``vllm.config.lora.MaxLoRARanks``) and
    refuses others with a bare validation error, while adapters of rank 2, 4, 12 or 24 are
    common; an adapter keeps its own rank (vLLM's LoRA layers take any rank up to
    ``max_lora_rank``). Raises ``ValueError`` above the largest value vLLM accepts."""
    from typing import get_args

    from vllm.config import lora

    allowed = sorted(get_args(getattr(lora, "MaxLoRARanks", None)))
    if not allowed:  # a vLLM that takes any value
        return rank
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(
            f"LoRA rank {rank}: vLLM serves adapters up to max_lora_rank {allowed[-1]}, the largest "
            f"value it accepts ({', '.join(map(str, allowed))})"
        )
    return fits[0]


def start_for_rank(rank: int) -> str:
    """What to start an engine with for adapters of ``rank``, for messages."""
    try:
        return f"start it with max_lora_rank={engine_lora_rank(rank)}"
    except ValueError as e:
        return str(e)


class AdapterSlots:
    """The LoRA adapters weightsync loaded into one vLLM worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        # lora id -> (adapter name, config, tensors): what the slot holds now, kept unmodified
        # for ``restore`` (vLLM may scale the tensors it was handed in place)
        self.loaded: dict[int, tuple[str, dict[str, Any], dict[str, Any]]] = {}
        # every adapter name loaded here: vLLM's prefix cache keys a request's KV blocks by
        # its adapter's name and path, so a name loaded again with other weights (the same
        # version sent anew) would find the old adapter's blocks
        self.names: set[str] = set()

    def _manager(self) -> Any:
        runner = self.worker.model_runner
        manager = getattr(runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError(
                "weightsync: this vLLM replica was started without LoRA: start it with "
                "enable_lora=True (and max_loras >= lora_keep + 1) for a LoRA sync"
            )
        return manager

    def limits(self) -> dict[str, Any]:
        """The engine's LoRA limits (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``)."""
        config = self._manager().lora_config
        return {
            "max_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
            "max_cpu_loras": config.max_cpu_loras,
        }

    def check_base(self, trainer: dict[str, str]) -> dict[str, Any]:
        """Hold the checkpoint this replica loaded against the trainer's base weights
        (``named_digests`` of ``weightsync.lora.base_weights``): every tensor of the
        checkpoint's safetensors files must hold the trainer's values, exactly, in whatever
        dtype each side keeps them (``weightsync.lora.base_difference``). Raises
        ``ValueError`` naming the tensors that differ (and how) or that the trainer lacks."""
        from safetensors import safe_open

        from weightsync.lora import base_difference

        t0 = time.perf_counter()
        root = Path(self.worker.vllm_config.model_config.model)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        if not files:
            raise ValueError(
                f"weightsync: LoRA sync without the base weights, but this replica's model {str(root)!r} "
                "has no safetensors files to check the trainer's base against; send the base once "
                "(VLLMRollout(..., model=..., initial_version=...)) instead"
            )
        checked = 0
        differ: dict[str, str] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names = f.keys()  # a safetensors handle is not iterable
                for name in names:
                    checked += 1
                    if name not in trainer:
                        differ[name] = "missing on the trainer"
                    elif (why := base_difference(trainer[name], f.get_tensor(name))) is not None:
                        differ[name] = why
        if differ:
            shown = ", ".join(f"{n} ({differ[n]})" for n in sorted(differ)[:3])
            raise ValueError(
                f"weightsync: the trainer's base model is not the checkpoint this replica loaded "
                f"({root}): {len(differ)} of {checked} tensors differ: {shown}"
                + (" ..." if len(differ) > 3 else "")
            )
        return {"base_tensors_checked": checked, "base_check_s": time.perf_counter() - t0}

    def load(
        self, name: str, lora_id: int, config: dict[str, Any], tensors: list[tuple[str, Any]]
    ) -> dict[str, Any]:
        """Build the adapter from ``tensors`` (PEFT names; copied, the staging store is reused)
        and put it in slot ``lora_id`` in place of what that slot held, pinned.
        ``lora_name_reused``: ``name`` was loaded before (the engine core then resets its
        prefix cache, ``weightsync.integrations.vllm_caches.reset_served_caches``)."""
        t0 = time.perf_counter()
        kept = {n: t.clone() for n, t in tensors}
        lora = self._build(name, lora_id, config, kept)
        adapters = self._manager()._adapter_manager  # noqa: SLF001 -- vLLM 0.32: only the model manager takes an in-memory LoRAModel
        adapters.remove_adapter(lora_id)  # the slot's previous adapter (version N - keep - 1)
        adapters.add_adapter(lora)
        adapters.pin_adapter(lora_id)
        self.loaded[lora_id] = (name, config, kept)
        reused = name in self.names
        self.names.add(name)
        return {
            "lora_id": lora_id,
            "lora_name": name,
            "lora_load_s": time.perf_counter() - t0,
            "lora_name_reused": reused,
        }

    def restore(self) -> int:
        """After a full update's reload (which made vLLM drop every adapter): add the
        adapters the slots held again, pinned; returns how many."""
        if not self.loaded:
            return 0
        adapters = self._manager()._adapter_manager  # noqa: SLF001 -- vLLM 0.32: only the model manager takes an in-memory LoRAModel
        for lora_id, (name, config, kept) in sorted(self.loaded.items()):
            adapters.remove_adapter(lora_id)
            adapters.add_adapter(self._build(name, lora_id, config, kept))
            adapters.pin_adapter(lora_id)
        return len(self.loaded)

    def _build(self, name: str, lora_id: int, config: dict[str, Any], tensors: dict[str, Any]) -> Any:
        """vLLM's ``LoRAModel`` of adapter ``name`` for ``tensors`` (PEFT names; copied
        again, so ``tensors`` stays as it came), checked against the engine's limits."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self._manager()
        helper = PEFTHelper.from_dict(
            {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        helper.validate_legal(manager.lora_config)  # rank and features, before anything changes
        adapters = manager._adapter_manager  # noqa: SLF001 -- vLLM 0.32: only the model manager takes an in-memory LoRAModel
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id,
            {n: t.clone() for n, t in tensors.items()},
            helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        known = set(adapters.supported_lora_modules) | {
            m for packed in adapters.packed_modules_mapping.values() for m in packed
        }
        unknown = sorted({m.rsplit(".", 1)[-1] for m in lora.loras} - known)
        if unknown:
            raise ValueError(
                f"weightsync: adapter {name!r} targets modules this model has no LoRA layer for: {unknown}"
            )
        return lora
