"""The weight version of every sample a vLLM replica serves, per token where a request
crosses an update.

    outs = replica.generate(prompts, params)          # an ``LLMReplica`` of a ``VLLMRollout``
    for out in outs:
        out.output                    # vLLM's own ``RequestOutput``
        out.spans[0]                  # [(0, 6), (41, 7)]: tokens 0..40 by version 6, 41.. by 7
        out.token_versions(0)         # [6, 6, ..., 7, 7]: one per generated token

Where the versions come from: vLLM 0.32's engine core holds a weight-version label
(``set_weight_version``) and stamps it on every step's outputs; the front end's output
processor starts a new span for a request at the count of output tokens it holds when the
label of that request's outputs changes (``CompletionOutput.weight_versions``). The label is
what the engine itself held when it sampled each token, so no span depends on when anyone
read anything. ``VLLMRollout`` sets the label to the version it loaded while the replica is
paused, after the load and before the resume: a request kept across the update
(``mode="keep"``) has its tokens before the pause under the old label and those after under
the new one, and a request admitted while a version is being staged runs under the version
served, since the label changes only at the commit. A replica left paused with a mix of
two versions keeps its old label and samples nothing until an update succeeds.

A token sampled after an update under ``keep`` comes from the new weights over a context
whose KV the new weights computed: the update resets the prefix cache, which preempts the
requests kept across it, and each computes its KV again when it resumes
(``weightsync.integrations.vllm_caches``). The spans, the output and ``VersionedOutput`` are
engine-neutral (``weightsync.integrations.replicas.versions``).
"""

from __future__ import annotations

import threading
from typing import Any

from weightsync.integrations.replicas.versions import Span, VersionedOutput, version_of


def label_engine(llm: Any, version: int) -> None:
    """Label ``llm``'s engine with ``version``: every token it samples from now on carries it.
    Call it only while the engine is paused (tokens of a step in flight would take it)."""
    llm.llm_engine.set_weight_version(str(version))


def engine_label(llm: Any) -> int | None:
    """The version ``llm``'s engine labels its tokens with now (None: never labelled)."""
    return version_of(llm.llm_engine.get_weight_version())


def spans_of(completion: Any) -> list[Span]:
    """The version spans of one finished ``CompletionOutput`` (``[]`` with no tokens).

    Raises ``ValueError`` where vLLM reported none for its tokens (an unfinished output, or
    an engine without per-token versions) or a label that is not a weightsync version."""
    reported = getattr(completion, "weight_versions", None)
    if reported is None:
        if not completion.token_ids:
            return []
        raise ValueError(
            "vLLM reported no weight versions for this output (versions come with finished "
            "outputs of vLLM 0.32 or later)"
        )
    spans = [(s.start, version_of(s.version)) for s in reported if s.end > s.start]
    covered = sum(s.end - s.start for s in reported)
    if covered != len(completion.token_ids):
        raise ValueError(f"vLLM's spans cover {covered} of {len(completion.token_ids)} tokens")
    return spans


def versioned(output: Any) -> VersionedOutput:
    """vLLM's ``RequestOutput`` of a finished request with the versions of its completions."""
    return VersionedOutput(
        output,
        tuple(tuple(spans_of(c)) for c in output.outputs),
        tuple(tuple(c.token_ids) for c in output.outputs),
    )


def generate(llm: Any, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> list[VersionedOutput]:
    """``llm.generate(prompts, sampling_params, **kwargs)`` with every request's versions.
    Safe beside a ``VLLMRollout`` updating ``llm`` from another thread once the engine's
    client is shared (``share_client``; ``LLMReplica`` does it)."""
    kwargs.setdefault("use_tqdm", False)
    return [versioned(o) for o in llm.generate(prompts, sampling_params, **kwargs)]


def share_client(llm: Any) -> None:
    """Let threads share ``llm``'s engine client: one generating, another pausing, calling
    the workers and resuming it for an update.

    vLLM's offline client (``SyncMPClient``) sends every request (a prompt added, a pause, a
    ``collective_rpc``) on one ZeroMQ socket without a lock, and ZeroMQ sockets are not
    thread-safe; its answers come back through a thread of its own and a queue, which are.
    Each send here takes a lock. Idempotent; an in-process client is left as it is."""
    client = llm.llm_engine.engine_core
    send = getattr(client, "_send_input", None)  # vLLM 0.32: every send to the engine core goes through it
    if send is None or getattr(send, "weightsync_lock", None) is not None:
        return
    lock = threading.Lock()

    def locked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return send(*args, **kwargs)

    locked.weightsync_lock = lock  # type: ignore[attr-defined]
    client._send_input = locked  # noqa: SLF001 -- vLLM 0.32: no lock of its own around the socket
