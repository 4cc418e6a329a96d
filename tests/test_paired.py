"""Backend ``paired``: several trainer ranks, each feeding its own replica over a two-rank
Gloo group, replicas forwarding along a ring. Real processes, real Gloo."""

import time

import pytest
import workers
from procs import CTX, collect, start, stop

from weightsync import EngineConfig, PeerLost, Sender, SyncError
from weightsync.engines.nccl import CHUNK_BYTES, partner
from weightsync.engines.paired import Deal
from weightsync.plan import TensorSpec, make_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# 2 MiB buckets: the largest test tensor (1.4 MB) fits, since paired never splits a tensor.
BASE = ["backend=paired", "update_weights_bucket_megabytes=2", "timeout_s=30"]


def test_partner_is_a_derangement_and_the_deal_is_balanced():
    for n in range(2, 9):
        assert sorted(partner(s, n) for s in range(n)) == list(range(n))
        assert all(partner(s, n) != s for s in range(n))
    specs = [s for s in workers_specs(40)]
    plan = make_plan(specs, 1 << 20)
    deal = Deal(3)
    shares = [deal(b.nbytes) for b in plan.buckets]
    assert set(shares) == {0, 1, 2}
    assert max(deal.loads) - min(deal.loads) <= max(b.nbytes for b in plan.buckets)
    # Pieces of the LLM shape (its 64 MiB embedding and lm_head included) over 2 trainer
    # links: the shares differ by at most one piece, at every point of the plan.
    from weightsync.bench.models import llm_specs

    deal = Deal(2)
    for b in make_plan(llm_specs(256 << 20, "bfloat16"), 64 << 20).buckets:
        for offset in range(0, b.nbytes, CHUNK_BYTES):
            deal(min(CHUNK_BYTES, b.nbytes - offset))
            assert max(deal.loads) - min(deal.loads) <= CHUNK_BYTES


def workers_specs(n):
    return [TensorSpec(f"t{i}", (50000 + 997 * i,), "float32") for i in range(n)]


def _split_reports(reports):
    trainers = [r for r in reports if isinstance(r[0], tuple)]
    receivers = [r for r in reports if not isinstance(r[0], tuple)]
    return trainers, receivers


