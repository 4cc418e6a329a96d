"""Backend ``mooncake``: buckets moved point to point by Mooncake Transfer Engine.

Every process registers a ring of ``SLOTS`` bucket-sized slots with its own Mooncake
Transfer Engine. Bytes move by one-sided writes into the next process's ring, over the
transport that the buffers' device calls for (``platform.mooncake_protocol``: TCP for
host memory, RDMA for CUDA memory, ``ascend_direct`` on Ascend NPUs). No metadata server
is needed: engines find each other by Mooncake's peer-to-peer handshake (``P2PHANDSHAKE``),
addressed as ``host:rpc_port``.

Fan-out is a chain: sender -> receiver 1 -> receiver 2 -> ... A bucket goes down each link
in pieces of ``CHUNK_BYTES`` (``engines.ring``), a write or two in flight per link (see
``_IN_FLIGHT_LOCAL``): once a piece landed, READY tells the downstream how many bytes of
the bucket are in its slot so far, and a receiver forwards
each newly announced range at once, in the same pieces; it hands the bucket to its
consumer once all of it arrived, and says DONE upstream once the consumer and its
forwards are through with the slot. While the consumer reads a bucket a thread goes on
relaying (its last pieces, the next bucket's first ones), so no link waits for a
consumer. So every link carries the model exactly once, the sender uploads it once,
whatever the number of receivers, and a hop delays the stream by about a piece, not a
bucket. A slot is rewritten only after DONE for the bucket it held. The sender copies a
bucket that is one range of a source tensor into its (registered) slot piece by piece,
each copy while earlier pieces are on the wire (registering every source tensor instead
would cost a registration per sync, and memory a failed write may still read). A tree
would make each inner node upload everything two or more times, halving the rate on the
bottleneck links: the chain is faster, and simpler. Its cost: one receiver lost in the
middle fails the sync for those behind it; a new chain of the others then takes the
version again (``drop_lost_receivers``) or the next one.

Signals do not go through Mooncake: each link has a small TCP connection of our own,
bound to the control connection's interface, carrying the slot ring's versioned frames
(``engines.ring``, shared with ``shm``): "n bytes of bucket k are in your slot"
downstream, "I am done with bucket k" upstream, tagged with version and bucket, so nothing
left over from an earlier version can satisfy a wait in a later one. Set-up messages (who
is up- and downstream of whom) are msgpack; a connection must first prove it belongs to
this sync with the 128-bit token from ``prepare()`` (which travels over the authenticated
control channel); others are logged and dropped without delaying anyone. A peer that dies
closes its sockets, so its neighbours fail at once rather than at their deadline.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync import platform
from weightsync.engines import ring
from weightsync.engines.base import Join, Landing, NextBucket, Producer, Transport
from weightsync.engines.ring import CHUNK_BYTES, DONE, FAIL, READY, SLOTS, PeerError, Signals
from weightsync.plan import Bucket

try:
    from mooncake.engine import TransferEngine
except ImportError as e:  # the registry reports this as "backend 'mooncake' cannot be loaded"
    raise ImportError(
        f"backend 'mooncake' needs Mooncake Transfer Engine: pip install 'weightsync[mooncake]' "
        f"(CUDA: mooncake-transfer-engine, Ascend: mooncake-transfer-engine-npu) ({e})",
        name=e.name or "mooncake",
    ) from e

log = logging.getLogger("weightsync.engines.mooncake")

_POLL_S = ring.POLL_S
# Piece writes on a link at once. Measured (1 MiB pieces, TCP): on one host two are 1.7x
# one; across a shaped 1 Gbit/s link one is 0.94x the link ceiling, two 0.90x, four 0.82x.
_IN_FLIGHT_LOCAL, _IN_FLIGHT_REMOTE = 2, 1
_DRAIN_POLL_S = 0.0005  # a forwarding receiver looks this often whether a write landed
# Memory that a transfer may still have been using when its sync was abandoned: kept,
# never freed, so Mooncake cannot write into (or read from) memory that was given back.
_ORPHANS: list[Any] = []


def orphan(*things: Any) -> None:
    """Keep ``things`` (registered memory, the engine it is registered with) for good."""
    _ORPHANS.append(things)


def start_engine(host: str, protocol: str, nic_filter: str) -> Any:
    """A Mooncake Transfer Engine listening on ``host``, found by peer-to-peer handshake."""
    te = TransferEngine()
    rc = te.initialize(host, "P2PHANDSHAKE", protocol, nic_filter)
    if rc != 0:
        raise RuntimeError(
            f"Mooncake Transfer Engine did not start on {host} with protocol {protocol!r} "
            f"(device_name={nic_filter!r}): initialize returned {rc}"
        )
    return te


def register(te: Any, memory: torch.Tensor, protocol: str) -> None:
    """Register ``memory`` with ``te``, so peers may write into it (or it be written from)."""
    rc = te.register_memory(memory.data_ptr(), memory.numel() * memory.element_size())
    if rc != 0:
        raise RuntimeError(
            f"Mooncake could not register {memory.numel() * memory.element_size()} bytes of "
            f"{memory.device} memory for {protocol!r}: register_memory returned {rc}"
        )


class _Local:
    """This process's Mooncake Transfer Engine and its registered ring of slots."""

    def __init__(
        self, host: str, protocol: str, nic_filter: str, device: torch.device, slot_bytes: int
    ) -> None:
        self.te = start_engine(host, protocol, nic_filter)
        self.host = host
        self.rpc_port = int(self.te.get_rpc_port())
        self.slot_bytes = slot_bytes
        self.ring = torch.empty(SLOTS * slot_bytes, dtype=torch.uint8, device=device)
        register(self.te, self.ring, protocol)
        self.inflight: set[int] = set()  # batch ids of writes not yet seen complete

    def slot(self, k: int) -> torch.Tensor:
        return ring.slot(self.ring, self.slot_bytes, k)

    def release(self) -> None:
        if self.inflight:  # a write may still read the ring: let a failing peer's resolve
            until = time.monotonic() + 2.0
            while self.inflight and time.monotonic() < until:
                self.inflight = {b for b in self.inflight if self.te.transfer_check_status(b) == 0}
                time.sleep(0.01)
        if self.inflight:
            log.warning("mooncake: %d write(s) still in flight; keeping their memory", len(self.inflight))
            orphan(self.te, self.ring)
        else:
            self.te.unregister_memory(self.ring.data_ptr())
        self.te = None  # type: ignore[assignment]  (the engine stops with its last reference)
        self.ring = None  # type: ignore[assignment]


