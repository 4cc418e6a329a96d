"""Process bodies of tests/test_restart.py (importable under spawn): replicas that outlive
trainer processes."""

import torch
import workers

from weightsync import EngineConfig, Sender, SyncError


def replica(address, rank, overrides, commands, results):
    """A rollout replica as the vLLM integration runs one (``ReplicaReceiver``, opened again
    with the same address before every update, as ``init_weight_transfer_engine`` would),
    loading into a dict. Receives each version it is told; reports its status and digests."""
    from weightsync.integrations.replicas.receiver import ReplicaReceiver

    torch.set_num_threads(1)
    state = ReplicaReceiver()
    weights: dict[str, str] = {}

    def reload(items):
        for name, tensor in items:
            weights[name] = workers.digest(tensor)

    try:
        while (version := commands.get(timeout=120)) is not None:
            state.open(address, rank, overrides)
            status = state.receive(version, reload)
            results.put((rank, status, dict(weights)))
    finally:
        state.close()


def trainer(address, overrides, plan, results):
    """One trainer process: a new ``Sender`` on ``address``; sends each ``(version, force)``
    of ``plan``, reporting ``("listening",)`` once it listens, then ``("ok", version)`` or
    ``("error", type, message)`` for each; then exits."""
    torch.set_num_threads(1)
    with Sender(EngineConfig.from_overrides(overrides), address, 1) as sender:
        results.put(("listening",))
        for version, force in plan:
            try:
                sender.send(workers.make_weights(version), version=version, force=force)
                results.put(("ok", version))
            except SyncError as e:
                results.put(("error", type(e).__name__, str(e)))
