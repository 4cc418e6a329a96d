"""Fault injection: every case is bounded by a timeout and asserts the error message and the
state afterwards. See docs/reliability.md for the promise each case proves."""

import logging
import os
import signal
import socket
import threading
import time

import pytest
import torch
import workers
from procs import CTX, collect, free_port, start, stop
from proxy import ControlProxy

from weightsync import EngineConfig, HandshakeError, Receiver, Sender, SyncError
from weightsync.errors import RemoteFailure, SourceFailed
from weightsync.sources import IteratorSource

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def config(*extra, backend="nccl", timeout=30):
    return [f"backend={backend}", "update_weights_bucket_megabytes=1", f"timeout_s={timeout}", *extra]


big_weights = workers.big_weights


def digests(weights):
    return {n: workers.digest(t.contiguous()) for n, t in weights.items()}


# ---------------------------------------------------------------------------- killed peers
@pytest.mark.parametrize("backend", ["nccl", "shm", pytest.param("mooncake", marks=workers.needs_mooncake)])
def test_receiver_sigkilled_mid_sync_then_survivors_sync_bit_exact(backend):
    """A receiver SIGKILLed in version 2 (version 1 done, so no start-up is timed): the
    sender and both survivors fail far below the 60 s deadline (detected, not waited
    out), the survivors keep version 1 and know version 2 is torn; version 3 to the
    survivors is exact."""
    kill_mid_sync_then_sync_the_survivors(backend, drop=False)


def test_with_drop_lost_receivers_shm_fails_the_sync_and_the_next_goes_to_the_survivors():
    """As above with ``drop_lost_receivers`` on a transport that does not route around the
    lost receiver: the sync fails the same way, the sender drops it by itself, and the next
    sync reaches the survivors without ``remove_receiver``."""
    kill_mid_sync_then_sync_the_survivors("shm", drop=True)


def kill_mid_sync_then_sync_the_survivors(backend, drop):
    q = CTX.Queue()
    overrides = [*config(backend=backend, timeout=60), f"drop_lost_receivers={str(drop).lower()}"]
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 3) as sender:
        victim = start(workers.run_resilient_receiver, sender.address, 0, overrides, [1, 2], q, (2, 3))
        survivors = [
            start(workers.run_resilient_receiver, sender.address, r, overrides, [1, 2, 3], q) for r in (1, 2)
        ]
        try:
            sender.send(big_weights(1), version=1)
            assert sorted(r[1] for r in collect(q, 3)) == [1, 1, 1]
            t0 = time.monotonic()
            with pytest.raises(SyncError, match=r"receiver rank 0 \(pid \d+.*\) disconnected") as failure:
                sender.send(big_weights(2), version=2)
            assert time.monotonic() - t0 < 10
            assert failure.value.ranks == [0]
            victim.join(timeout=10)
            assert victim.exitcode == -signal.SIGKILL
            # Every survivor gets a clear error far within its deadline, keeps version 1
            # and knows the failed sync delivered part of version 2.
            for _ in survivors:
                rank, status, message, held, attempted, torn = q.get(timeout=30)
                assert (status, held, attempted, torn) == ("error", 1, 2, True), message
                assert "version 2" in message
            assert time.monotonic() - t0 < 10
            # Same sender, same surviving processes: drop the dead one, the next sync is exact.
            assert ("dropped from the receivers (drop_lost_receivers)" in str(failure.value)) == drop
            assert sender.receivers == ([1, 2] if drop else [0, 1, 2])
            sender.remove_receiver(0)  # what a controller does with error.ranks; dropped already: the same
            assert sender.receivers == [1, 2]
            sender.send(big_weights(3), version=3)
            for _ in survivors:
                rank, version, got, held = q.get(timeout=60)
                assert (version, held) == (3, 3) and got == digests(big_weights(3))
        finally:
            stop([victim, *survivors])


