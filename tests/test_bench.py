"""`weightsync bench` on a model directory, and its refusal of one without weights.

The README's bench lines run in tests/test_doc_commands.py, with the checks of their rows:
every transport and the alternatives in one run (`--backend mooncake,paired,disk,nccl,shm`:
every row, its bytes, each version bit-exact, the ratios, JSON and plot), `--update adamw`
with its rows for delta off, auto and on, `--hosts 4` on the emulated cluster."""

import pytest
import torch
from clirun import weightsync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def bench(*args):
    return weightsync("bench", *args, timeout=380)


def test_bench_reads_a_model_directory_and_explains_a_bad_one(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"w": torch.randn(300, 500), "b": torch.zeros(7, dtype=torch.int64)},
        str(tmp_path / "model.safetensors"),
    )
    out = bench(
        "--model",
        str(tmp_path),
        "--receivers",
        "1",
        "--repeats",
        "1",
        "--bucket-mb",
        "1",
        "--backend",
        "shm",
        "--no-alternatives",
    )
    assert out.returncode == 0, out.stderr
    assert "shm" in out.stdout and "2 tensors" in out.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    out = bench("--model", str(empty), "--backend", "shm")
    assert out.returncode == 1 and "no *.safetensors files" in out.stderr


def test_bump_changes_every_byte_of_every_tensor_each_version():
    """The bench checks each version bit-exact on every receiver (digests, or slices against
    ``bump`` of a reference): that finds a stale byte only if every byte changes each version."""
    from weightsync.bench import models
    from weightsync.plan import TensorSpec, as_bytes

    specs = models.synthetic_specs("small-tensors", 1, "bfloat16")[:3] + [
        TensorSpec("mask", (300,), "bool"),
        TensorSpec("ids", (5, 7), "int64"),
        TensorSpec("empty", (0,), "float32"),
    ]
    state = models.filled(specs, seed=1)
    state["mask"].copy_(torch.arange(300) % 3 == 0)
    for version in range(1, 300):  # every step modulo 256, and past it
        before = {n: as_bytes(t).clone() for n, t in state.items()}
        models.bump(state, version)
        for name, t in state.items():
            stale = (as_bytes(t) == before[name]).sum().item()
            assert stale == 0, (version, name, stale)
        assert state["mask"].view(torch.uint8).max() <= 1  # still valid bools
