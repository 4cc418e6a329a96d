"""After vLLM's in-place reload (``reload_weights``, layerwise): what weightsync adds around
it in a worker, both for the worker extension and the weight-transfer engine. A reload that
succeeded gets the modules tied to an earlier one's weight processed again; a reload that
raised is finalized, so the replica still runs. These follow vLLM's reload internals
(checked against vLLM 0.32) and change when those do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("weightsync.vllm")


def reprocess_tied(model: torch.nn.Module, vllm_config: Any) -> None:
    """Redo the post-load processing of modules whose weight is tied to an earlier one's.

    vLLM's layerwise reload processes a layer when its own weights arrive. A tied lm_head
    gets none (the checkpoint carries only the embedding), so where the backend keeps a
    processed copy (the CPU backend packs linear weights into an opaque form, vLLM 0.32) it
    would go on computing logits with the old weights although its parameter is new.
    """
    from vllm.config import set_current_vllm_config

    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    with set_current_vllm_config(vllm_config):
        for modules in owners.values():
            for module in modules[1:]:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)


def finalize_reload(model: torch.nn.Module, vllm_config: Any) -> None:
    """After a reload that raised: put every layer back on its own tensors (vLLM moved
    them to the meta device for loading), so the replica still runs."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    try:
        with set_current_vllm_config(vllm_config):
            finalize_layerwise_reload(model, vllm_config.model_config)
    except Exception:  # best effort: the original error is the one to report
        log.exception("weightsync: could not finalize the interrupted reload")
