"""``weightsync estimate``: the routes it walks are the real ones, its shortcuts exact.

The prediction against measured runs is checked where the runs are made: the emulated-
cluster lines of tests/test_doc_commands.py compare every row with ``predict`` for the
same flags (``predicted.check_predicted``). The figures BENCHMARKS.md gives for the estimate (the
anchors, the measured-against-predicted table) are recomputed here from its tables: a
regression check of the document, which shares the estimate's routes and fitted costs."""

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


def _table(title_start: str, header_start: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first table under the BENCHMARKS.md heading that
    starts with ``title_start``, whose header row starts with ``header_start``."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text[text.index("\n" + title_start) :]
    lines = section[section.index("\n" + header_start) + 1 :].splitlines()
    rows = []
    for line in lines[2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _estimate(tmp_path, *flags: str) -> dict[str, dict]:
    """``weightsync estimate FLAGS --json`` as a user runs it, with the documented default
    costs (a calibration file that does not exist): its rows by backend."""
    import json

    from clirun import weightsync

    out = weightsync(
        "estimate", *flags, "--json", "--calibration", str(tmp_path / "absent.json"), timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["backend"]: r for r in json.loads(out.stdout)}


def test_the_anchors_predictions_in_benchmarks_md_are_what_estimate_says(tmp_path):
    """BENCHMARKS.md's anchors table: each row's cluster file and size, run through
    ``weightsync estimate``, give the predicted seconds written there (to its 2 decimals)
    and the model's bytes. A regression check: it holds the document to the estimate, it
    does not show the estimate right at that scale."""
    import re

    rows = _table("## `weightsync estimate` at the anchors' scale", "| published result |")
    assert len(rows) == 4, rows
    for cells in rows:
        (cluster,) = re.findall(r"`([\w.-]+\.yaml)`", cells[2])
        (size_gb,) = re.findall(r"`--size-gb ([\d.]+)`", cells[2])
        (model,) = re.findall(r"([\d.]+) (TB|GB)", cells[2])
        got = _estimate(
            tmp_path,
            "--cluster",
            f"docs/clusters/{cluster}",
            "--size-gb",
            size_gb,
            "--backend",
            "nccl,sharded",
        )
        for backend, cell in (("nccl", cells[3]), ("sharded", cells[4])):
            (written,) = re.findall(r"^([\d.]+) s", cell)
            assert f"{got[backend]['seconds']:.2f}" == written, (cluster, backend, got[backend], cell)
        scale = 1e12 if model[1] == "TB" else 1e9
        digits = len(model[0].partition(".")[2])
        assert f"{got['nccl']['bytes'] / scale:.{digits}f}" == model[0], (
            cluster,
            got["nccl"]["bytes"],
            cells[2],
        )


def test_the_predicted_column_of_measured_against_predicted_is_what_estimate_says(tmp_path):
    """BENCHMARKS.md's measured-against-predicted table: each row's flags ("same": the row
    above's; "the same at ...": those, changed) through ``weightsync estimate`` give its
    predicted seconds (3 decimals), and its ratio is predicted over measured. ``--set``
    (the bench's engine settings, such as Mooncake links) does not change the route the
    estimate walks: dropped."""
    import re

    rows = _table("### `weightsync estimate` against measured runs", "| cluster (`weightsync bench ...`) |")
    assert len(rows) >= 12, rows
    flags: dict[str, str] = {}
    runs: dict[tuple[str, ...], list[list[str]]] = {}  # one estimate per cluster, every backend
    for cells in rows:
        given = re.findall(r"(--[\w-]+) ([^\s`]+)", " ".join(re.findall(r"`([^`]*)`", cells[0])))
        if cells[0] == "same":
            pass
        elif cells[0].startswith("the same"):
            flags = {**flags, **dict(given)}
        else:
            flags = dict(given)
        runs.setdefault(tuple(x for k, v in flags.items() if k != "--set" for x in (k, v)), []).append(cells)
    for argv, cells_of in runs.items():
        backends = sorted({c[1].strip("`") for c in cells_of})
        got = _estimate(tmp_path, *argv, "--backend", ",".join(backends))
        for cells in cells_of:
            seconds = got[cells[1].strip("`")]["seconds"]
            measured, predicted, ratio = (float(c) for c in cells[2:5])
            # written to 3 decimals from the bench's 4 (1.3645 reads 1.364 or 1.365)
            assert abs(seconds - predicted) <= 0.0006, (cells, argv, seconds)
            assert abs(predicted / measured - ratio) <= 0.0051, cells
