"""Backend ``weightsync`` across Ray nodes: a ``ray.cluster_utils.Cluster`` of three nodes on
this host (all on loopback, so every node has the IP 127.0.0.1: "same node" can only be
told by Ray node id). The trainer runs on the head node, the rollout workers one per node.
"""

from __future__ import annotations

import pytest
import ray
import verl_helpers as H
from ray.cluster_utils import Cluster
from verl.checkpoint_engine import CheckpointEngineManager

import weightsync.integrations.verl  # noqa: F401  (registers backend "weightsync" in the driver too)


@pytest.fixture(scope="module")
def cluster():
    # Capacity places the workers: the trainer asks for a 2-CPU bundle, which only the head
    # node (3 CPUs) holds; the three 1-CPU rollout bundles then take one CPU on every node.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return H.tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def reaper(cluster):
    r = H.Reaper()
    yield r
    r.close()


@pytest.mark.timeout(300)
# auto picks nccl across nodes (asserted below) and shm once only local replicas remain: a
# superset of transport=nccl here, which test_verl_manager and test_verl_hosts run as well
@pytest.mark.parametrize("transport", ["auto"])
def test_trainer_on_one_node_rollout_spread_over_nodes(transport, cluster, model_path, reaper):
    config = H.checkpoint_engine_config(transport)
    trainer = H.make_trainer(config, reaper.pool([1], max_colocate_count=2))
    reaper.track(trainer.workers)
    _rollout, replicas = H.make_rollout(config, model_path, reaper.pool([1, 1, 1]))
    workers = H.replica_workers(replicas)
    reaper.track(workers)

    # where Ray put them, as Ray reports it
    trainer_node = H.nodes(trainer.workers)[0]
    rollout_nodes = H.nodes(workers)
    assert trainer_node == cluster.head_node.node_id
    assert len(set(rollout_nodes)) == 3 and trainer_node in rollout_nodes, rollout_nodes
    node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}

    manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=list(replicas))
    for step in (1, 2, 3):
        H.update(manager, trainer, step, workers)
    states = H.engine_state(workers)
    assert {s["transport"] for s in states} == {"nccl"}  # auto: workers on other nodes -> nccl
    address = ray.get(trainer.execute_checkpoint_engine(["describe"]))[0]["address"]
    assert address.rsplit(":", 1)[0] == node_ip[trainer_node]  # advertised: the node IP Ray reports
    assert {s["address"] for s in states} == {address}

    if transport == "auto":  # the topology decides at every update
        local = [r for r, node in zip(replicas, rollout_nodes) if node == trainer_node]
        away = [r for r, node in zip(replicas, rollout_nodes) if node != trainer_node]
        manager.remove_replicas(away)
        H.update(manager, trainer, 4, H.replica_workers(local))
        assert [s["transport"] for s in H.engine_state(H.replica_workers(local))] == ["shm"]
        manager.add_replicas(away)
        H.update(manager, trainer, 5, workers)
        assert {s["transport"] for s in H.engine_state(workers)} == {"nccl"}