def _the_others_take_version_2_without_the_middle_receiver(overrides, victim_body, versions, *victim_args):
    """3 receivers, the middle one (rank 1) running ``victim_body(..., versions, queue,
    *victim_args)`` and lost in version 2:
    ``send`` succeeds dropping it, both others hold version 2 bit-exact from that one
    ``receive`` call, and version 3 reaches them without a word."""
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 3) as sender:
        first = start(workers.run_resilient_receiver, sender.address, 0, overrides, [1, 2, 3], q)
        victim = start(victim_body, sender.address, 1, overrides, versions, q, *victim_args)
        last = start(workers.run_resilient_receiver, sender.address, 2, overrides, [1, 2, 3], q)
        try:
            sender.send(big_weights(1), version=1)
            assert sorted(r[1] for r in collect(q, 3)) == [1, 1, 1]
            t0 = time.monotonic()
            stats = sender.send(big_weights(2), version=2)
            assert time.monotonic() - t0 < 15
            assert stats.dropped == [1] and sender.receivers == [0, 2]
            for rank, version, got, held in collect(q, 2):
                assert (version, held) == (2, 2) and got == digests(big_weights(2)), rank
            victim.join(timeout=10)
            assert victim.exitcode == -signal.SIGKILL
            assert sender.send(big_weights(3), version=3).dropped == []
            for rank, version, got, held in collect(q, 2):
                assert (version, held) == (3, 3) and got == digests(big_weights(3))
        finally:
            stop([first, victim, last])


@pytest.mark.parametrize(
    "backend",
    [
        "nccl",
        pytest.param("nccl-chain", id="nccl-chain"),
        pytest.param("mooncake", marks=workers.needs_mooncake),
    ],
)
def test_with_drop_lost_receivers_the_others_take_the_version_again_in_the_same_sync(backend):
    """``drop_lost_receivers``: the middle receiver of 3 SIGKILLed in version 2. The send
    succeeds, naming it in ``stats.dropped``; both others take version 2 bit-exact in the
    same ``receive`` call, each tensor handed out once (the worker asserts it); version 3
    goes to them without a word. Gloo's broadcast, the chain over Gloo, Mooncake's chain."""
    topology = ["engine_kwargs.nccl.topology=chain"] if backend == "nccl-chain" else []
    overrides = config("drop_lost_receivers=true", *topology, backend=backend.split("-")[0], timeout=60)
    _the_others_take_version_2_without_the_middle_receiver(
        overrides, workers.run_resilient_receiver, [1, 2], (2, 3)
    )


@pytest.mark.parametrize("when", ["in-its-handshake", "after-its-last-tensor"])
def test_with_drop_lost_receivers_a_receiver_lost_outside_the_transfer_is_routed_around_too(when):
    """``drop_lost_receivers`` where no data plane is in the way: the middle receiver of 3
    SIGKILLed in version 2's handshake (the others have answered and wait for the go, one
    answer still unread), or once it took version 2's last tensor (the others may hold the
    version already: they keep it). Either way ``send`` succeeds dropping it, each other
    holds version 2 bit-exact from that one ``receive`` call (each answers the re-route,
    whatever it sent before), and version 3 reaches them. Gloo's broadcast."""
    overrides = config("drop_lost_receivers=true", timeout=60)
    if when == "in-its-handshake":
        _the_others_take_version_2_without_the_middle_receiver(
            overrides, workers.run_receiver_dying_in_the_handshake, 2
        )
    else:
        last_tensor = (2, len(big_weights(2)))
        _the_others_take_version_2_without_the_middle_receiver(
            overrides, workers.run_resilient_receiver, [1, 2], last_tensor
        )


def test_sender_sigkilled_mid_sync_then_a_new_sender_completes_the_version():
    address = f"127.0.0.1:{free_port()}"
    overrides = config(timeout=20)
    q = CTX.Queue()
    sender = start(workers.run_sender, address, overrides, 1, [1, 2], q)
    replacement = None
    try:
        with Receiver(EngineConfig.from_overrides(overrides), address, 0) as receiver:
            assert {n: workers.digest(t) for n, t in receiver.receive(version=1)} == digests(big_weights(1))
            # Version 2: the trainer dies after the first tensor arrived.
            t0 = time.monotonic()
            with pytest.raises(
                SyncError, match=r"receiver rank 0: transfer of version 2 from sender at 127.0.0.1:\d+ failed"
            ):
                for i, _ in enumerate(receiver.receive(version=2)):
                    if i == 0:
                        os.kill(sender.pid, signal.SIGKILL)
            assert time.monotonic() - t0 < 15
            assert (receiver.version, receiver.failed_version, receiver.torn) == (1, 2, True)
            # A new trainer process on the same address: the same receiver joins it by itself.
            replacement = start(workers.run_sender, address, overrides, 1, [2], q)
            got = {n: workers.digest(t) for n, t in receiver.receive(version=2)}
            assert got == digests(big_weights(2))
            assert (receiver.version, receiver.failed_version, receiver.torn) == (2, None, False)
    finally:
        stop([p for p in (sender, replacement) if p is not None])


