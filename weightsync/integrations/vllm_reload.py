"""After vLLM's in-place reload (``reload_weights``, layerwise): what weightsync adds around
it in a worker, both for the worker extension and the weight-transfer engine. A reload that
succeeded gets the modules tied to an earlier one's weight processed again; a reload that
raised is finalized, so the replica still runs. These follow vLLM's reload internals
(checked against vLLM 0.32) and change when those do.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightsync.integrations.replicas.receiver import NotTaken
from weightsync.integrations.vllm_experts import foreign, rebalanced, worker_slots
from weightsync.wire.checkpoint import checkpoint_pieces

log = logging.getLogger("weightsync.vllm")


def reprocess_tied(model: torch.nn.Module, vllm_config: Any) -> None:
    """Redo the post-load processing of modules whose weight is tied to an earlier one's.

    vLLM's layerwise reload processes a layer when its own weights arrive. A tied lm_head
    gets none (the checkpoint carries only the embedding), so where the backend keeps a
    processed copy (the CPU backend packs linear weights into an opaque form, vLLM 0.32) it
    would go on computing logits with the old weights although its parameter is new.
    """
    from vllm.config import set_current_vllm_config

    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    with set_current_vllm_config(vllm_config):
        for modules in owners.values():
            for module in modules[1:]:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)


def finalize_reload(model: torch.nn.Module, vllm_config: Any) -> None:
    """After a reload that raised: put every layer back on its own tensors (vLLM moved
    them to the meta device for loading), so the replica still runs."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    try:
        with set_current_vllm_config(vllm_config):
            finalize_layerwise_reload(model, vllm_config.model_config)
    except Exception:  # best effort: the original error is the one to report
        log.exception("weightsync: could not finalize the interrupted reload")


_COVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_cover(model: torch.nn.Module, vllm_config: Any) -> dict[str, frozenset[str]]:
    """What a full version of the served model carries, in transformers' terms: each tensor
    of its transformers form (ties once) -> the checkpoint names that carry it together
    (an MoE's fused stack: each expert's matrices; another tensor: its own name). Learned
    once per model from a meta-device instance of its transformers class and transformers'
    own conversion (``weightsync.wire.checkpoint``); empty where that cannot be built (a
    model transformers does not know): the parameter-level check then stands alone.

    Why: vLLM reports the parameters it wrote, and an MoE's experts are one parameter
    (``w13_weight``) to it: a version that left one expert's matrix out was reported as a
    complete write of that parameter."""
    if model in _COVERS:
        return _COVERS[model]
    cover: dict[str, frozenset[str]] = {}
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(vllm_config.model_config.hf_config)
        seen: set[int] = set()
        state = {}
        for name, t in hf.state_dict(keep_vars=True).items():
            if id(t) not in seen:  # a tie is carried once, under its first name
                seen.add(id(t))
                state[name] = t.detach()
        pieces: dict[str, set[str]] = {}
        for piece, (_, own) in checkpoint_pieces(hf, state).items():
            if own is not None:
                pieces.setdefault(own, set()).add(piece)
        cover = {own: frozenset(pieces.get(own, {own})) for own in state}
    except Exception:
        log.debug(
            "weightsync: no transformers form of the served model to check a full version by", exc_info=True
        )
    _COVERS[model] = cover
    return cover


def uncovered(cover: dict[str, frozenset[str]], fed: set[str], exempt: Callable[[str], bool]) -> list[str]:
    """Checkpoint names a full version should have carried and did not: of each tensor
    carried neither under its own name nor by all its pieces, the pieces that are absent."""
    missing = []
    for own, pieces in cover.items():
        if own in fed or pieces <= fed:
            continue
        missing.extend(sorted(p for p in pieces - fed if not exempt(p)))
    return missing


#: checkpoint quantization methods whose checkpoints name each matrix as transformers does
#: (``P.weight``, in FP8, its scales beside it under other names): a full version of such a
#: model is checked by the transformers form's names, as an unquantized one is
NAMED_AS_TRANSFORMERS = frozenset({"fp8"})


