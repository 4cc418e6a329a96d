"""Backend ``disk``: versions published as checkpoints in a shared directory.

In-process cases run the sender in a thread (its ``send`` waits for acks); the crash
cases kill real processes."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import workers
from procs import CTX, start, stop
from workers import Background

from weightsync import (
    EngineConfig,
    HandshakeError,
    Receiver,
    Sender,
    SyncError,
    SyncTimeout,
    VerificationError,
)
from weightsync.config.keys import ConfigError
from weightsync.engines.disk import MANIFEST, published_versions, version_dir
from weightsync.errors import PeerLost, RemoteFailure

pytestmark = pytest.mark.timeout(120)


def overrides(path, *extra, timeout=20):
    return [
        "backend=disk",
        f"engine_kwargs.disk.path={path}",
        "update_weights_bucket_megabytes=1",
        f"timeout_s={timeout}",
        *extra,
    ]


def config(path, *extra, timeout=20):
    return EngineConfig.from_overrides(overrides(path, *extra, timeout=timeout))


def digests(weights):
    return {n: workers.digest(t.contiguous()) for n, t in weights.items()}


def sync(sender, receiver, weights, version, **kwargs):
    """Send in the background, receive here; return what arrived."""
    send = Background(sender, weights, version, **kwargs)
    got = {n: workers.digest(t) for n, t in receiver.receive(version=version)}
    send.join()
    return got


def load_published(directory: Path) -> dict[str, torch.Tensor]:
    """A published version read the way any tool would: index + plain safetensors."""
    from safetensors.torch import load_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(directory / file)))
    assert set(state) == set(index["weight_map"])
    return state


# ---------------------------------------------------------------------------- config
def test_config_needs_a_path_and_keeps_at_least_two(tmp_path):
    with pytest.raises(
        ConfigError, match=r"engine_kwargs.disk.path='': backend=disk needs a directory shared"
    ):
        EngineConfig.from_overrides(["backend=disk"])
    with pytest.raises(ConfigError, match=r"engine_kwargs.disk.keep=1: must be at least 2"):
        EngineConfig.from_overrides(
            [f"engine_kwargs.disk.path={tmp_path}", "backend=disk", "engine_kwargs.disk.keep=1"]
        )
    c = config(tmp_path)
    assert (c.engine_kwargs.disk.path, c.engine_kwargs.disk.keep) == (str(tmp_path), 2)


# ---------------------------------------------------------------------------- in process
def test_published_checkpoint_is_loadable_and_bit_exact_with_shards_smaller_than_a_tensor(tmp_path):
    with (
        Sender(config(tmp_path, "verify=crc32"), "unused:0", 1) as sender,
        Receiver(config(tmp_path, "verify=crc32"), "unused:0", 0) as receiver,
    ):
        for v in (1, 2):
            assert sync(sender, receiver, workers.make_weights(v), v) == workers.expected_digests(v)
            assert receiver.version == v and receiver.failed_version is None
        stats = sender.last_stats
        assert (
            stats.tensors == 9
            and stats.buckets >= 2
            and stats.bytes == sum(t.nbytes for t in workers.make_weights(2).values())
        )
    directory = tmp_path / version_dir(2)
    files = sorted(p.name for p in directory.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert files == sorted([*shards, "model.safetensors.index.json", MANIFEST])
    # The 1.4 MB embedding is larger than a 1 MiB shard: it sits alone in one.
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert list(index["weight_map"].values()).count(index["weight_map"]["embed.weight"]) == 1
    assert digests(load_published(directory)) == workers.expected_digests(2)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["version"] == 2 and manifest["verify"] == "crc32" and manifest["force"] is False
    assert all(len(s["checksums"]) == len(s["tensors"]) for s in manifest["shards"])
    assert manifest["writer"]["pid"] == os.getpid()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_transformers_loads_a_published_version(tmp_path):
    transformers = pytest.importorskip("transformers")
    # Embedding and head of 1.3 MB each: larger than a 1 MiB shard, so several shards.
    cfg = transformers.Qwen2Config(
        vocab_size=5000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    trainer = transformers.AutoModelForCausalLM.from_config(cfg)
    with (
        Sender(config(tmp_path), "unused:0", 1) as sender,
        Receiver(config(tmp_path), "unused:0", 0) as receiver,
    ):
        send = Background(sender, trainer, 1)
        for _ in receiver.receive(version=1):
            pass
        send.join()
    directory = tmp_path / version_dir(1)
    assert sender.last_stats.buckets >= 3
    cfg.save_pretrained(directory)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    expected = trainer.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in loaded.state_dict().items())


def test_pruning_keeps_the_newest_versions_and_their_acks(tmp_path):
    with (
        Sender(config(tmp_path, "engine_kwargs.disk.keep=3"), "unused:0", 1) as sender,
        Receiver(config(tmp_path, "engine_kwargs.disk.keep=3"), "unused:0", 0) as receiver,
    ):
        for v in range(1, 6):
            sync(sender, receiver, {"w": torch.full((4,), float(v))}, v)
        assert published_versions(tmp_path) == [3, 4, 5]
        assert sorted(p.name for p in (tmp_path / "acks").iterdir()) == [
            f"{version_dir(v)}.rank0.json" for v in (3, 4, 5)
        ]
        # Asking for a pruned version fails at once, saying so.
        with pytest.raises(
            SyncError,
            match=r"version 2 is not in .*older than the newest published version 5, so it was pruned \(keep=3; kept: 3, 4, 5\)",
        ):
            next(receiver.receive(version=2))
        assert receiver.version == 5 and receiver.failed_version is None


def test_a_version_not_published_in_time_is_a_clear_timeout(tmp_path):
    with (
        Sender(config(tmp_path), "unused:0", 1) as sender,
        Receiver(config(tmp_path, timeout=0.5), "unused:0", 0) as receiver,
    ):
        sync(sender, receiver, {"w": torch.ones(3)}, 6)
        t0 = time.monotonic()
        with pytest.raises(
            SyncTimeout,
            match=rf"receiver rank 0: version 7 was not published in {tmp_path} within 0.5 s \(newest published: 6\)",
        ):
            next(receiver.receive(version=7))
        assert time.monotonic() - t0 < 3
        with pytest.raises(
            SyncTimeout, match=r"no version newer than 6 was published .* \(newest published: 6\)"
        ):
            next(receiver.receive())
        assert (receiver.version, receiver.failed_version, receiver.torn) == (6, None, False)


def test_receivers_that_never_answer_are_named_at_the_deadline(tmp_path):
    with Sender(config(tmp_path, timeout=1), "unused:0", 2) as sender:
        t0 = time.monotonic()
        with pytest.raises(
            SyncTimeout, match=r"receiver rank 0 did not pick up version 1 .* within 1.0 s; receiver rank 1"
        ) as failure:
            sender.send({"w": torch.ones(3)}, version=1)
        assert failure.value.ranks == [0, 1] and time.monotonic() - t0 < 5
        assert published_versions(tmp_path) == [1]  # published: a late receiver still finds it


@pytest.mark.parametrize("verify", ["crc32", "xxh3"])
def test_a_corrupted_shard_fails_verification_on_the_receiver_and_the_sender(tmp_path, verify):
    pytest.importorskip("xxhash") if verify == "xxh3" else None
    weights = workers.make_weights(3)
    with (
        Sender(config(tmp_path, f"verify={verify}"), "unused:0", 1) as sender,
        Receiver(config(tmp_path, f"verify={verify}"), "unused:0", 0) as receiver,
    ):
        sync(sender, receiver, workers.make_weights(2), 2)
        send = Background(sender, weights, 3)
        directory = tmp_path / version_dir(3)
        while not directory.exists():
            time.sleep(0.01)
        manifest = json.loads((directory / MANIFEST).read_text())
        shard = manifest["shards"][-1]  # the last shard: earlier ones are delivered first
        with open(directory / shard["file"], "r+b") as f:  # flip the last byte of tensor data
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(
            VerificationError,
            match=rf"receiver rank 0: version 3 failed verification \({verify}\) in shard {shard['file']}; tensors affected: {shard['tensors'][-1]}",
        ):
            for _ in receiver.receive(version=3):
                pass
        with pytest.raises(
            RemoteFailure, match=r"receiver rank 0 failed version 3: .*VerificationError"
        ) as failure:
            send.join()
        assert failure.value.ranks == [0]
        # Not advanced; torn, since the shards before the damaged one were delivered.
        assert (receiver.version, receiver.failed_version, receiver.torn) == (2, 3, True)
        # A retry publishes version 3 anew (replacing the damaged one); it arrives whole.
        assert sync(sender, receiver, weights, 3) == digests(weights)
        assert (receiver.version, receiver.failed_version, receiver.torn) == (3, None, False)


def test_a_stale_version_is_refused_unless_forced(tmp_path):
    with (
        Sender(config(tmp_path), "unused:0", 1) as sender,
        Receiver(config(tmp_path), "unused:0", 0) as receiver,
    ):
        for v in (4, 5):
            sync(sender, receiver, {"w": torch.full((2,), float(v))}, v)
        with pytest.raises(
            HandshakeError, match=r"version 3 is older than version 5, the newest published in .*force=True"
        ):
            sender.send({"w": torch.zeros(2)}, version=3)
        assert published_versions(tmp_path) == [4, 5]
        # The receiver itself refuses an older version it asks for, unless published with force.
        with pytest.raises(
            HandshakeError,
            match=r"receiver rank 0 refused version 4: version 4 is older than version 5, which this receiver holds",
        ):
            next(receiver.receive(version=4))
        assert (receiver.version, receiver.failed_version) == (5, None)
        # A rollback with force: newer versions are withdrawn, and receive() takes it.
        send = Background(sender, {"w": torch.full((2,), 3.0)}, 3, force=True)
        got = dict(receiver.receive())
        send.join()
        assert torch.equal(got["w"], torch.full((2,), 3.0)) and receiver.version == 3
        assert published_versions(tmp_path) == [3]


def test_load_into_a_module_and_membership_changes(tmp_path):
    trainer = workers.Small(seed=1)
    model = workers.Small(seed=2)
    with (
        Sender(config(tmp_path, timeout=1), "unused:0", 2) as sender,
        Receiver(config(tmp_path), "unused:0", 0) as receiver,
    ):
        sender.remove_receiver(1)  # only rank 0 acknowledges now
        workers.bump_small(trainer, 1)
        send = Background(sender, trainer, 1)
        stats = receiver.load_into(model, version=1)
        send.join()
        assert workers.module_digests(model) == workers.module_digests(trainer) and stats.missing == []
        sender.add_receiver(1)  # rank 1 is awaited again, and does not come
        with pytest.raises(SyncTimeout, match="receiver rank 1 did not pick up version 2") as failure:
            send = Background(sender, trainer, 2)
            receiver.load_into(model, version=2)
            send.join()
        assert failure.value.ranks == [1] and receiver.version == 2


# ---------------------------------------------------------------------------- processes
@pytest.mark.slow
@pytest.mark.parametrize("num_receivers", [1, 3])
def test_versions_arrive_bit_exact_in_receiver_processes(tmp_path, num_receivers):
    versions = [1, 2, 3]
    q = CTX.Queue()
    ov = overrides(tmp_path, "verify=crc32")
    with Sender(EngineConfig.from_overrides(ov), "unused:0", num_receivers) as sender:
        procs = [start(workers.run_receiver, "unused:0", r, ov, versions, q) for r in range(num_receivers)]
        try:
            for v in versions:
                stats = sender.send(workers.make_weights(v), version=v)
                assert stats.tensors == 9 and stats.buckets >= 2
                for rank, version, got, held in [q.get(timeout=60) for _ in range(num_receivers)]:
                    assert (version, held) == (v, v) and got == workers.expected_digests(v), (
                        f"receiver {rank}, version {v}"
                    )
        finally:
            stop(procs)
    assert published_versions(tmp_path) == [2, 3]


@pytest.mark.slow
def test_a_writer_killed_mid_write_publishes_nothing_and_a_new_writer_does(tmp_path):
    ov = overrides(tmp_path)
    q = CTX.Queue()
    writer = start(workers.run_slow_sender, ov, 1, 1, q)
    replacement = None
    try:
        assert q.get(timeout=60)[0] == "writing"
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(timeout=10)
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-v1-")]
        assert len(leftovers) == 1 and published_versions(tmp_path) == []
        with Receiver(config(tmp_path, timeout=1), "unused:0", 0) as receiver:
            with pytest.raises(
                SyncTimeout,
                match=r"version 1 was not published in .* within 1.0 s \(newest published: none\)",
            ):
                next(receiver.receive(version=1))
            assert (receiver.version, receiver.failed_version) == (None, None)
            # A new queue: the killed writer may have died holding the old one's write lock.
            q = CTX.Queue()
            replacement = start(workers.run_sender, "unused:0", ov, 1, [1], q)
            receiver.config.timeout_s = 60
            got = {n: workers.digest(t) for n, t in receiver.receive(version=1)}
            assert got == digests(workers.big_weights(1)) and receiver.version == 1
            assert q.get(timeout=60) == ("listening", "unused:0") and q.get(timeout=60) == ("sent", 1)
        # The dead writer's temporary directory was removed by the next writer.
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    finally:
        stop([writer] + ([replacement] if replacement else []))


@pytest.mark.slow
def test_a_receiver_killed_mid_read_is_named_and_the_survivors_go_on(tmp_path):
    ov = overrides(tmp_path, timeout=20)
    q = CTX.Queue()
    with Sender(EngineConfig.from_overrides(ov), "unused:0", 3) as sender:
        victim = start(workers.run_resilient_receiver, "unused:0", 0, ov, [1], q, (1, 3))
        survivors = [start(workers.run_resilient_receiver, "unused:0", r, ov, [1, 2], q) for r in (1, 2)]
        try:
            t0 = time.monotonic()
            with pytest.raises(
                PeerLost, match=r"receiver rank 0 \(pid \d+ on .*\) died while reading version 1"
            ) as failure:
                sender.send(workers.big_weights(1), version=1)
            assert failure.value.ranks == [0] and time.monotonic() - t0 < 20
            victim.join(timeout=10)
            assert victim.exitcode == -signal.SIGKILL
            for _ in survivors:  # the others read version 1 whole: nothing on disk was torn
                rank, version, got, held = q.get(timeout=30)
                assert (version, held) == (1, 1) and got == digests(workers.big_weights(1))
            sender.remove_receiver(0)
            sender.send(workers.big_weights(2), version=2)
            for _ in survivors:
                rank, version, got, held = q.get(timeout=30)
                assert (version, held) == (2, 2) and got == digests(workers.big_weights(2))
        finally:
            stop([victim, *survivors])
