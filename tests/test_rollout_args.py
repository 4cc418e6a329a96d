"""Rollout configuration -> vLLM / SGLang engine arguments: the table, its checks."""

import pytest

from weightsync.integrations.rollout_args import (
    TABLE,
    RolloutArgsError,
    sglang_server_args,
    table_markdown,
    vllm_engine_args,
)


def test_vllm_args_from_nested_verl_keys():
    args = vllm_engine_args(
        {
            "actor_rollout_ref": {
                "model": {"path": "/m", "trust_remote_code": True},
                "rollout": {
                    "tensor_model_parallel_size": 2,
                    "data_parallel_size": 2,
                    "expert_parallel_size": 4,
                    "gpu_memory_utilization": 1,
                    "max_num_seqs": 64,
                    "quantization": "fp8",
                    "enable_prefix_caching": False,
                    "load_format": "auto",
                },
            }
        }
    )
    assert args["model"] == "/m" and args["trust_remote_code"] is True
    assert args["tensor_parallel_size"] == 4 and "data_parallel_size" not in args
    assert args["enable_expert_parallel"] is True
    assert args["gpu_memory_utilization"] == 1.0 and args["max_num_seqs"] == 64
    assert (
        args["quantization"] == "fp8"
        and args["enable_prefix_caching"] is False
        and args["load_format"] == "auto"
    )


def test_sglang_names_from_the_same_table():
    args = sglang_server_args(
        {
            "model.path": "/m",
            "rollout.tensor_model_parallel_size": 2,
            "rollout.data_parallel_size": 2,
            "rollout.enable_prefix_caching": True,
            "rollout.max_num_seqs": 8,
            "rollout.enforce_eager": True,
        }
    )
    assert args["model_path"] == "/m" and args["tp_size"] == 4 and args["dp_size"] == 2
    assert args["disable_radix_cache"] is False and args["max_running_requests"] == 8
    assert args["disable_cuda_graph"] is True and args["enable_memory_saver"] is True


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"model.path": "/m", "rollout.tensor_parallel_size": 2},
            "did you mean 'rollout.tensor_model_parallel_size'",
        ),
        ({"model.path": "/m", "rollout.max_num_seqs": "8"}, r"rollout.max_num_seqs='8': expected int"),
        ({"model.path": "/m", "rollout.enforce_eager": 1}, "expected bool"),
        ({"model.path": "/m", "rollout.max_num_seqs": True}, "expected int"),
        (
            {"model.path": "/m", "rollout.expert_parallel_size": 3, "rollout.tensor_model_parallel_size": 2},
            "expert_parallel_size=3 contradicts",
        ),
        ({"model.path": "/m", "rollout.gpu_memory_utilization": 1.5}, r"must be in \(0, 1\]"),
        ({"model.path": "/m", "rollout.data_parallel_size": 0}, "must be >= 1"),
        ({"model.path": "/m", "rollout.load_format": "tar"}, "load_format='tar': expected one of"),
        ({"rollout.max_num_seqs": 8}, "model.path is required"),
    ],
)
def test_unknown_or_contradictory_values_name_the_key(config, message):
    with pytest.raises(RolloutArgsError, match=message):
        vllm_engine_args(config)


def test_table_markdown_lists_every_key():
    text = table_markdown()
    assert all(f"`{m.key}`" in text for m in TABLE)


def test_docs_table_matches_the_code():
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "vllm.md").read_text()
    assert table_markdown() in docs, (
        "docs/vllm.md: paste weightsync.integrations.rollout_args.table_markdown()"
    )