@pytest.mark.parametrize("backend", ["nccl", "shm"])
def test_the_trainers_source_raising_mid_transfer_fails_at_once_blaming_no_peer(backend):
    """The trainer's source raises after 20 tensors went out: the sender raises
    ``SourceFailed`` (the source's exception as its cause) at once, blaming no receiver,
    where it used to wait 2 s for a peer's EOF first; both receivers fail that version
    within seconds, keep version 1, know version 2 is torn; version 3 is exact."""
    q = CTX.Queue()
    overrides = config(backend=backend, timeout=60)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        receivers = [
            start(workers.run_resilient_receiver, sender.address, r, overrides, [1, 2, 3], q) for r in (0, 1)
        ]
        try:
            sender.send(big_weights(1), version=1)
            assert sorted(r[1] for r in collect(q, 2)) == [1, 1]
            source = workers.FailingSource(big_weights(2), after=20)
            with pytest.raises(
                SourceFailed,
                match=r"sync of version 2 failed: the source raised after 20 tensor\(s\): "
                r"RuntimeError: the trainer failed mid-transfer",
            ) as failure:
                sender.send(source, version=2)
            assert time.monotonic() - source.raised_at < 1.0  # the EOF grace was 2 s
            assert failure.value.ranks == []
            # what docs/reliability.md promises: the source's own exception is the cause
            assert failure.value.__cause__ is source.error
            for _ in receivers:
                rank, status, message, held, attempted, torn = q.get(timeout=30)
                assert (status, held, attempted, torn) == ("error", 1, 2, True), message
            sender.send(big_weights(3), version=3)
            for _ in receivers:
                rank, version, got, held = q.get(timeout=60)
                assert (version, held) == (3, 3) and got == digests(big_weights(3))
        finally:
            stop(receivers)


# ---------------------------------------------------------------------------- dropped connection
def test_dropped_control_connection_fails_both_sides_then_the_next_sync_is_exact():
    overrides = config(timeout=20)
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        # challenge, welcome, sync, go, then 3 bucket announcements (streamed source): cut.
        proxy = ControlProxy(sender.address, cut_after=7)
        receiver = start(workers.run_resilient_receiver, proxy.address, 0, overrides, [1, 1], q)
        try:
            t0 = time.monotonic()
            peer = rf"receiver rank 0 \(pid {receiver.pid}, 127\.0\.0\.1:\d+\)"
            with pytest.raises(
                SyncError, match=rf"{peer} (disconnected|closed the connection)|connection to {peer} lost"
            ) as failure:
                sender.send(IteratorSource(iter(big_weights(1).items())), version=1)
            assert failure.value.ranks == [0]
            assert proxy.cut.is_set()
            rank, status, message, held, attempted, torn = q.get(timeout=30)
            assert (status, held, attempted, torn) == ("error", None, 1, True), message
            assert time.monotonic() - t0 < 12  # both sides, long before their 20 s deadline
            # The retry of the same version reconnects through a fresh connection.
            sender.send(big_weights(1), version=1)
            rank, version, got, held = q.get(timeout=60)
            assert (version, held) == (1, 1) and got == digests(big_weights(1))
            assert proxy.connections == 2
        finally:
            proxy.close()
            stop([receiver])


# ---------------------------------------------------------------------------- corrupted bytes
def test_corrupted_bucket_is_caught_by_verification_naming_the_tensors(monkeypatch):
    overrides = config("verify=crc32", "custom_backend_module=faulty_engine", backend="corrupting-nccl")
    q = CTX.Queue()
    weights = big_weights(1)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [
            start(workers.run_resilient_receiver, sender.address, r, overrides, [1, 1], q) for r in range(2)
        ]
        try:
            monkeypatch.setenv("WEIGHTSYNC_TEST_CORRUPT", "1")  # bucket 1: the second part of embed.weight
            damage = (
                "version 1 failed verification (crc32) in 1 bucket(s) [1]; tensors affected: embed.weight"
            )
            with pytest.raises(RemoteFailure) as failure:
                sender.send(weights, version=1)
            assert str(failure.value) == "; ".join(
                f"receiver rank {r} failed version 1: receiver rank {r}: {damage}" for r in (0, 1)
            )
            assert failure.value.ranks == [0, 1]
            for _ in range(2):
                rank, status, message, held, attempted, torn = q.get(timeout=30)
                assert message == f"VerificationError: receiver rank {rank}: {damage}"
                assert (status, held, torn) == ("error", None, True)
            # The retry of the same version, undamaged, completes it on the same connections.
            monkeypatch.delenv("WEIGHTSYNC_TEST_CORRUPT")
            sender.send(weights, version=1)
            for _ in range(2):
                rank, version, got, held = q.get(timeout=30)
                assert (version, held) == (1, 1) and got == digests(weights)
        finally:
            stop(procs)


