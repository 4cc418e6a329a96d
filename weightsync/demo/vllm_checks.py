"""What ``weightsync demo --rollout vllm`` checks besides greedy parity, each against a
reference of its own:

- ``--arch moe --trainers M``: a version that leaves one expert's matrix out
  (``shards_without``) must fail after the load, naming it, before the same version is sent
  complete.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.demo.plain import DemoFailed
from weightsync.plan import TensorSpec

#: the expert matrix the MoE demo's incomplete version leaves out (``--arch moe --trainers M``)
LEFT_OUT = "model.layers.1.mlp.experts.3.up_proj.weight"


def leaves_expert_out(opts: Any, step: int) -> bool:
    """Whether this step of the demo first sends the version without ``LEFT_OUT``: the tiny
    MoE fed by FSDP2 ranks over ``sharded``, at its last step (the version is trained: a
    load that took it would serve a mix)."""
    return opts.model is None and opts.arch == "moe" and opts.trainers > 1 and step == opts.steps


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # an FSDP2 DTensor: gathered (every rank runs it)
    return (full() if full is not None else t).detach()


def shards_without(
    model: torch.nn.Module, trainers: int, rank: int, left_out: str = LEFT_OUT
) -> dict[str, Any]:
    """Trainer rank ``rank``'s ``Shard(0)`` part of ``model``'s checkpoint form (one matrix per
    expert; gathered: a collective) without ``left_out``: a full version missing one expert's
    matrix, as a trainer that builds its own state dict could send one."""
    from weightsync.sharding.typical import held, trainer_boxes
    from weightsync.wire.checkpoint import converted_items

    state = dict(converted_items(model, model.state_dict(), _whole))
    if left_out not in state:
        raise DemoFailed(f"the model's checkpoint form has no {left_out!r} to leave out")
    del state[left_out]
    specs = [TensorSpec.of(n, t) for n, t in state.items()]
    return held(state, trainer_boxes(specs, trainers, rank))


def check_left_out(error: BaseException | None, report: Any, tp: int, left_out: str = LEFT_OUT) -> None:
    """The version without ``left_out`` failed after the load on every worker, naming it (the
    post-load check: vLLM counts a layer's experts as one parameter, written by the others),
    and the replica reports a mix of two versions."""
    if error is None:
        raise DemoFailed(
            f"a full version without {left_out} was taken: the replica serves a mix and says it does not"
        )
    for rep in report.replicas:
        text = rep.error or ""
        if text.count(left_out) < tp or "did not carry" not in text:  # every worker names it
            raise DemoFailed(f"{rep.name}: the version without {left_out} failed without naming it: {text}")
        if rep.ok or rep.version is not None or not rep.mixed:
            raise DemoFailed(
                f"{rep.name}: after the version without {left_out}: ok {rep.ok}, version {rep.version}, "
                f"mixed {rep.mixed} (expected a mix, not taken)"
            )
