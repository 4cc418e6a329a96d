"""A trainer process for tests/test_vllm_trainer.py: vLLM's factory with weightsync, one
version sent to a server, then it holds (as a trainer between steps) until it is killed."""

from __future__ import annotations

import time


def send_one_version_and_hold(
    url: str, port: int, model_dir: str, version: int, overrides: list[str], q
) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightsyncTrainerInitInfo

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
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        raise
    while True:  # the test kills this process here, its sender still open
        time.sleep(1)


def stage_slowly(url: str, port: int, model_dir: str, version: int, overrides: list[str], q) -> None:
    """Stage ``version`` to the server, 0.5 s per tensor; says ("staging", version) once the
    transfer is under way (the test kills this process then)."""
    import threading

    import torch
    import workers
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightsyncTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-2)
    info = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1", master_port=port, world_size=2, rank=0, overrides=overrides
    )
    source = workers.SlowSource(dict(model.state_dict()), delay_s=0.5)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url), source=source
    )
    threading.Thread(target=lambda: (source.started.wait(), q.put(("staging", version))), daemon=True).start()
    engine.stage_weights(version)
    q.put(("staged", version))  # not reached: the test kills this process first
