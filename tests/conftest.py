"""The test run's policy on optional dependencies and skips.

- A test marked ``vllm`` needs vLLM (its CPU build), one marked ``mooncake`` the Mooncake
  Transfer Engine wheel. Where one is missing such a test is skipped, naming the command
  that installs it; under ``CI`` (set by CI runners) or ``WEIGHTSYNC_REQUIRE_ALL=1`` it
  fails instead, with the same command.
- Under ``WEIGHTSYNC_REQUIRE_ALL=1`` (``make test`` sets it), or ``CI`` alone, no skip is
  allowed at all: every skip becomes a failure that says why it was skipped, so a passing
  run ran every test it selected. Deselection (``-m "not slow"``, ``-m "not cuda"``) is not
  a skip.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import pytest

REQUIRE_ALL_ENV = "WEIGHTSYNC_REQUIRE_ALL"

# marker -> (module to import, how to install it)
OPTIONAL = {
    "vllm": (
        "vllm",
        "make install-vllm  (pip install -e '.[vllm]'; see the Makefile for the packages it then removes)",
    ),
    "trl": ("trl", "make install-vllm  (pip install -e '.[trl]')"),
    "mooncake": (
        "mooncake.engine",
        "make install-mooncake  (apt-get install libibverbs1 libnl-3-200 libnl-route-3-200; pip install -e '.[mooncake]')",
    ),
}


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def strict() -> bool:
    """Missing optional dependencies fail the run (CI, or everything required)."""
    return require_all() or os.environ.get("CI", "").lower() not in ("", "0", "false")


@functools.cache
def missing(module: str) -> str | None:
    """Why ``module`` cannot be imported, or None if it can. vLLM is only looked up (its
    import takes seconds and the tests import it anyway); the Mooncake wheel is imported,
    since it may be installed without the shared libraries it needs."""
    try:
        if module == "vllm":
            return None if importlib.util.find_spec(module) is not None else f"no module named {module!r}"
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a wheel whose shared libraries are missing
        return f"{type(e).__name__}: {e}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "mooncake: needs Mooncake Transfer Engine (make install-mooncake)")
    config.addinivalue_line("markers", "trl: needs TRL (the trl extra; make install-vllm)")


def pytest_runtest_setup(item):
    for marker, (module, install) in OPTIONAL.items():
        if item.get_closest_marker(marker) is None:
            continue
        why = missing(module)
        if why is None:
            continue
        message = f"needs {marker} ({why}); install it with: {install}"
        if strict():
            pytest.fail(
                f"{message} [CI or {REQUIRE_ALL_ENV}=1: a missing dependency fails the run]", pytrace=False
            )
        pytest.skip(message)


def _as_failure(report) -> None:
    if not (strict() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped, and CI or {REQUIRE_ALL_ENV}=1 allows no skip: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _as_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _as_failure(outcome.get_result())


@pytest.fixture(scope="session")
def tied_llama_dir(tmp_path_factory):
    """A tiny Hugging Face model directory (config.json + model.safetensors), made here: a
    2-layer Llama with tied embeddings, whose embedding (3001 x 96 fp32, 1.15 MB) is larger
    than a 1 MiB bucket."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=3001,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("tied-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path