@pytest.mark.parametrize("trainers,receivers", [(2, 3), (1, 1), (3, 2)])
def test_every_replica_gets_every_tensor_bit_exact(trainers, receivers):
    versions = [1, 2, 3]
    q = CTX.Queue()
    overrides = BASE + ["verify=crc32"]
    with Sender(
        EngineConfig.from_overrides(overrides), "127.0.0.1:0", receivers, rank=0, num_trainers=trainers
    ) as sender:
        # receiver 0 warms up explicitly (an engine's init), the others wait in receive()
        procs = [
            start(
                workers.run_receiver,
                sender.address,
                r,
                overrides,
                versions,
                q,
                None,
                False,
                False,
                None,
                None,
                r == 0,
            )
            for r in range(receivers)
        ]
        procs += [
            start(workers.run_paired_trainer, sender.address, i, trainers, overrides, receivers, versions, q)
            for i in range(1, trainers)
        ]
        try:
            # with several trainer ranks: connections only (they join the data plane in their first send)
            sender.warm_up(workers.make_weights(1))
            assert q.get(timeout=60) == (0, "warm")
            links = None
            for v in versions:
                stats = sender.send(workers.make_weights(v), version=v)
                assert stats.tensors == 9
                # The two-rank groups persist across versions: built once, then reused.
                now = dict(sender._transport._groups)
                assert links is None or now == links
                links = now
                reports = collect(q, receivers + trainers - 1)
                shares, got = _split_reports(reports)
                assert all(version == v for _, version, *_ in shares), shares
                for rank, version, digests, held in got:
                    assert version == v, digests
                    assert held == v
                    assert digests == workers.expected_digests(v), f"receiver {rank} differs at version {v}"
                # Every trainer rank with a piece dealt to it sent a share of nearly equal
                # bytes; rank 0 (the first piece is its) counts them all, the whole model.
                plan = make_plan([TensorSpec.of(n, t) for n, t in workers.make_weights(v).items()], 2 << 20)
                assert stats.wire_bytes == sum(b.nbytes for b in plan.buckets)
                assert stats.bytes == sum(s.nbytes for s in plan.tensors)  # the model's, no padding
                others = [sent for _, _, sent, _ in shares]
                assert sum(others) < stats.bytes
                pieces = sum(-(-b.nbytes // CHUNK_BYTES) for b in plan.buckets)
                assert sum(1 for sent in others if sent) == min(trainers, pieces) - 1
                assert all(abs(sent - stats.bytes / trainers) <= CHUNK_BYTES for sent in others if sent)
        finally:
            stop(procs)


@pytest.mark.timeout(120)
def test_with_drop_lost_receivers_a_lost_receiver_fails_the_sync_and_the_next_goes_to_the_others():
    """docs/reliability.md, ``paired`` with ``drop_lost_receivers=true`` (2 trainer ranks,
    2 replicas): receiver 1 exits abruptly after its first tensor of version 2. ``paired``
    does not route around it (every trainer rank would have to send again in step), so the
    sync fails on both trainer ranks; trainer rank 0 drops it by itself, and version 3 goes
    to the other replica bit-exact, both trainer ranks sending, with no ``remove_receiver``."""
    q = CTX.Queue()
    trainers, receivers = 2, 2
    overrides = [*BASE, "drop_lost_receivers=true"]
    with Sender(
        EngineConfig.from_overrides(overrides), "127.0.0.1:0", receivers, rank=0, num_trainers=trainers
    ) as sender:
        procs = [
            start(workers.run_receiver, sender.address, 0, overrides, [1, 2, 3], q, None, False, True),
            start(workers.run_receiver, sender.address, 1, overrides, [1, 2], q, 1, False, True, 2),
            start(
                workers.run_paired_trainer, sender.address, 1, trainers, overrides, receivers, [1, 2, 3], q
            ),
        ]
        try:
            sender.send(workers.make_weights(1), version=1)
            shares, got = _split_reports(collect(q, 3))
            assert [s[1] for s in shares] == [1] and sorted((r[0], r[1]) for r in got) == [(0, 1), (1, 1)]
            t0 = time.monotonic()
            victim = rf"receiver rank 1 \(pid {procs[1].pid}, 127\.0\.0\.1:\d+\)"
            with pytest.raises(
                PeerLost,
                match=rf"({victim} (disconnected|closed the connection)|connection to {victim} lost).*; "
                r"dropped from the receivers \(drop_lost_receivers\): the next sync goes to receiver rank\(s\) \[0\]",
            ) as err:
                sender.send(workers.make_weights(2), version=2)
            assert time.monotonic() - t0 < 15  # noticed, not waited out (timeout_s is 30)
            assert err.value.ranks == [1] and sender.receivers == [0]  # dropped, by the sender itself
            procs[1].join(timeout=10)
            assert procs[1].exitcode == 9
            # Trainer rank 1 saw version 2 fail; the other replica failed it too, or had received
            # all of it (then it holds it, bit-exact) before the failure.
            shares, got = _split_reports(collect(q, 2))
            assert [s[1] for s in shares] == ["error"] and "version 2" in shares[0][2], shares
            [(rank, version, digests, held)] = got
            assert rank == 0
            if version == "error":
                assert held == 1 and "version 2" in digests, (digests, held)
            else:
                assert (version, held, digests) == (2, 2, workers.expected_digests(2))
            stats = sender.send(workers.make_weights(3), version=3)  # no remove_receiver, on any rank
            assert stats.receivers == 1
            shares, got = _split_reports(collect(q, 2))
            assert [s[1] for s in shares] == [3] and shares[0][2] > 0, shares  # trainer rank 1 sent its share
            assert got == [(0, 3, workers.expected_digests(3), 3)]
        finally:
            stop(procs)


def test_a_tensor_larger_than_a_bucket_is_refused_naming_it():
    overrides = ["backend=paired", "update_weights_bucket_megabytes=1", "timeout_s=5"]
    with Sender(EngineConfig.from_overrides(overrides), "127.0.0.1:0", 1) as sender:
        with pytest.raises(SyncError, match=r"'embed\.weight' \(1\.4 MiB\).*at least 2"):
            sender.send(workers.make_weights(1), version=1)


def test_a_receiver_killed_mid_transfer_is_named_and_the_survivors_go_on():
    q = CTX.Queue()
    trainers, receivers = 2, 3
    overrides = BASE
    with Sender(
        EngineConfig.from_overrides(overrides), "127.0.0.1:0", receivers, rank=0, num_trainers=trainers
    ) as sender:
        # Receiver rank 1 dies after its first tensor of version 2.
        procs = [
            start(
                workers.run_receiver,
                sender.address,
                r,
                overrides,
                [1, 2, 3],
                q,
                1 if r == 1 else None,
                False,
                True,
                2,
            )
            for r in range(receivers)
        ]
        procs += [
            start(workers.run_paired_trainer, sender.address, 1, trainers, overrides, receivers, [1, 2, 3], q)
        ]
        try:
            sender.send(workers.make_weights(1), version=1)
            collect(q, receivers + 1)
            t0 = time.monotonic()
            victim = rf"receiver rank 1 \(pid {procs[1].pid}, 127\.0\.0\.1:\d+\)"
            # docs/reliability.md: trainer rank 0 gets PeerLost naming it, and only it is blamed.
            with pytest.raises(
                PeerLost, match=rf"{victim} (disconnected|closed the connection)|connection to {victim} lost"
            ) as err:
                sender.send(workers.make_weights(2), version=2)
            assert time.monotonic() - t0 < 15  # noticed, not waited out (timeout_s is 30)
            assert err.value.ranks == [1], err.value
            # The other trainer rank saw version 2 fail; each survivor either failed it too
            # or had received all of it (then it holds it, bit-exact) before the failure.
            shares, got = _split_reports(collect(q, 3))
            assert [s[1] for s in shares] == ["error"], shares
            for rank, version, digests, held in got:
                if version == "error":  # failed it: keeps version 1, and says which version failed
                    assert held == 1 and "version 2" in digests, (rank, digests, held)
                else:
                    assert (version, held, digests) == (2, 2, workers.expected_digests(2))
            sender.remove_receiver(1)
            sender.send(workers.make_weights(3), version=3)
            shares, got = _split_reports(collect(q, 3))
            assert [s[1] for s in shares] == [3]
            assert sorted(r[0] for r in got) == [0, 2]
            for rank, version, digests, held in got:
                assert (version, held) == (3, 3)
                assert digests == workers.expected_digests(3)
        finally:
            stop(procs)
