"""A trainer process for tests/test_vllm_trainer.py: vLLM's factory with weightsync, one
version sent to a server, then the next one staged and held under way until the test kills
this process."""

from __future__ import annotations

import time


def send_then_stage_and_hold(
    url: str, port: int, model_dir: str, version: int, overrides: list[str], q
) -> None:
    """Send ``version`` (the weights in ``model_dir``) to the server, saying ("sent", version);
    then stage ``version + 1`` (the same weights nudged), its transfer held after its first
    tensors, saying ("staging", version + 1) once it is: the test kills this process then."""
    import threading

    import torch
    import workers
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo  # registers the trainer engine

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        info = WeightsyncTrainerInitInfo(
            master_address="127.0.0.1", master_port=port, world_size=2, rank=0, overrides=overrides
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
        )
        engine.send_weights(version=version)
        q.put(("sent", version))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-2)
        source = engine.source = workers.HeldSource(dict(model.state_dict()), hold_s=120)
        threading.Thread(
            target=lambda: (source.holding.wait(), q.put(("staging", version + 1))), daemon=True
        ).start()
        engine.stage_weights(version + 1)
        q.put(("staged", version + 1))  # not reached: the test kills this process first
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise
    while True:
        time.sleep(1)
