"""The `weightsync demo` command end to end, on a model directory made here."""

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_demo(*args):
    return subprocess.run([sys.executable, "-m", "weightsync.cli", "demo", *args],
                          capture_output=True, text=True, timeout=280)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=3001, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tied-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_demo_with_a_model_directory_and_buckets_smaller_than_a_tensor(tied_llama_dir):
    # The tied embedding (3001 x 96 fp32, 1.15 MB) is larger than a 1 MiB bucket: it is split.
    out = run_demo("--model", str(tied_llama_dir), "--bucket-mb", "1", "--receivers", "2", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo OK: 2 syncs to 2 receivers, bit-exact" in out.stdout


def test_demo_fails_loudly():
    out = run_demo("--backend", "ncl", "--steps", "1")
    assert out.returncode != 0
    assert "did you mean 'nccl'" in out.stderr


@pytest.mark.parametrize("backend", ["paired", "mooncake", "disk"])
def test_demo_on_the_point_to_point_and_disk_backends(tied_llama_dir, backend):
    # 2 MiB buckets: paired never splits a tensor, and the tied embedding is 1.15 MB.
    out = run_demo("--backend", backend, "--model", str(tied_llama_dir), "--bucket-mb", "2", "--receivers", "3",
                   "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo OK: 2 syncs to 3 receivers, bit-exact" in out.stdout