def unchecked_quantization(vllm_config: Any) -> str | None:
    """Why a full version of this replica's model cannot be checked against its checkpoint
    (``checkpoint_cover``), or None where it can: unquantized; quantized online (vLLM
    quantizes a complete unquantized checkpoint as it loads: the update carries what that
    checkpoint does); or a checkpoint quantized with a method in ``NAMED_AS_TRANSFORMERS``
    (its scales need not come: a version that leaves a scale out keeps the scale served,
    which only a partial FP8 update may do, and a sender of FP8 sends both).

    Other quantized checkpoints (``compressed-tensors``' ``weight_packed``, AWQ's and GPTQ's
    ``qweight``) carry matrices under names transformers' form lacks, so no full-version
    check can be made: such a full version is refused naming the method (an update that
    says ``partial=True`` is taken unchecked), where it was taken unchecked before."""
    model_config = vllm_config.model_config
    method = model_config.quantization
    if method is None:
        return None
    arch = getattr(model_config, "model_arch_config", None)
    in_checkpoint = getattr(arch, "quantization_config", None)
    if in_checkpoint is None:
        in_checkpoint = getattr(model_config.hf_config, "quantization_config", None)
    if in_checkpoint is None:  # online: the checkpoint is the unquantized one
        return None
    stored = in_checkpoint.get("quant_method") if isinstance(in_checkpoint, dict) else None
    if method in NAMED_AS_TRANSFORMERS or stored in NAMED_AS_TRANSFORMERS:
        return None
    return (
        f"weightsync cannot check that a full version carries every tensor of a checkpoint quantized as "
        f"{method!r} (its names are not transformers'; checked: unquantized, online quantization, "
        f"{', '.join(sorted(NAMED_AS_TRANSFORMERS))}): send it with partial=True to have it taken unchecked"
    )


def _foreign(model: torch.nn.Module, vllm_config: Any) -> Callable[[str], bool]:
    """Checkpoint tensors this worker's loader skips by design: under expert parallelism, the
    experts other ranks keep (by the engine's expert map, ``vllm_experts``)."""
    expert_parallel = bool(getattr(vllm_config.parallel_config, "enable_expert_parallel", False))
    return foreign(worker_slots(model, vllm_config), expert_parallel)


def full_version_vet(model: torch.nn.Module, vllm_config: Any) -> Callable[[Any], None]:
    """A receiver's ``vet`` for a full version: before anything moves, the offered tensors
    must carry every tensor of the served model's checkpoint (``checkpoint_cover``), or the
    sync is refused naming what it lacks, and the replica keeps serving what it holds. A
    quantized model's full version is checked the same way where its checkpoint names its
    matrices as transformers does, and refused where it cannot be checked
    (``unchecked_quantization``); under expert parallelism the experts other ranks keep are
    exempt (``checked_load`` says why)."""
    exempt = _foreign(model, vllm_config)

    def vet(specs: Any) -> None:
        if (why := unchecked_quantization(vllm_config)) is not None:
            raise ValueError(why)
        cover = checkpoint_cover(model, vllm_config)
        offered = {s.name for s in specs}
        absent = uncovered(cover, offered, exempt)
        if absent:
            known = set(cover).union(*cover.values())
            strangers = sorted(offered - known)  # a misspelling, say: named beside what it hides
            besides = (
                f"; it carries {len(strangers)} it does not know: {_listed(strangers)}" if strangers else ""
            )
            raise ValueError(
                f"the full version does not carry {len(absent)} tensor(s) of the served model's checkpoint: "
                f"{_listed(absent)}{besides} (an update that leaves parameters as they are must say partial=True)"
            )

    return vet


