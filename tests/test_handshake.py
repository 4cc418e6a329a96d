"""Handshake refusals, one per field the two sides must agree on: both sides name both
values, nothing is written, the connections stay, and the next sync on the same sender and
receivers is exact (docs/reliability.md, "version, bucket size, plan, verify mode or
protocol disagree").

A receiver configured differently refuses at its first sync, which cannot show that the
same pair goes on afterwards; so the fields that are configuration (protocol, bucket size,
verify mode, plan hash, engine description) are changed in one sync message on the wire by
a proxy, and the version fields by what the receiver expects."""

import re

import pytest
import workers
from procs import CTX, collect, start, stop
from proxy import ControlProxy

from weightsync import EngineConfig, HandshakeError, Sender
from weightsync.session.channel import PROTOCOL_VERSION

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

OVERRIDES = ["backend=nccl", "update_weights_bucket_megabytes=1", "timeout_s=30"]
BUCKET = 1 << 20


def _changed(field, value):
    """A rewrite of the sync message of version 2 only."""

    def rewrite(msg):
        if msg.get("type") == "sync" and msg.get("version") == 2:
            return {**msg, field: value(msg) if callable(value) else value}
        return None

    return rewrite


# case: (what rank 0 expects in the refused round, the version sent, the rewrite, rank 0's
# problem, the ranks that refuse)
CASES = {
    "version": (3, 2, None, "version: sender sends 2, receiver expects 3", [0]),
    "older version": (
        0,
        0,
        None,
        "version 0 is older than version 1, which this receiver holds "
        r"\(send it with force=True to roll back\)",
        [0, 1],
    ),
    "protocol": (
        2,
        2,
        _changed("protocol", 3),
        f"protocol version: sender 3, receiver {PROTOCOL_VERSION}",
        [0],
    ),
    "bucket size": (
        2,
        2,
        _changed("bucket_bytes", 2 * BUCKET),
        f"bucket size: sender {2 * BUCKET} bytes, receiver {BUCKET} bytes "
        r"\(update_weights_bucket_megabytes must match\)",
        [0],
    ),
    "verify mode": (
        2,
        2,
        _changed("verify", "crc32"),
        r"verify: sender 'crc32', receiver 'off' \(set the same value on both sides\)",
        [0],
    ),
    "plan hash": (
        2,
        2,
        _changed("plan_hash", "f" * 16),
        "plan hash: sender f{16}, receiver holds [0-9a-f]+",
        [0],
    ),
    "engine": (
        2,
        2,
        _changed("engine", lambda m: {**m["engine"], "rank": 0}),
        "engine rank=0 is not a receiver's rank in a group of world_size=3",
        [0],
    ),
}


def model(version):
    m = workers.Small(seed=0)
    workers.bump_small(m, version)
    return m


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_handshake_writes_nothing_and_the_same_connections_take_the_next_sync(case):
    expects, sent, rewrite, problem, refusers = CASES[case]
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(OVERRIDES), "127.0.0.1:0", 2) as sender:
        # Each receiver's control connection through a proxy that counts them; rank 0's
        # changes the one message.
        proxies = [ControlProxy(sender.address, rewrite=rewrite), ControlProxy(sender.address)]
        versions = {0: [1, expects, 2], 1: [1, sent, 2]}
        procs = [
            start(workers.run_module_receiver, proxies[rank].address, rank, OVERRIDES, versions[rank], q)
            for rank in (0, 1)
        ]
        try:
            first = workers.module_digests(model(1))
            sender.send(model(1), version=1)
            assert sorted((r, v, d == first) for r, v, d, _ in collect(q, 2)) == [(0, 1, True), (1, 1, True)]

            with pytest.raises(
                HandshakeError, match=f"receiver rank 0 refused version {sent}: {problem}"
            ) as refusal:
                sender.send(model(3), version=sent)
            assert refusal.value.ranks == refusers
            assert proxies[0].rewritten.is_set() == (rewrite is not None)
            for rank, status, message, held, failed, torn, digests in sorted(collect(q, 2)):
                assert status == "error"
                if rank in refusers:  # its own refusal, naming both values
                    assert message.startswith(
                        f"HandshakeError: receiver rank {rank} refused version {sent}: "
                    )
                    if rank == 0:
                        assert re.search(problem, message), message
                else:  # told by the sender why the sync is off: rank 0's refusal
                    assert "receiver rank 0 refused version" in message, message
                # Nothing written: the model holds version 1 whole, no failed attempt recorded.
                assert (held, failed, torn) == (1, None, False), message
                assert digests == first

            second = workers.module_digests(model(2))
            sender.send(model(2), version=2)
            assert sorted((r, v, d == second) for r, v, d, _ in collect(q, 2)) == [(0, 2, True), (1, 2, True)]
            assert [p.connections for p in proxies] == [1, 1]  # neither receiver reconnected
        finally:
            stop(procs)
            for p in proxies:
                p.close()
