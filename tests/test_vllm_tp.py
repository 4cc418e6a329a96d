"""A real vLLM (CPU build) replica with tensor parallelism 2, fed by ``backend=sharded``:
each worker learns the slices it keeps from its own loaders (a dry run) and takes only
those, from the trainer ranks that hold them.

One replica (two workers, a core each) is started for the module, of a model shaped so that
a slicing mistake shows (``MODEL``: k/v heads split between the ranks, a padded vocabulary,
tied embeddings); the demo's model, whose one k/v head both ranks replicate, is covered by
``weightsync demo --rollout vllm --tp 2`` in test_doc_commands.py. The last test kills one
of its workers. Without vLLM, conftest.py skips them (marker ``vllm``), or fails them in CI.
"""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch
import workers
from procs import CTX, alive, free_port, start, stop
from vllm_client import LLMClient
from vllm_planted import EXTENSION, importable

from weightsync.demo.vllm import (
    PROMPTS,
    replica_greedy,
    save_tiny_model,
    start_replica,
    trainer_greedy,
    vllm_environment,
)
from weightsync.integrations.replicas.reports import ReplicaUpdateError
from weightsync.integrations.vllm_replicas import LLMReplica
from weightsync.integrations.vllm_rollout import VLLMRollout
from weightsync.plan import TensorSpec
from weightsync.sharding.agreement import ShardSource
from weightsync.sharding.layout import Box
from weightsync.sharding.typical import held, trainer_boxes

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(240)]

TP = 2
NEW = 6
TIMEOUT_S = 60
DETECT_S = 10
OVERRIDES = ["backend=sharded", "update_weights_bucket_megabytes=1", f"timeout_s={TIMEOUT_S}"]


#: The demo's model reshaped where a slicing mistake shows (the demo's own, with one k/v
#: head, a vocabulary of 512 and no tie, hid three): 2 k/v heads for 4 query heads, so each
#: TP rank keeps other k/v heads (GQA, 2 query heads per k/v head); a vocabulary of 500,
#: padded to 512 and split 256 + 244; embeddings tied (no ``lm_head.weight`` in the
#: checkpoint: vLLM's head is the embedding, updated with it). Head size 32, as the CPU
#: attention backend needs.
MODEL = dict(
    vocab_size=500, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
)


