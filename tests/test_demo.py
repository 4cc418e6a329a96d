"""The `weightsync demo` command beyond the README's demo lines (tests/test_doc_commands.py
runs those, the point-to-point and disk backends on conftest.py's tied_llama_dir in many
small buckets): a bad backend fails loudly, a flag without what it needs is refused."""

import json
import multiprocessing as mp
import time

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


@pytest.mark.vllm
def test_the_lora_demo_takes_a_bf16_checkpoint_whose_base_the_float32_trainer_holds_exactly(tmp_path):
    """A tiny tied Llama saved in bf16: the demo's trainer holds it in float32 (the same
    values: bf16 -> float32 is exact), the replica loaded the bf16 files; the base check
    compares values, not bytes, so the LoRA updates go through with greedy parity."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    out = run_demo(
        "--rollout", "vllm", "--lora-rank", "4", "--model", str(tmp_path), "--receivers", "1", "--steps", "1"
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "demo OK: 1 updates to 1 vLLM replicas, LoRA adapter only" in out.stdout, out.stdout
    assert "greedy parity with the trainer" in out.stdout


def _waits(conn):  # a trainer rank waiting its handshake deadline for a peer that died
    time.sleep(60)


def _dies(conn):  # a rollout rank failing before it connects, without a report
    raise SystemExit(3)


def _reports_an_error(conn):
    conn.send_bytes(json.dumps({"rank": 1, "error": "RuntimeError: no engine"}).encode())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("target", "said"), [(_dies, "exited with code 3"), (_reports_an_error, "no engine")]
)
def test_a_demo_process_failing_ends_the_wait_at_once_while_an_earlier_one_still_waits(target, said):
    """The demos read every process's report at once: one that dies or reports an error is
    named at once, not after the deadline of a rank listed before it that waits on it."""
    from weightsync.demo.plain import DemoFailed, read_reports

    ctx = mp.get_context("spawn")
    named = []
    for who, body in (("trainer rank 0", _waits), ("rollout rank 1", target)):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=body, args=(child,), daemon=True)
        proc.start()
        child.close()
        named.append((who, proc, parent))
    t0 = time.monotonic()
    try:
        with pytest.raises(DemoFailed, match=f"rollout rank 1.*{said}"):
            read_reports(named, timeout_s=45)
        assert time.monotonic() - t0 < 20
    finally:
        for _, proc, _ in named:
            proc.kill()
            proc.join()
