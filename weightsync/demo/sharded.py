"""``weightsync demo --backend sharded --trainers M --tp T``: a sharded trainer to
tensor-parallel replicas, each byte sent once by the trainer rank that holds it.

M trainer processes train the demo's model under FSDP2 (``fully_shard``, one Gloo world)
and sync it after every step with ``backend=sharded``: each sends fragments of its local
shards only. ``--receivers`` replicas, each T processes of its own Gloo world holding the
model tensor-parallel (``parallelize_module``: column-parallel q/k/v, gate and up
projections and the LM head, row-parallel o and down projections, a vocab-parallel
embedding; norms whole), take only the slices they keep. After every version, trainer rank
0 writes the full tensors (gathered for the check, not for the sync) and this process
compares every rank's every kept slice with them, bit for bit.

With ``--arch moe --ep E`` each replica is E expert-parallel ranks instead: each keeps the
experts vLLM's linear placement gives it, in fused stacks of its own slots as transformers
lays experts out (``ExpertSink``), and every other tensor whole (the attention
data-parallel); the trainer sends each expert's matrices in the checkpoint form, once to
each rank that keeps them, and every rank's every slot is compared with the trainer's
expert.

With ``--quantize fp8`` (``--tp 1``) replica 0 holds the decoder layers' matrices in FP8
blocks (``fp8_holding``): each trainer rank quantizes its own rows, the blocks its shard
boundary cuts agreed between the ranks (docs/quantized.md), and replica 0's bytes and
scales are checked against vLLM's convention applied to the full tensors.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from weightsync.demo.plain import (
    DemoFailed,
    DemoOptions,
    build_model,
    engine_config,
    read_reports,
    send_json,
)
from weightsync.platform import free_port, process_context, start_process
from weightsync.quant.replica import fp8_expected, fp8_holding
from weightsync.verify import tensor_digest

# Module suffixes of a Llama/Qwen2-shaped decoder and how a tensor-parallel replica splits them.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass
class ShardedDemoOptions(DemoOptions):
    trainers: int = 2
    tp: int = 2
    #: expert-parallel ranks per replica (``--arch moe``; replaces ``tp``)
    ep: int = 1

    @property
    def ranks(self) -> int:
        """Rollout ranks per replica."""
        return self.ep if self.ep > 1 else self.tp


@contextlib.contextmanager
def _reported(conn: Connection, rank: int) -> Iterator[None]:
    """A demo process's body: any failure reported to this process's parent, then exit 1."""
    try:
        yield
    except BaseException as e:
        send_json(conn, {"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from e
    finally:
        conn.close()


def _world(rank: int, size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


def _tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan of a Llama/Qwen2-shaped model, by module name."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COLUMN:
            plan[name] = ColwiseParallel()
        elif leaf in _ROW:
            plan[name] = RowwiseParallel()
    plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if not getattr(model.config, "tie_word_embeddings", False):  # tied: the embedding's split
        plan["lm_head"] = ColwiseParallel()
    return plan


def trainer_main(
    conn: Connection, opts: ShardedDemoOptions, address: str, rank: int, port: int, folder: str
) -> None:
    """Trainer rank ``rank``: FSDP2 training, a sharded sync after every step."""
    torch.set_num_threads(1)
    with _reported(conn, rank):
        import torch.distributed as dist
        from safetensors.torch import save_file
        from torch.distributed.fsdp import fully_shard

        from weightsync.sender.sender import Sender

        _world(rank, opts.trainers, port)
        model = build_model(opts.model, pretrained=True, seed=opts.seed, arch=opts.arch)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(opts.seed)
        config = engine_config(opts)
        with Sender(
            config, address, opts.receivers * opts.ranks, rank=rank, num_trainers=opts.trainers
        ) as sender:
            for step in range(1, opts.steps + 1):
                ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                stats = sender.send(model, version=step)
                full = {
                    n: t.full_tensor() for n, t in model.state_dict().items()
                }  # the check's, after the sync
                if rank == 0:
                    save_file({n: t.contiguous() for n, t in full.items()}, f"{folder}/v{step}.safetensors")
                send_json(conn, {"rank": rank, "loss": loss.item(), "stats": stats.to_dict()})
        dist.destroy_process_group()


def rollout_main(
    conn: Connection, opts: ShardedDemoOptions, address: str, replica: int, tp_rank: int, port: int
) -> None:
    """One rank of a tensor-parallel replica: every version into its slices; reports each
    kept slice's box and digest."""
    torch.set_num_threads(1)
    rank = replica * opts.ranks + tp_rank
    with _reported(conn, rank):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from weightsync.receiver.receiver import Receiver
        from weightsync.sharding.fragments import local_shards
        from weightsync.sinks import ModuleSink

        _world(tp_rank, opts.ranks, port)
        model = build_model(opts.model, pretrained=False, seed=opts.seed + 1000 + rank, arch=opts.arch)
        held: Any = None  # an FP8 replica's tensors (whole: --quantize runs with --tp 1)
        if opts.ep > 1:
            _expert_rollout(conn, opts, address, rank, tp_rank, model)
            dist.destroy_process_group()
            return
        if opts.quantize and replica == 0:
            held = fp8_holding(s.spec for s in local_shards(model).values())
        else:
            parallelize_module(model, init_device_mesh("cpu", (opts.tp,)), _tp_plan(model))
            model.tie_weights()  # the LM head of a tied model shares the embedding's new parameter
        with Receiver(engine_config(opts), address, rank) as receiver:
            for step in range(1, opts.steps + 1):
                stats = receiver.load_into(ModuleSink(held) if held is not None else model, version=step)
                slices = {
                    n: [s.box.to_wire(), tensor_digest(s.tensor)]
                    for n, s in local_shards(held if held is not None else model).items()
                }
                send_json(
                    conn,
                    {"rank": rank, "version": receiver.version, "stats": stats.to_dict(), "slices": slices},
                )
        dist.destroy_process_group()


