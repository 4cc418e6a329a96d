"""What ``weightsync demo --rollout vllm`` checks besides greedy parity, each against a
reference of its own:

- ``--tp T`` over ``backend=sharded`` (the tiny model): the slices each worker's dry run
  derived, and the bytes each worker received, against a table worked out here from the
  model's config and vLLM's tensor-parallel split rule (``tp_reads``), not from the dry run;
- ``--trainers M``: each version's bytes in the replica against the same replica's own
  reload (``weightsync_reload_from_path``) of the trainer's ``save_pretrained``
  (``reload_matches``; the FSDP2 model gathered to save it);
- ``--arch moe --trainers M``: a version that leaves one expert's matrix out
  (``shards_without``) must be refused by every worker before anything moves, naming it,
  the replicas still on the version before, and then the same version sent complete serves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.demo.plain import DemoFailed
from weightsync.plan import TensorSpec
from weightsync.sharding.layout import Box

#: the expert matrix the MoE demo's incomplete version leaves out (``--arch moe --trainers M``)
LEFT_OUT = "model.layers.1.mlp.experts.3.up_proj.weight"

#: vLLM pads a vocabulary to a multiple of this before splitting it (``DEFAULT_VOCAB_PADDING_SIZE``)
VOCAB_PADDING = 64


def leaves_expert_out(opts: Any, step: int) -> bool:
    """Whether this step of the demo first sends the version without ``LEFT_OUT``: the tiny
    MoE fed by FSDP2 ranks over ``sharded``, at its last step (the version is trained: a
    load that took it would serve a mix)."""
    return opts.model is None and opts.arch == "moe" and opts.trainers > 1 and step == opts.steps


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # an FSDP2 DTensor: gathered (every rank runs it)
    return (full() if full is not None else t).detach()


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every DTensor gathered whole: a collective every trainer
    rank runs at the same point."""
    return {name: _whole(t) for name, t in model.state_dict().items()}


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


def check_left_out(
    error: BaseException | None, report: Any, tp: int, before: dict[str, int | None], left_out: str = LEFT_OUT
) -> None:
    """The version without ``left_out`` was refused by every worker before anything moved,
    naming it (the route's tensors checked against the served model's checkpoint: vLLM counts
    a layer's experts as one parameter, which the others would have written), and each replica
    still serves the version it served before (``before``: by replica name), not a mix."""
    if error is None:
        raise DemoFailed(
            f"a full version without {left_out} was taken: the replica serves a mix and says it does not"
        )
    for rep in report.replicas:
        text = rep.error or ""
        if text.count(left_out) < tp or "does not carry" not in text:  # every worker names it
            raise DemoFailed(f"{rep.name}: the version without {left_out} failed without naming it: {text}")
        if rep.ok or rep.version != before[rep.name] or rep.mixed:
            raise DemoFailed(
                f"{rep.name}: after the version without {left_out}: ok {rep.ok}, version {rep.version}, "
                f"mixed {rep.mixed} (expected refused, still on version {before[rep.name]})"
            )


