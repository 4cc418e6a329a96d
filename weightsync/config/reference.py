"""The parameter reference (``docs/configuration*.md``), generated from the configuration's
own field documentation (``weightsync config --docs [--lang zh]``)."""

from __future__ import annotations

from weightsync.config.backends import VERL_MODULE, builtin_backends
from weightsync.config.keys import PREFIX, all_keys
from weightsync.config.verl import VERL_KEYS

_DOC_TEXT = {
    "en": {
        "title": "# Configuration reference",
        "intro": (
            "Generated from `weightsync/config/keys.py` by `weightsync config --docs`; do not edit by hand.\n\n"
            "Keys can be written in the short form (`backend=nccl`) or with verl's full prefix "
            f"(`{PREFIX}backend=nccl`); trainer keys keep their own full names. Set them as dotted "
            "overrides (`--set KEY=VALUE`, `EngineConfig.from_overrides([...])`) or in YAML "
            "(`EngineConfig.from_yaml(path)`)."
        ),
        "header": "| key | type | default | allowed | description |",
        "help": "help",
        "any": "any",
        "verl_title": "## verl adapter: `engine_kwargs.weightsync`",
        "verl_intro": (
            "With verl's `checkpoint_engine.backend=weightsync` and `custom_backend_module="
            f"{VERL_MODULE}` (see [verl.md](verl.md)), verl passes `{PREFIX}engine_kwargs.weightsync` "
            "to the adapter. It takes these keys, and any key of the table above except `backend`, "
            "`update_weights_bucket_megabytes` (verl's own key sets the bucket), "
            "`custom_backend_module` and the trainer keys; `engine_kwargs.nccl.group_name` may also "
            "be written `nccl.group_name`."
        ),
        "verl_header": "| key | default | allowed | description |",
    },
    "zh": {
        "title": "# 配置参考",
        "intro": (
            "由 `weightsync config --docs` 从 `weightsync/config/keys.py` 生成，请勿手工编辑。\n\n"
            "键可写成短形式（`backend=nccl`）或带 verl 完整前缀的形式"
            f"（`{PREFIX}backend=nccl`）；训练器相关键使用其自身的完整名称。可通过点号覆盖"
            "（`--set KEY=VALUE`、`EngineConfig.from_overrides([...])`）或 YAML"
            "（`EngineConfig.from_yaml(path)`）设置。"
        ),
        "header": "| 键 | 类型 | 默认值 | 取值范围 | 说明 |",
        "help": "help_zh",
        "any": "任意",
        "verl_title": "## verl 适配器：`engine_kwargs.weightsync`",
        "verl_intro": (
            "在 verl 中设置 `checkpoint_engine.backend=weightsync` 与 `custom_backend_module="
            f"{VERL_MODULE}`（见 [verl.zh.md](verl.zh.md)）后，verl 把 `{PREFIX}engine_kwargs.weightsync` "
            "传给适配器。它接受下列键，以及上表中除 `backend`、`update_weights_bucket_megabytes`"
            "（桶大小由 verl 自己的键设置）、`custom_backend_module` 和训练器相关键之外的任何键；"
            "`engine_kwargs.nccl.group_name` 也可写作 `nccl.group_name`。"
        ),
        "verl_header": "| 键 | 默认值 | 取值范围 | 说明 |",
    },
}


def docs_markdown(lang: str = "en") -> str:
    """The parameter reference as Markdown, in ``"en"`` or ``"zh"``."""
    text = _DOC_TEXT[lang]
    lines = [text["title"], "", text["intro"], "", text["header"], "| --- | --- | --- | --- | --- |"]
    for k in all_keys():
        choices = k.meta.get("choices")
        if isinstance(choices, tuple):
            allowed = ", ".join(f"`{c}`" for c in choices)
        elif k.meta.get("allowed"):
            allowed = k.meta["allowed"]
        elif choices:
            allowed = ", ".join(f"`{c}`" for c in builtin_backends()) + " (+ plugins)"
        elif k.type_name in ("int", "float"):
            allowed = "> 0"
        elif k.type_name == "bool":
            allowed = "`true`, `false`"
        else:
            allowed = text["any"]
        default = (
            "null"
            if k.default is None
            else f"`{str(k.default).lower() if isinstance(k.default, bool) else k.default}`"
        )
        if k.default == "":
            default = '`""`'
        name = f"`{k.display}`"
        lines.append(f"| {name} | {k.type_name} | {default} | {allowed} | {k.meta[text['help']]} |")
    lines += [
        "",
        text["verl_title"],
        "",
        text["verl_intro"],
        "",
        text["verl_header"],
        "| --- | --- | --- | --- |",
    ]
    for v in VERL_KEYS:
        allowed = ", ".join(f"`{c}`" for c in v.choices) if v.choices else text["any"]
        default = "null" if v.default is None else f"`{v.default}`"
        lines.append(f"| `{v.name}` | {default} | {allowed} | {v.help if lang == 'en' else v.help_zh} |")
    return "\n".join(lines) + "\n"
