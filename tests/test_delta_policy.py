"""``delta=auto`` decides before it spends: a probe of the version predicts what a delta
sync would cost, and a sync predicted slower than the last dense one goes whole, with no
base kept until deltas are probed again (``weightsync/delta/policy.py``). The sender's
base and policy run here in-process on the real codec; the transports' side of delta
syncs is in test_delta_sync.py."""

from dataclasses import dataclass, field
from unittest import mock

import torch

from weightsync.delta import policy as delta_policy
from weightsync.delta.send_stage import SenderBase
from weightsync.plan import TensorSpec
from weightsync.sources import as_source

SHAPES = {f"layer{i}.weight": (512, 1024) for i in range(16)}  # 16 MiB of bf16


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in SHAPES.items()}


def step(state: dict[str, torch.Tensor], seed: int) -> None:
    """Change 3% of every tensor's elements by one unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        flat = t.view(-1).view(torch.int16)
        flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() * 3 // 100]] += 1


def sync(base: SenderBase, state: dict[str, torch.Tensor], version: int, seconds: float) -> bool:
    """One sync to receiver 0 that it completes in ``seconds``; True if it went as deltas."""
    specs = [TensorSpec.of(name, t) for name, t in state.items()]
    encoding = base.encode(as_source(state), specs, version, [0])
    base.finished(encoding, seconds, {0})
    return encoding.header is not None


def test_a_probe_that_predicts_a_loss_sends_the_version_whole_and_keeps_no_base():
    state = model(0)
    base = SenderBase()
    assert not sync(base, state, 1, seconds=1e-4)  # no base yet: whole, and it becomes the base
    step(state, 1)
    with mock.patch.object(delta_policy, "NOTICE_S", 0.0):
        assert not sync(base, state, 2, seconds=1e-4)  # a probe cannot encode 16 MiB that fast
    assert base.policy.delta_s is not None and base.policy.delta_s > 1e-4  # the prediction
    assert base.version is None, "while deltas lose, a dense sync keeps no base copy"


def test_the_same_version_goes_as_deltas_where_dense_syncs_are_slow():
    """As across a slow link: the probe predicts far less than a dense sync costs."""
    state = model(0)
    base = SenderBase()
    assert not sync(base, state, 1, seconds=100.0)
    step(state, 1)
    assert sync(base, state, 2, seconds=100.0)
    assert base.version == 2 and base.holders == {0}
    # the base took the version: it equals the new state bit for bit
    assert all(torch.equal(base.tensors[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())


@dataclass
class CountingPolicy(delta_policy.DeltaPolicy):
    """The real policy, noting the verdict of each probe (``go`` follows every probe)."""

    verdicts: list[bool] = field(default_factory=list)

    def go(self, predicted_s: float, probe: delta_policy.Probe) -> bool:
        went = super().go(predicted_s, probe)
        self.verdicts.append(went)
        return went


def test_after_a_loss_deltas_are_probed_again_and_the_sync_before_keeps_a_base():
    """Deltas lose a probe (a probe cannot encode 16 MiB as fast as a 0.1 ms dense sync):
    the next ``RETRY_AFTER`` syncs rest, whole and unprobed, keeping no base but for the
    one before the next probe; then a probe (against that base) decides afresh. The real
    policy decides throughout; ``CountingPolicy`` only notes its probes' verdicts."""
    state = model(0)
    base = SenderBase(policy=CountingPolicy())
    sync(base, state, 1, seconds=1e-4)
    probed, kept = {}, []
    retry = 2 + delta_policy.RETRY_AFTER  # the sync that probes again
    with mock.patch.object(delta_policy, "NOTICE_S", 0.0):
        for v in range(2, retry + 1):
            step(state, v)
            before = len(base.policy.verdicts)
            assert not sync(base, state, v, seconds=1e-4)  # every probe loses here
            probed[v] = base.policy.verdicts[before:]
            kept.append(base.version is not None)
    # version 2 was probed and lost; the syncs after it rest (not one probe) until the retry
    assert probed == {2: [False], **{v: [] for v in range(3, retry)}, retry: [False]}
    # the syncs that rest keep no base but for the one before the next probe (the retry lost
    # again: the rest begins anew, without a base)
    assert kept == [False] * (delta_policy.RETRY_AFTER - 1) + [True, False]


def test_the_receivers_base_digest_counts_in_the_cost_of_a_delta_sync():
    """A receiver hashes its base in the handshake, outside a sync's measured seconds: the
    cost model adds it (as long as the sender's own digest of the base took), so a delta
    sync that is faster than dense on the wire but not once the digest is paid counts as lost."""
    base = SenderBase(policy=delta_policy.DeltaPolicy())
    state = model(0)
    assert not sync(base, state, 1, seconds=1.0)  # the first: whole, its base hashed in the background
    assert base.base_digest() and base._digest_s() > 0  # the sender timed its digest
    base.policy.always = True  # deltas whatever they cost: the measured cost is what is checked
    step(state, 1)
    digest_s = base._digest_s()
    assert sync(base, state, 2, seconds=0.5)
    assert base.policy.delta_s == 0.5 + digest_s
    policy = delta_policy.DeltaPolicy(dense_s=1.0)
    policy.delta_done(0.95, encode_s=0.5, wire_fraction=0.03, changed=1000, digest_s=0.0)
    assert not policy._lost()
    policy.delta_done(0.95, encode_s=0.5, wire_fraction=0.03, changed=1000, digest_s=0.3)
    assert policy._lost() and policy.delta_s == 0.95 + 0.3
    assert (
        abs(policy.apply_s_per_change - (0.95 - 0.5 - 0.03) / 1000) < 1e-12
    )  # the digest is not an apply cost


def test_a_failed_sync_is_no_measurement_of_what_deltas_cost():
    """A delta sync that failed (a receiver lost: its time is the heartbeat grace, or the
    deadline) tells the policy nothing: the version goes as deltas again, and so does the next."""
    state = model(0)
    base = SenderBase()
    assert not sync(base, state, 1, seconds=1.0)
    step(state, 1)
    encoding = base.encode(as_source(state), [TensorSpec.of(n, t) for n, t in state.items()], 2, [0])
    assert encoding.header is not None
    base.finished(encoding, None, set())  # failed, after 5 s of grace: as the sender reports it
    assert base.version == 1 and base.holders == {0}  # the receiver keeps its base
    assert sync(base, state, 2, seconds=1.0), "a failure's seconds turned deltas off"
    step(state, 2)
    assert sync(base, state, 3, seconds=1.0)


def test_a_version_taken_again_keeps_its_earlier_holders():
    """Re-routed around a lost receiver (``drop_lost_receivers``): receiver 0 completed
    version 2 before the loss, receiver 1 takes it again alone. Both hold version 2 after,
    so version 3 goes to both as deltas, without a dense section."""
    state = model(0)
    base = SenderBase(policy=delta_policy.DeltaPolicy(always=True))
    specs = [TensorSpec.of(name, t) for name, t in state.items()]

    def encode(version, receivers):
        return base.encode(as_source(state), specs, version, receivers)

    base.finished(encode(1, [0, 1]), 1.0, {0, 1})
    step(state, 1)
    base.finished(encode(2, [0, 1]), None, {0})  # the attempt failed; receiver 0 had completed it
    base.finished(encode(2, [1]), 1.0, {1})  # the version again, to receiver 1
    assert base.version == 2 and base.holders == {0, 1}
    step(state, 2)
    encoding = encode(3, [0, 1])
    assert encoding.header is not None and not encoding.header.dense