def _listed(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _Writes(TorchDispatchMode):
    """Elements written by ``copy_`` on this thread while active: what vLLM's layerwise
    reload counts as loaded (its ``CopyCounter``, vLLM 0.32), counted here across the
    whole ``load_weights`` call. Dispatch modes are per thread: the receiving thread's
    copies are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def update_vet(runner: Any, vllm_config: Any, partial: bool) -> Callable[[Any], None] | None:
    """A worker's ``vet`` for an update: a full version's (``full_version_vet``), and, where
    the engine runs a load balancer (EPLB), a refusal before anything moves once it moved an
    expert away from where vLLM's loader lands it (``vllm_experts.rebalanced``)."""
    model = runner.get_model()
    full = None if partial else full_version_vet(model, vllm_config)
    if getattr(runner, "eplb_state", None) is None:
        return full

    def vet(specs: Any) -> None:
        if (where := rebalanced(runner, model, vllm_config)) is not None:
            raise ValueError(
                f"the engine's load balancer moved its experts ({where}): vLLM 0.32's loader would land "
                "experts in slots that now hold others; refused before anything moves"
            )
        if full is not None:
            full(specs)

    return vet


@contextlib.contextmanager
def checked_load(
    model: torch.nn.Module, vllm_config: Any, *, where: str, partial: bool = False
) -> Iterator[set[str]]:
    """Around one reload of ``model``: fail it (``NotTaken``, after the reload returned)
    naming what the engine did not take. vLLM's own ``reload_weights`` only logs a warning
    for parameters not loaded, and a loader may skip a name silently (``AutoWeightsLoader``
    ignores any ``.bias`` a layer lacks): the update reported success while the replica
    served a mix of versions.

    - A tensor the engine did not take: ``model.load_weights`` (which ``reload_weights``
      calls once with the whole iterator) is wrapped for the reload, and so is the
      iterator handed to it. Loaders consume it one item at a time (a plain loop, or
      ``itertools.groupby`` in ``AutoWeightsLoader``, which pulls the next item only when
      asked for it), so what is written between handing out an item and being asked for
      the next is that item's doing. An item in whose window nothing was copied into the
      model (``_Writes``: vLLM's own measure of loading) was not taken: an unknown name a
      loader skips, or a layout it ignores. A loader that buffers items to write them later
      would be refused by this: fail closed, never a guess. Exempt: names of parameters
      tied to another one (vLLM skips them and itself checks that the one they are tied to
      loaded), and under expert parallelism the experts other ranks keep (the engine's
      expert map, ``vllm_experts.worker_slots``), which this rank's loader skips by design;
      an expert this rank keeps is checked as any tensor is.
    - A parameter a full version left untouched: ``load_weights`` returns the names of
      the parameters it wrote; every parameter of the model must be among them, unless the
      caller says the update is ``partial``. As vLLM does, not checked for a quantized
      model (its kernel-format parameters, scales among them, need not come from a
      checkpoint); its version is still checked to carry every tensor of the transformers
      form (``checkpoint_cover``; refused where no such check can be made:
      ``unchecked_quantization``).
    - A tensor of the checkpoint a full version did not carry (``uncovered``): vLLM
      counts an MoE layer's experts as one parameter, written by any expert's matrix.
    - A loader that raises: the error names the tensor it was loading.

    Yields the set of parameters the loader reports it wrote (filled once it returned).
    """
    expected = {
        name.replace(".base_layer.", ".") if vllm_config.lora_config else name
        for name, _ in model.named_parameters()
    }
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - expected
    foreign = _foreign(model, vllm_config)
    untaken: list[str] = []
    fed: set[str] = set()  # every name handed to the loader
    reported: list[set[str] | None] = []
    written: set[str] = set()
    original = model.__dict__.get("load_weights")  # an instance attribute of its own (rare)
    bound = model.load_weights

    def exempt(name: str) -> bool:
        return name in tied or foreign(name)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        writes = _Writes()
        current: list[str | None] = [None]

        def watched() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                current[0] = name
                fed.add(name)
                before = writes.numel
                yield name, tensor
                if writes.numel == before and not exempt(name):
                    untaken.append(name)
                current[0] = None

        try:
            with writes:
                loaded = bound(watched())
        except Exception as e:
            if current[0] is None:
                raise
            raise NotTaken(
                f"{where}: the engine's loader failed on tensor {current[0]!r}: {type(e).__name__}: {e}"
            ) from e
        reported.append(set(loaded) if loaded is not None else None)
        written.update(loaded or ())
        return loaded

    model.load_weights = load_weights  # type: ignore[method-assign]
    try:
        yield written
    finally:
        if original is None:
            del model.load_weights
        else:
            model.load_weights = original  # type: ignore[method-assign]
    problems = []
    if untaken:
        problems.append(f"it took nothing of {len(untaken)} tensor(s): {_listed(untaken)}")
    if not reported:
        problems.append("its loader was not called")
    elif reported[-1] is None:
        problems.append("its loader did not say which parameters it wrote")
    elif not partial:
        quantized = vllm_config.model_config.quantization is not None
        if not quantized and (missing := expected - reported[-1]):
            problems.append(
                f"the full version left {len(missing)} of its {len(expected)} parameter(s) unwritten: "
                f"{_listed(missing)} (an update that leaves parameters as they are must say partial=True)"
            )
        elif quantized and (why := unchecked_quantization(vllm_config)) is not None:
            problems.append(why)
        elif absent := uncovered(checkpoint_cover(model, vllm_config), fed, exempt):
            problems.append(
                f"the full version did not carry {len(absent)} tensor(s) of the model's checkpoint: "
                f"{_listed(absent)} (an update that leaves parameters as they are must say partial=True)"
            )
    if problems:
        raise NotTaken(f"{where}: the engine did not take the update: " + "; ".join(problems))


@contextlib.contextmanager
def cpu_experts_repacked(model: torch.nn.Module, vllm_config: Any) -> Iterator[list[str]]:
    """Within a reload: each CPU expert layer the reload processes is padded and prepacked
    again, as at its first load; yields the names of the layers done.

    vLLM 0.32's unquantized MoE method sets its kernel up at the first load only
    (``UnquantizedFusedMoEMethod.process_weights_after_loading``: on a weight update it
    copies the new weights in and skips ``moe_kernel.fused_experts
    .process_weights_after_loading``). On the CPU backend that step pads the intermediate
    dimension to the kernel's alignment and prepacks ``w13_weight``/``w2_weight`` into the
    layout its grouped GEMM reads. Without it, after an update the kernel read plain weights
    as packed ones (a Qwen3-MoE replica served other tokens than its trainer while every
    update reported success, issue 58), and a layer whose intermediate size needs padding
    (48 -> 64) failed the reload (``The size of tensor a (128) must match the size of
    tensor b (96)``: the processed weights are copied back into the padded storage). So the
    step runs right after the method's own, inside the layer's processing, for exactly the
    layers the reload processes (a layer it did not reach keeps its packed weights).
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        yield []
        return
    done: list[str] = []
    methods = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        original = method.process_weights_after_loading

        def processed(layer: torch.nn.Module, original=original, experts=experts, name=name) -> None:
            original(layer)
            experts.process_weights_after_loading(layer)
            done.append(name)

        method.process_weights_after_loading = processed  # this instance, for this reload
        methods.append(method)
    try:
        yield done
    finally:
        for method in methods:
            del method.process_weights_after_loading
        if done:
            log.debug("weightsync: repacked the CPU experts of %d layer(s) in the reload", len(done))


def worker_reload(
    worker: Any, where: Callable[[], str], partial: bool = False
) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    """A worker extension's reload: the worker's ``reload_weights`` (checkpoint format,
    layerwise), checked against what the loader reports it loaded (``checked_load``, its
    errors naming ``where()``; ``partial``: the update may leave parameters as they are),
    with the CPU experts repacked, then tied modules processed again and the LoRA adapters
    put back."""

    def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        model = worker.model_runner.get_model()
        try:
            with (
                checked_load(model, worker.vllm_config, where=where(), partial=partial),
                cpu_experts_repacked(model, worker.vllm_config),
            ):
                worker.reload_weights(weights_iterator=weights)
        except BaseException:
            finalize_reload(model, worker.vllm_config)
            raise
        reprocess_tied(model, worker.vllm_config)
        restore_adapters(worker)

    return reload


def restore_adapters(worker: Any) -> None:
    """vLLM drops every LoRA adapter when a reload succeeds; put weightsync's back. A failure
    here is logged, not raised: the weights did load, and the update must say so."""
    slots = getattr(worker, "_weightsync_adapters", None)
    try:
        if slots is not None and (count := slots.restore()):
            log.info("weightsync: %d LoRA adapter(s) kept across the full update", count)
    except Exception:
        log.exception("weightsync: the LoRA adapters could not be added back after the reload")