def _expert_rollout(
    conn: Connection, opts: ShardedDemoOptions, address: str, rank: int, ep_rank: int, model: torch.nn.Module
) -> None:
    """An expert-parallel rank: its experts (vLLM's linear placement) in stacks of its own
    slots, every other tensor whole; reports each slot's matrices under their checkpoint
    names (the expert each slot holds) and each other tensor, with digests."""
    from weightsync.receiver.receiver import Receiver
    from weightsync.receiver.sharded_sink import ExpertSink
    from weightsync.sharding.experts import Slots, expert_of, slot_views
    from weightsync.sharding.fragments import local_shards
    from weightsync.sharding.pieces import checkpoint_plan

    shards = local_shards(model)
    plan = checkpoint_plan(model, {n: s.spec for n, s in shards.items()})
    stacks = {p.root for p in plan.values() if p is not None}
    found = [where for name in plan if (where := expert_of(name)) is not None]
    layers, experts = sorted({layer for layer, _ in found}), 1 + max(e for _, e in found)
    slots = Slots.linear(layers, experts, opts.ep, ep_rank)
    local = {  # its own slots only: the stack's rows for the experts it keeps
        name: torch.zeros(
            (len(slots.layers[int(name.split(".layers.")[1].split(".")[0])]), *shards[name].spec.shape[1:])
        )
        for name in stacks
    }
    dense = {n: s for n, s in shards.items() if n not in stacks}
    sink = ExpertSink(dense, lambda: slots, lambda held: slot_views(model, local, held))
    with Receiver(engine_config(opts), address, rank) as receiver:
        for step in range(1, opts.steps + 1):
            stats = receiver.load_into(sink, version=step)
            kept = {n: [s.box.to_wire(), tensor_digest(s.tensor)] for n, s in dense.items()}
            for name, views in slot_views(model, local, slots).items():
                for view in views:
                    kept[name] = [[[0] * view.dim(), list(view.shape)], tensor_digest(view)]
            send_json(
                conn, {"rank": rank, "version": receiver.version, "stats": stats.to_dict(), "slices": kept}
            )


def _check(folder: str, step: int, report: dict[str, Any], fp8: bool = False, model: Any = None) -> int:
    """Every slice of a rollout rank's report against the trainer's full tensors (``fp8``:
    against their FP8 blocks and scales where an FP8 replica holds them so; ``model``: in
    its checkpoint form too); returns the bytes it keeps."""
    from safetensors.torch import load_file

    from weightsync.wire.checkpoint import checkpoint_views

    full = load_file(f"{folder}/v{step}.safetensors")
    if fp8:
        full = fp8_expected(full)
    if model is not None:
        full = {**full, **checkpoint_views(model, full)}
    kept = 0
    for name, (box, digest) in report["slices"].items():
        if name not in full:
            raise DemoFailed(f"rollout rank {report['rank']} keeps {name!r}, which the trainer does not have")
        starts, lengths = box
        expected = full[name][tuple(slice(s, s + n) for s, n in zip(starts, lengths))]
        if tensor_digest(expected) != digest:
            raise DemoFailed(
                f"rollout rank {report['rank']}, version {step}: its slice {box} of {name!r} differs from the trainer's"
            )
        kept += expected.numel() * expected.element_size()
    return kept


