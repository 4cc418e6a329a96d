"""vLLM's weight-sync client calls made on an ``LLM`` of the test's own process, for the
tests that drive vLLM's trainer-side factory (``WeightTransferTrainerFactory``)."""

from __future__ import annotations


class LLMClient:
    """vLLM's weight-sync client calls, made on an ``LLM`` of this process (as vLLM's Ray
    client makes them on an actor holding one)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version=None) -> None:
        self.llm.finish_weight_update(weight_version)