@pytest.mark.parametrize("verify", ["crc32", "xxh3"])
def test_verification_names_the_damaged_tensor_of_a_whole_tensor_bucket(monkeypatch, verify):
    """A real transfer whose second bucket (the second half of a 2 MiB tensor, sent from the
    tensor's own memory) is damaged on the wire: the receiver's checksum of what arrived
    differs from the one the sender published, and the message names that tensor."""
    overrides = config(f"verify={verify}", "custom_backend_module=faulty_engine", backend="corrupting-nccl")
    weights = {
        "layers.0.norm.weight": torch.ones(64),
        "layers.0.mlp.weight": torch.arange(1 << 19, dtype=torch.float32),
    }
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        procs = [start(workers.run_resilient_receiver, sender.address, 0, overrides, [3], q)]
        try:
            monkeypatch.setenv("WEIGHTSYNC_TEST_CORRUPT", "1")
            with pytest.raises(RemoteFailure) as failure:
                sender.send(weights, version=3)
            damage = f"receiver rank 0: version 3 failed verification ({verify}) in 1 bucket(s) [1]; tensors affected: layers.0.mlp.weight"
            assert str(failure.value) == f"receiver rank 0 failed version 3: {damage}"
            rank, status, message, held, attempted, torn = q.get(timeout=30)
            assert (message, held, attempted, torn) == (f"VerificationError: {damage}", None, 3, True)
            assert torch.equal(
                weights["layers.0.mlp.weight"], torch.arange(1 << 19, dtype=torch.float32)
            )  # damaged on the wire only
        finally:
            stop(procs)


# ---------------------------------------------------------------------------- versions
@pytest.mark.parametrize(
    "backend", ["nccl", "shm", "paired", pytest.param("mooncake", marks=workers.needs_mooncake)]
)
def test_stale_version_is_refused_unless_forced(backend):
    # paired never splits a tensor: its buckets must hold make_weights' 1.4 MB embedding
    overrides = config(backend=backend, timeout=20) + (
        ["update_weights_bucket_megabytes=2"] if backend == "paired" else []
    )
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        proc = start(workers.run_resilient_receiver, sender.address, 0, overrides, [None, None, None], q)
        try:
            sender.send(workers.make_weights(5), version=5)
            assert q.get(timeout=60)[3] == 5  # the version the receiver holds
            with pytest.raises(
                HandshakeError, match="version 3 is older than version 5, which this receiver holds"
            ):
                sender.send(workers.make_weights(3), version=3)
            rank, status, message, held, attempted, torn = q.get(timeout=30)
            assert (status, held, torn) == ("error", 5, False) and "force=True" in message
            sender.send(workers.make_weights(3), version=3, force=True)  # a deliberate rollback
            rank, version, got, held = q.get(timeout=30)
            assert held == 3 and got == workers.expected_digests(3)
        finally:
            stop([proc])


# ---------------------------------------------------------------------------- strangers
def test_peer_with_a_wrong_secret_is_rejected_and_logged_while_the_sync_goes_on(monkeypatch, caplog):
    overrides = config(timeout=20)
    monkeypatch.setenv("WEIGHTSYNC_SECRET", "correct horse")  # children inherit it
    q = CTX.Queue()
    caplog.set_level(logging.WARNING, logger="weightsync.session")
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        # A stranger claiming rank 0 with the wrong secret, before the real receivers start.
        stranger_config = EngineConfig.from_overrides([*overrides, "auth_secret=battery staple"])
        stranger_error: list[Exception] = []

        def stranger():
            try:
                Receiver(stranger_config, sender.address, 0).connect()
            except Exception as e:
                stranger_error.append(e)

        intruder = threading.Thread(target=stranger, daemon=True)
        intruder.start()
        procs = [
            start(workers.run_resilient_receiver, sender.address, r, overrides, [1], q) for r in range(2)
        ]
        try:
            sender.send(workers.make_weights(1), version=1)
            for _ in range(2):
                rank, version, got, held = q.get(timeout=60)
                assert version == 1 and got == workers.expected_digests(1)
            intruder.join(timeout=10)
            assert "authentication failed" in str(stranger_error[0])
            assert any(
                "rejected connection from 127.0.0.1" in r.message and "authentication failed" in r.message
                for r in caplog.records
            )
        finally:
            stop(procs)


