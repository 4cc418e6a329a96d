"""The data-plane rendezvous store (``weightsync.engines.rendezvous``): torch's store semantics,
only for holders of the group's token, on the chosen interface, every wait bounded, and no
stranger able to list, read, plant or stall anything. Real sockets, real Gloo."""

import datetime
import logging
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch
import torch.distributed as dist

from weightsync import platform
from weightsync.engines import rendezvous
from weightsync.errors import HandshakeError, PeerLost, SyncError, SyncTimeout

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    srv = rendezvous.serve("127.0.0.1", timeout_s=5.0)
    yield srv
    srv.close()


def frame(msg) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


def read_frame(sock) -> dict:
    def exactly(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    (size,) = struct.unpack("!I", exactly(4))
    return msgpack.unpackb(exactly(size), raw=False)


def hung_up(sock, within=5.0) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("side", ["client", "local"])
def test_operations_follow_torch_store_semantics(server, side):
    token = server.new_group()
    store = rendezvous.connect("127.0.0.1", server.port, token, 5.0) if side == "client" else server.store()
    other = server.store() if side == "client" else rendezvous.connect("127.0.0.1", server.port, token, 5.0)
    try:
        store.set("a", b"\x00\xffbytes")
        store.set("s", "text")
        assert other.get("a") == b"\x00\xffbytes" and other.get("s") == b"text"
        assert store.add("n", 3) == 3 and other.add("n", -1) == 2 and store.get("n") == b"2"
        assert store.check(["a", "n"]) and not store.check(["a", "absent"])
        store.wait(["a", "s"])
        store.wait(["a"], datetime.timedelta(seconds=1))
        # compare_set as TCPStore does it
        assert store.compare_set("c", "", "first") == b"first"  # absent, expected empty: set
        assert store.compare_set("c", "wrong", "second") == b"first"  # mismatch: current value
        assert store.compare_set("c", "first", "second") == b"second"
        assert store.compare_set("absent", "x", "y") == b"x"  # absent, expected non-empty
        assert not store.check(["absent"])
        assert store.delete_key("c") and not store.delete_key("c") and not other.check(["c"])
        # a value set later, by another rank, ends a wait
        threading.Timer(0.3, other.set, args=("late", b"1")).start()
        t0 = time.monotonic()
        assert store.get("late") == b"1" and time.monotonic() - t0 < 3
        # torch's own wrappers work on top of it
        prefixed = dist.PrefixStore("p", store)
        prefixed.set("k", "v")
        assert other.get("p/k") == b"v"
        with pytest.raises(RuntimeError, match="add: key 'a' does not hold an integer"):
            store.add("a", 1)
    finally:
        for s in (store, other):
            if isinstance(s, rendezvous.StoreClient):
                s.close()


def test_there_is_no_way_to_list_or_count_keys(server):
    token = server.new_group()
    client = rendezvous.connect("127.0.0.1", server.port, token, 5.0)
    try:
        client.set("secret/key", b"v")
        with pytest.raises(NotImplementedError):  # torch's default: no listing
            client.list_keys()
        with pytest.raises(RuntimeError, match="pure virtual"):
            client.num_keys()
        with pytest.raises(RuntimeError, match="unknown operation 'list_keys'"):
            client._request("list_keys", {})
    finally:
        client.close()


def test_every_wait_ends_at_its_deadline_and_consults_the_watch(server):
    token = server.new_group()
    watched = []
    client = rendezvous.connect("127.0.0.1", server.port, token, 1.5, watch=lambda: watched.append(1))
    try:
        t0 = time.monotonic()
        with pytest.raises(
            SyncTimeout, match=r"timed out after 1.5 s in the data-plane rendezvous waiting for never"
        ):
            client.get("never")
        assert 1.4 < time.monotonic() - t0 < 4 and watched
        t0 = time.monotonic()
        with pytest.raises(SyncTimeout):
            client.wait(["never"], datetime.timedelta(seconds=0.6))  # torch's own timeout
        assert time.monotonic() - t0 < 2.5
        with pytest.raises(SyncTimeout):  # torch's "no timeout" (zero) is still bounded
            client.wait(["never"], datetime.timedelta(0))

        def lost():
            raise PeerLost("the sender closed the control connection")

        client.watch = lost  # the session abandons the wait once a peer is gone
        t0 = time.monotonic()
        with pytest.raises(PeerLost):
            client.get("never")
        assert time.monotonic() - t0 < 1.5
    finally:
        client.close()


def test_strangers_are_turned_away_and_delay_nobody(server, caplog):
    caplog.set_level(logging.WARNING, logger="weightsync.engines.rendezvous")
    token = server.new_group()
    server.store().set("weights/key", b"value")
    address = ("127.0.0.1", server.port)
    silent = socket.create_connection(address)  # never says a word
    wrong = socket.create_connection(address)
    wrong.sendall(frame({"type": "hello", "token": "0" * 32}))
    garbage = socket.create_connection(address)
    garbage.sendall(b"\xff" * 64)
    oversized = socket.create_connection(address)
    oversized.sendall(struct.pack("!I", 1 << 30))
    # what a stranger would try first: a request without the token
    nosy = socket.create_connection(address)
    nosy.sendall(frame({"type": "get", "key": "weights/key", "wait_s": 0}))
    try:
        t0 = time.monotonic()
        client = rendezvous.connect("127.0.0.1", server.port, token, 5.0)
        assert client.get("weights/key") == b"value"
        assert time.monotonic() - t0 < 2  # the silent one holds nobody up
        client.close()
        assert read_frame(wrong) == {"type": "error", "message": "wrong or missing group token"}
        for sock in (wrong, garbage, oversized, nosy):
            assert hung_up(sock)
        messages = [r.getMessage() for r in caplog.records]
        assert any("rejected 127.0.0.1:" in m and "wrong or missing group token" in m for m in messages), (
            messages
        )
        with pytest.raises(
            SyncError, match="turned this rank away: .*wrong or missing group token"
        ) as refused:
            rendezvous.connect("127.0.0.1", server.port, "f" * 32, 5.0)
        assert not isinstance(refused.value, HandshakeError)  # a failed data plane, not a refused version
    finally:
        for sock in (silent, wrong, garbage, oversized, nosy):
            sock.close()


def test_a_new_group_voids_the_old_token_its_connections_and_its_keys(server):
    old = server.new_group()
    client = rendezvous.connect("127.0.0.1", server.port, old, 5.0)
    client.set("k", b"old")
    new = server.new_group()
    assert new != old and len(new) == 32
    with pytest.raises(PeerLost):  # its connection was hung up on
        client.check(["k"])
    client.close()
    with pytest.raises(SyncError, match="turned this rank away"):
        rendezvous.connect("127.0.0.1", server.port, old, 5.0)
    fresh = rendezvous.connect("127.0.0.1", server.port, new, 5.0)
    try:
        assert not fresh.check(["k"])
    finally:
        fresh.close()


def test_sizes_are_bounded(server):
    token = server.new_group()
    client = rendezvous.connect("127.0.0.1", server.port, token, 5.0)
    try:
        with pytest.raises(RuntimeError, match="not a string of at most 4096 characters"):
            client.set("k" * 5000, b"v")
        client.set("big", b"x" * (8 << 20))  # well within a frame
        assert len(client.get("big")) == 8 << 20
    finally:
        client.close()
    # a frame over the limit from a member is a protocol error: it is dropped
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(frame({"type": "hello", "token": token}))
        assert read_frame(sock)["type"] == "welcome"
        sock.sendall(struct.pack("!I", rendezvous.MAX_FRAME_BYTES + 1))
        assert hung_up(sock)
    finally:
        sock.close()


def listening(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    from listeners import listening_sockets

    return [addr for addr, p, _ in listening_sockets() if p == port]


def test_it_listens_only_on_the_interface_it_is_given(server):
    assert server.host == "127.0.0.1"
    assert listening(server.port) == ["127.0.0.1"]


def test_a_gloo_group_is_built_over_it_from_rank_0_in_process_and_a_client():
    server = rendezvous.serve("127.0.0.1", 10.0)
    token = server.new_group()
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store = server.store() if r == 0 else rendezvous.connect("127.0.0.1", server.port, token, 10.0)
            group = platform.new_process_group(
                "gloo", dist.PrefixStore("weightsync/test/1", store), r, 3, 10.0, bind_host="127.0.0.1"
            )
            t = torch.arange(4, dtype=torch.float32) if r == 0 else torch.zeros(4)
            group.broadcast(t, 0).wait()
            out[r] = t
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    server.close()
    assert not errors, errors
    assert all(torch.equal(out[r], torch.arange(4, dtype=torch.float32)) for r in range(3))
