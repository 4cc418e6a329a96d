"""Which weights sampled each token a replica serves, whatever the engine.

A replica's engine holds a weight-version label that weightsync sets to the version it
loaded, while the replica is paused (after the load, before the resume), and stamps every
token it samples with the label it held then. A request's versions come back as spans,
``[(first_token_index, version), ...]``: vLLM 0.32's ``CompletionOutput.weight_versions``
(``weightsync.integrations.vllm_versions``), SGLang 0.5.23's ``meta_info["weight_versions"]``
(``weightsync.integrations.sglang``), and both engines' HTTP servers in the same JSON shape
(``spans_of_json``). ``VersionedOutput`` carries an engine's own output beside them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: ``(first_token_index, version)``: the output tokens from ``first_token_index`` up to the
#: next span's first index were sampled by ``version`` (None: weights no weightsync update
#: gave the engine, e.g. its checkpoint at start)
Span = tuple[int, "int | None"]

#: the label of an engine no one labelled (vLLM's ``EngineCore._weight_version``, SGLang's
#: ``weight_version`` default)
UNLABELLED = "default"


def version_of(label: str) -> int | None:
    """The weightsync version an engine's label names (None: unlabelled)."""
    if label == UNLABELLED:
        return None
    try:
        return int(label)
    except ValueError:
        raise ValueError(
            f"the engine labels its tokens {label!r}: not a weightsync version (someone else set "
            "the engine's weight_version)"
        ) from None


def spans_of_json(weight_versions: Sequence[Mapping[str, Any]]) -> list[Span]:
    """The version spans of one output as the engines' servers and SGLang's ``meta_info``
    give them (``[{"version": "7", "start": 0, "end": 41}, ...]``: vLLM's
    ``POST /inference/v1/generate`` of ``vllm serve --enable-scale-out``, each choice's
    ``weight_versions``; SGLang's ``meta_info["weight_versions"]``)."""
    return [
        (int(s["start"]), version_of(str(s["version"]))) for s in weight_versions if s["end"] > s["start"]
    ]


def expand(spans: Sequence[Span], num_tokens: int) -> list[int | None]:
    """One version per token from ``spans``: what an importance-sampling correction indexes."""
    out: list[int | None] = []
    bounds = [start for start, _ in spans[1:]] + [num_tokens]
    for (start, version), end in zip(spans, bounds):
        out.extend([version] * (end - start))
    return out


@dataclass(frozen=True)
class VersionedOutput:
    """An engine's output of one request (vLLM's ``RequestOutput``, SGLang's output dict)
    and, for each of its completions (vLLM's ``n``), the token ids it generated and the
    versions that sampled them."""

    output: Any
    spans: tuple[tuple[Span, ...], ...]
    tokens: tuple[tuple[int, ...], ...]

    @property
    def versions(self) -> set[int | None]:
        """Every version that sampled a token of this request."""
        return {version for spans in self.spans for _, version in spans}

    def token_versions(self, index: int = 0) -> list[int | None]:
        """The version of each generated token of completion ``index``."""
        return expand(self.spans[index], len(self.tokens[index]))
