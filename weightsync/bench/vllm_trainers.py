"""The trainer ranks of ``weightsync bench --rollout vllm --trainers M`` other than rank 0:
processes of their own (on emulated hosts of their own with ``--hosts``) that hold the same
model as rank 0, change it as rank 0 does, and send their ``Shard(0)`` of every tensor with
its updates, for backends where every rank sends (``sharded``, ``paired``). Rank 0 (the
bench, ``weightsync.bench.vllm``) drives them over a pipe each, in JSON.
"""

from __future__ import annotations

from typing import Any

import torch


def bump_weights(model: torch.nn.Module, step: int) -> None:
    """Change every weight a little (a training step's worth)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-3)


def trainer_rank_main(conn: Any, model_dir: str, rank: int, trainers: int, netns: str | None) -> None:
    """Trainer rank ``rank`` > 0 of the bench: the same model as rank 0 and the same changes
    (``bump_weights``, by the steps rank 0 lists), sending its ``Shard(0)`` of every tensor when
    told; JSON commands from rank 0 on ``conn``, an answer to each ``send`` and ``close``."""
    import json

    from transformers import AutoModelForCausalLM

    from weightsync.config.engine import EngineConfig
    from weightsync.plan import TensorSpec
    from weightsync.sender.sender import Sender
    from weightsync.sharding.typical import held, trainer_boxes

    torch.set_num_threads(1)
    if netns is not None:
        from weightsync.bench.cluster import enter

        enter(netns)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    shards = held(state, trainer_boxes([TensorSpec.of(n, t) for n, t in state.items()], trainers, rank))
    sender = None
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            if cmd.get("exit"):
                return
            try:
                for step in cmd.get("bump", []):
                    bump_weights(model, step)
                if "open" in cmd:
                    o = cmd["open"]
                    config = EngineConfig.from_overrides(o["overrides"])
                    sender = Sender(config, o["address"], o["receivers"], rank=rank, num_trainers=trainers)
                if "bump" in cmd:
                    reply = {"bumped": cmd["bump"]}
                elif "send" in cmd:
                    assert sender is not None
                    stats = sender.send(shards, version=cmd["send"])
                    reply = {"version": cmd["send"], "bytes": stats.wire_bytes}
                elif cmd.get("close"):
                    if sender is not None:
                        sender.close()
                    sender, reply = None, {"closed": True}
                else:
                    continue
            except Exception as e:
                reply = {"error": f"trainer rank {rank}: {type(e).__name__}: {e}"}
            conn.send_bytes(json.dumps(reply).encode())
    finally:
        if sender is not None:
            sender.close()
        conn.close()


class TrainerRanks:
    """Trainer ranks 1.. of ``trainers``: processes that mirror this one's model and
    send their shards with its updates, for backends where every rank sends."""

    def __init__(self, trainers: int, model_dir: str, cluster: Any) -> None:
        import json

        from weightsync.platform import process_context, start_process

        self._json = json
        self.bumping = False
        self.ranks: list[tuple[Any, Any]] = []
        if trainers == 1:
            return
        ctx = process_context(["weightsync.bench.vllm_trainers", "weightsync.sender.sender"])
        for rank in range(1, trainers):
            netns = cluster.hosts[rank].netns if cluster is not None else None
            mine, theirs = ctx.Pipe()
            proc = start_process(ctx, trainer_rank_main, theirs, model_dir, rank, trainers, netns)
            theirs.close()
            self.ranks.append((proc, mine))

    def _tell(self, cmd: dict[str, Any]) -> None:
        for _, conn in self.ranks:
            conn.send_bytes(self._json.dumps(cmd).encode())

    def _answers(self, timeout_s: float) -> list[dict[str, Any]]:
        out = []
        for rank, (proc, conn) in enumerate(self.ranks, start=1):
            if not conn.poll(timeout_s):
                raise RuntimeError(
                    f"trainer rank {rank} (pid {proc.pid}) did not answer within {timeout_s:.0f} s"
                )
            out.append(self._json.loads(conn.recv_bytes()))
            if "error" in out[-1]:
                raise RuntimeError(out[-1]["error"])
        return out

    def open(self, address: str, overrides: list[str], receivers: int) -> None:
        self._tell({"open": {"address": address, "overrides": overrides, "receivers": receivers}})

    def bump(self, step: int) -> None:
        """Every rank changes its model as this process does for ``step``; waits for them
        (after this process's own change: they run meanwhile)."""
        self._tell({"bump": [step]})
        self.bumping = bool(self.ranks)

    def bumped(self, timeout_s: float = 120) -> None:
        if self.bumping:
            self._answers(timeout_s)
            self.bumping = False

    def send(self, version: int) -> None:
        """Every rank sends ``version``."""
        self._tell({"send": version})

    def sent(self, timeout_s: float) -> list[dict[str, Any]]:
        return self._answers(timeout_s)

    def close_senders(self, timeout_s: float) -> None:
        self._tell({"close": True})
        self._answers(timeout_s)

    def stop(self) -> None:
        for proc, conn in self.ranks:  # only our own children, by handle
            try:
                conn.send_bytes(self._json.dumps({"exit": True}).encode())
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
