"""``sharded``'s links over Mooncake Transfer Engine (``engine_kwargs.sharded.links=mooncake``).

A link of the route carries bytes one way, from its sending end (a trainer rank, or a
receiver passing its chain on) to its receiving end, and both ends issue its operations in
the same order (their pair's plan), as over a two-rank process group: so a link here keeps
that group's one operation, ``broadcast(tensor, 0)``, and ``sharded`` drives it unchanged.
The receiving end posts each piece with the address it must land at, in its bucket buffers
(memory registered with its own Transfer Engine); the sending end writes the piece there,
one-sided, and says it landed. The ends talk over a TCP connection of our own, fixed frames:
POST ("piece n lands at address a, b bytes") one way, LANDED ("piece n is in your memory")
the other. A thread per sending end serves its link in order, so every link of a rank moves
at once; a receiving end learns of landed pieces when it next looks. A full socket buffer is
no failure: a receiving end keeps the POSTs its socket cannot take yet and sends them as it
drains, a sending end waits to send a LANDED (up to ``timeout_s`` without a byte taken).

Set-up goes through the group's rendezvous store (whose keys only token holders reach): every
rank publishes its endpoint (Transfer Engine's ``host:rpc_port``, its link listener), a
sending end connects to its peer's listener and proves with the group's token that it belongs
to this group; strangers are logged and closed. A peer that dies closes its sockets, so the
other end fails at once, naming it. Memory a write may still touch after a failure (the
receiving end's buffers, a sending thread's that did not stop) is kept, never freed.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.engines import mooncake, ring
from weightsync.engines.base import Join
from weightsync.engines.ring import CHUNK_BYTES, PeerError

log = logging.getLogger("weightsync.engines.mooncake_links")

_FRAME = struct.Struct("<B7xqqq")  # (kind, piece number, address, bytes)
POST, LANDED = 1, 2
_STOP_JOIN_S = 2.0  # how long a failed link's sending thread may take to end its write
_POLL_MIN_S, _POLL_MAX_S = 0.0001, 0.0005  # how often a sending end asks whether its write landed


class _Work:
    """One piece's operation, as ``sharded`` waits for a collective's: ``is_completed()``
    (also once it expired) and ``wait()`` (raises its error, or the timeout). It expires when
    its link made no progress for ``timeout_s`` since it was queued: a piece posted far ahead
    of a slow link may wait longer than that for its turn."""

    def __init__(self, what: str, timeout_s: float, progress: Callable[[], float]) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.queued = time.monotonic()
        self.progress = progress  # when its link last moved a piece

    def expired(self) -> bool:
        return time.monotonic() > max(self.queued, self.progress()) + self.timeout_s

    def _late(self) -> TimeoutError:
        return TimeoutError(f"{self.what}: its link moved nothing for {self.timeout_s} s")


class _Written(_Work):
    """A piece a sending end's thread writes: done once its receiving end was told."""

    def __init__(self, what: str, timeout_s: float, progress: Callable[[], float]) -> None:
        super().__init__(what, timeout_s, progress)
        self._done = threading.Event()
        self.error: BaseException | None = None

    def end(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set() or self.expired()

    def wait(self) -> bool:
        while not self._done.wait(ring.POLL_S):
            if self.expired():
                raise self._late()
        if self.error is not None:
            raise self.error
        return True


class _Arrival(_Work):
    """A piece a receiving end posted: done once its sending end said it landed."""

    def __init__(self, link: _Receiving, piece: int) -> None:
        super().__init__(f"receiving a piece from {link.peer} (mooncake)", link.timeout_s, lambda: link.moved)
        self.link = link
        self.piece = piece

    def is_completed(self) -> bool:
        self.link.read(block=False)
        return self.link.landed > self.piece or self.link.error is not None or self.expired()

    def wait(self) -> bool:
        while self.link.landed <= self.piece:
            if self.link.error is not None:
                raise self.link.error
            if self.expired():
                raise self._late()
            self.link.read(block=True)
        return True


class _Endpoint:
    """This process's Transfer Engine, the memory registered with it, and the listener the
    sending ends of its inbound links connect to."""

    def __init__(self, host: str, device: torch.device, nic_filter: str) -> None:
        self.device = device
        self.protocol = platform.mooncake_protocol(device.type)
        self.te = mooncake.start_engine(host, self.protocol, nic_filter)
        self.host = host
        self.rpc_port = int(self.te.get_rpc_port())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(128)  # a connect never waits for our accept: no ordering between links
        self.regions: dict[int, torch.Tensor] = {}  # registered memory by address

    def register(self, memory: torch.Tensor) -> None:
        mooncake.register(self.te, memory, self.protocol)
        self.regions[memory.data_ptr()] = memory

    def unregister(self, memory: torch.Tensor, failed: bool) -> None:
        """Give ``memory`` back; after a failure it is kept registered for good (a late
        write may still land in it)."""
        if self.regions.pop(memory.data_ptr(), None) is None:
            return
        if failed:
            mooncake.orphan(self.te, memory)
        else:
            self.te.unregister_memory(memory.data_ptr())

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether all of ``tensor``'s bytes are in registered memory."""
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        return any(
            base <= start and end <= base + m.numel() * m.element_size() for base, m in self.regions.items()
        )

    def close(self) -> None:
        for memory in list(self.regions.values()):
            self.unregister(memory, failed=False)
        self.listener.close()
        self.te = None  # the engine stops with its last reference (orphaned memory keeps its own)


class _Sending:
    """The sending end of one link: a thread writes the pieces ``broadcast`` queues, in
    order, each once the receiving end posted where it lands."""

    def __init__(
        self, endpoint: _Endpoint, sock: socket.socket, target: str, peer: str, timeout_s: float, stage: bool
    ) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.target = target  # the receiving end's Mooncake segment, "host:rpc_port"
        self.peer = peer
        self.timeout_s = timeout_s
        # A trainer rank's pieces are views of its shard: staged. A receiver forwards from its
        # registered bucket buffers and needs none.
        self.staging: torch.Tensor | None = None
        if stage:
            self.staging = torch.empty(2 * CHUNK_BYTES, dtype=torch.uint8, device=endpoint.device)
            endpoint.register(self.staging)
        self._queue: deque[tuple[_Written, torch.Tensor]] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self.moved = time.monotonic()  # when a write last landed
        self._thread = threading.Thread(target=self._run, name="weightsync-mooncake-link", daemon=True)
        self._thread.start()

    def broadcast(self, tensor: torch.Tensor, src: int) -> _Written:
        """Write ``tensor`` (uint8, at most ``CHUNK_BYTES``) into the receiving end's next
        posted piece. ``src`` is this end's rank in the link: 0."""
        assert src == 0 and tensor.numel() <= CHUNK_BYTES
        work = _Written(f"writing a piece to {self.peer} (mooncake)", self.timeout_s, lambda: self.moved)
        with self._cv:
            if self._error is not None:
                work.end(self._error)
            else:
                self._queue.append((work, tensor))
                self._cv.notify()
        return work

    def _next(self, block: bool) -> tuple[_Written, torch.Tensor] | None:
        """The next queued piece (None: none yet, without ``block``); raises once closed."""
        with self._cv:
            while block and not self._queue and not self._stop:
                self._cv.wait()
            if self._stop:
                raise PeerError(f"the link to {self.peer} was closed")
            return self._queue.popleft() if self._queue else None

    def _posted(self, piece: int) -> tuple[int, int]:
        """The receiving end's POST of ``piece``: (address, bytes). Waits as long as it
        takes: the session's deadline and ``close`` end the wait."""
        buf = bytearray()
        while len(buf) < _FRAME.size:
            if self._stop:
                raise PeerError(f"the link to {self.peer} was closed")
            try:
                chunk = self.sock.recv(_FRAME.size - len(buf))
            except TimeoutError:
                continue
            except OSError as e:
                raise PeerError(f"{self.peer} closed its link (mooncake) ({e})") from e
            if not chunk:
                raise PeerError(f"{self.peer} closed its link (mooncake)")
            buf += chunk
        kind, got, address, nbytes = _FRAME.unpack(buf)
        if (kind, got) != (POST, piece):
            raise PeerError(f"{self.peer} posted piece {got} (kind {kind}) where piece {piece} was due")
        return address, nbytes

    def _tell(self, frame: bytes) -> None:
        """Send ``frame`` to the receiving end. While its socket buffers are full (it reads
        them when it next looks at its link: a consumer may hold a bucket meanwhile) this
        waits, up to ``timeout_s`` without a byte taken; ``close`` ends the wait."""
        view = memoryview(frame)
        since = time.monotonic()
        while view:
            if self._stop:
                raise PeerError(f"the link to {self.peer} was closed")
            try:
                view = view[self.sock.send(view) :]  # the socket's timeout: ring.POLL_S
            except TimeoutError:
                if time.monotonic() - since > self.timeout_s:
                    raise PeerError(
                        f"{self.peer} read nothing of its link (mooncake) for {self.timeout_s} s"
                    ) from None
                continue
            except OSError as e:
                raise PeerError(f"{self.peer} closed its link (mooncake) ({e})") from e
            since = time.monotonic()

    def _landed(self, batch: int) -> bool:
        """Whether the write ``batch`` landed (asks Mooncake once); raises if it failed."""
        status = self.endpoint.te.transfer_check_status(batch)
        if status == 0:
            return False
        if status != 1:
            raise PeerError(
                f"Mooncake failed to write to {self.peer} ({'timed out' if status == -2 else f'status {status}'})"
            )
        return True

    def _run(self) -> None:
        """One write on the wire at a time (across a 1 Gbit/s link one beats two: see
        ``engines.mooncake``), the next piece staged meanwhile: a piece that is a view of the
        trainer's own tensor is copied into the registered staging half the write in flight
        does not read."""
        piece = 0
        ready: tuple[_Written, torch.Tensor, int] | None = None  # staged (its half, or -1), not yet written
        writing: tuple[_Written, int, int] | None = None  # (work, batch id, staging half or -1)
        pause = _POLL_MIN_S
        try:
            self.sock.settimeout(ring.POLL_S)  # so a close is seen while waiting for a POST
            while True:
                if ready is None and (item := self._next(block=writing is None)) is not None:
                    work, tensor = item
                    ready = (work, tensor, -1)
                    if not self.endpoint.holds(tensor):
                        if self.staging is None:
                            raise PeerError(f"a piece forwarded to {self.peer} is not in registered memory")
                        half = 1 if writing is not None and writing[2] == 0 else 0
                        staged = self.staging[half * CHUNK_BYTES : half * CHUNK_BYTES + tensor.numel()]
                        platform.copy_bytes(staged, tensor)
                        platform.synchronize(staged.device)
                        ready = (work, staged, half)
                if writing is not None:
                    if not self._landed(writing[1]):
                        if self._stop:
                            raise PeerError(f"the link to {self.peer} was closed")
                        time.sleep(pause)
                        pause = min(pause * 2, _POLL_MAX_S)
                        continue
                    self._tell(_FRAME.pack(LANDED, piece - 1, 0, 0))
                    self.moved = time.monotonic()
                    writing[0].end()
                    writing, pause = None, _POLL_MIN_S
                if ready is not None:
                    work, source, half = ready
                    address, nbytes = self._posted(piece)
                    if nbytes != source.numel():
                        raise PeerError(
                            f"{self.peer} posted {nbytes} bytes for piece {piece}, it has {source.numel()}"
                        )
                    batch = self.endpoint.te.transfer_submit_write(
                        self.target, source.data_ptr(), address, nbytes
                    )
                    if batch is None or batch <= 0:
                        raise PeerError(f"Mooncake could not start writing to {self.peer} (returned {batch})")
                    writing, ready = (work, batch, half), None
                    piece += 1
        except BaseException as e:
            error = e if isinstance(e, PeerError) else PeerError(f"the link to {self.peer} failed: {e}")
            with self._cv:
                self._error = error
                pending = [w for w, _ in self._queue]
                self._queue.clear()
            for work in [x[0] for x in (writing, ready) if x is not None] + pending:
                work.end(error)

    def close(self, failed: bool) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        _shut(self.sock)
        self._thread.join(_STOP_JOIN_S)
        if self._thread.is_alive():  # a write that did not end still reads its source
            log.warning("mooncake: a write to %s did not end; keeping its memory", self.peer)
            failed = True
        if self.staging is not None:
            self.endpoint.unregister(self.staging, failed)
        self.sock.close()


class _Receiving:
    """The receiving end of one link: posts where each piece lands; reads what landed.

    Its socket never blocks: POST frames the socket cannot take now (the sending end reads
    one per piece it writes, and ``sharded`` posts up to 4 buckets of pieces ahead: 8192
    frames, 256 KiB, at the default 2048 MiB buckets) wait in ``_out`` and go as it drains,
    whenever this end looks at its link."""

    def __init__(self, endpoint: _Endpoint, sock: socket.socket, peer: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.peer = peer
        self.timeout_s = timeout_s
        self.posted = 0  # pieces posted
        self.landed = 0  # pieces landed (they land in order)
        self.moved = time.monotonic()  # when the last one landed
        self.error: PeerError | None = None
        self._buf = bytearray()  # LANDED frames read, not yet whole
        self._out = bytearray()  # POST frames not yet taken by the socket
        sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)

    def broadcast(self, tensor: torch.Tensor, src: int) -> _Arrival:
        """Post ``tensor`` (uint8, in registered memory) as where the next piece lands.
        ``src`` is the sending end's rank in the link: 0."""
        assert src == 0
        if not self.endpoint.holds(tensor):
            raise RuntimeError("sharded over mooncake: a piece must land in registered memory")
        self._out += _FRAME.pack(POST, self.posted, tensor.data_ptr(), tensor.numel())
        self.posted += 1
        self.read(block=False)  # sends what the socket takes now
        return _Arrival(self, self.posted - 1)

    def _send(self) -> None:
        """Send as much of ``_out`` as the socket takes now."""
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except BlockingIOError:
                return
            del self._out[:sent]

    def read(self, block: bool) -> None:
        """Send the POST frames the socket takes and take the frames that arrived; with
        ``block``, first wait (at most ``ring.POLL_S``) until one arrives or, while POST
        frames wait, the socket takes more."""
        if self.error is not None:
            return
        try:
            self._send()
            if block:
                wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._out else 0)
                self._selector.modify(self.sock, wanted)
                self._selector.select(ring.POLL_S)
                self._send()
            while True:
                try:
                    chunk = self.sock.recv(64 * _FRAME.size)
                except BlockingIOError:
                    return
                if not chunk:
                    raise PeerError(f"{self.peer} closed its link (mooncake)")
                self._buf += chunk
                while len(self._buf) >= _FRAME.size:
                    kind, piece, _, _ = _FRAME.unpack(self._buf[: _FRAME.size])
                    del self._buf[: _FRAME.size]
                    if (kind, piece) != (LANDED, self.landed):
                        raise PeerError(
                            f"{self.peer} said piece {piece} landed (kind {kind}), piece {self.landed} was due"
                        )
                    self.landed += 1
                    self.moved = time.monotonic()
        except PeerError as e:
            self.error = e
        except OSError as e:
            self.error = PeerError(f"{self.peer} closed its link (mooncake) ({e})")

    def close(self, failed: bool) -> None:
        _shut(self.sock)
        self._selector.close()
        self.sock.close()


