"""The `weightsync demo` command beyond the README's demo lines (tests/test_doc_commands.py
runs those, the point-to-point and disk backends on conftest.py's tied_llama_dir in many
small buckets): a bad backend fails loudly."""

import pytest
from clirun import weightsync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_demo(*args):
    return weightsync("demo", *args, timeout=280)


def test_demo_fails_loudly():
    out = run_demo("--backend", "ncl", "--steps", "1")
    assert out.returncode != 0
    assert "did you mean 'nccl'" in out.stderr