def test_receiver_refuses_a_sender_without_the_secret(monkeypatch):
    overrides = config(timeout=5)
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        threading.Thread(target=lambda: _quietly(sender.connect), daemon=True).start()
        receiver = Receiver(
            EngineConfig.from_overrides([*overrides, "auth_secret=s3cret"]), sender.address, 0
        )
        with pytest.raises(HandshakeError, match="failed authentication: it does not hold the shared secret"):
            receiver.connect()


def _quietly(fn):
    try:
        fn()
    except Exception:
        pass


def test_malformed_and_silent_strangers_do_not_delay_or_break_the_sync(caplog):
    """A silent stranger (whose hello would time out after ``HELLO_TIMEOUT_S``, 10 s), a
    hello that claims 1 GiB and one that is not msgpack delay nobody: the receiver's sync,
    timed from its connect (its start-up done), takes far less than that timeout while
    the silent one is still waited for."""
    from weightsync.session.channel import HELLO_TIMEOUT_S

    overrides = config(timeout=20)
    q, go = CTX.Queue(), CTX.Event()
    caplog.set_level(logging.WARNING, logger="weightsync.session")
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        host, port = sender.address.rsplit(":", 1)
        proc = start(workers.run_resilient_receiver, sender.address, 0, overrides, [1], q, None, None, go)
        silent = oversized = garbage = None
        try:
            assert q.get(timeout=60) == (0, "ready")
            silent = socket.create_connection((host, int(port)))  # connects and says nothing
            oversized = socket.create_connection((host, int(port)))
            oversized.sendall((1 << 30).to_bytes(4, "big"))  # claims a 1 GiB hello
            garbage = socket.create_connection((host, int(port)))
            garbage.sendall(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
            time.sleep(0.2)  # the strangers are in the sender's hands before the receiver
            t0 = time.monotonic()
            go.set()
            sender.send(workers.make_weights(1), version=1)
            assert time.monotonic() - t0 < HELLO_TIMEOUT_S / 3  # a serial greeting would wait ~10 s
            rank, version, got, held = q.get(timeout=30)
            assert version == 1 and got == workers.expected_digests(1)
            silent.settimeout(1.0)
            assert silent.recv(4096)  # the sender's challenge, and then
            silent.settimeout(0.05)  # still open: the sender did not get rid of it first
            with pytest.raises(TimeoutError):
                silent.recv(1)
            messages = " | ".join(r.message for r in caplog.records)
            assert "limit 4096" in messages and "malformed message" in messages
        finally:
            for s in (silent, oversized, garbage):
                if s is not None:
                    s.close()
            stop([proc])


def test_greetings_in_progress_are_capped_and_the_sync_goes_on_once_they_end(caplog):
    """At most ``MAX_PENDING_HELLOS`` connections are greeted at once (each greeting is a
    thread and a socket): one more is closed unanswered, with a warning. When the strangers
    hang up, the slots free and the receiver's sync completes within the same send."""
    from weightsync.session.channel import HELLO_TIMEOUT_S, MAX_PENDING_HELLOS

    overrides = config(timeout=30)
    q, go = CTX.Queue(), CTX.Event()
    caplog.set_level(logging.WARNING, logger="weightsync.session")
    strangers = []
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        host, port = sender.address.rsplit(":", 1)
        proc = start(workers.run_resilient_receiver, sender.address, 0, overrides, [1], q, None, None, go)
        try:
            assert q.get(timeout=60) == (0, "ready")
            sent = workers.Background(sender, workers.make_weights(1), 1)  # accepting from now on
            t0 = time.monotonic()
            for _ in range(MAX_PENDING_HELLOS):
                s = socket.create_connection((host, int(port)))
                strangers.append(s)
                s.settimeout(10)
                assert s.recv(4096)  # its challenge: a greeting under way, waiting for a hello
            one_more = socket.create_connection((host, int(port)))
            strangers.append(one_more)
            one_more.settimeout(5)
            assert one_more.recv(4096) == b""  # closed without a challenge
            assert any(
                f"{MAX_PENDING_HELLOS} connections are already saying hello" in r.message
                for r in caplog.records
            )
            for s in strangers:
                s.close()
            go.set()
            sent.join(timeout=60)
            assert (
                time.monotonic() - t0 < HELLO_TIMEOUT_S
            )  # the strangers ended early; nobody waited out their hello
            rank, version, got, held = q.get(timeout=30)
            assert (version, held) == (1, 1) and got == workers.expected_digests(1)
        finally:
            for s in strangers:
                s.close()
            stop([proc])
