"""A Ray cluster on this machine for the `ray` tests, all of it on loopback: a head node (the trainer's, no rollout
resource) and two 1-CPU nodes that offer the custom resource `rollout`, every process bound to 127.0.0.1, with
no dashboard, no usage report, no runtime-environment downloads and a small object store per node. Actors set their
own thread count (Ray gives an actor without num_cpus OMP_NUM_THREADS=1), so the threads are set here explicitly."""

from __future__ import annotations

import os

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import ray  # the `ray` extra: pip install 'posttrain[ray]'
from ray.cluster_utils import Cluster

from posttrain.online.producers.ray_cluster import connect

LOOPBACK = "127.0.0.1"
OBJECT_STORE = 80 << 20  # per node; Ray's minimum is 75 MiB
NODE = dict(num_cpus=1, object_store_memory=OBJECT_STORE, node_ip_address=LOOPBACK)


def rollout_node(cluster: Cluster):
    return cluster.add_node(resources={"rollout": 1}, **NODE)


@pytest.fixture(scope="session")
def ray_cluster():
    """The cluster, with this test process connected as its driver (the trainer)."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **NODE))
    nodes = [rollout_node(cluster) for _ in range(2)]
    cluster.wait_for_nodes()
    connect(cluster.address, 0, "rollout")
    cluster.rollout_nodes = nodes
    cluster.add_rollout_node = lambda: rollout_node(cluster)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


# Rounds name their weights (no in-flight updates): a run with actors lost, or stopped and resumed, must end as
# an uninterrupted one.
FAULTY = dict(max_steps=4, async_generation_rounds=2, vllm_sync_steps=2, async_inflight_weight_updates=False)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, tiny_model_path):
    """The run the faulty and resumed ones must equal: the generation process, nothing killed (its threads as
    same_threads)."""
    from test_producers_process import PROCESS, same_threads
    from test_producers_thread import grpo

    with pytest.MonkeyPatch.context() as monkeypatch:
        same_threads.__wrapped__(monkeypatch)
        plain = grpo(tiny_model_path, tmp_path_factory.mktemp("plain"), **FAULTY, **PROCESS)
        plain.train()
    return plain


@pytest.fixture
def faulty_settings() -> dict:
    """The settings of `uninterrupted`, for the runs that must equal it."""
    return dict(FAULTY)
