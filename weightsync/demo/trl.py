"""``weightsync demo --trainer trl``: TRL's GRPOTrainer with a vLLM replica synced by weightsync.

A tiny Qwen2-shaped model and a word-level tokenizer are built here (nothing downloaded);
the replica is a vLLM engine (CPU build) started on the saved model with the weightsync
worker extension. ``WeightsyncGRPOTrainer`` runs a few GRPO steps; the toy reward is the
share of completion words from a target set, which a few steps raise. As every step ends
the replica serves version = step, and the check compares its weights with the trainer's
(digests of every tensor the engine keeps readable, in its layout: q/k/v and gate/up
fused as vLLM holds them) and its prompt logprobs with the trainer's own (the linear
matrices, which vLLM's CPU build packs out of reach, decide them). Each step's reward, sync seconds and
check are printed.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.demo.plain import DemoFailed

VOCAB = 512
PAD, EOS = 0, 1
#: the words the toy reward pays for: 64 of the 509 plain ones (one in eight at random)
TARGET = frozenset(f"w{i}" for i in range(3, 3 + 64))
#: prompts of the toy dataset (words, as the tokenizer splits them)
DATASET_PROMPTS = [" ".join(f"w{(7 * i + 13 * j) % 500 + 100}" for j in range(4)) for i in range(16)]
#: token-id prompts whose logprobs the replica and the trainer must agree on
PARITY_PROMPTS: list[list[int]] = [[100 + 7 * i for i in range(12)], [200 + 5 * i for i in range(12)]]


@dataclass
class TRLDemoOptions:
    steps: int = 6
    overrides: tuple[str, ...] = ("backend=nccl",)
    seed: int = 0
    learning_rate: float = 5e-2
    #: completions per prompt (GRPO's group), and prompts per step
    generations: int = 8
    prompts_per_step: int = 4
    new_tokens: int = 8


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over ``w0 .. w{VOCAB-1}`` (w0 is padding, w1 end of sequence),
    built in memory: GRPOTrainer tokenizes its prompts and decodes completions with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w1", unk_token="w2")


def target_reward(completions: list[str], **_: Any) -> list[float]:
    """The share of each completion's words that are in ``TARGET``."""
    out = []
    for c in completions:
        words = c.split()
        out.append(sum(w in TARGET for w in words) / max(len(words), 1))
    return out


