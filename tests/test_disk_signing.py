"""Backend ``disk`` with a shared secret: the sender signs every manifest (HMAC-SHA256 over
its canonical JSON, which holds each shard's SHA-256); a receiver with the secret refuses
unsigned or wrongly signed versions before reading a tensor, its state unchanged, and
refuses a shard whose bytes changed after signing."""

import json
import os
import time

import pytest
import torch
import workers
from test_disk import digests, overrides, sync
from workers import Background

from weightsync import EngineConfig, HandshakeError, Receiver, Sender, VerificationError
from weightsync.engines.disk import MANIFEST, SIGNATURE, version_dir
from weightsync.errors import RemoteFailure

pytestmark = pytest.mark.timeout(120)


def config(path, secret=None, timeout=20):
    extra = [f"auth_secret={secret}"] if secret is not None else []
    return EngineConfig.from_overrides(overrides(path, *extra, timeout=timeout))


def manifest_of(path, version):
    return json.loads((path / version_dir(version) / MANIFEST).read_text())


def test_signed_versions_arrive_and_their_manifests_carry_the_signature(tmp_path):
    weights = workers.make_weights(1)
    with (
        Sender(config(tmp_path, "s3cret"), "unused:0", 1) as sender,
        Receiver(config(tmp_path, "s3cret"), "unused:0", 0) as receiver,
    ):
        assert sync(sender, receiver, weights, 1) == digests(weights)
        assert receiver.version == 1
    manifest = manifest_of(tmp_path, 1)
    assert len(manifest[SIGNATURE]) == 64 and all(len(s["sha256"]) == 64 for s in manifest["shards"])
    # Without a secret nothing is signed (and a receiver without one reads signed versions).
    with (
        Sender(config(tmp_path / "plain"), "unused:0", 1) as sender,
        Receiver(config(tmp_path / "plain"), "unused:0", 0) as receiver,
    ):
        sync(sender, receiver, weights, 1)
    assert SIGNATURE not in manifest_of(tmp_path / "plain", 1)
    with Receiver(config(tmp_path), "unused:0", 1) as unsigned_reader:
        assert {n: workers.digest(t) for n, t in unsigned_reader.receive(version=1)} == digests(weights)


@pytest.mark.parametrize("case", ["unsigned", "other secret", "tampered manifest"])
def test_unsigned_or_wrongly_signed_versions_are_refused_and_the_state_stays(tmp_path, case):
    with (
        Sender(config(tmp_path, "s3cret"), "unused:0", 1) as sender,
        Receiver(config(tmp_path, "s3cret"), "unused:0", 0) as receiver,
    ):
        sync(sender, receiver, {"w": torch.full((4,), 1.0)}, 1)
        assert (receiver.version, receiver.failed_version, receiver.torn) == (1, None, False)
        # Version 2 published by a writer without the secret, with another one, or signed
        # and then changed (its weights swapped for others, digests and all).
        secret = {"unsigned": None, "other secret": "guess", "tampered manifest": "s3cret"}[case]
        with Sender(config(tmp_path, secret, timeout=2), "unused:0", 1) as intruder:
            send = Background(intruder, {"w": torch.full((4,), 666.0)}, 2)
            if case == "tampered manifest":
                directory = tmp_path / version_dir(2)
                while not directory.exists():
                    time.sleep(0.01)
                manifest = manifest_of(tmp_path, 2)
                manifest["force"] = True
                (directory / MANIFEST).write_text(json.dumps(manifest))
            expected = {
                "unsigned": r"its manifest is not signed, and this receiver has a shared secret \(auth_secret or \$WEIGHTSYNC_SECRET\)",
                "other secret": r"its manifest's signature does not match: the sender holds another shared secret",
                "tampered manifest": r"its manifest's signature does not match: .* or the manifest was changed after it was signed",
            }[case]
            with pytest.raises(HandshakeError, match=rf"receiver rank 0 refused version 2: {expected}"):
                next(receiver.receive(version=2))
            with pytest.raises(HandshakeError, match="receiver rank 0 refused version 2"):
                send.join()  # the refusal reaches the writer, as any refusal does
        assert (receiver.version, receiver.failed_version, receiver.torn) == (1, None, False)


def test_a_shard_changed_after_signing_is_caught_before_its_tensors_are_used(tmp_path):
    weights = workers.make_weights(3)
    with (
        Sender(config(tmp_path, "s3cret"), "unused:0", 1) as sender,
        Receiver(config(tmp_path, "s3cret"), "unused:0", 0) as receiver,
    ):
        sync(sender, receiver, workers.make_weights(2), 2)
        send = Background(sender, weights, 3)
        directory = tmp_path / version_dir(3)
        while not directory.exists():
            time.sleep(0.01)
        shard = manifest_of(tmp_path, 3)["shards"][-1]
        with open(directory / shard["file"], "r+b") as f:  # same size, one byte of data changed
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        got = []
        with pytest.raises(
            VerificationError,
            match=rf"shard {shard['file']} of version 3 does not match the digest its signed manifest holds",
        ):
            for name, _ in receiver.receive(version=3):
                got.append(name)
        assert not set(got) & set(shard["tensors"])  # nothing of the changed shard was handed out
        with pytest.raises(RemoteFailure, match="receiver rank 0 failed version 3"):
            send.join()
        assert (receiver.version, receiver.failed_version) == (2, 3)
