"""The slices a vLLM worker keeps of each checkpoint tensor, learned from its own loaders.

A worker of a tensor-parallel replica loads a checkpoint tensor by handing it whole to the
model's ``load_weights``, whose weight loaders narrow it to this rank's part (rows of a
column-parallel projection, columns of a row-parallel one, this rank's q, k and v heads of
a fused ``qkv_proj``, its vocabulary shard) and copy that part into a parameter. Here every
checkpoint tensor goes through ``load_weights`` once as a ``ReadRecorder``
(``weightsync.sharding.reads``): a stand-in without bytes that follows the loader's view
ops and notes the box each copy reads. The worker then asks the route for that box only,
and later hands ``reload_weights`` a tensor of the full shape whose box holds the received
bytes: the same loader narrows to the same box.

No table of models or layers: whatever a loader does is found by running it. Where it does
something a box cannot describe (arithmetic on the tensor, ``item()``, a concatenation), or
reads nothing while the dry run watches, the tensor is taken whole (``whole`` says why):
fail closed, never a guess.

The dry run uses vLLM's own layerwise reload setup (``initialize_layerwise_reload``: every
layer's parameters restored on the meta device in their checkpoint-loading shapes, as the
CPU backend's repacking or quantization left them otherwise), so loaders see what a reload
shows them; a layer whose loading would complete is never processed (``_Guard``), and
``finalize_layerwise_reload`` puts every layer back on its own tensors. It runs in the
worker's thread that vLLM's RPC calls (the engine is not stepping the model meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from weightsync.integrations.replicas.slices import Slices
from weightsync.integrations.vllm_experts import foreign as foreign_to
from weightsync.integrations.vllm_experts import worker_slots
from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box
from weightsync.sharding.reads import Unreducible, dry_run

log = logging.getLogger("weightsync.vllm")


class _WouldProcess(Unreducible):
    """The dry run would have completed a layer (and processed its absent weights)."""


@contextlib.contextmanager
def _guarded(layerwise: Any) -> Iterator[None]:
    """No layer is processed while loaders see stand-ins: a loader that copies anything
    real (and so would complete its layer) makes that tensor whole instead."""
    original = layerwise._layerwise_process  # noqa: SLF001 -- vLLM 0.32: no hook to stop layerwise processing

    def refuse(layer: torch.nn.Module, info: Any) -> None:
        raise _WouldProcess(f"loading it would complete {type(layer).__name__} in the dry run")

    layerwise._layerwise_process = refuse  # noqa: SLF001 -- vLLM 0.32: no hook to stop layerwise processing
    try:
        yield
    finally:
        layerwise._layerwise_process = original  # noqa: SLF001 -- vLLM 0.32: no hook to stop layerwise processing


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """vLLM's reload warns for every layer that loaded nothing: the dry run loads nothing."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def derive_slices(model: torch.nn.Module, vllm_config: Any, specs: Sequence[TensorSpec]) -> Slices:
    """Run ``model.load_weights`` once per checkpoint tensor of ``specs`` on stand-ins and
    return the box of each that this worker's loaders read."""
    import time

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise

    t0 = time.perf_counter()
    boxes: dict[str, Box] = {}
    whole: dict[str, str] = {}
    with set_current_vllm_config(vllm_config), _quiet(layerwise.__name__), torch.no_grad():
        layerwise.initialize_layerwise_reload(model)
        try:
            with _guarded(layerwise):
                for spec in specs:
                    box, why = dry_run(spec, lambda t, name=spec.name: model.load_weights([(name, t)]))
                    boxes[spec.name] = box
                    if why is not None:
                        whole[spec.name] = why
        finally:
            for layer in model.modules():  # nothing was loaded: every layer gets its own tensors back
                info = layerwise.get_layerwise_info(layer)
                if info.can_load():
                    info.load_numel = 0
            layerwise.finalize_layerwise_reload(model, vllm_config.model_config)
    # Under expert parallelism an expert another rank keeps reads nothing here (its loader
    # skips it by design): this worker asks for none of it, by the engine's own expert map.
    # An expert it keeps that read nothing stays whole (fail closed).
    foreign = foreign_to(worker_slots(model, vllm_config), False)
    for spec in specs:
        if foreign(spec.name):
            boxes.pop(spec.name, None)
            whole.pop(spec.name, None)
    slices = Slices(tuple(specs), boxes, whole, time.perf_counter() - t0)
    log.info(
        "weightsync: derived the slices of %d checkpoint tensors in %.2f s (%d taken whole)",
        len(specs),
        slices.seconds,
        len(whole),
    )
    return slices