class MooncakeEngine(Transport):
    name = "mooncake"
    reroutes = True  # failed writes land in orphaned ring memory only (``_Local.release``)

    def __init__(self, config, device) -> None:
        super().__init__(config, device)
        self._join_record: Join | None = None  # the sync in progress
        self._capacity = 0  # bytes per slot
        self._generation = 0
        self._token = ""
        self._key: tuple | None = None  # the chain this process is joined to
        self._info: dict[str, Any] | None = None  # sender: what prepare handed out
        self._listener: socket.socket | None = None
        self._local: _Local | None = None
        self._up: Signals | None = None  # receivers: where buckets come from
        self._down: Signals | None = None  # where buckets go (None at the end of the chain)
        self._target = ""  # Mooncake segment of the downstream process: "host:rpc_port"
        self._target_ring = 0  # address of its ring
        self._in_flight = _IN_FLIGHT_REMOTE  # writes on that link at once

    # ------------------------------------------------------------------ set-up
    def _ring_device(self) -> torch.device:
        wanted = self.config.engine_kwargs.mooncake.device
        if wanted in ("auto", self.device.type):
            return self.device
        return torch.device(wanted)

    def _open_local(self, host: str) -> None:
        device = self._ring_device()
        protocol = platform.mooncake_protocol(device.type)
        self._local = _Local(
            host, protocol, self.config.engine_kwargs.mooncake.device_name, device, self._capacity
        )
        log.debug(
            "mooncake: %d slots of %d bytes on %s, %s on %s:%d",
            SLOTS,
            self._capacity,
            device,
            protocol,
            host,
            self._local.rpc_port,
        )

    @property
    def _sync(self) -> Join:
        assert self._join_record is not None, "connect() first"
        return self._join_record

    @staticmethod
    def _bind_host(join: Join) -> str:
        """Where our sockets and Mooncake listen: the control connection's interface."""
        if join.local_host and join.local_host not in ("0.0.0.0", "::"):
            return join.local_host
        return socket.gethostbyname(socket.gethostname())

    def _listen(self, host: str) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(8)
        return listener

    def prepare(self, join: Join) -> dict[str, Any]:
        capacity = min(max(join.capacity, 1), self.config.bucket_bytes)
        if capacity > self._capacity:
            self._drop()  # receivers join the new, larger chain at this sync's connect
            self._capacity = capacity
        if self._info is None:
            self._drop()
            bind = self._bind_host(join)
            self._open_local(bind)
            self._listener = self._listen(bind)
            self._generation += 1
            self._token = secrets.token_hex(16)  # 128 bits: proves a connection is ours
            self._info = {
                "signal_port": self._listener.getsockname()[1],
                "token": self._token,
                "generation": self._generation,
                "slot_bytes": self._capacity,
            }
        return dict(self._info)

    def connect(self, join: Join, info: dict[str, Any]) -> None:
        self._join_record = join
        for link in (self._up, self._down):
            if link is not None:
                link.watch = join.watch
        key = (info["token"], info["generation"], join.world_size)
        if self._key == key:
            return
        try:
            if join.rank == 0:
                self._build_chain(join)
            else:
                self._join(join, info)
        except BaseException:
            self._drop()  # close what was opened: the neighbours fail at once, not at their deadline
            raise
        self._key = key

    def _build_chain(self, join: Join) -> None:
        """Sender: every receiver registers; tell each who is up- and downstream of it."""
        assert self._listener is not None and self._local is not None
        generation, world_size, timeout = self._generation, join.world_size, self.config.timeout_s

        def check(msg: dict, sock: socket.socket, taken: dict) -> int:
            if ring.int_field(msg, "generation") != generation:
                raise ValueError(f"generation {msg.get('generation')} is not the current one ({generation})")
            rank = ring.int_field(msg, "rank")
            if not 1 <= rank < world_size or rank in taken:
                raise ValueError(f"rank {rank} is not a free receiver rank of this sync")
            for field in ("label", "rpc_port", "ring", "signal_port"):
                ring.int_field(msg, field)
            return rank

        peers = ring.accept_peers(
            self._listener, world_size - 1, self._token, check, timeout, join.watch, "mooncake receiver(s)"
        )
        self._listener.close()  # everyone joined: nobody else may attach to this chain
        self._listener = None
        deadline = time.monotonic() + timeout
        try:
            for rank, (sock, _, _) in peers.items():
                up = None
                if rank > 1:
                    _, msg, addr = peers[rank - 1]
                    up = {"host": addr, "signal_port": msg["signal_port"], "label": msg["label"]}
                down = None
                if rank + 1 < world_size:
                    _, msg, addr = peers[rank + 1]
                    down = {
                        "host": addr,
                        "rpc_port": msg["rpc_port"],
                        "ring": msg["ring"],
                        "label": msg["label"],
                    }
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.sendall(ring.pack_message({"up": up, "down": down}))
        except OSError as e:
            for sock, _, _ in peers.values():
                sock.close()
            raise PeerError(f"mooncake: a receiver left while the chain was set up ({e})") from e
        first, msg, addr = peers[1]
        for rank, (sock, _, _) in peers.items():
            if rank != 1:
                sock.close()  # they talk to their neighbours now
        label = int(msg["label"])
        self._down = Signals(first, f"receiver rank {label} (mooncake)", label, timeout, join.watch)
        self._aim(addr, int(msg["rpc_port"]), int(msg["ring"]))

    def _join(self, join: Join, info: dict[str, Any]) -> None:
        """Receiver: register with the sender, link to the neighbours it names."""
        self._drop()
        capacity = int(info["slot_bytes"])
        if not 0 < capacity <= self.config.bucket_bytes:
            raise PeerError(
                f"mooncake: the sender asks for slots of {capacity} bytes; buckets are {self.config.bucket_bytes}"
            )
        self._capacity = capacity
        self._token = str(info["token"])
        host = self._bind_host(join)
        self._open_local(host)
        assert self._local is not None
        last = join.rank == join.world_size - 1
        self._listener = None if last else self._listen(host)
        timeout = self.config.timeout_s
        sender = (join.sender_host or host, int(info["signal_port"]))
        try:
            reg = socket.create_connection(sender, timeout=timeout, source_address=(host, 0))
        except OSError as e:
            raise PeerError(f"mooncake: could not reach the sender's signal port {sender}: {e}") from e
        try:
            reg.sendall(
                ring.pack_message(
                    {
                        "token": self._token,
                        "generation": int(info["generation"]),
                        "rank": join.rank,
                        "label": join.receiver_rank,
                        "rpc_port": self._local.rpc_port,
                        "ring": self._local.ring.data_ptr(),
                        "signal_port": self._listener.getsockname()[1] if self._listener is not None else 0,
                    }
                )
            )
            route = ring.read_message(reg, "the sender (mooncake)", timeout, join.watch)
        except BaseException:
            reg.close()
            raise
        up = route.get("up")
        if up is None:
            self._up = Signals(reg, "the sender (mooncake)", None, timeout, join.watch)
        else:
            reg.close()
            upstream = (str(up["host"]), int(up["signal_port"]))
            name = f"receiver rank {up['label']} (mooncake)"
            try:
                sock = socket.create_connection(upstream, timeout=timeout, source_address=(host, 0))
            except OSError as e:
                raise PeerError(f"mooncake: could not reach {name} at {upstream}: {e}") from e
            self._up = Signals(sock, name, int(up["label"]), timeout, join.watch)
            try:
                sock.sendall(
                    ring.pack_message(
                        {"token": self._token, "generation": int(info["generation"]), "rank": join.rank}
                    )
                )
            except OSError as e:
                raise PeerError(f"{name} closed its connection ({e})") from e
        down = route.get("down")
        if down is not None and self._listener is not None:
            want = join.rank + 1
            generation = int(info["generation"])

            def check(msg: dict, sock: socket.socket, taken: dict) -> int:
                if ring.int_field(msg, "generation") != generation or ring.int_field(msg, "rank") != want:
                    raise ValueError(
                        f"generation {msg.get('generation')}, rank {msg.get('rank')}: not our downstream"
                    )
                return want

            sock, _, _ = ring.accept_peers(
                self._listener,
                1,
                self._token,
                check,
                timeout,
                join.watch,
                f"downstream receiver (rank {down['label']})",
            )[want]
            label = int(down["label"])
            self._down = Signals(sock, f"receiver rank {label} (mooncake)", label, timeout, join.watch)
            self._aim(str(down["host"]), int(down["rpc_port"]), int(down["ring"]))
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _aim(self, host: str, rpc_port: int, ring_address: int) -> None:
        """Write downstream to the ring at ``ring_address`` of the engine at ``host:rpc_port``."""
        assert self._local is not None
        self._target, self._target_ring = f"{host}:{rpc_port}", ring_address
        self._in_flight = _IN_FLIGHT_LOCAL if host == self._local.host else _IN_FLIGHT_REMOTE

    # ------------------------------------------------------------------ data
    # A bucket goes down a link in pieces of CHUNK_BYTES: each piece is a write into the same
    # range of the downstream's slot; once it landed, READY carries the bytes of the bucket
    # landed so far. ``window`` holds the (at most ``_in_flight``) writes on their way,
    # oldest first, as (bucket, batch id or None, end of the piece in the bucket).
    def _write(self, k: int, start: int, nbytes: int) -> int:
        """Start writing bytes ``[start, start + nbytes)`` of our slot of bucket ``k`` into
        the same range of the downstream's slot; its batch id."""
        assert self._local is not None and self._down is not None
        offset = (k % SLOTS) * self._capacity + start
        batch = self._local.te.transfer_submit_write(
            self._target, self._local.ring.data_ptr() + offset, self._target_ring + offset, nbytes
        )
        if batch is None or batch <= 0:
            raise PeerError(
                f"Mooncake could not start writing bucket {k} to {self._down.peer} (returned {batch})",
                self._down.label,
            )
        self._local.inflight.add(batch)
        return batch

    def _landed(self, k: int, batch: int | None) -> bool:
        """Whether the write ``batch`` of bucket ``k`` landed downstream (asks Mooncake once)."""
        if batch is None:
            return True
        assert self._local is not None and self._down is not None
        status = self._local.te.transfer_check_status(batch)
        if status == 0:
            return False
        self._local.inflight.discard(batch)  # its id is freed once reported; never ask again
        if status != 1:
            raise PeerError(
                f"Mooncake failed to write bucket {k} of version {self._sync.version} to {self._down.peer} "
                f"({'timed out' if status == -2 else f'status {status}'})",
                self._down.label,
            )
        return True

    def _await(self, done: Callable[[], bool], k: int) -> None:
        """Poll ``done`` until it is true, watching the sync; bounded by the timeout, as a
        write of bucket ``k`` downstream that took too long."""
        assert self._down is not None
        deadline = time.monotonic() + self.config.timeout_s
        next_watch, pause = time.monotonic() + _POLL_S, 0.0001
        while not done():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"writing bucket {k} of version {self._sync.version} to {self._down.peer} "
                    f"took longer than {self.config.timeout_s} s"
                )
            if now > next_watch:
                next_watch = now + _POLL_S
                self._sync.check()
            time.sleep(pause)
            pause = min(pause * 2, _DRAIN_POLL_S)

    def _complete(self, k: int, batch: int | None) -> None:
        """Wait (bounded) until the write ``batch`` of bucket ``k`` landed downstream."""
        self._await(lambda: self._landed(k, batch), k)

    def _retire(self, window: deque, block: bool = True) -> bool:
        """The oldest write of ``window`` landed (waiting for it if ``block``): READY for
        the bytes of its bucket up to its end. False if it had not landed."""
        assert self._down is not None
        k, batch, end = window[0]
        if block:
            self._complete(k, batch)
        elif not self._landed(k, batch):
            return False
        window.popleft()
        self._down.send(READY, self._sync.version, k, end)
        return True

    def _retire_landed(self, window: deque) -> None:
        """Announce the writes that already landed, oldest first, without waiting."""
        while window and self._retire(window, block=False):
            pass

    def _drain(self, window: deque, up: Signals) -> None:
        """Announce our writes downstream as they land while nothing comes from ``up`` (the
        link whose signal is awaited next), so a piece waits for no later one, nor for that
        signal, to go on."""

        def idle() -> bool:
            self._retire_landed(window)
            return not window or up.readable(_DRAIN_POLL_S)

        if window:
            self._await(idle, window[0][0])

    def _flush(self, window: deque, upto: int | None = None) -> None:
        """Wait for the writes in ``window`` (those of buckets up to ``upto``) and announce them."""
        while window and (upto is None or window[0][0] <= upto):
            self._retire(window)

    def _forward(self, window: deque, k: int, start: int, end: int) -> None:
        """Write bytes ``[start, end)`` of bucket ``k`` downstream, in pieces of
        ``CHUNK_BYTES``, at most ``_in_flight`` on the wire. An empty bucket is one READY."""
        if start == end == 0:
            self._flush(window)
            assert self._down is not None
            self._down.send(READY, self._sync.version, k, 0)
            return
        for a in range(start, end, CHUNK_BYTES):
            b = min(a + CHUNK_BYTES, end)
            while len(window) >= self._in_flight:
                self._retire(window)
            window.append((k, self._write(k, a, b - a), b))

    def send_buckets(self, produce: Producer) -> int:
        assert self._down is not None and self._local is not None, "connect() first"
        version = self._sync.version
        down = self._down
        window: deque = deque()
        sent = 0
        k = 0
        try:
            while True:
                if k >= SLOTS:  # the receiver's slot (and ours) must be free of bucket k - SLOTS
                    self._flush(window, upto=k - SLOTS)  # its READYs are what that DONE waits for
                    self._drain(window, down)  # later buckets' pieces are announced meanwhile
                    down.wait(DONE, version, k - SLOTS)
                self._retire_landed(window)
                slot = self._local.slot(k)
                produced = produce(slot)
                if produced is None:
                    break
                bucket, payload = produced
                n = bucket.nbytes
                if n and payload.data_ptr() != slot.data_ptr():
                    # A bucket sent from its source tensor: copied into the slot (the memory
                    # registered with Mooncake) piece by piece, each while the previous ones
                    # are on the wire.
                    for a in range(0, n, CHUNK_BYTES):
                        b = min(a + CHUNK_BYTES, n)
                        platform.copy_bytes(slot[a:b], payload[a:b])
                        platform.synchronize(slot.device)
                        self._forward(window, k, a, b)
                else:
                    platform.synchronize(slot.device)
                    self._forward(window, k, 0, n)
                sent += n
                k += 1
            self._flush(window)
            # The loop's last pass waited for bucket k - SLOTS: the later ones are still read.
            for seq in range(max(0, k - SLOTS + 1), k):
                down.wait(DONE, version, seq)
        except BaseException:
            self._drop()  # receivers see their sockets close and fail at once
            raise
        return sent

    def _take(self, window: deque, k: int, have: int, limit: int) -> int:
        """The next READY of bucket ``k`` from upstream (``have``: bytes announced before it,
        -1 for none), its new bytes forwarded downstream at once; the bytes now announced."""
        up, down, version = self._up, self._down, self._sync.version
        assert up is not None
        got = up.wait(READY, version, k)
        if got > limit:
            raise PeerError(f"{up.peer} wrote {got} bytes for bucket {k}, at most {limit} fit")
        if got <= have:  # counts only grow (READY 0 comes once, for an empty bucket)
            raise PeerError(f"{up.peer} announced {got} bytes of bucket {k} after {have}")
        if down is not None:
            if have < 0 and k >= SLOTS:  # the downstream's slot must be free of bucket k - SLOTS
                self._drain(window, down)
                down.wait(DONE, version, k - SLOTS)
            self._forward(window, k, max(have, 0), got)
            self._retire_landed(window)
        return got

    def _relay_ahead(self, window: deque, k: int, stop: threading.Event, box: list) -> None:
        """While the consumer reads bucket ``k - 1``: take and forward what arrives of
        bucket ``k`` (its size is not known yet: a slot bounds it), so the downstream link
        does not wait for the consumer. Runs in a thread; the generator waits for it before
        touching any state again. ``box`` gets ``[bytes announced]`` or ``[error]``."""
        have = -1
        up, down = self._up, self._down
        assert up is not None and down is not None
        try:
            while not stop.is_set():
                self._retire_landed(window)
                # Never block: no write may start, or DONE for bucket k - SLOTS is due first (_take).
                held = len(window) >= self._in_flight or (have < 0 and k >= SLOTS and not down.readable(0))
                if held:
                    time.sleep(_DRAIN_POLL_S)
                elif up.readable(_DRAIN_POLL_S):
                    have = self._take(window, k, have, self._capacity)
            box.append(have)
        except BaseException as e:
            box.append(e)

    def recv_buckets(
        self, next_bucket: NextBucket, landing: Landing | None = None
    ) -> Iterator[tuple[Bucket, torch.Tensor]]:
        # ``landing`` is not used: the upstream writes into our registered slots.
        assert self._up is not None and self._local is not None, "connect() first"
        version = self._sync.version
        up, down = self._up, self._down
        window: deque = deque()
        k = 0
        have = -1  # bytes of bucket k known to have landed (none announced yet)
        try:
            while (bucket := next_bucket()) is not None:
                n = bucket.nbytes
                if n > self._capacity:  # the plan and the ring disagree: never read past a slot
                    raise PeerError(f"bucket {k} has {n} bytes, the sender's slots {self._capacity}")
                while True:
                    if have > n or have == 0 < n:  # READY 0 is an empty bucket's only signal
                        raise PeerError(f"{up.peer} announced {have} bytes of bucket {k}, the plan says {n}")
                    if have == n:
                        break
                    if down is not None:
                        self._drain(window, up)
                    have = self._take(window, k, have, n)
                ahead = None
                if down is not None:  # bucket k + 1 goes on while the consumer reads bucket k
                    stop, box = threading.Event(), []
                    ahead = threading.Thread(
                        target=self._relay_ahead,
                        args=(window, k + 1, stop, box),
                        name="weightsync-mooncake-relay",
                        daemon=True,
                    )
                    ahead.start()
                try:
                    yield bucket, self._local.slot(k)[:n]
                finally:
                    if ahead is not None:
                        stop.set()
                        ahead.join()  # bounded: the relay polls, and its waits have timeout_s
                if ahead is not None:
                    have = box[0]
                    if isinstance(have, BaseException):
                        raise have
                else:
                    have = -1
                platform.synchronize(self._local.ring.device)  # our reads of the slot are complete
                if down is not None:
                    self._flush(window, upto=k)
                up.send(DONE, version, k, 0)  # our slot may be rewritten: nothing reads it now
                k += 1
            if have >= 0:
                raise PeerError(
                    f"{up.peer} announced {have} bytes of bucket {k}, which the plan does not hold"
                )
            if down is not None:
                self._flush(window)
                for seq in range(max(0, k - SLOTS), k):
                    down.wait(DONE, version, seq)
        except BaseException as e:
            if isinstance(e, PeerError) and e.lost is not None and e.lost != up.label:
                try:  # tell the chain upstream who was lost, so the sender names it
                    up.send(FAIL, version, k, e.lost)
                except PeerError:
                    pass
            self._drop()
            raise

    # ------------------------------------------------------------------ teardown
    def reset(self) -> None:
        self._drop()

    def finish(self, ok: bool) -> None:
        if not ok:  # the chain's state is unknown: the next sync sets up a new one
            self._drop()

    def close(self) -> None:
        self._drop()

    def _drop(self) -> None:
        """Leave the chain: close sockets, unregister the ring, stop the transfer engine
        (a new chain gets a new one, so Mooncake keeps no stale view of its peers)."""
        for link in (self._up, self._down):
            if link is not None:
                link.close()
        self._up = self._down = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._local is not None:
            self._local.release()
            self._local = None
        self._key = None
        self._info = None
        self._target, self._target_ring = "", 0
