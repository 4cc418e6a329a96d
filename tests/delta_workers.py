"""Process bodies of tests/test_delta_sync.py (importable under spawn)."""

import os
import signal
import time

import torch
import workers

from weightsync import EngineConfig, Receiver
from weightsync.bench.updates import AdamWUpdates
from weightsync.integrations.replicas.staging import Stager
from weightsync.plan import TensorSpec

# A small Qwen2-shaped model in bf16 (the rollout copy of fp32 masters): one tensor larger
# than a 1 MiB bucket (split over buckets), many small ones.
SPECS = (
    [TensorSpec("embed.weight", (1024, 640), "bfloat16")]
    + [
        TensorSpec(f"layers.{i}.{name}", shape, "bfloat16")
        for i in range(2)
        for name, shape in (
            ("q.weight", (256, 256)),
            ("q.bias", (256,)),
            ("mlp.weight", (512, 256)),
            ("norm.weight", (256,)),
        )
    ]
    + [TensorSpec("step", (), "int64")]
)


def versions(count: int, lr: float = 1e-6) -> list[dict[str, torch.Tensor]]:
    """``count`` AdamW steps of the model (versions 1..count), as the trainer sends them."""
    updates = AdamWUpdates(SPECS, lr=lr, seed=3)
    out = []
    for _ in range(count):
        out.append({n: t.clone() for n, t in updates.step().items()})
    return out


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: workers.digest(t.contiguous()) for n, t in tensors.items()}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for spec in SPECS:
            self.register_buffer(spec.name.replace(".", "_"), torch.zeros(spec.shape, dtype=spec.torch_dtype))

    def state(self) -> dict[str, torch.Tensor]:
        return {s.name: getattr(self, s.name.replace(".", "_")) for s in SPECS}


def receiver(
    address, rank, overrides, todo, queue, mode="load", corrupt_after=None, kill_in=None, stall_s=0.0
):
    """Receive each version of ``todo``; report ``(rank, version, digests, held, delta_base)``
    or ``(rank, "error", message, held, torn)``. ``mode``: ``load`` (into a model, by name)
    or ``receive`` (streamed tensors). ``corrupt_after=v``: flip a bit of the model after
    version v (a damaged base). ``kill_in=v``: SIGKILL itself once version v's transfer
    started (mid-delta), ``stall_s`` after its first bucket arrived."""
    torch.set_num_threads(1)
    model = Model()
    # load_into takes the model's names: SPECS' names map to buffer names by a dict view.
    state = model.state()
    sink_model = _Named(state)
    stager = Stager()
    with Receiver(EngineConfig.from_overrides(overrides), address, rank) as rec:
        if kill_in is not None:
            _kill_when_receiving(rec, kill_in, stall_s)
        for v in todo:
            try:
                if mode == "load":
                    stats = rec.load_into(sink_model, version=v)
                    got = digests(state)
                elif mode == "stage":  # a vLLM worker's staging copy (in the background)
                    got, stats = _stage(rec, stager, v)
                    queue.put(
                        (
                            rank,
                            v,
                            got,
                            stager.store.state.version,
                            (stats.delta_base, stager.store.allocated_bytes),
                        )
                    )
                    continue
                else:
                    got = {n: workers.digest(t) for n, t in rec.receive(version=v)}
                    stats = rec.last_stats
                queue.put((rank, v, got, rec.version, stats.delta_base))
            except Exception as e:
                queue.put((rank, "error", f"{type(e).__name__}: {e}", rec.version, rec.torn))
            if corrupt_after == v:
                t = state["layers.0.q.weight"]
                t.view(torch.int16)[0, 0] ^= 1  # one bit of the base the sender does not know of


class _Named(torch.nn.Module):
    """A module whose state dict is exactly ``state`` (names with dots)."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def state_dict(self, *args, keep_vars=False, **kwargs):
        return dict(self._state)


def _kill_when_receiving(rec, version, stall_s=0.0):
    """Kill this process once the transport delivers its first bucket of ``version``
    (``stall_s`` later: the sync lasts that long before it fails)."""
    transport = rec._transport
    original = transport.recv_buckets

    def recv_buckets(next_bucket, landing=None):
        for item in original(next_bucket, landing):
            if rec._receiving == version:
                time.sleep(stall_s)
                os.kill(os.getpid(), signal.SIGKILL)
            yield item

    transport.recv_buckets = recv_buckets


def _stage(rec, stager, version):
    """Stage ``version`` as a vLLM worker does; the served state must stay untouched."""
    served = rec.state
    stager.begin(rec, version, served)
    assert stager.wait(120)
    assert rec.state is served and served.version is None, "staging touched the served state"
    status = stager.status()
    if not status["stage_ok"]:
        raise RuntimeError(status["stage_error"])
    return digests(dict(stager.store.items())), rec.last_stats
