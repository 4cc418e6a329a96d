"""Configuration: verl's keys and defaults, both key forms, YAML, messages that name the key."""

import textwrap
from pathlib import Path

import pytest
from clirun import weightsync

from weightsync.config.backends import known_backends
from weightsync.config.engine import EngineConfig
from weightsync.config.keys import PREFIX, ConfigError
from weightsync.config.reference import docs_markdown
from weightsync.engines.base import EngineUnavailable
from weightsync.engines.registry import get_engine

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
    c = EngineConfig.from_overrides(
        [
            "backend=nccl",
            f"{PREFIX}update_weights_bucket_megabytes=64",
            f"{PREFIX}engine_kwargs.nccl.group_name=weights",
            "engine_kwargs.nccl.rebuild_group=True",
            "trainer.v1.trainer_mode=separate_async",
            "trainer.use_v1=true",
        ]
    )
    assert (c.backend, c.update_weights_bucket_megabytes) == ("nccl", 64)
    assert c.engine_kwargs.nccl.group_name == "weights"
    assert c.engine_kwargs.nccl.rebuild_group is True
    assert c.trainer.trainer_mode == "separate_async" and c.trainer.use_v1 is True


def test_unknown_key_suggests_the_closest():
    with pytest.raises(
        ConfigError,
        match="unknown configuration key 'update_weights_bucket_megabyte'.*did you mean 'update_weights_bucket_megabytes'",
    ):
        EngineConfig.from_overrides(["update_weights_bucket_megabyte=3"])
    with pytest.raises(ConfigError, match="did you mean 'engine_kwargs.nccl.group_name'"):
        EngineConfig.from_overrides([f"{PREFIX}engine_kwargs.nccl.groupname=x"])


