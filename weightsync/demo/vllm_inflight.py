"""``weightsync demo --rollout vllm --in-flight``: the in-flight demo
(``weightsync.demo.inflight``, where its check is described) on vLLM replicas, prefix
caching on with blocks of ``BLOCK`` tokens."""

from __future__ import annotations

from typing import Any

from weightsync.demo.inflight import BLOCK, NEW_TOKENS, Engine, run_in_flight
from weightsync.demo.vllm import VLLMDemoOptions, prepare_demo, start_replicas


def run_in_flight_demo(opts: VLLMDemoOptions, console: Any = None) -> list[Any]:
    """Run the in-flight demo on vLLM replicas; raise ``DemoFailed`` on any mismatch."""
    from vllm import SamplingParams

    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout

    setup = prepare_demo(opts, console)
    llms = start_replicas(
        opts, setup.console, setup.model_dir, setup.max_len, enable_prefix_caching=True, block_size=BLOCK
    )
    replicas = [LLMReplica(llm, f"replica{i}") for i, llm in enumerate(llms)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = Engine(
        generate=lambda replica, prompts: replica.generate(
            [{"prompt_token_ids": p} for p in prompts], params
        ),
        under_way=_under_way,
        name="vLLM",
    )
    with VLLMRollout(
        replicas, setup.config, address=opts.address, model=setup.model, initial_version=0
    ) as rollout:
        return run_in_flight(
            engine,
            replicas,
            rollout,
            setup.model,
            steps=opts.steps,
            seed=opts.seed,
            new_tokens=opts.new_tokens,
            console=setup.console,
        )


def _under_way(replica: Any, tokens: int) -> bool:
    """A request of ``replica`` in flight with ``tokens`` generated and more to come, read
    from vLLM 0.32's front-end request states, which the generating thread advances."""
    try:
        states = list(replica.llm.llm_engine.output_processor.request_states.values())
    except RuntimeError:  # the generating thread changed the dict meanwhile
        return False
    return any(tokens <= s.detokenizer.num_output_tokens() < NEW_TOKENS - tokens for s in states)