def _shut(sock: socket.socket) -> None:
    """Wake whatever waits on ``sock`` and tell the peer at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


Link = _Sending | _Receiving


def _name(said: dict[str, Any], rank: int) -> str:
    """How errors name the peer at group rank ``rank``: as it names itself in ``said`` (its
    endpoint or its first message; it holds the group's token)."""
    name = said.get("name")
    return name if isinstance(name, str) and 0 < len(name) <= 100 else f"the peer at group rank {rank}"


class MooncakeLinks:
    """This process's ends of ``sharded``'s links over Mooncake: one Transfer Engine, the
    bucket buffers registered with it, and a link per pair of the route it is in."""

    def __init__(self, config: Any, device: torch.device) -> None:
        self.config = config
        self.device = device
        self._endpoint: _Endpoint | None = None
        self._buffers: list[torch.Tensor] = []  # registered bucket buffers

    def _open_endpoint(self, join: Join) -> _Endpoint:
        if self._endpoint is None:
            host = join.local_host if join.local_host not in (None, "0.0.0.0", "::") else None
            self._endpoint = _Endpoint(
                host or socket.gethostbyname(socket.gethostname()),
                self.device,
                self.config.engine_kwargs.mooncake.device_name,
            )
        return self._endpoint

    def buffers(self, join: Join, buffers: list[torch.Tensor] | None) -> None:
        """Make ``buffers`` (the engine's bucket buffers) the registered ones: pieces land
        in them, and are written from them without a copy."""
        if buffers is not None and [b.data_ptr() for b in buffers] == [b.data_ptr() for b in self._buffers]:
            return
        endpoint = self._open_endpoint(join)
        for old in self._buffers:
            endpoint.unregister(old, failed=False)
        self._buffers = []
        for buffer in buffers or []:
            endpoint.register(buffer)
            self._buffers.append(buffer)

    def abandon_buffers(self) -> None:
        """After a failed sync: a late write may still land in the buffers; keep them."""
        if self._endpoint is not None:
            for old in self._buffers:
                self._endpoint.unregister(old, failed=True)
        self._buffers = []

    def open(
        self,
        join: Join,
        store: dist.Store,
        token: str,
        links: list[tuple[int, int]],
    ) -> dict[tuple[int, int], Link]:
        """This rank's ends of ``links`` (group ranks, sending end first). Each end names
        its peer as the peer names itself (``Join.name``: "receiver rank 3"), which it
        publishes with its endpoint and says when it connects: a group rank is a place
        among this sync's members, not a receiver rank (after a receiver was dropped, or
        one added under a new rank, the two differ)."""
        endpoint = self._open_endpoint(join)
        me, timeout = join.rank, self.config.timeout_s
        where = {
            "host": endpoint.host,
            "rpc_port": endpoint.rpc_port,
            "port": endpoint.listener.getsockname()[1],
            "name": join.name,
        }
        store.set(f"mooncake/{me}", msgpack.packb(where))
        opened: dict[tuple[int, int], Link] = {}
        inbound = {a for a, b in links if b == me}  # none: a trainer rank
        try:
            for a, b in links:
                if a != me:
                    continue
                peer = ring.unpack_message(bytes(store.get(f"mooncake/{b}")))
                host, port = str(peer["host"]), ring.int_field(peer, "port")
                try:
                    sock = socket.create_connection(
                        (host, port), timeout=timeout, source_address=(endpoint.host, 0)
                    )
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(ring.pack_message({"token": token, "from": a, "to": b, "name": join.name}))
                except OSError as e:
                    raise PeerError(
                        f"mooncake: could not reach {_name(peer, b)} at {host}:{port}: {e}"
                    ) from e
                target = f"{host}:{ring.int_field(peer, 'rpc_port')}"
                opened[(a, b)] = _Sending(endpoint, sock, target, _name(peer, b), timeout, stage=not inbound)

            def check(msg: dict, sock: socket.socket, taken: dict) -> int:
                source = ring.int_field(msg, "from")
                if ring.int_field(msg, "to") != me or source not in inbound or source in taken:
                    raise ValueError(f"link {source} -> {msg.get('to')} is not one this rank awaits")
                return source

            if inbound:
                accepted = ring.accept_peers(
                    endpoint.listener, len(inbound), token, check, timeout, join.watch, "mooncake link(s)"
                )
                for a, (sock, hello, _) in accepted.items():
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    opened[(a, me)] = _Receiving(endpoint, sock, _name(hello, a), timeout)
        except BaseException:
            self.close(list(opened.values()), failed=True)
            raise
        return opened

    def close(self, links: list[Any], failed: bool) -> None:
        """Close ``links`` (a failed sync's: their memory may still be written or read)."""
        for link in links:
            link.close(failed)
        if failed:
            self.abandon_buffers()

    def shutdown(self) -> None:
        """Release the Transfer Engine and everything registered with it."""
        self._buffers = []
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
