"""``weightsync estimate``: the routes it walks are the real ones, its shortcuts exact.

The prediction against measured runs is checked where the runs are made: the emulated-
cluster lines of tests/test_doc_commands.py compare every row with ``predict`` for the
same flags (``predicted.check_predicted``)."""

from pathlib import Path

import pytest

from weightsync.bench import models
from weightsync.estimate import Calibration, Cluster, flows_of, predict
from weightsync.estimate.cluster import rate
from weightsync.estimate.routes import _sharded_route, layer_unit

ROOT = Path(__file__).resolve().parent.parent


def test_rates_read_bits_and_bytes():
    assert rate("400gbit") == 400e9 and rate("1gbit") == 1e9
    assert rate("900GBps") == 900e9 * 8  # NVLink and memory are quoted in bytes
    with pytest.raises(ValueError, match="link rate"):
        rate("fast")


def test_the_layer_shortcut_gives_the_full_route_of_a_decoder():
    """Every layer of a decoder has layer 0's shapes, so its route is layer 0's: the flows
    from layer 0's route times the layers equal the route planned over every tensor."""
    specs = models.synthetic_specs("llm", 200, "bfloat16")
    outside, layer, count = layer_unit(specs)
    assert count > 1 and len(outside) + count * len(layer) == len(specs)
    cluster = Cluster.of_flags(7, 3, 2, "1gbit", tp=2)
    full, depth = _sharded_route(cluster, specs)
    assert flows_of("sharded", cluster, specs) == (full, depth)


def test_the_six_host_route_sends_each_shard_once_and_beats_the_chain():
    """The emulated cluster of BENCHMARKS.md's M x N run: each trainer NIC sends its shard,
    each receiver NIC takes its slices (measured there: 133.6-133.9 MB each), chains forward."""
    specs = models.synthetic_specs("llm", 256, "bfloat16")
    cluster = Cluster.of_flags(6, 2, 2, "1gbit", tp=2)
    sharded, nccl = predict(cluster, specs, "sharded"), predict(cluster, specs, "nccl")
    model = sum(s.nbytes for s in specs)
    sent = [sharded.nic_bytes[f"host{h}/0"]["tx"] for h in (0, 1)]
    taken = [sharded.nic_bytes[f"host{h}/0"]["rx"] for h in (2, 3, 4, 5)]
    assert abs(sum(sent) - model) < 0.01 * model
    assert all(abs(n - model / 2) < 0.01 * model for n in sent + taken), (sent, taken)
    assert nccl.nic_bytes["host0/0"]["tx"] >= model  # the whole model out of one NIC
    assert 1.7 < nccl.seconds / sharded.seconds < 2.1
    assert sharded.ceiling_s < sharded.seconds < 1.25 * sharded.ceiling_s


def test_a_cluster_file_places_ranks_and_colocated_bytes_stay_on_the_host(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "device: gpu\nbucket_mb: 256\nhosts:\n"
        "  - {name: node, count: 2, devices: 4, nics: 4, nic: 100gbit, intra: 400GBps}\n"
        "trainer: {host: node, ranks: 4}\nreplicas: {host: node, count: 2, tp: 2}\n"
    )
    cluster = Cluster.from_yaml(path)
    assert cluster.trainers == ((0, 0), (0, 1), (0, 2), (0, 3)) and cluster.receivers[0] == (0, 0)
    specs = models.synthetic_specs("llm", 200, "bfloat16")
    estimate = predict(cluster, specs, "sharded", Calibration(sync_overhead_s=0.0))
    assert estimate.intra_bytes  # trainer and receivers colocated on node0: through NVLink
    with pytest.raises(ValueError, match="do not fit"):
        Cluster.from_dict({"hosts": [{"name": "a", "devices": 2}], "trainer": {"ranks": 3}})


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "docs" / "clusters").glob("*.yaml")))
def test_every_cluster_file_of_the_docs_reads_and_predicts(name):
    """The anchors' clusters (BENCHMARKS.md), on a small model: the files stay readable."""
    cluster = Cluster.from_yaml(ROOT / "docs" / "clusters" / f"{name}.yaml")
    specs = models.synthetic_specs("llm", 4096, "bfloat16")
    for backend in ("nccl", "sharded"):
        estimate = predict(cluster, specs, backend)
        assert estimate.ceiling_s <= estimate.seconds, (backend, estimate)


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.timeout(300)
def test_predictions_hold_on_slow_links(tmp_path):
    """Measured against predicted at 250 Mbit/s (the doc lines' checks cover 1 and 4 Gbit/s,
    2 trainer hosts and tensor parallelism): a chain of 2 receivers, ``nccl`` and ``mooncake``,
    against the prediction for the same flags, which the bench row carries (the bounds:
    ``predicted.check_predicted``)."""
    import json

    from clirun import weightsync
    from predicted import check_predicted

    out = weightsync(
        "bench", "--hosts", "3", "--link", "250mbit", "--backend", "nccl,mooncake", "--size-mb", "64",
        "--repeats", "1", "--json", timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert [r["backend"] for r in rows] == ["nccl", "mooncake"]
    check_predicted(rows)
