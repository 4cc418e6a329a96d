"""A trainer process for tests/test_vllm_trainer.py: vLLM's factory with weightsync, one
version sent to a server, then it holds (as a trainer between steps) until it is killed."""

from __future__ import annotations

import time


def send_one_version_and_hold(url: str, port: int, model_dir: str, version: int, overrides: list[str], q) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        info = WeightsyncTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                                         overrides=overrides)
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
        engine.send_weights(version=version)
        q.put(("sent", version))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise
    while True:  # the test kills this process here, its sender still open
        time.sleep(1)
