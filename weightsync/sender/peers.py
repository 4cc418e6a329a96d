"""``SessionPeers``: who takes part in trainer rank 0's session, and how to reach them.

The control plane's membership, apart from what a sync does with it (``Sender``): the
receiver ranks every sync goes to and those dropped, the listening socket, each receiver's
control connection (and, where every trainer rank sends, the other trainer ranks'), the plan
hash each receiver holds; accepting peers, watching them, dropping them, telling them all
something, and explaining a failure by naming the peer behind it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from weightsync.config.engine import EngineConfig
from weightsync.engines.base import Join
from weightsync.errors import HandshakeError, PeerLost, RemoteFailure, SyncError
from weightsync.sender.ranks import TrainerPeers
from weightsync.sender.replies import dead_ranks, explain, gather_done, lost_receivers
from weightsync.session.channel import Channel, Deadline
from weightsync.session.control import ControlServer, PartlyConnected
from weightsync.sharding.agreement import RECEIVER, TRAINER
from weightsync.stages import Answer, Members

#: a peer of one handshake round: how messages name it, its receiver rank (None: a trainer
#: rank), its connection
Peer = tuple[str, int | None, Channel]

WILDCARDS = ("", "0.0.0.0", "::")


class SessionPeers:
    """Trainer rank 0's peers (on other ranks: the membership only, ``server`` None).

    ``reset_plane`` is called whenever the set of connected peers changes: every rank then
    joins a new data-plane group.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_receivers: int,
        trainers: int,
        server: ControlServer | None,
        reset_plane: Callable[[], None],
    ) -> None:
        self.config = config
        self.server = server
        self._members = set(range(num_receivers))
        self._dropped: set[int] = set()  # lost and dropped (drop_lost_receivers), not added back
        #: receiver rank -> its control connection
        self.channels: dict[int, Channel] = {}
        #: the other trainer ranks' connections (where every trainer rank sends)
        self.trainers = TrainerPeers(trainers)
        #: receiver rank -> the plan hash it holds (an unchanged plan travels as its hash)
        self.acked_plan: dict[int, str] = {}
        #: what the session is in, for messages ("the transfer of version 3")
        self.doing = ""
        self._reset_plane = reset_plane

    # ------------------------------------------------------------------ membership
    @property
    def receivers(self) -> list[int]:
        return sorted(self._members)

    @property
    def dropped(self) -> list[int]:
        return sorted(self._dropped)

    def remove(self, rank: int) -> None:
        """``Sender.remove_receiver``."""
        if rank in self._dropped:
            self._dropped.discard(rank)
            return
        if rank not in self._members:
            raise ValueError(f"receiver rank {rank} is not a member (members: {self.receivers})")
        if len(self._members) == 1:
            raise ValueError(f"receiver rank {rank} is the last receiver; a sync needs at least one")
        self._members.discard(rank)
        if rank in self.channels:
            self.drop([rank])
        self._reset_plane()  # the data plane is rebuilt for the new membership

    def add(self, rank: int) -> None:
        """``Sender.add_receiver``."""
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"receiver rank must be a non-negative int, got {rank!r}")
        self._members.add(rank)
        self._dropped.discard(rank)

    def lose(self, ranks: list[int]) -> bool:
        """Receivers lost in a sync leave the members (``drop_lost_receivers``); False
        (nothing changed) when no member would be left."""
        if not self._members - set(ranks):
            return False
        self._members -= set(ranks)
        self._dropped |= set(ranks)
        return True

    def group_rank(self, rank: int) -> int:
        """A receiver's rank in the data-plane group: its place among the members, after 0."""
        return self.receivers.index(rank) + 1

    def members(self, trainers: int, senders: int = 1) -> Members:
        """The sync's members as the stages see them."""
        assert self.server is not None
        host = self.server.host  # in a layout: where rank 0's bytes leave from
        where = socket.gethostname() if host in WILDCARDS else host
        return Members(tuple(self.receivers), trainers, where, senders)

    @contextlib.contextmanager
    def only(self, ranks: list[int] | None) -> Iterator[None]:
        """The sync in this block goes to these receivers only (None: every member)."""
        if ranks is None:
            yield
            return
        members, channels = self._members, self.channels
        self._members, self.channels = set(ranks), {r: channels[r] for r in ranks}
        try:
            yield
        finally:  # channels the block dropped stay dropped
            self._members = members
            self.channels = {r: ch for r, ch in channels.items() if r not in ranks} | self.channels

    # ------------------------------------------------------------------ connections
    def connect(self) -> None:
        """Wait (up to ``timeout_s``) until every member (and other trainer rank) is connected."""
        if self.server is None:
            return
        # Gone since the last sync: accept them anew. One that went silent (its host cut off,
        # say) gets the heartbeat grace to come back, not the whole deadline.
        silent = {}
        for rank in dead_ranks(self.channels):
            if self.channels[rank].silent:
                silent[rank] = self.channels[rank].gone("since the last sync")
            self.drop([rank])
        missing: set[Any] = (self._members - set(self.channels)) | self.trainers.missing()
        if not missing:
            return
        accepted: dict[Any, Channel] = {}
        grace = self.config.heartbeat_grace if silent and missing <= set(silent) else None
        try:
            accepted = self.server.accept(missing, self.config, seconds=grace)
        except PartlyConnected as e:
            accepted = e.connected  # those that came stay connected for the next try
            if grace is not None:
                raise PeerLost(
                    "; ".join(f"{silent[r]}, and it did not come back within {grace:.1f} s" for r in e.ranks),
                    ranks=e.ranks,
                ) from None
            raise
        finally:
            for key, ch in accepted.items():
                if isinstance(key, int):
                    self.channels[key] = ch
                else:
                    self.trainers.channels[key[1]] = ch
            self._reset_plane()  # new members: every rank joins a new data-plane group

    def watch(self) -> None:
        """Raise if a peer's control connection closed (its process is likely gone)."""
        dead = dead_ranks(self.channels)
        gone = self.trainers.dead()
        if dead or gone:
            raise PeerLost(lost_receivers(self.channels, dead, f"during {self.doing}", gone), ranks=dead)

    def join(self, version: int, senders: int, capacity_bytes: int) -> Join:
        """Trainer rank 0's ``Join`` record: the host of the data plane, on the control
        socket's interface (any, where that listens on a wildcard)."""
        assert self.server is not None
        return Join(
            version=version,
            rank=0,
            world_size=len(self._members) + senders,
            senders=senders,
            capacity=capacity_bytes,
            name="trainer rank 0",
            local_host=None if self.server.host in WILDCARDS else self.server.host,
            peer_hosts=tuple(self.channels[r].sock.getpeername()[0] for r in sorted(self.channels)),
            watch=self.watch,
        )

    def drop(self, ranks: list[int] | None = None) -> None:
        """Close connections to these receivers (None: to every peer, trainers included)."""
        for rank in list(self.channels) if ranks is None else ranks:
            self.channels.pop(rank).close()
            self.acked_plan.pop(rank, None)
        if ranks is None:
            self.trainers.close()

    def close(self) -> None:
        """Tell the receivers the session ends (so they do not wait to join again), close
        every connection and the listening socket."""
        for ch in self.channels.values():
            with contextlib.suppress(SyncError):
                ch.send({"type": "closing"}, Deadline(1.0, "saying goodbye"))
        self.drop()
        if self.server is not None:
            self.server.close()
            self.server = None

    # ------------------------------------------------------------------ telling and hearing
    def peers(self) -> list[Peer]:
        """Every connected peer, receivers first (by rank), then the other trainer ranks."""
        return [
            (f"receiver rank {r}", r, ch) for r, ch in sorted(self.channels.items())
        ] + self.trainers.peers()

    def answers_of(self, replies: list[tuple[int | None, dict[str, Any]]]) -> list[Answer]:
        """A round's replies (in ``peers`` order) as the stages read them."""
        sides = [(RECEIVER, r) for r in sorted(self.channels)]
        sides += [(TRAINER, i) for i in sorted(self.trainers.channels)]
        return [(side, rank, reply) for (side, rank), (_, reply) in zip(sides, replies)]

    def broadcast(self, msg: dict[str, Any], deadline: Deadline) -> None:
        for ch in self.channels.values():
            ch.send(msg, deadline)

    def abort(
        self, peers: list[Peer], deadline: Deadline, reason: str, cause: Exception | None = None
    ) -> NoReturn:
        """End a handshake: every peer told why, ``HandshakeError`` raised."""
        for _, _, ch in peers:
            with contextlib.suppress(SyncError):
                ch.send({"type": "abort", "message": reason}, deadline)
        raise HandshakeError(reason) from cause

    def cancel(self, version: int, reason: str) -> None:
        """Tell the receivers waiting for the sync of ``version`` that it will not come."""
        deadline = Deadline(min(2.0, self.config.timeout_s), f"cancelling version {version}")
        for ch in self.channels.values():
            with contextlib.suppress(SyncError):  # best effort: one gone does not stop the others
                ch.send({"type": "cancel", "version": version, "message": reason}, deadline)

    def gather_done(self, version: int, confirmed: set[int]) -> None:
        """Every receiver's word on ``version`` (those that took it go into ``confirmed``);
        ``RemoteFailure`` naming those that did not."""
        failures = gather_done(self.channels, version, self.config.timeout_s, confirmed)
        if failures:
            raise RemoteFailure("; ".join(failures.values()), ranks=list(failures))

    def explain(self, error: Exception, what: str) -> Exception:
        """``error`` as the peer behind it explains it (``weightsync.sender.replies.explain``)."""
        return explain(error, what, self.channels, min(2.0, self.config.timeout_s), self.trainers.channels)

    def raise_explained(self, error: Exception, what: str) -> NoReturn:
        """Raise ``error`` explained; one explained in place keeps its own cause (never itself)."""
        explained = self.explain(error, what)
        if explained is error:
            raise error
        raise explained from error
