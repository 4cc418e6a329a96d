"""The experts a vLLM worker keeps under expert parallelism, read from its own layers.

Each MoE layer of a worker under ``enable_expert_parallel`` holds an ``ExpertMapManager``
whose ``expert_map`` gives every global (physical) expert id its local slot, -1 where another
rank holds it. vLLM 0.32's loader names a physical expert after a logical one by the initial
arrangement (``EplbState.build_initial_global_physical_to_logical_map``: the routed experts
in order, then the redundant ones round the logical ids), so that is the map a weight update
lands by: a checkpoint expert goes to every local slot whose physical id it names there.

After an EPLB rebalance the slots hold other experts than that arrangement says, and
vLLM's loader would land an expert's bytes in a slot that now serves another (vLLM PR
#55228 proposes refusing such updates). ``rebalanced`` names the first such slot; a worker
refuses the update before anything moves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync.sharding.experts import Slots, expert_of

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _initial(logical: int, redundant: int) -> list[int]:
    from vllm.distributed.eplb.eplb_state import EplbState

    return list(EplbState.build_initial_global_physical_to_logical_map(logical, redundant))


def _redundant(vllm_config: Any) -> int:
    eplb = getattr(vllm_config.parallel_config, "eplb_config", None)
    return int(getattr(eplb, "num_redundant_experts", 0) or 0)


def worker_slots(model: torch.nn.Module, vllm_config: Any) -> Slots | None:
    """This worker's expert slots as its loader fills them (None: no expert parallelism)."""
    if not getattr(vllm_config.parallel_config, "enable_expert_parallel", False):
        return None
    redundant = _redundant(vllm_config)
    layers: dict[int, tuple[int, ...]] = {}
    logical = 0
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        match = _LAYER.search(f".{name}.")
        if manager is None or match is None or int(match.group(1)) in layers or not manager.use_ep:
            continue
        expert_map = manager.expert_map
        if expert_map is None:
            continue
        logical = int(manager.global_num_experts) - redundant
        initial = _initial(logical, redundant)
        local = sorted((int(slot), p) for p, slot in enumerate(expert_map.tolist()) if slot >= 0)
        layers[int(match.group(1))] = tuple(initial[p] for _, p in local)
    return Slots(layers, logical) if layers else None


def foreign(slots: Slots | None, enable_expert_parallel: bool) -> Callable[[str], bool]:
    """Whether a checkpoint tensor is an expert's that this worker does not keep (its loader
    skips it by design). Without the worker's map under expert parallelism: every expert's."""
    if slots is None:
        return lambda name: enable_expert_parallel and ".experts." in name

    def check(name: str) -> bool:  # an expert id the model lacks is no rank's: never exempt
        where = expert_of(name)
        return (
            where is not None
            and where[0] in slots.layers
            and where[1] < slots.experts
            and not slots.holds(*where)
        )

    return check


def moved(tables: Sequence[Sequence[int]], layers: Sequence[int], redundant: int) -> str | None:
    """The first MoE layer (``layers[i]`` for row ``i``), physical slot and experts where a
    physical -> logical table (EPLB's, a row per MoE layer) differs from the arrangement
    vLLM's loader lands updates by; None where every slot holds what it assumes."""
    for index, row in enumerate(tables):
        initial = _initial(len(row) - redundant, redundant)
        for physical, (now, assumed) in enumerate(zip(row, initial)):
            if now != assumed:
                layer = layers[index] if index < len(layers) else index
                return (
                    f"layer {layer} physical slot {physical} holds expert {now} since a rebalance, where vLLM's "
                    f"loader lands expert {assumed}"
                )
    return None


def rebalanced(runner: Any, model: torch.nn.Module, vllm_config: Any) -> str | None:
    """``moved`` for the engine's own load balancer state (``runner.eplb_state``: none on
    vLLM 0.32's CPU build, which runs no EPLB; the GPU check exercises it)."""
    state = getattr(runner, "eplb_state", None)
    if state is None:
        return None
    layers = sorted(
        {
            int(match.group(1))
            for name, module in model.named_modules()
            if hasattr(module, "expert_map_manager") and (match := _LAYER.search(f".{name}."))
        }
    )
    for model_state in getattr(state, "model_states", {}).values():
        where = moved(model_state.physical_to_logical_map.tolist(), layers, _redundant(vllm_config))
        if where is not None:
            return where
    return None
