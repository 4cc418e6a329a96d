"""Sinks, sources and the colocated `naive` backend, all inside one process."""

import asyncio

import pytest
import torch

from weightsync import EngineConfig, HandshakeError, ModuleSink, Receiver, Sender, SinkError, TensorSpec
from weightsync.sources import IteratorSource, ModuleSource, as_source


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.body = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # one storage, two names
        self.register_buffer("steps", torch.tensor(0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_module_source_sends_tied_weights_once_and_skips_non_persistent():
    names = [s.name for s in ModuleSource(Tied()).specs()]
    assert "embed.weight" in names and "head.weight" not in names
    assert "steps" in names and "scratch" not in names


def test_wire_dtype_casts_only_multibyte_floats():
    state = {"w": torch.randn(3), "i": torch.arange(3), "f8": torch.randn(2).to(torch.float8_e5m2)}
    src = as_source(state, wire_dtype=torch.bfloat16)
    assert [s.dtype for s in src.specs()] == ["bfloat16", "int64", "float8_e5m2"]
    sent = dict(src.tensors())
    assert sent["w"].dtype == torch.bfloat16 and torch.equal(sent["w"], state["w"].to(torch.bfloat16))
    wrapped = as_source(ModuleSource(torch.nn.Linear(2, 2)), wire_dtype=torch.float16)
    assert [s.dtype for s in wrapped.specs()] == ["float16", "float16"]
    assert all(t.dtype == torch.float16 for _, t in wrapped.tensors())


def test_sink_checks_name_shape_dtype_and_reports_missing():
    model = Tied()
    sink = ModuleSink(model)
    with pytest.raises(
        SinkError, match="tensor 'body.wieght' is not in the model; closest model name: 'body.weight'"
    ):
        sink.check([TensorSpec("body.wieght", (6, 6), "float32")])
    with pytest.raises(SinkError, match=r"tensor 'body.weight': shape \(6, 5\) received, model has \(6, 6\)"):
        sink.check([TensorSpec("body.weight", (6, 5), "float32")])
    with pytest.raises(SinkError, match="tensor 'norm.bias': dtype bfloat16 received, model has float32"):
        sink.load("norm.bias", torch.zeros(6, dtype=torch.bfloat16))
    new = torch.randn(11, 6)
    sink.load("embed.weight", new)
    assert torch.equal(model.head.weight, new)  # the tie holds: written in place
    missing = sink.missing()
    assert "head.weight" not in missing and "embed.weight" not in missing
    assert set(missing) == {"body.weight", "body.bias", "norm.weight", "norm.bias", "steps"}


def test_naive_backend_hands_over_in_process_and_advances_versions():
    config = EngineConfig()
    assert config.backend == "naive"
    trainer, rollout = Tied(), Tied()
    with (
        Sender(config, "colocated-test", num_receivers=1) as sender,
        Receiver(config, "colocated-test", 0) as receiver,
    ):
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(version)
            sender.send(trainer, version=version)
            stats = receiver.load_into(rollout, version=version)
            assert receiver.version == version and stats.missing == []
            for (n, a), (_, b) in zip(trainer.state_dict().items(), rollout.state_dict().items()):
                assert torch.equal(a, b), n


def test_naive_receiver_that_finds_nothing_times_out_with_a_clear_message():
    config = EngineConfig.from_overrides(["timeout_s=0.2"])
    with Receiver(config, "nobody-sends-here", 0) as receiver:
        with pytest.raises(
            TimeoutError, match="naive backend: receiver rank 0 waited 0.2 s at 'nobody-sends-here'"
        ):
            receiver.load_into(Tied())
        assert receiver.version is None


def test_naive_failed_load_leaves_version_unchanged():
    config = EngineConfig()
    with Sender(config, "colocated-bad", 1) as sender, Receiver(config, "colocated-bad", 0) as receiver:
        sender.send({"embed.weight": torch.zeros(11, 7)}, version=1)
        # Checked before anything is written, so a clean refusal, as over a session.
        with pytest.raises(HandshakeError, match="embed.weight"):
            receiver.load_into(Tied(), version=1)
        assert (receiver.version, receiver.failed_version, receiver.torn) == (None, None, False)


def test_naive_async_api():
    config = EngineConfig()

    async def main():
        with (
            Sender(config, "colocated-async", 1) as sender,
            Receiver(config, "colocated-async", 0) as receiver,
        ):
            source = IteratorSource(iter([("a", torch.ones(2)), ("b", torch.zeros(3))]))
            await sender.send_async(source, version=7)
            got = {n: t.clone() async for n, t in receiver.receive_async(version=7)}
            return got, receiver.version

    got, version = asyncio.run(main())
    assert version == 7 and torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"], torch.zeros(3))


def test_naive_every_trainer_rank_hands_over_to_its_own_rollout():
    # Colocated: each trainer rank's process holds its own rollout, so rank 1 publishes too.
    config = EngineConfig()
    trainer, rollout = Tied(), Tied()
    with (
        Sender(config, "colocated-rank1", 1, rank=1) as sender,
        Receiver(config, "colocated-rank1", 0) as receiver,
    ):
        sender.send(trainer, version=4)
        receiver.load_into(rollout, version=4)
        assert torch.equal(rollout.body.weight, trainer.body.weight) and receiver.version == 4
