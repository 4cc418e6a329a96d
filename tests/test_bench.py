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
