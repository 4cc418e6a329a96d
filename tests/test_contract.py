"""The engine contracts: a third-party backend is one file, and the version rules (stale,
force, torn) are the same on every family."""

import pytest
import torch
import workers
from procs import CTX, collect, start, stop

from weightsync import EngineConfig, HandshakeError, Publisher, Receiver, Sender, Transport
from weightsync.engines.registry import get_engine
from weightsync.errors import RemoteFailure


def test_builtin_backends_implement_one_of_the_two_contracts():
    families = {name: get_engine(name) for name in ("naive", "nccl", "shm", "paired", "disk")}
    assert {n for n, c in families.items() if issubclass(c, Publisher)} == {"naive", "disk"}
    assert {n for n, c in families.items() if issubclass(c, Transport)} == {"nccl", "shm", "paired"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_one_file_transport_loaded_by_custom_backend_module_syncs_bit_exact():
    overrides = [
        "custom_backend_module=tcp_transport",
        "backend=tcp",
        "update_weights_bucket_megabytes=1",
        "timeout_s=30",
    ]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 2) as sender:
        procs = [start(workers.run_receiver, sender.address, r, overrides, [1, 2, 3], q) for r in range(2)]
        try:
            for v in (1, 2, 3):
                stats = sender.send(workers.make_weights(v), version=v)
                assert stats.buckets > 1  # the 1.4 MB tensor spans buckets: the session merges it
                for rank, version, got, held in collect(q, 2, timeout=60):
                    assert (version, held) == (v, v) and got == workers.expected_digests(v), rank
        finally:
            stop(procs)


def _weights(v):
    return {"a": torch.full((4,), float(v)), "b": torch.arange(6) + v}


@pytest.mark.parametrize("backend", ["naive", "disk"])
def test_publishers_follow_the_version_rules(backend, tmp_path):
    overrides = [f"backend={backend}", "timeout_s=5"]
    if backend == "disk":
        overrides.append(f"engine_kwargs.disk.path={tmp_path}")
    config = EngineConfig.from_overrides(overrides)
    address = f"rules-{backend}"
    with Sender(config, address, 1) as sender, Receiver(config, address, 0) as receiver:

        def send(v, **kw):
            if backend == "disk":  # the disk sender waits for the receiver's acknowledgement
                return workers.Background(sender, _weights(v), v, **kw)
            sender.send(_weights(v), version=v, **kw)
            return None

        def join(t, fails=None):
            if t is None:
                return None
            if fails is None:
                return t.join()
            with pytest.raises(fails):
                t.join()

        t = send(2)
        assert {n: x.clone() for n, x in receiver.receive()}["a"][0] == 2
        join(t)
        assert (receiver.version, receiver.failed_version, receiver.torn) == (2, None, False)

        # a consumer that stops after one tensor: failed and torn (something was delivered)
        t = send(3)
        for _ in receiver.receive():
            break
        join(t, fails=RemoteFailure)  # the disk publisher hears the receiver did not complete it
        assert (receiver.version, receiver.failed_version, receiver.torn) == (2, 3, True)

        # stale: refused before anything is read, the state as it was
        if backend == "disk":
            with pytest.raises(HandshakeError):  # the disk sender itself refuses an older version
                sender.send(_weights(1), version=1)
        else:
            t = send(1)
            with pytest.raises(HandshakeError, match="older than version 2"):
                list(receiver.receive())
            assert (receiver.version, receiver.failed_version, receiver.torn) == (2, 3, True)

        # forced rollback: taken, and it makes the weights whole again
        t = send(1, force=True)
        got = {n: x.clone() for n, x in receiver.receive()}
        join(t)
        assert got["a"][0] == 1 and (receiver.version, receiver.failed_version, receiver.torn) == (
            1,
            None,
            False,
        )
