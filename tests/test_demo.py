"""The `weightsync demo` command beyond the README's demo lines (tests/test_doc_commands.py
runs those, the point-to-point and disk backends on conftest.py's tied_llama_dir in many
small buckets): a bad backend fails loudly, a flag without what it needs is refused."""

import pytest
from clirun import weightsync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_demo(*args):
    return weightsync("demo", *args, timeout=280)


def test_demo_fails_loudly():
    out = run_demo("--backend", "ncl", "--steps", "1")
    assert out.returncode != 0
    assert "did you mean 'nccl'" in out.stderr


def test_lora_rank_without_vllm_replicas_is_refused_saying_what_it_needs():
    for command in ("demo", "bench"):
        out = weightsync(command, "--lora-rank", "8", timeout=120)
        assert out.returncode == 2 and "use it with --rollout vllm" in out.stderr, (command, out.stderr)