def trainer_load(model, state) -> None:
    """The trainer's copy of ``state``: a checkpoint of a tied model has no ``lm_head.weight``
    (the head is the embedding)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], []), (missing, unexpected)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """``MODEL`` in one replica of 2 workers, each bound to a core as vLLM's CPU build wants."""
    from transformers import AutoModelForCausalLM

    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND",)}
    vllm_environment(tp=TP)  # each worker bound to a core of its own: 0|1
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("tp") / "model"), seed=3, **MODEL)
    with importable():
        llm = start_replica(
            model_dir,
            max_model_len=128,
            tensor_parallel_size=TP,
            worker_extension_cls=EXTENSION,
            weight_transfer_config={"backend": "weightsync"},  # vLLM's own RL API too
        )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    yield llm, model, model_dir
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def vllm_boxes(spec: TensorSpec, rank: int, config) -> Box:
    """What vLLM's Qwen2 keeps on TP rank ``rank``, worked out here from the model's config
    (independently of the dry run): column-parallel rows, row-parallel columns, k/v heads
    replicated when there are fewer than TP ranks, the vocabulary padded to 64 and split."""
    shape, name = spec.shape, spec.name
    whole = Box.whole(shape)

    def rows(start: int, n: int) -> Box:
        return Box((start, *[0] * (len(shape) - 1)), (n, *shape[1:]))

    def cols(start: int, n: int) -> Box:
        return Box((0, start), (shape[0], n))

    head = config.hidden_size // config.num_attention_heads
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
        part = shape[0] // TP
        return rows(rank * part, part)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        kv = config.num_key_value_heads
        if kv >= TP:
            return rows(rank * shape[0] // TP, shape[0] // TP)
        return rows((rank // (TP // kv)) * head, head)  # each rank's one head, replicated
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        part = shape[1] // TP
        return cols(rank * part, part)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = math.ceil(shape[0] / 64) * 64
        per = padded // TP
        start = min(rank * per, shape[0])
        return rows(start, min(per, shape[0] - start))
    return whole  # norms


def shards_of(state, rank: int, trainers: int):
    return held(state, trainer_boxes([TensorSpec.of(n, t) for n, t in state.items()], trainers, rank))


def test_each_worker_takes_only_its_slices_from_two_trainer_ranks_and_serves_the_trainers_weights(replica):
    llm, model, model_dir = replica
    address = f"127.0.0.1:{free_port()}"
    versions = [1, 2, 3]
    results = CTX.Queue()
    peer = start(workers.run_fsdp_like_trainer, address, 1, 2, OVERRIDES, TP, model_dir, versions, results)
    try:
        with VLLMRollout([LLMReplica(llm, "tp")], OVERRIDES, address=address, num_trainers=2) as rollout:
            state = workers.tp_version_weights(model_dir, versions[0])
            slices = rollout.learn_slices(shards_of(state, 0, 2))["tp"]
            specs = ShardSource.of(shards_of(state, 0, 2)).specs()
            # the dry run's boxes are vLLM's own slicing, tensor by tensor, on both ranks
            for rank, worker in enumerate(slices):
                assert worker["whole_tensors"] == {}
                for spec in specs:
                    got = Box.from_wire(worker["boxes"][spec.name])
                    assert got == vllm_boxes(spec, rank, model.config), (rank, spec.name)
            whole = sum(s.nbytes for s in specs)
            norms = sum(s.nbytes for s in specs if s.name.endswith("norm.weight"))
            # both workers together: the model once (each k/v head and vocabulary row on one
            # worker only), plus the norms that both keep
            assert sum(kept := [w["kept_bytes"] for w in slices]) == whole + norms, (kept, whole, norms)
            for v in versions:
                state = workers.tp_version_weights(model_dir, v)
                # version 3 staged: the slices land in a compact staging copy while the replica serves
                report = rollout.update(shards_of(state, 0, 2), v, staged=v == 3)
                assert report.ok, report.summary()
                trainer_load(model, state)
                assert replica_greedy(llm, PROMPTS, NEW) == trainer_greedy(model, PROMPTS, NEW), v
                (rep,) = report.replicas
                if v == 3:
                    assert report.phase == "staged"
                    wire = rep.worker_stage_wire_bytes
                else:  # each worker unpacked exactly the bytes of the slices it keeps
                    assert rep.worker_bytes == kept, (rep.worker_bytes, kept)
                    wire = rep.worker_wire_bytes
                _check_wire(report.stats.wire_bytes, wire, kept, len(specs))
                peer_v = results.get(timeout=30)
                assert peer_v[:2] == (1, v) and isinstance(peer_v[2], int), peer_v
    finally:
        stop([peer])


def _check_wire(trainers: int, wire: list[int], kept: list[int], tensors: int) -> None:
    """Bytes counted on the wire at both ends: what the trainer ranks' transports posted
    (``trainers``: rank 0's figure counts every rank's) is what the workers' transports
    handed over (one replica: no chain), and each worker's is its slices plus at most the
    alignment of its pieces (a piece per tensor and trainer rank, 64 bytes each). A bucket
    moved twice, or one missing, breaks them."""
    assert trainers == sum(wire), (trainers, wire)
    assert all(k <= w < k + 64 * 2 * tensors for k, w in zip(kept, wire)), (wire, kept)


def test_vllms_trainer_factory_with_backend_sharded_brings_each_worker_only_its_slices(replica):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import WeightsyncTrainerInitInfo

    llm, model, model_dir = replica
    info = WeightsyncTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=1 + TP, rank=0, overrides=OVERRIDES
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=LLMClient(llm), source=ModuleSource(model)
    )
    try:
        for v in (11, 12):
            state = workers.tp_version_weights(model_dir, v)
            trainer_load(model, state)
            stats = engine.send_weights(version=v)
            assert replica_greedy(llm, PROMPTS, NEW) == trainer_greedy(model, PROMPTS, NEW), v
        specs = [TensorSpec.of(n, t).to_wire() for n, t in model.named_parameters()]
        kept = [w["kept_bytes"] for w in llm.collective_rpc("weightsync_slices", args=(specs,))]
        # what the trainer's transport posted: every worker's slices, each piece once (the
        # workers' own counts live in vLLM's transfer engine, out of reach of an RPC)
        assert sum(kept) <= stats.wire_bytes < sum(kept) + 64 * TP * len(specs), (stats.wire_bytes, kept)
        assert sum(kept) < 1.25 * sum(t.nbytes for t in state.values()), kept
    finally:
        engine.shutdown()


def test_a_loader_step_that_no_box_describes_takes_that_tensor_whole_and_still_matches(replica):
    llm, model, model_dir = replica
    planted = "model.layers.0.mlp.down_proj.weight"
    llm.collective_rpc("plant_unreducible_load", args=(planted,))
    with VLLMRollout([LLMReplica(llm, "tp")], OVERRIDES) as rollout:
        state = workers.tp_version_weights(model_dir, 4)
        slices = rollout.learn_slices(state)["tp"]
        for worker in slices:
            assert list(worker["whole_tensors"]) == [planted], worker["whole_tensors"]
            assert "mul" in worker["whole_tensors"][planted]
            assert worker["boxes"][planted] == Box.whole(state[planted].shape).to_wire()
        # never silent on every TP worker: a full version that leaves a tensor out is refused
        # before anything moves, naming it (the route's tensors against the checkpoint)...
        left_out = "model.layers.1.mlp.down_proj.weight"
        without = {n: t for n, t in state.items() if n != left_out}
        with pytest.raises(ReplicaUpdateError) as info:
            rollout.update(without, 4)
        (rep,) = info.value.report.replicas
        assert "does not carry 1 tensor(s)" in rep.error and left_out in rep.error, rep.error
        assert not rep.mixed and not any(rep.worker_bytes), rep
        # ...and with that check planted off, every worker's check after the load fails it
        # naming it; the retry of that version, complete, goes through
        llm.collective_rpc("plant_no_vet")
        try:
            with pytest.raises(ReplicaUpdateError) as info:
                rollout.update(without, 4)
        finally:
            llm.collective_rpc("plant_no_vet", args=(False,))
        (rep,) = info.value.report.replicas
        for rank in range(TP):
            assert f"worker {rank} (receiver rank {rank}): the engine did not take the update" in rep.error
        assert rep.error.count(f"unwritten: {left_out}") == TP and rep.mixed, rep
        report = rollout.update(state, 4)
        assert report.ok, report.summary()
        trainer_load(model, state)
        assert replica_greedy(llm, PROMPTS, NEW) == trainer_greedy(model, PROMPTS, NEW)
        (rep,) = report.replicas
        assert rep.worker_bytes == [w["kept_bytes"] for w in slices]
        # LoRA updates send the adapter whole: a sharded rollout refuses one before anything moves
        with pytest.raises(ValueError, match="use another backend than sharded"):
            rollout.update(model, 5, lora=True)
        # The trainer now sends bf16: tensors other than those the slices were learned for. The
        # streamed update learns them again (the same boxes, half the bytes) and matches.
        state = {n: t.bfloat16() for n, t in workers.tp_version_weights(model_dir, 5).items()}
        report = rollout.update(state, 5)
        assert report.ok, report.summary()
        trainer_load(model, {n: t.float() for n, t in state.items()})
        assert replica_greedy(llm, PROMPTS, NEW) == trainer_greedy(model, PROMPTS, NEW)
        specs = [TensorSpec.of(n, t) for n, t in state.items()]
        kept = [
            sum(
                (Box.whole(s.shape) if s.name == planted else vllm_boxes(s, r, model.config)).numel
                for s in specs
            )
            * 2
            for r in range(TP)
        ]
        (rep,) = report.replicas
        assert rep.worker_kept_bytes == rep.worker_bytes == kept, (
            rep.worker_kept_bytes,
            rep.worker_bytes,
            kept,
        )
        _check_wire(report.stats.wire_bytes, rep.worker_wire_bytes, kept, len(specs))


def test_a_worker_killed_mid_update_is_named_with_its_tp_rank_and_the_replica_stays_paused(replica):
    llm, model, model_dir = replica
    state = workers.tp_version_weights(model_dir, 6)
    with VLLMRollout([LLMReplica(llm, "tp")], OVERRIDES) as rollout:
        rollout.update(state, 6)
        victim = llm.collective_rpc("weightsync_status")[1]["pid"]

        class KillingShards(dict):
            """The trainer's shards; TP rank 1's worker is killed once the route is agreed,
            as the first fragment is read."""

            def __getitem__(self, name):
                if alive(victim):
                    os.kill(victim, signal.SIGKILL)
                    while alive(victim):
                        time.sleep(0.05)
                return super().__getitem__(name)

        source = ShardSource.of(workers.tp_version_weights(model_dir, 7))
        source.shards = KillingShards(source.shards)
        t0 = time.monotonic()
        with pytest.raises(ReplicaUpdateError, match=r"receiver rank 1 \(replica 'tp', TP rank 1\)") as info:
            rollout.update(source, 7)
        assert time.monotonic() - t0 < DETECT_S
        (rep,) = info.value.report.replicas
        assert not rep.ok and not rep.resumed and rep.version != 7
