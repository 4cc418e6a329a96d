"""The trainer ranks of a session whose every trainer rank sends (``paired``, ``sharded``).

Trainer rank 0 runs the session; ranks > 0 connect to it like receivers (role
``trainer``), follow its handshake, send their share of the buckets, report what they sent
(bytes and checksums) and finally learn the outcome, so every trainer rank's ``send``
returns or raises alike::

    rank 0 -> rank i   sync {version, plan_hash, verify, bucket_bytes, engine}
    rank i -> rank 0   ready | error {message}
    rank 0 -> rank i   go | abort {message}
    (rank i sends its share through the transport)
    rank i -> rank 0   sent {ok, message, bytes, checksums}
    rank 0 -> rank i   result {ok, message}

``TrainerPeers`` is rank 0's side, ``TrainerFollower`` the side of a rank > 0.
"""

from __future__ import annotations

import time
from typing import Any

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join, Transport
from weightsync.errors import HandshakeError, PeerLost, ProtocolError, SyncError
from weightsync.plan import Plan, capacity
from weightsync.sender.packer import producer
from weightsync.session.channel import Channel, Deadline
from weightsync.session.control import connect
from weightsync.sources import WeightSource
from weightsync.stages import Members, Outgoing, SendStages
from weightsync.stats import SyncStats


class TrainerPeers:
    """Trainer rank 0: its connections to trainer ranks 1..M-1."""

    def __init__(self, count: int) -> None:
        #: trainer ranks other than 0 (0 when only rank 0 sends)
        self.count = count
        self.channels: dict[int, Channel] = {}

    def missing(self) -> set[tuple[str, int]]:
        """Members the control server must still accept, after dropping dead ones."""
        for i in [i for i, ch in self.channels.items() if ch.is_dead()]:
            self.channels.pop(i).close()
        return {("trainer", i) for i in range(1, self.count + 1) if i not in self.channels}

    def dead(self) -> list[Channel]:
        """The channels of trainer ranks gone (closed, or silent past the grace)."""
        return [ch for ch in self.channels.values() if ch.is_dead()]

    def sync_messages(
        self, msg: dict[str, Any], info: dict[str, Any], first_rank: int
    ) -> list[tuple[Channel, dict]]:
        """The sync message for each trainer rank: the receivers' (without the plan: they
        computed it themselves) with their own group rank."""
        return [
            (ch, {**msg, "plan": None, "engine": {**info, "rank": first_rank + i - 1}})
            for i, ch in sorted(self.channels.items())
        ]

    def peers(self) -> list[tuple[str, None, Channel]]:
        return [(f"trainer rank {i}", None, ch) for i, ch in sorted(self.channels.items())]

    def gather_shares(
        self,
        version: int,
        sums: dict[int, int],
        deadline: Deadline,
        by_rank: dict[int, dict[int, int]] | None = None,
    ) -> int:
        """Wait until every other trainer rank sent its share; merge their checksums into
        ``sums`` (or, each rank's buckets being its own: ``by_rank[i]``, ``sharded``);
        return the bytes their transports sent (counted as posted, alignment included)."""
        sent = 0
        for i, ch in sorted(self.channels.items()):
            reply = ch.recv(deadline, expect="sent")
            if reply.get("ok") is not True:
                raise SyncError(
                    f"trainer rank {i} failed to send its share of version {version}: {reply.get('message')}"
                )
            into = by_rank.setdefault(i, {}) if by_rank is not None else sums
            for index, value in reply.get("checksums") or []:
                into[int(index)] = value
            # "wire_bytes": what crossed; "bytes" alone from a rank of an older weightsync
            sent += int(reply.get("wire_bytes", reply.get("bytes")) or 0)
        return sent

    def tell(self, version: int, failure: str | None, timeout_s: float) -> None:
        """The outcome, so every trainer rank's ``send`` agrees."""
        deadline = Deadline(timeout_s, f"reporting version {version} to the trainer ranks")
        for ch in list(self.channels.values()):
            try:
                ch.send({"type": "result", "ok": failure is None, "message": failure}, deadline)
            except SyncError:
                pass  # it went away; it reconnects at its next send

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()


