"""The slot ring shared by ``shm`` and ``mooncake``: signals tagged with the version that
never satisfy a wait of another version, bounded waits that consult the session's watch,
and a ring's accept loop that a silent or hostile stranger cannot stall (on ``shm``'s Unix
socket, in a real multi-process sync)."""

import logging
import socket
import time

import pytest
import workers
from procs import CTX, collect, start, stop

from weightsync import EngineConfig, Sender
from weightsync.engines.ring import DONE, FAIL, READY, PeerError, Signals, pack_message


def tcp_pair():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


def test_a_signal_of_an_earlier_version_never_satisfies_a_later_wait():
    a, b = tcp_pair()
    try:
        tx, rx = Signals(a, "the sender", None, 5, None), Signals(b, "receiver rank 0", 0, 5, None)
        tx.send(DONE, 3, 0, 0)  # the last completion of version 3, still on the line
        with pytest.raises(
            PeerError,
            match=r"sent done for bucket 0 of version 3 where done for bucket 0 of version 4 was due",
        ):
            rx.wait(DONE, 4, 0)
        tx.send(READY, 4, 1, 10)
        with pytest.raises(PeerError, match="ready for bucket 1 of version 4 where ready for bucket 0"):
            rx.wait(READY, 4, 0)
        tx.send(READY, 4, 0, 123)
        assert rx.wait(READY, 4, 0) == 123
        tx.send(FAIL, 4, 1, 7)  # passed up a chain: receiver 7 is gone
        with pytest.raises(PeerError, match="receiver rank 7 closed its connection") as lost:
            rx.wait(READY, 4, 1)
        assert lost.value.lost == 7
        a.close()
        with pytest.raises(PeerError, match=r"receiver rank 0 closed its connection") as closed:
            rx.wait(READY, 4, 1)
        assert closed.value.lost == 0
    finally:
        a.close()
        b.close()


def test_a_silent_neighbour_times_out_within_the_deadline():
    a, b = tcp_pair()
    watched = []
    try:
        rx = Signals(b, "receiver rank 2", 2, 0.6, lambda: watched.append(1))
        t0 = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"no ready signal for bucket 5 of version 9 from receiver rank 2 within 0.6 s"
        ):
            rx.wait(READY, 9, 5)
        assert time.monotonic() - t0 < 2 and watched  # the session's watch was consulted meanwhile
    finally:
        a.close()
        b.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_shm_strangers_on_the_rings_socket_do_not_stall_the_sync(monkeypatch, caplog):
    from weightsync.engines.shm import ShmEngine

    strangers: list[socket.socket] = []
    prepare = ShmEngine.prepare

    def prepare_with_strangers(self, join):
        info = prepare(self, join)
        if not strangers:  # before any receiver: one that says nothing, one with a wrong token
            silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            silent.connect("\0" + info["socket"])
            wrong = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            wrong.connect("\0" + info["socket"])
            wrong.sendall(pack_message({"token": "0" * 32, "generation": info["generation"], "rank": 1}))
            strangers.extend([silent, wrong])
        return info

    monkeypatch.setattr(ShmEngine, "prepare", prepare_with_strangers)
    caplog.set_level(logging.WARNING, logger="weightsync.engines.ring")
    overrides = ["backend=shm", "update_weights_bucket_megabytes=1", "timeout_s=20"]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_receiver, sender.address, r, overrides, [1, 2], q) for r in range(2)]
        try:
            for v in (1, 2):
                t0 = time.monotonic()
                sender.send(workers.make_weights(v), version=v)
                assert time.monotonic() - t0 < 15  # the silent stranger held nobody up
                for rank, version, got, held in collect(q, 2, timeout=60):
                    assert (version, held) == (v, v) and got == workers.expected_digests(v)
            assert any(
                "joining shm receiver(s): wrong session token" in r.getMessage() for r in caplog.records
            )
            strangers[1].settimeout(5)
            assert strangers[1].recv(1) == b""  # the wrong one was hung up on
        finally:
            for s in strangers:
                s.close()
            stop(procs)