@pytest.mark.parametrize(
    "override, message",
    [
        # backends that other tests register (plugins) may sort in between the built-in ones
        (
            "backend=ncl",
            r"backend='ncl' is not a known backend \(did you mean 'nccl'\?\); known backends: "
            r"([\w-]+, )*disk, ([\w-]+, )*mooncake, ([\w-]+, )*naive, ([\w-]+, )*nccl",
        ),
        ("update_weights_bucket_megabytes=abc", r"update_weights_bucket_megabytes='abc': expected int"),
        ("update_weights_bucket_megabytes=0", r"update_weights_bucket_megabytes=0: must be a positive"),
        ("engine_kwargs.nccl.rebuild_group=maybe", r"rebuild_group='maybe': expected bool"),
        ("timeout_s=-1", r"timeout_s=-1.0: must be a positive"),
        (
            "engine_kwargs.mooncake.device=tpu",
            r"engine_kwargs.mooncake.device='tpu': allowed values are auto, cuda, npu, cpu",
        ),
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
    nested.write_text(
        textwrap.dedent("""
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
    """)
    )
    c = EngineConfig.from_yaml(nested, ["update_weights_bucket_megabytes=128"])
    assert (c.backend, c.update_weights_bucket_megabytes) == ("nccl", 128)
    assert c.engine_kwargs.nccl.group_name == "g1" and c.engine_kwargs.nccl.rebuild_group is True
    assert c.trainer.trainer_mode == "separate_async"
    flat = tmp_path / "flat.yaml"
    flat.write_text("backend: nccl\ntimeout_s: 5\n")
    assert EngineConfig.from_yaml(flat).timeout_s == 5.0
    whole_verl = tmp_path / "ppo.yaml"
    whole_verl.write_text(
        textwrap.dedent("""
        actor_rollout_ref:
          model: {path: /models/qwen}
          rollout:
            n: 8
            checkpoint_engine: {backend: nccl, update_weights_bucket_megabytes: 64}
        trainer: {total_epochs: 3, v1: {trainer_mode: separate_async}}
    """)
    )
    c = EngineConfig.from_yaml(whole_verl)  # verl's other keys are verl's business
    assert (c.backend, c.update_weights_bucket_megabytes, c.trainer.trainer_mode) == (
        "nccl",
        64,
        "separate_async",
    )
    typo = tmp_path / "typo.yaml"
    typo.write_text("actor_rollout_ref:\n  rollout:\n    checkpoint_engine: {backnd: nccl}\n")
    with pytest.raises(
        ConfigError, match="'actor_rollout_ref.rollout.checkpoint_engine.backnd'.*did you mean 'backend'"
    ):
        EngineConfig.from_yaml(typo)
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint_engine:\n  backend: nccl\n")
    with pytest.raises(ConfigError, match="unknown configuration key 'checkpoint_engine.backend'"):
        EngineConfig.from_yaml(bad)


def test_custom_backend_module_is_imported_before_lookup(tmp_path, monkeypatch):
    (tmp_path / "my_ws_plugin.py").write_text(
        textwrap.dedent("""
        from weightsync.engines import register_engine
        from weightsync.engines.nccl import CollectiveEngine

        class MyEngine(CollectiveEngine):
            name = "mine"

        register_engine("mine", MyEngine)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    c = EngineConfig.from_overrides(["custom_backend_module=my_ws_plugin", "backend=mine"])
    assert get_engine(c.backend).__name__ == "MyEngine"
    with pytest.raises(ConfigError, match="custom_backend_module='no_such_plugin_mod': cannot import it"):
        EngineConfig.from_overrides(["custom_backend_module=no_such_plugin_mod"])


def test_backend_whose_import_fails_says_which_module_is_missing(tmp_path, monkeypatch):
    (tmp_path / "ws_needs_dep.py").write_text("import mooncake_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from weightsync.config.backends import register_engine

    register_engine("needsdep", "ws_needs_dep:Engine")
    assert "needsdep" in known_backends()
    for _ in range(2):  # the failure is recorded, and said again on every request
        with pytest.raises(
            EngineUnavailable,
            match="backend 'needsdep' cannot be loaded.*'mooncake_dependency_not_installed' is missing",
        ):
            get_engine("needsdep")


def test_generated_docs_match_the_code():
    for lang, path in (("en", "docs/configuration.md"), ("zh", "docs/configuration.zh.md")):
        assert (ROOT / path).read_text() == docs_markdown(lang), f"{path} drifted: run `make docs`"
    en = docs_markdown("en")
    from weightsync.config.keys import all_keys

    for key in all_keys():
        assert f"`{key.display}`" in en


def run_cli(*args):
    return weightsync(*args, timeout=60)


def test_cli_config_check():
    bad = run_cli("config", "--check", "backend=ncl")
    assert bad.returncode == 2, bad  # the exit status --check promises for an invalid configuration
    assert bad.stderr.startswith("error: backend='ncl' is not a known backend (did you mean 'nccl'?)"), (
        bad.stderr
    )
    assert bad.stdout == ""
    good = run_cli("config", "--check", "backend=nccl")
    assert (good.returncode, good.stdout) == (0, "config OK\n"), good
    shown = run_cli("config", f"{PREFIX}backend=nccl", "update_weights_bucket_megabytes=64")
    assert "backend=nccl" in shown.stdout and "update_weights_bucket_megabytes=64" in shown.stdout


def test_every_command_has_help():
    for args in (["--help"], ["demo", "--help"], ["config", "--help"]):
        out = run_cli(*args)
        assert out.returncode == 0 and "usage: weightsync" in out.stdout


# ---------------------------------------------------------------------------- verl's own configs
VERL_MULTI = """
actor_rollout_ref:
  model: {path: /models/qwen}
  rollout:
    checkpoint_engine:
      _target_: verl.workers.config.CheckpointEngineConfig
      backend: BACKEND
      update_weights_bucket_megabytes: 512
      custom_backend_module: null
      engine_kwargs:
        nccl: {group_name: g1, rebuild_group: true, multi_sender: true, rollout_dtype: bfloat16}
        nixl: {device: cuda}
        kimi_ckpt_engine: {rebuild_group: false}
        mooncake: {device: npu, device_name: mlx5_0, rollout_dtype: bfloat16}
        weightsync: {transport: auto, timeout_s: 60, verify: crc32, nccl: {group_name: ws}}
trainer:
  use_v1: true
  v1:
    trainer_mode: separate_async
    separate_async: {parameter_sync_step: 4, hybrid_rollout: {_target_: x.Y, enable_switch: false}}
"""


def verl_yaml(tmp_path, backend: str, text: str = VERL_MULTI) -> Path:
    path = tmp_path / f"verl-{backend}.yaml"
    path.write_text(text.replace("BACKEND", backend))
    return path


def test_verl_trainer_modes_are_verls():
    c = EngineConfig()
    assert (c.trainer.trainer_mode, c.trainer.use_v1) == ("sync", True)  # verl 0.9.1's defaults
    for mode in ("sync", "colocate_async", "separate_async"):
        assert (
            EngineConfig.from_overrides(
                [f"trainer.v1.trainer_mode={mode}", "backend=nccl"]
            ).trainer.trainer_mode
            == mode
        )
    assert EngineConfig.from_overrides(["trainer.v1.trainer_mode=colocate"]).trainer.trainer_mode == "sync"
    with pytest.raises(ConfigError, match="allowed values are sync, colocate_async, separate_async"):
        EngineConfig.from_overrides(["trainer.v1.trainer_mode=async"])


def test_verl_config_with_several_backends_engine_kwargs(tmp_path):
    notes: list[str] = []
    c = EngineConfig.from_yaml(verl_yaml(tmp_path, "nccl"), notes=notes)
    assert (c.backend, c.update_weights_bucket_megabytes) == ("nccl", 512)
    assert (c.engine_kwargs.nccl.group_name, c.engine_kwargs.nccl.rebuild_group) == ("g1", True)
    assert c.engine_kwargs.mooncake.device == "auto"  # mooncake's entry is not nccl's: ignored
    assert c.trainer.trainer_mode == "separate_async"
    text = "\n".join(notes)
    for name in ("nixl", "kimi_ckpt_engine", "mooncake", "weightsync"):
        assert (
            f"{PREFIX}engine_kwargs.{name}: ignored, as verl does: backend=nccl reads only its own entry"
            in text
        )
    for key in ("multi_sender", "rollout_dtype"):
        assert f"engine_kwargs.nccl.{key}: taken by verl's own nccl engine, not read by weightsync's" in text

    c = EngineConfig.from_yaml(verl_yaml(tmp_path, "mooncake"), notes=(notes := []))
    assert (c.engine_kwargs.mooncake.device, c.engine_kwargs.mooncake.device_name) == ("npu", "mlx5_0")
    assert c.engine_kwargs.nccl.group_name == "default"
    assert any(
        "engine_kwargs.mooncake.rollout_dtype: taken by verl's own mooncake engine" in n for n in notes
    )

    c = EngineConfig.from_yaml(verl_yaml(tmp_path, "paired"))  # paired also reads nccl's group options
    assert (c.backend, c.engine_kwargs.nccl.group_name) == ("paired", "g1")


def test_verl_config_with_the_weightsync_adapter(tmp_path):
    text = VERL_MULTI.replace(
        "custom_backend_module: null", "custom_backend_module: weightsync.integrations.verl"
    )
    notes: list[str] = []
    c = EngineConfig.from_yaml(
        verl_yaml(tmp_path, "weightsync", text), notes=notes
    )  # verl need not be installed
    assert (c.backend, c.timeout_s, c.verify, c.engine_kwargs.nccl.group_name) == (
        "nccl",
        60.0,
        "crc32",
        "ws",
    )
    assert c.custom_backend_module is None  # verl's plugin import, not a weightsync backend module
    assert any("transport=auto: chosen at every update" in n for n in notes)
    assert any(
        f"{PREFIX}engine_kwargs.nccl: ignored, as verl does: backend=weightsync reads engine_kwargs.weightsync"
        in n
        for n in notes
    )
    bad = text.replace("verify: crc32", "verfy: crc32")
    with pytest.raises(
        ConfigError,
        match=r"unknown key .*engine_kwargs\.weightsync\.verfy \(did you mean 'verify'\?\); known keys: transport, host, timeout_s, .*verify, delta",
    ):
        EngineConfig.from_yaml(verl_yaml(tmp_path, "weightsync", bad))


@pytest.mark.parametrize(
    "backend, message",
    [
        (
            "hccl",
            r"backend='hccl': weightsync has no backend of that name: use backend=nccl, which runs on HCCL on Ascend",
        ),
        ("nixl", r"backend='nixl': verl's NIXL engine is not provided by weightsync; .*backend=mooncake"),
        ("kimi_ckpt_engine", r"backend='kimi_ckpt_engine': .* not provided by weightsync; use backend=nccl"),
        ("delta_sharded", r"backend='delta_sharded': verl's delta engine .* not provided .*delta=auto"),
        ("weightsync", r"backend='weightsync': that is the name weightsync's adapter registers in verl"),
    ],
)
def test_verl_backend_names_weightsync_does_not_provide(backend, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_overrides([f"backend={backend}"])
    if backend != "weightsync":  # in a verl config too, with that backend's engine_kwargs left aside
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_yaml(verl_yaml(tmp_path, backend))


def test_verl_adapter_kwargs():
    from weightsync.config.verl import parse_verl_kwargs

    o = parse_verl_kwargs(
        {
            "transport": "shm",
            "host": "10.0.0.5",
            "timeout_s": 9,
            "nccl": {"group_name": "w"},
            "engine_kwargs": {"disk": {"path": "/d"}},
            "auth_secret": "s",
        }
    )
    assert (o.transport, o.host) == ("shm", "10.0.0.5")
    assert o.settings == [
        ("timeout_s", 9),
        ("engine_kwargs.nccl.group_name", "w"),
        ("engine_kwargs.disk.path", "/d"),
        ("auth_secret", "s"),
    ]
    assert parse_verl_kwargs(None).transport == "nccl"
    with pytest.raises(
        ConfigError,
        match=r"transport='nccll': allowed values are nccl, shm, paired, sharded, mooncake, disk, auto \(did you mean 'nccl'\?\)",
    ):
        parse_verl_kwargs({"transport": "nccll"})
    with pytest.raises(
        ConfigError,
        match=r"engine_kwargs\.weightsync\.backend: not set here; name the weightsync backend with `transport`",
    ):
        parse_verl_kwargs({"backend": "nccl"})
    with pytest.raises(ConfigError, match=r"update_weights_bucket_megabytes: not set here; verl passes"):
        parse_verl_kwargs({"update_weights_bucket_megabytes": 4})
    with pytest.raises(ConfigError, match=r"unknown key .*weightsync\.trainer\.use_v1"):
        parse_verl_kwargs({"trainer": {"use_v1": True}})


def test_cli_reads_a_verl_config_with_notes(tmp_path):
    out = run_cli("config", "--yaml", str(verl_yaml(tmp_path, "nccl")), "--check")
    assert out.returncode == 0, out.stderr
    assert (
        "config OK" in out.stdout and "note: " in out.stderr and "engine_kwargs.nixl: ignored" in out.stderr
    )
    out = run_cli("config", "--yaml", str(verl_yaml(tmp_path, "hccl")), "--check")
    assert out.returncode == 2 and "use backend=nccl" in out.stderr
