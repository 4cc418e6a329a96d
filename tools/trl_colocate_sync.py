"""TRL 1.16's own colocate sync (VLLMGeneration.sync_weights: load_weights per parameter into
the trainer process's LLM) against weightsync's (VLLMRollout.update into a replica process),
same tiny model, CPU. Run: PYTHONPATH=. .venv/bin/python tools/trl_colocate_sync.py"""

import os
import statistics
import tempfile
import time


def main():
    from trl import GRPOTrainer

    from weightsync.demo.trl import TRLDemoOptions, build, grpo_config, target_reward

    opts = TRLDemoOptions()
    tmp = tempfile.mkdtemp()
    parts = build(tmp, opts, replica_names=())
    cfg = grpo_config(os.path.join(tmp, "out"), opts)
    cfg.vllm_mode = "colocate"
    cfg.vllm_max_model_length = 128
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    t = GRPOTrainer(
        model=parts["model"],
        reward_funcs=target_reward,
        args=cfg,
        train_dataset=parts["dataset"],
        processing_class=parts["tokenizer"],
    )
    gen = t.vllm_generation
    times = []
    for i in range(6):
        t0 = time.perf_counter()
        try:
            gen.sync_weights()
        except Exception as e:  # what TRL's own sync does here, measured
            print(
                f"TRL colocate sync_weights #{i} failed after {time.perf_counter() - t0:.3f} s: {type(e).__name__}: {e}"
            )
            return
        times.append(time.perf_counter() - t0)
    print(
        "TRL colocate sync_weights s:", [round(x, 4) for x in times], "median", statistics.median(times[1:])
    )


if __name__ == "__main__":
    main()
