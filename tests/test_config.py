"""Configuration: verl's keys and defaults, both key forms, YAML, messages that name the key."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from weightsync.config import PREFIX, ConfigError, EngineConfig, docs_markdown
from weightsync.engines import EngineUnavailable, get_engine, known_backends

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_match_verl():
    c = EngineConfig()
    assert c.backend == "naive"
    assert c.update_weights_bucket_megabytes == 2048
    assert c.engine_kwargs.nccl.group_name == "default"
    assert c.engine_kwargs.nccl.rebuild_group is False
    assert c.engine_kwargs.mooncake.device_name == ""
    assert c.custom_backend_module is None
    assert c.timeout_s == 300
    assert c.bucket_bytes == 2048 << 20


def test_short_and_full_keys():
    c = EngineConfig.from_overrides([
        "backend=nccl",
        f"{PREFIX}update_weights_bucket_megabytes=64",
        f"{PREFIX}engine_kwargs.nccl.group_name=weights",
        "engine_kwargs.nccl.rebuild_group=True",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.use_v1=true",
    ])
    assert (c.backend, c.update_weights_bucket_megabytes) == ("nccl", 64)
    assert c.engine_kwargs.nccl.group_name == "weights"
    assert c.engine_kwargs.nccl.rebuild_group is True
    assert c.trainer.trainer_mode == "separate_async" and c.trainer.use_v1 is True


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="unknown configuration key 'update_weights_bucket_megabyte'.*did you mean 'update_weights_bucket_megabytes'"):
        EngineConfig.from_overrides(["update_weights_bucket_megabyte=3"])
    with pytest.raises(ConfigError, match="did you mean 'engine_kwargs.nccl.group_name'"):
        EngineConfig.from_overrides([f"{PREFIX}engine_kwargs.nccl.groupname=x"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("backend=ncl", r"backend='ncl' is not a known backend \(did you mean 'nccl'\?\); known backends: disk, mooncake, naive, nccl"),
        ("update_weights_bucket_megabytes=abc", r"update_weights_bucket_megabytes='abc': expected int"),
        ("update_weights_bucket_megabytes=0", r"update_weights_bucket_megabytes=0: must be a positive"),
        ("engine_kwargs.nccl.rebuild_group=maybe", r"rebuild_group='maybe': expected bool"),
        ("timeout_s=-1", r"timeout_s=-1.0: must be a positive"),
        ("engine_kwargs.mooncake.device=tpu", r"engine_kwargs.mooncake.device='tpu': allowed values are auto, cuda, npu, cpu"),
        ("backend", r"override 'backend' is not of the form key=value"),
    ],
)
def test_bad_values_name_key_value_and_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_overrides([override])


def test_separate_async_needs_a_transport():
    with pytest.raises(ConfigError, match="separate_async with backend=naive.*transport"):
        EngineConfig.from_overrides(["trainer.v1.trainer_mode=separate_async"])
    EngineConfig.from_overrides(["trainer.v1.trainer_mode=separate_async", "backend=nccl"])


def test_yaml_nested_and_flat(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text(textwrap.dedent("""
        actor_rollout_ref:
          rollout:
            checkpoint_engine:
              backend: nccl
              update_weights_bucket_megabytes: 512
              engine_kwargs:
                nccl: {group_name: g1, rebuild_group: true}
        trainer:
          use_v1: true
          v1: {trainer_mode: separate_async}
    """))
    c = EngineConfig.from_yaml(nested, ["update_weights_bucket_megabytes=128"])
    assert (c.backend, c.update_weights_bucket_megabytes) == ("nccl", 128)
    assert c.engine_kwargs.nccl.group_name == "g1" and c.engine_kwargs.nccl.rebuild_group is True
    assert c.trainer.trainer_mode == "separate_async"
    flat = tmp_path / "flat.yaml"
    flat.write_text("backend: nccl\ntimeout_s: 5\n")
    assert EngineConfig.from_yaml(flat).timeout_s == 5.0
    whole_verl = tmp_path / "ppo.yaml"
    whole_verl.write_text(textwrap.dedent("""
        actor_rollout_ref:
          model: {path: /models/qwen}
          rollout:
            n: 8
            checkpoint_engine: {backend: nccl, update_weights_bucket_megabytes: 64}
        trainer: {total_epochs: 3, v1: {trainer_mode: separate_async}}
    """))
    c = EngineConfig.from_yaml(whole_verl)  # verl's other keys are verl's business
    assert (c.backend, c.update_weights_bucket_megabytes, c.trainer.trainer_mode) == ("nccl", 64, "separate_async")
    typo = tmp_path / "typo.yaml"
    typo.write_text("actor_rollout_ref:\n  rollout:\n    checkpoint_engine: {backnd: nccl}\n")
    with pytest.raises(ConfigError, match="'actor_rollout_ref.rollout.checkpoint_engine.backnd'.*did you mean 'backend'"):
        EngineConfig.from_yaml(typo)
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint_engine:\n  backend: nccl\n")
    with pytest.raises(ConfigError, match="unknown configuration key 'checkpoint_engine.backend'"):
        EngineConfig.from_yaml(bad)


def test_custom_backend_module_is_imported_before_lookup(tmp_path, monkeypatch):
    (tmp_path / "my_ws_plugin.py").write_text(textwrap.dedent("""
        from weightsync.engines import register_engine
        from weightsync.engines.nccl import CollectiveEngine

        class MyEngine(CollectiveEngine):
            name = "mine"

        register_engine("mine", MyEngine)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    c = EngineConfig.from_overrides(["custom_backend_module=my_ws_plugin", "backend=mine"])
    assert get_engine(c.backend).__name__ == "MyEngine"
    with pytest.raises(ConfigError, match="custom_backend_module='no_such_plugin_mod': cannot import it"):
        EngineConfig.from_overrides(["custom_backend_module=no_such_plugin_mod"])


def test_backend_whose_import_fails_says_which_module_is_missing(tmp_path, monkeypatch):
    (tmp_path / "ws_needs_dep.py").write_text("import mooncake_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from weightsync.engines import register_engine

    register_engine("needsdep", "ws_needs_dep:Engine")
    assert "needsdep" in known_backends()
    for _ in range(2):  # the failure is recorded, and said again on every request
        with pytest.raises(EngineUnavailable, match="backend 'needsdep' cannot be loaded.*'mooncake_dependency_not_installed' is missing"):
            get_engine("needsdep")


def test_generated_docs_match_the_code():
    for lang, path in (("en", "docs/configuration.md"), ("zh", "docs/configuration.zh.md")):
        assert (ROOT / path).read_text() == docs_markdown(lang), f"{path} drifted: run `make docs`"
    en = docs_markdown("en")
    from weightsync.config import all_keys

    for key in all_keys():
        assert f"`{key.display}`" in en


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "weightsync.cli", *args], capture_output=True, text=True, timeout=60)


def test_cli_config_check():
    bad = run_cli("config", "--check", "backend=ncl")
    assert bad.returncode != 0 and "did you mean 'nccl'" in bad.stderr
    good = run_cli("config", "--check", "backend=nccl")
    assert good.returncode == 0
    shown = run_cli("config", f"{PREFIX}backend=nccl", "update_weights_bucket_megabytes=64")
    assert "backend=nccl" in shown.stdout and "update_weights_bucket_megabytes=64" in shown.stdout


def test_every_command_has_help():
    for args in (["--help"], ["demo", "--help"], ["config", "--help"]):
        out = run_cli(*args)
        assert out.returncode == 0 and "usage: weightsync" in out.stdout