def tp_reads(spec: TensorSpec, rank: int, tp: int, config: Any) -> list[Box]:
    """The boxes of ``spec`` (a tensor of the demo's Qwen2 or Qwen3-MoE as transformers holds
    it) that vLLM's loaders on tensor-parallel rank ``rank`` of ``tp`` read, from the model's
    config and vLLM's split rule: column-parallel rows (``q_proj``, ``gate_proj``/``up_proj``,
    each half of a fused ``experts.gate_up_proj`` per expert), row-parallel columns
    (``o_proj``, ``down_proj``, ``experts.down_proj``), k/v heads split or, fewer than the
    ranks, the rank's head replicated, the vocabulary padded to 64 and split, the router and
    norms whole. A tensor no rule names fails the check (no guess)."""
    shape, name = tuple(spec.shape), spec.name
    whole = Box.whole(shape)

    def along(dim: int, start: int, n: int) -> Box:
        starts = [0] * len(shape)
        lengths = list(shape)
        starts[dim], lengths[dim] = start, n
        return Box(tuple(starts), tuple(lengths))

    def split(dim: int, offset: int = 0, size: int | None = None) -> Box:
        size = shape[dim] if size is None else size
        if size % tp:
            raise DemoFailed(f"{name}: {size} does not split over {tp} ranks")
        part = size // tp
        return along(dim, offset + rank * part, part)

    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows then up rows
        inter = shape[1] // 2
        return [split(1, 0, inter), split(1, inter, inter)]
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        return [split(2)]
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
        return [split(0)]
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        kv = config.num_key_value_heads
        if kv >= tp:
            return [split(0)]
        head = shape[0] // kv
        return [along(0, (rank // (tp // kv)) * head, head)]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return [split(1)]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per = math.ceil(shape[0] / VOCAB_PADDING) * VOCAB_PADDING // tp
        start = min(rank * per, shape[0])
        return [along(0, start, min(per, shape[0] - start))]
    if name.endswith(("norm.weight", "mlp.gate.weight")):
        return [whole]
    raise DemoFailed(f"no tensor-parallel rule here for {name} {list(shape)}")


def covering(boxes: Sequence[Box]) -> Box:
    """The smallest box covering ``boxes`` (what a worker asks for: one box per tensor)."""
    starts = tuple(min(b.starts[d] for b in boxes) for d in range(len(boxes[0].starts)))
    ends = tuple(max(b.ends[d] for b in boxes) for d in range(len(boxes[0].starts)))
    return Box(starts, tuple(e - s for s, e in zip(starts, ends)))


def tp_table(specs: Sequence[TensorSpec], tp: int, config: Any) -> list[dict[str, Box]]:
    """Each worker's box of every tensor, by ``tp_reads``."""
    return [{s.name: covering(tp_reads(s, rank, tp, config)) for s in specs} for rank in range(tp)]


def table_bytes(specs: Sequence[TensorSpec], boxes: Mapping[str, Box]) -> int:
    return sum(boxes[s.name].numel * s.torch_dtype.itemsize for s in specs)


def check_slices(
    name: str, workers: Sequence[Mapping[str, Any]], specs: Sequence[TensorSpec], table: list[dict[str, Box]]
) -> None:
    """Each worker's dry-run boxes (``weightsync_slices``) are the table's, tensor by tensor,
    and nothing is taken whole."""
    if len(workers) != len(table):
        raise DemoFailed(f"{name}: {len(workers)} workers derived slices, the table has {len(table)}")
    for rank, (worker, want) in enumerate(zip(workers, table)):
        if worker["whole_tensors"]:
            raise DemoFailed(f"{name} TP rank {rank} takes tensors whole: {worker['whole_tensors']}")
        for spec in specs:
            got = Box.from_wire(worker["boxes"][spec.name])
            if got != want[spec.name]:
                raise DemoFailed(
                    f"{name} TP rank {rank}: the dry run keeps {got} of {spec.name}, vLLM's split rule {want[spec.name]}"
                )


def reload_matches(
    llm: Any, state: Mapping[str, torch.Tensor], model_dir: str, disk: str, first: bool
) -> list[str]:
    """The replica's tensors as synced equal its own reload of ``state`` saved by
    transformers' ``save_pretrained`` (the demo's model class) into ``disk``, on every worker;
    ``first``: the reload is shown to write (from the first checkpoint the synced tensors
    differ). Returns the expert tensors compared (MoE: each layer's ``w13_weight``/``w2_weight``)."""
    from transformers import AutoModelForCausalLM

    synced = llm.collective_rpc("weightsync_digests")
    if first:
        llm.collective_rpc("weightsync_reload_from_path", args=(model_dir,))
        if llm.collective_rpc("weightsync_digests") == synced:
            raise DemoFailed("vLLM's reload of the first checkpoint changed nothing: it is no reference")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(dict(state), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise DemoFailed(
            f"the gathered state does not fit the model: missing {missing}, unexpected {unexpected}"
        )
    ref.save_pretrained(disk)
    llm.collective_rpc("weightsync_reload_from_path", args=(disk,))
    reloaded = llm.collective_rpc("weightsync_digests")
    for rank, (a, b) in enumerate(zip(synced, reloaded)):
        differ = sorted(n for n in a if b.get(n) != a[n])
        if differ or a.keys() != b.keys():
            raise DemoFailed(
                f"worker {rank}: the synced tensors differ from vLLM's reload of save_pretrained: {differ[:4]}"
            )
    return sorted(n for n in synced[0] if n.endswith(("w13_weight", "w2_weight")))
