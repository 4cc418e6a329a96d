"""The `weightsync demo` command end to end, beyond the README's demo lines (which
tests/test_doc_commands.py runs): a bad backend, and many small buckets on the point-to-point
and disk backends (conftest.py's tied_llama_dir)."""

import pytest
from clirun import weightsync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_demo(*args):
    return weightsync("demo", *args, timeout=280)


def test_demo_fails_loudly():
    out = run_demo("--backend", "ncl", "--steps", "1")
    assert out.returncode != 0
    assert "did you mean 'nccl'" in out.stderr


@pytest.mark.parametrize("backend", ["paired", "mooncake", "disk"])
def test_demo_on_the_point_to_point_and_disk_backends(tied_llama_dir, backend):
    # 2 MiB buckets: paired never splits a tensor, and the tied embedding is 1.15 MB.
    out = run_demo(
        "--backend",
        backend,
        "--model",
        str(tied_llama_dir),
        "--bucket-mb",
        "2",
        "--receivers",
        "3",
        "--steps",
        "2",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo OK: 2 syncs to 3 receivers, bit-exact" in out.stdout
