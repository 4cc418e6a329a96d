"""Backend ``weightsync`` across hosts: verl 0.9.1's own CheckpointEngineManager on a Ray
cluster whose nodes are the hosts of an emulated cluster (``weightsync.bench.cluster``:
network namespaces, each with its own address and a shaped NIC on one bridge). The trainer
runs on host 0, one rollout worker on each of hosts 1 and 2; the Ray driver runs on host 0
too, this process stays outside and watches the NICs, cuts and heals links (tests/verl/
ray_hosts.py). Needs root, as CI has: never skipped.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
import verl_helpers as H
from cuts import cut_mid_transfer
from ray_hosts import RayHosts
from verl.checkpoint_engine import CheckpointEngineManager

from weightsync.bench.cluster import Cluster, parse_rate

TIMEOUT_S = 15  # weightsync's deadline in the cut test; the heartbeat grace derived from it is 5 s
GRACE_S = 5
# Host 2's NIC is slow, so an update of the cut test's model (about 50 MB) takes over a
# second through it, long enough to be cut in the middle even on a busy machine.
RATES = [parse_rate("1gbit"), parse_rate("1gbit"), parse_rate("250mbit")]
# The trainer asks for a 2-CPU bundle, which only host 0 holds; each 1-CPU rollout bundle
# then takes host 1 or host 2 (verl sorts its placement groups by node IP: worker i on host i+1).
CPUS = [2, 1, 1]
BIG = {**H.SHAPES, "model.layers.0.mlp.down_proj.weight": ((24 << 10, 1024), torch.bfloat16)}  # + 48 MiB


@pytest.fixture(scope="module")
def hosts():
    with Cluster(3, RATES) as cluster, RayHosts(cluster, CPUS) as ray_hosts:
        yield ray_hosts
        ray_hosts.close()
        # every Ray process ended by Ray's own stop, before close's sweep killed what was left
        assert not any(ray_hosts.unended.values()), ray_hosts.unended
        assert not any(ray_hosts.leftovers().values()), ray_hosts.leftovers()  # and the sweep left nothing


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return H.tiny_model_dir(tmp_path_factory.mktemp("model"))


# ---------------------------------------------------------------------------- run in the driver
def start(state, transport, model_path, timeout_s=30, shapes=None):
    """verl's manager over a trainer and two rollout workers; returns where Ray put them."""
    state["reaper"] = reaper = H.Reaper()
    config = H.checkpoint_engine_config(transport, timeout_s=timeout_s)
    trainer = H.make_trainer(config, reaper.pool([1], max_colocate_count=2), shapes=shapes)
    reaper.track(trainer.workers)
    _rollout, replicas = H.make_rollout(config, model_path, reaper.pool([1, 1]))
    workers = H.replica_workers(replicas)
    reaper.track(workers)
    manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas))
    state.update(
        trainer=trainer,
        replicas=replicas,
        workers=workers,
        manager=manager,
        shapes=shapes,
        timeout_s=timeout_s,
    )
    node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return node_ip[H.nodes(trainer.workers)[0]], [node_ip[n] for n in H.nodes(workers)]


def step(state, global_steps, workers=None):
    """One update, every worker (or those of ``workers``) checked bit-exact; returns the
    manager's metrics and the workers' engine states."""
    chosen = [state["workers"][i] for i in workers] if workers is not None else state["workers"]
    metrics = H.update(state["manager"], state["trainer"], global_steps, chosen, shapes=state["shapes"])
    return metrics, H.engine_state(chosen)


def failing_step(state, global_steps):
    """An update that fails: what verl's manager raised and the trainer's send_weights outcome."""
    trainer = state["trainer"]
    trainer.train_to(global_steps)
    H.reset_last_update(trainer)
    try:
        state["manager"].update_weights(global_steps=global_steps)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    return raised, H.last_update(trainer, within_s=state["timeout_s"] + 15)


def remove(state, index):
    state["manager"].remove_replicas([state["replicas"][index]])


def add(state, index):
    state["manager"].add_replicas([state["replicas"][index]])


def stop(state):
    if "reaper" in state:
        state.pop("reaper").close()
    state.clear()


# ---------------------------------------------------------------------------- the tests
def host_of(hosts, address):
    return [h.address for h in hosts.cluster.hosts].index(address)


