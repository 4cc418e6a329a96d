"""Process bodies of tests/test_quant.py (importable under spawn): receivers holding some
tensors in FP8 with block scales (float32 or UE8M0) and the rest as the trainer holds them."""

import time

import torch
import workers

from weightsync import EngineConfig, ModuleSink, Receiver, Sender
from weightsync.wire.fp8 import scale_shape

# Shapes that are not multiples of 128, a 1-D tensor, an expert stack, and an embedding and
# norm that a quantized replica keeps in bf16. Values differ per tensor and per version, so a
# scale or a block landed in the wrong place shows.
SHAPES = {
    "embed.weight": (300, 64),
    "layers.0.proj.weight": (200, 130),
    "layers.0.mlp.weight": (384, 256),
    "layers.0.experts.gate_up_proj": (3, 96, 130),
    "layers.0.norm.weight": (64,),
}
#: what an FP8 receiver holds quantized (as vLLM keeps embeddings and norms in bf16)
QUANTIZED = ("layers.0.proj.weight", "layers.0.mlp.weight", "layers.0.experts.gate_up_proj")
BLOCK = (128, 128)


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + version)
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        t = torch.randn(shape, generator=g) * (1 + i) + version
        if t.dim() > 1:  # one block of each matrix far larger than the rest: its own scale
            t.view(-1, t.shape[-1])[:5, :7] *= 40
        out[name] = t.to(torch.bfloat16)
    return out


def sparse_weights(version: int) -> dict[str, torch.Tensor]:
    """``weights(1)`` with one row of each matrix changed per later version (an RL step
    changes few elements): most FP8 bytes and scales stay, as deltas need."""
    out = weights(1)
    for name, t in out.items():
        if t.dim() > 1 and version > 1:
            rows = t.view(-1, t.shape[-1])
            rows[version % rows.shape[0]] += version
    return out


def holding(fp8: bool) -> dict[str, torch.Tensor]:
    """A replica's tensors: bf16, or FP8 with scales for ``QUANTIZED``."""
    held = {}
    for name, shape in SHAPES.items():
        if fp8 and name in QUANTIZED:
            held[name] = torch.zeros(shape, dtype=torch.float8_e4m3fn)
            held[name + "_scale_inv"] = torch.zeros(scale_shape(shape, BLOCK), dtype=torch.float32)
        else:
            held[name] = torch.zeros(shape, dtype=torch.bfloat16)
    return held


def run_receiver(address, rank, overrides, versions, queue, form="bf16"):
    """``form``: ``bf16``, ``fp8`` (float32 scales), ``ue8m0`` or ``bf16-scales`` (a scale
    layout the trainer does not make). Reports ``(rank, version, digests, missing)`` per
    version, or ``(rank, "error", message)``."""
    held = holding(form != "bf16")
    if form == "bf16-scales":
        for name in QUANTIZED:
            held[name + "_scale_inv"] = held[name + "_scale_inv"].to(torch.bfloat16)
    sink = ModuleSink(held, ue8m0=form == "ue8m0")
    try:
        with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
            for v in versions:
                stats = receiver.load_into(sink, version=v)
                queue.put(
                    (
                        rank,
                        v,
                        {n: workers.digest(t) for n, t in held.items()},
                        stats.missing,
                        stats.delta_base,
                    )
                )
    except Exception as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))


def run_fsdp_trainer(
    rank, store_port, address_queue, overrides, versions, queue, receivers=1, address=None, stall_in=None
):
    """Trainer rank of a 2-rank job whose matrices are DTensors sharded by rows (``Shard(0)``,
    as FSDP2 holds them): ``layers.0.proj.weight``'s first 128-row block is cut at row 100,
    ``layers.0.mlp.weight``'s second at row 192; the expert stack by columns (``Shard(2)``, as
    a ``shard_placement_fn`` may place it), each expert's first block cut at column 65. Over a dense backend rank 0 sends, rank 1
    gathers with it (``full_tensor`` is a collective); over ``sharded`` both send their rows
    (rank 1 joins rank 0's session at ``address``). ``stall_in``: rank 1 stops answering in
    that version, after the go, as it would start quantizing (alive, its sockets open)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        with Sender(EngineConfig.from_overrides(overrides), address or "127.0.0.1:0", receivers) as sender:
            if rank == 0:
                address_queue.put(sender.address)
            for v in versions:
                if rank == 1 and v == stall_in:
                    from weightsync.quant.sharded import FormedSource

                    FormedSource.quantize = lambda self: time.sleep(3600)
                state = {
                    n: distribute_tensor(t, mesh, [Shard(2 if t.dim() == 3 else 0)])
                    for n, t in weights(v).items()
                }
                local = state["layers.0.proj.weight"].to_local().shape[0]
                stats = sender.send(state, version=v)
                queue.put((rank, v, local, stats.quantized))
        dist.destroy_process_group()
    except Exception as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}", None))


def sliced_boxes(part, parts=2):
    """Part ``part`` of ``parts`` tensor-parallel slices of each quantized tensor and of its
    scales, as (box, scale box): a matrix's rows cut at multiples of 128 (as vLLM needs block
    FP8 slices cut), an expert stack's experts split."""
    from weightsync.sharding.layout import Box, chunk

    boxes = {}
    for name in QUANTIZED:
        shape, grid = SHAPES[name], scale_shape(SHAPES[name], BLOCK)
        if len(shape) == 3:
            start, length = chunk(shape[0], parts, part)
            boxes[name] = (
                Box((start, 0, 0), (length, *shape[1:])),
                Box((start, 0, 0), (length, *grid[1:])),
            )
        else:
            first, count = chunk(grid[0], parts, part)
            rows = min(shape[0], (first + count) * BLOCK[0]) - first * BLOCK[0]
            boxes[name] = (Box((first * BLOCK[0], 0), (rows, shape[1])), Box((first, 0), (count, grid[1])))
    return boxes


def run_sliced_receiver(address, rank, overrides, versions, queue, part, parts=2):
    """A tensor-parallel FP8 receiver rank over ``sharded`` (declared shards, as a
    Megatron-style or engine worker declares them): its slice of each quantized tensor's FP8
    bytes and scales (``sliced_boxes``), every other tensor whole in bf16. Reports ``(rank,
    version, digests, missing, None)`` per version, or ``(rank, "error", message)``."""
    from weightsync.sharding import declared_shards
    from weightsync.sharding.layout import Box

    slices = sliced_boxes(part, parts)
    shards = {}
    for name, shape in SHAPES.items():
        if name in slices:
            box, scales = slices[name]
            shards[name] = (shape, box, torch.zeros(box.lengths, dtype=torch.float8_e4m3fn))
            grid = scale_shape(shape, BLOCK)
            shards[name + "_scale_inv"] = (grid, scales, torch.zeros(scales.lengths, dtype=torch.float32))
        else:
            shards[name] = (shape, Box.whole(shape), torch.zeros(shape, dtype=torch.bfloat16))
    held = declared_shards(shards)
    try:
        with Receiver(EngineConfig.from_overrides(overrides), address, rank) as receiver:
            for v in versions:
                stats = receiver.load_into(held, version=v)
                digests = {n: workers.digest(s.tensor) for n, s in held.items()}
                queue.put((rank, v, digests, stats.missing, None))
    except Exception as e:
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))