def fused_digests(model: torch.nn.Module) -> dict[str, str]:
    """Digests of a Qwen2-shaped Hugging Face model's tensors in the layout vLLM's Qwen2
    holds them: q/k/v projections stacked into ``qkv_proj``, gate and up into
    ``gate_up_proj``, everything else by its own name (what a replica's
    ``weightsync_digests`` returns when it serves these weights)."""
    from weightsync.verify import named_digests

    state = {k: v.detach() for k, v in model.state_dict().items()}
    fused: dict[str, torch.Tensor] = {}
    for name in list(state):
        for parts, into in (
            (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            if f".{parts[0]}." in name:
                names = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts]
                fused[name.replace(f".{parts[0]}.", f".{into}.")] = torch.cat([state.pop(n) for n in names])
    return named_digests({**state, **fused}.items())


def replica_digests(llm: Any) -> dict[str, str]:
    return llm.collective_rpc("weightsync_digests")[0]


def compare_digests(llm: Any, model: torch.nn.Module) -> tuple[int, list[str]]:
    """``(tensors compared, names that differ)`` between ``model`` and the weights ``llm``
    serves, by digest. vLLM's CPU build packs each linear layer's matrix into a oneDNN
    handle and leaves an empty tensor in the state dict: those (q/k/v, o, gate/up, down) are
    not readable there and are left out (prompt logprobs cover them); every other tensor
    (embedding, norms, biases, lm_head) is compared, and one the engine lacks differs."""
    want, held = fused_digests(model), replica_digests(llm)
    packed = {k for k in want if k in held and held[k].split("|")[1] == "(0,)"}
    compared = [k for k in want if k not in packed]
    return len(compared), sorted(k for k in compared if want[k] != held.get(k))


#: how far the replica's prompt logprobs may be from the trainer's: float32 on both sides,
#: the engine's oneDNN matmuls against torch's (seen here: under 1e-5; one GRPO step moves
#: them by 1e-2 and more)
LOGPROB_TOLERANCE = 1e-4


def prompt_logprobs(llm: Any, model: torch.nn.Module) -> tuple[list[float], list[float]]:
    """The logprob of every token of ``PARITY_PROMPTS`` after the first, as the replica
    computes it and as the trainer's model does."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PARITY_PROMPTS], params, use_tqdm=False)
    served = [
        d[t].logprob for o, p in zip(outs, PARITY_PROMPTS) for d, t in zip(o.prompt_logprobs[1:], p[1:])
    ]
    # A fresh float32 copy: under GRPOConfig's bf16 default (on CPU too) Accelerate wraps
    # the trainer's own forward in bfloat16 autocast (2.6e-3 off the engine's float32 here)
    reference = type(model)(model.config).to(torch.float32)
    reference.load_state_dict(model.state_dict())
    reference.eval()
    own = []
    with torch.no_grad():
        for p in PARITY_PROMPTS:
            logits = reference(input_ids=torch.tensor([p])).logits[0, :-1].float()
            own += logits.log_softmax(-1).gather(1, torch.tensor(p[1:]).view(-1, 1)).view(-1).tolist()
    return served, own


def logprob_gap(llm: Any, model: torch.nn.Module) -> float:
    """The largest difference between the replica's and the trainer's prompt logprobs."""
    served, own = prompt_logprobs(llm, model)
    return max(abs(a - b) for a, b in zip(served, own))


def check_replica(llm: Any, model: torch.nn.Module) -> str | None:
    """None when ``llm`` holds ``model``'s weights: the digest of every tensor it keeps
    readable, and its prompt logprobs within ``LOGPROB_TOLERANCE`` of the trainer's (which
    the packed matrices decide); else what differs."""
    _, differ = compare_digests(llm, model)
    if differ:
        return f"{len(differ)} tensor(s) differ from the trainer's: {differ[:4]}"
    gap = logprob_gap(llm, model)
    if gap > LOGPROB_TOLERANCE:
        return f"prompt logprobs {gap:.2e} from the trainer's (tolerance {LOGPROB_TOLERANCE:.0e})"
    return None


def grpo_config(out_dir: str, opts: TRLDemoOptions) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=opts.steps,
        learning_rate=opts.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=opts.generations * opts.prompts_per_step,
        num_generations=opts.generations,
        max_completion_length=opts.new_tokens,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=opts.seed,
        disable_tqdm=True,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
    )


def build(tmp: str, opts: TRLDemoOptions, replica_names: tuple[str, ...] = ("r0",)) -> dict[str, Any]:
    """The tiny model saved under ``tmp``, the trainer's copy, the tokenizer, the dataset
    and one started vLLM engine per name (not yet in a rollout)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from weightsync.demo.vllm import save_tiny_model, start_replica, vllm_environment

    vllm_environment()
    model_dir = save_tiny_model(
        os.path.join(tmp, "model"),
        seed=opts.seed,
        vocab_size=VOCAB,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llms = {name: start_replica(model_dir, max_model_len=128, seed=opts.seed) for name in replica_names}
    dataset = Dataset.from_dict({"prompt": DATASET_PROMPTS})
    return {"dir": model_dir, "model": model, "tokenizer": tokenizer, "llms": llms, "dataset": dataset}


def run_trl_demo(opts: TRLDemoOptions) -> None:
    """Run the demo; print a line per step and ``demo OK``; raise ``DemoFailed`` on a
    replica that does not hold the trainer's weights after a step."""
    from transformers import PrinterCallback, TrainerCallback

    from weightsync.integrations.trl import WeightsyncGRPOTrainer, check_versions
    from weightsync.integrations.vllm_replicas import LLMReplica
    from weightsync.integrations.vllm_rollout import VLLMRollout

    check_versions()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with tempfile.TemporaryDirectory(prefix="weightsync-trl-") as tmp:
        t0 = time.perf_counter()
        parts = build(tmp, opts)
        ((name, llm),) = parts["llms"].items()
        print(f"vLLM replica {name!r} started in {time.perf_counter() - t0:.1f} s")
        rollout = VLLMRollout([LLMReplica(llm, name)], list(opts.overrides), model=parts["model"])
        rewards: list[float] = []
        problems: list[str] = []

        checked: dict[int, str] = {}

        class Check(TrainerCallback):
            """After each step's sync (the trainer's own callback runs first): the replica
            against the trainer; the line is printed when TRL logs the step's reward."""

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                gen = trainer.vllm_generation
                sync = gen.syncs[-1]
                served = sync.report.replicas[0].version
                problem = check_replica(llm, trainer.model)
                if served != state.global_step:
                    problem = f"replica serves version {served}, step {state.global_step}"
                if problem is not None:
                    problems.append(f"step {state.global_step}: {problem}")
                checked[state.global_step] = (
                    f"sync {sync.seconds * 1000:.0f} ms, replica on version {served} "
                    f"{'== trainer (digests, logprobs)' if problem is None else 'DIFFERS: ' + problem}; "
                    f"this step's completions sampled by version(s) {sorted(gen.last_versions, key=str)}"
                )

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
                if logs and "reward" in logs and state.global_step in checked:
                    rewards.append(float(logs["reward"]))
                    print(
                        f"step {state.global_step}: reward {logs['reward']:.3f}  {checked[state.global_step]}"
                    )

        try:
            trainer = WeightsyncGRPOTrainer(
                model=parts["model"],
                reward_funcs=target_reward,
                args=grpo_config(os.path.join(tmp, "out"), opts),
                train_dataset=parts["dataset"],
                processing_class=parts["tokenizer"],
                rollout=rollout,
            )
            # the step lines below say what TRL's own printer would (its whole log dict)
            trainer.remove_callback(PrinterCallback)
            trainer.add_callback(Check())
            trainer.train()
        finally:
            rollout.close()
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
        if problems:
            raise DemoFailed("; ".join(problems))
        if len(rewards) != opts.steps:
            raise DemoFailed(f"{len(rewards)} of {opts.steps} steps checked")
        print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {opts.steps} steps")
        print(
            f"demo OK: {len(trainer.syncs)} updates to 1 vLLM replicas (versions 0..{opts.steps}), "
            "each checked against the trainer"
        )