def run_sharded_demo(opts: ShardedDemoOptions, console=None) -> list[dict[str, Any]]:
    """Run the demo; raise ``DemoFailed`` (or a sync error) on any mismatch or failure."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 100)
    config = engine_config(opts)
    if config.backend != "sharded":
        raise DemoFailed(
            f"--trainers / --tp run the sharded demo: use --backend sharded, not {config.backend}"
        )
    console.print(
        f"[bold]weightsync demo[/]: {opts.trainers} FSDP2 trainer ranks -> {opts.receivers} replicas x "
        f"{opts.ranks} {'expert' if opts.ep > 1 else 'tensor'}-parallel ranks, backend sharded, bucket "
        f"{opts.bucket_mb} MiB, {opts.steps} steps"
    )
    host, _, port = opts.address.rpartition(":")
    address = f"{host or '127.0.0.1'}:{port if port not in ('', '0') else free_port()}"
    ctx = process_context(["weightsync.demo.sharded"])
    procs: list[tuple[str, mp.Process, Connection]] = []
    rows: list[dict[str, Any]] = []
    table = Table(title="syncs")
    # kept: what every rollout rank holds after the sync, together; sent: what left the
    # trainer ranks' NICs (less than kept where replicas pass their slices on)
    for col in (
        "version",
        "MB kept",
        "MB sent",
        "MB per rollout rank",
        "setup s",
        "wire s",
        "total s",
        "check",
    ):
        table.add_column(col, justify="right")
    # --ep: the rollout ranks report experts in the checkpoint form; the check converts the
    # trainer's tensors with a stand-in of the model
    checkpoint = build_model(None, pretrained=False, seed=0, arch=opts.arch) if opts.ep > 1 else None
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-") as folder:
        try:
            port_t = free_port()
            for r in range(opts.trainers):
                procs.append(_spawn(ctx, f"trainer rank {r}", trainer_main, opts, address, r, port_t, folder))
            for replica in range(opts.receivers):
                port_r = free_port()
                for t in range(opts.ranks):
                    procs.append(
                        _spawn(
                            ctx,
                            f"rollout rank {replica * opts.ranks + t}",
                            rollout_main,
                            opts,
                            address,
                            replica,
                            t,
                            port_r,
                        )
                    )
            for step in range(1, opts.steps + 1):
                with console.status(
                    f"step {step}: training on {opts.trainers} ranks, then syncing version {step}"
                ):
                    reports = read_reports(procs, config.timeout_s + 600)
                trainer, rollouts = reports[0], reports[opts.trainers :]
                kept = []
                for report in rollouts:
                    if report["version"] != step:
                        raise DemoFailed(
                            f"rollout rank {report['rank']} holds version {report['version']}, expected {step}"
                        )
                    fp8 = bool(opts.quantize) and report["rank"] < opts.tp  # replica 0
                    kept.append(_check(folder, step, report, fp8, checkpoint))
                    if opts.ep > 1 and report["stats"]["bytes"] != kept[-1]:  # its experts once, no others
                        raise DemoFailed(
                            f"rollout rank {report['rank']} took {report['stats']['bytes']} bytes of version {step} "
                            f"and keeps {kept[-1]}"
                        )
                stats = trainer["stats"]
                console.print(f"step {step}: loss {trainer['loss']:.4f}; version {step} in every kept slice")
                rows.append({"version": step, "trainer": stats, "kept": kept})
                table.add_row(
                    str(step),
                    f"{stats['bytes'] / 1e6:.1f}",
                    f"{stats['wire_bytes'] / 1e6:.1f}",
                    f"{sum(kept) / len(kept) / 1e6:.1f}",
                    f"{stats['handshake_s']:.3f}",
                    f"{stats['transfer_s']:.3f}",
                    f"{stats['seconds']:.3f}",
                    "bit-exact",
                )
            for _, proc, _ in procs:
                proc.join(timeout=30)
        finally:
            for _, proc, _ in procs:  # only our own children, by handle
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=5)
    console.print(table)
    fp8 = (
        " (replica 0 in FP8 blocks, quantized by each trainer rank on its own rows: vLLM's "
        "per_block_cast_to_fp8 bytes and scales)"
        if opts.quantize
        else ""
    )
    kept = (
        f"{opts.ep} expert-parallel ranks, each rank taking only its experts (vLLM's linear placement) and the "
        "other tensors"
        if opts.ep > 1
        else f"{opts.tp} tensor-parallel ranks, each rank taking only its slices"
    )
    console.print(
        f"demo OK: {len(rows)} syncs to {opts.receivers} receivers, bit-exact: {opts.receivers} replicas x "
        f"{kept} from {opts.trainers} FSDP2 trainer ranks{fp8}"
    )
    return rows


def _spawn(ctx, name: str, target, *args) -> tuple[str, mp.Process, Connection]:
    parent, child = ctx.Pipe(duplex=False)
    proc = start_process(ctx, target, child, *args)
    child.close()
    return name, proc, parent