class TrainerFollower:
    """Trainer rank > 0: joins rank 0's session and sends its share of every version."""

    def __init__(self, config: EngineConfig, address: str, rank: int) -> None:
        self.config = config
        self.address = address
        self.rank = rank
        self.channel: Channel | None = None

    def connect(self) -> Channel:
        """Join rank 0's session (once; again after a failure)."""
        if self.channel is None or self.channel.is_dead():
            self.close()
            self.channel = connect(self.address, self.rank, self.config, role="trainer")
        return self.channel

    def _watch(self) -> None:
        ch = self.channel
        if ch is not None and ch.is_dead():
            raise PeerLost(f"{ch.peer} disconnected during the transfer")

    def _problem(self, msg: dict[str, Any], version: int, plan: Plan | None) -> str | None:
        """What in rank 0's sync message this rank cannot follow, or None."""
        config = self.config
        if msg.get("version") != version:
            return f"trainer rank 0 sends version {msg.get('version')!r}, trainer rank {self.rank} version {version}"
        if plan is not None and msg.get("plan_hash") != plan.hash:
            return (
                f"trainer rank {self.rank} holds other tensors than trainer rank 0 (plan {plan.hash[:12]} vs "
                f"{str(msg.get('plan_hash'))[:12]}): every rank must pass the same names, shapes and dtypes"
            )
        if msg.get("verify") != config.verify or msg.get("bucket_bytes") != config.bucket_bytes:
            return f"trainer rank {self.rank}'s verify / bucket size differ from trainer rank 0's"
        return None

    def _refuse(self, ch: Channel, problem: str, deadline: Deadline) -> None:
        ch.send({"type": "error", "message": problem}, deadline)
        ch.recv(deadline, expect="abort")
        raise HandshakeError(problem)

    def _start(self, version: int) -> tuple[Channel, dict[str, Any], Deadline]:
        ch = self.connect()
        msg = ch.recv(
            Deadline(self.config.timeout_s, f"for trainer rank 0 to start version {version}"), expect="sync"
        )
        return ch, msg, Deadline(self.config.timeout_s, f"in the transfer of version {version}")

    def send(
        self,
        transport: Transport,
        stages: SendStages,
        src: WeightSource,
        version: int,
        plan: Plan | None,
        num_receivers: int,
    ) -> SyncStats:
        """Follow rank 0's sync of ``version`` through the same stages as rank 0's (each
        round: this rank's answer, ``SendStages.follow``), then send what they give this
        rank to pack (``own``)."""
        ch, msg, deadline = self._start(version)
        host = ch.sock.getsockname()[0]
        stages.start(None)
        while True:
            problem = self._problem(msg, version, plan)
            fields: dict[str, Any] = {}
            if problem is None:
                try:
                    fields = stages.follow(src, msg, self.rank, host)
                except ValueError as e:
                    problem = str(e)
            if problem is not None:
                self._refuse(ch, problem, deadline)
            ch.send({"type": "ready", **fields}, deadline)
            go = ch.recv(deadline, expect=("go", "again"))  # an abort raises HandshakeError here
            if go["type"] == "go":
                break
            msg = ch.recv(deadline, expect="sync")
        members = Members(tuple(range(num_receivers)), 0, host)  # rank 0's stages hold the real ones
        try:
            out = stages.own(Outgoing(src, plan, version), members, self.config.bucket_bytes)
        except RuntimeError as e:
            raise ProtocolError(f"trainer rank 0 gave the go of version {version}: {e}") from e
        return self._send(transport, stages, ch, msg, out, num_receivers, deadline)

    def _send(
        self,
        transport: Transport,
        stages: SendStages,
        ch: Channel,
        msg: dict[str, Any],
        out: Outgoing,
        num_receivers: int,
        deadline: Deadline,
    ) -> SyncStats:
        """After the go: join the data plane, send this rank's buckets, report, learn the outcome."""
        version, plan = out.version, out.plan
        assert plan is not None  # every following rank packs by a plan (carriable, or its part)
        config = self.config
        stats = SyncStats(version, receivers=num_receivers)
        ok = False
        try:
            info = msg["engine"]
            join = Join(
                version=version,
                rank=int(info["rank"]),
                world_size=int(info["world_size"]),
                senders=int(info["senders"]),
                capacity=capacity(plan, config.bucket_bytes),
                name=f"trainer rank {self.rank}",
                local_host=ch.sock.getsockname()[0],
                sender_host=ch.sock.getpeername()[0],
                watch=self._watch,
            )
            transport.connect(stages.join(join, config.bucket_bytes), info)
            packer, produce, sums = producer(
                out.source,
                config.bucket_bytes,
                plan,
                config.verify,
                announce=lambda m: None,
                sends=transport.sends,
            )
            t0 = time.perf_counter()
            stats.bytes = stats.wire_bytes = transport.send_buckets(produce)
            stats.transfer_s = time.perf_counter() - t0
            stats.buckets, stats.tensors = packer.buckets, packer.pulled
            stages.account(stats)
            ch.send(
                {
                    "type": "sent",
                    "ok": True,
                    "bytes": stats.bytes,
                    "wire_bytes": stats.wire_bytes,
                    "checksums": list(sums.items()),
                },
                deadline,
            )
            result = ch.recv(
                Deadline(config.timeout_s, f"for the outcome of version {version}"), expect="result"
            )
            ok = True
        except Exception as e:
            try:
                ch.send({"type": "sent", "ok": False, "message": f"{type(e).__name__}: {e}"}, deadline)
            except SyncError:
                pass
            self.close()  # connect anew at the next send
            raise (
                e
                if isinstance(e, SyncError)
                else SyncError(
                    f"trainer rank {self.rank}: sending its share of version {version} failed: {e}"
                )
            ) from e
        finally:
            transport.finish(ok=ok)
        if result.get("ok") is not True:
            raise SyncError(f"version {version} failed (reported by trainer rank 0): {result.get('message')}")
        return stats

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