def crossing(hosts, global_steps, trainer_ip, model):
    """Update ``global_steps`` to both workers (bit-exact, or it raises) and check, on the
    NICs' counters, that the model crossed the links."""
    before = hosts.cluster.counters()
    metrics, states = hosts.call(step, global_steps)
    after = hosts.cluster.counters()
    # auto too: the workers are on other Ray nodes, so a transport between hosts
    assert [s["transport"] for s in states] == ["nccl", "nccl"], states
    assert {s["address"].rsplit(":", 1)[0] for s in states} == {trainer_ip}  # the trainer's host address
    sent = [a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before)]
    got = [a["rx_bytes"] - b["rx_bytes"] for a, b in zip(after, before)]
    # Each rollout host's NIC took the model in whole. Across hosts nccl chains: the
    # trainer's NIC sends it once, one rollout worker forwards it to the other (a
    # broadcast would send it from the trainer once per worker).
    assert got[1] >= model and got[2] >= model, (global_steps, got)
    assert model <= sent[0] < 1.5 * model, (global_steps, sent)
    assert max(sent[1], sent[2]) >= model, (global_steps, sent)
    return metrics


@pytest.mark.timeout(200)  # the module's Ray cluster starts in the first test's time
def test_auto_picks_a_transport_between_hosts_and_the_model_crosses_the_links_bit_exact(hosts, model_path):
    try:
        trainer_ip, rollout_ips = hosts.call(start, "auto", model_path)
        assert [host_of(hosts, trainer_ip), *[host_of(hosts, ip) for ip in rollout_ips]] == [0, 1, 2]
        for global_steps in (1, 2, 3):
            crossing(hosts, global_steps, trainer_ip, H.TOTAL_BYTES)
    finally:
        hosts.call(stop)


@pytest.mark.timeout(200)
def test_nccl_across_hosts_and_a_rollout_host_cut_mid_update_named_within_the_grace(hosts, model_path):
    """nccl bit-exact across the links; host 2 cut mid-update: the trainer's error names it
    within the heartbeat grace, the survivor takes the next update with host 2 still cut,
    and after the heal the same worker rejoins."""
    cluster = hosts.cluster
    model = H.total_bytes(BIG)
    try:
        trainer_ip, rollout_ips = hosts.call(start, "nccl", model_path, timeout_s=TIMEOUT_S, shapes=BIG)
        assert [host_of(hosts, trainer_ip), *[host_of(hosts, ip) for ip in rollout_ips]] == [0, 1, 2]
        crossing(hosts, 1, trainer_ip, model)

        try:
            # rollout worker 1 (receiver rank 1), once 8 MiB of the update streamed into host 2
            cut = cut_mid_transfer(
                cluster, 2, lambda: hosts.submit(failing_step, 2), arrived=8 << 20, total=model
            )
            raised, outcome = hosts.result(timeout=TIMEOUT_S + 60)
            assert raised is not None, "verl's manager reported a successful update"
            # Every worker's failure came from weightsync's watch (the survivor: the sender
            # dropped the sync; the cut one: its sender went silent), none from Gloo's own
            # deadline, although both had messages of the streamed sync not read yet.
            assert "Timed out waiting" not in raised, raised
            assert outcome is not None and outcome["ok"] is False, outcome
            # the heartbeats named it within their grace, far before the deadline
            assert outcome["at"] - cut < GRACE_S + 3 < TIMEOUT_S, (outcome["at"] - cut, outcome["error"])
            assert outcome["ranks"] == [1], outcome
            for part in (
                "weightsync (nccl",
                "version 2",
                "receiver rank 1 = rollout worker 1",
                rollout_ips[1],
                "went silent",
            ):
                assert part in outcome["error"], (part, outcome["error"])

            # Host 2 still cut off: without it, the next update reaches the survivor bit-exact,
            # at once: the survivor (downstream of host 2 on nccl's chain) gave version 2 up
            # when the trainer dropped it, not at its Gloo deadline (measured 6.7 s after the cut).
            hosts.call(remove, 1)
            metrics, states = hosts.call(step, 3, [0])
            assert metrics["weightsync/receivers"] == 1 and states[0]["rank"] == 0
            assert time.monotonic() - cut < GRACE_S + 6 < TIMEOUT_S  # no one waited for a deadline
        finally:
            cluster.heal(2)
        # healed: the same worker process comes back at the next update, both bit-exact
        hosts.call(add, 1)
        assert crossing(hosts, 4, trainer_ip, model)["weightsync/receivers"] == 2
    finally:
        hosts.call(stop)
