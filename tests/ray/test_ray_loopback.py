"""The local Ray cluster of the tests, and the Ray a run starts for itself (ray_address=None), stay on loopback:
every node's address and the GCS address are in 127.0.0.0/8 (ray #59110: Ray replaces a loopback address given to
ray.init or `ray start --address 127.0.0.1` by the host's other address)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _paths import subprocess_pythonpath

from posttrain.online.producers.ray_cluster import loopback_addresses, outside_loopback

pytestmark = [pytest.mark.ray]


def test_every_ray_address_is_loopback(ray_cluster):
    addresses = loopback_addresses()
    assert len([what for what in addresses if what.startswith("node")]) == 3
    assert outside_loopback(addresses) == {}, addresses
    assert ray_cluster.address.startswith("127.")


def test_outside_loopback_names_what_is_not_on_loopback():
    found = outside_loopback({"gcs": "127.0.0.1", "node a": "10.1.2.3", "node b": "127.0.1.1"})
    assert found == {"node a": "10.1.2.3"}


STARTED_BY_THE_RUN = """
import json, ray
from posttrain.online.producers.ray_cluster import connect, loopback_addresses
assert connect(None, 1, "rollout")
where = ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).options(resources={"rollout": 1}).remote())
print(json.dumps({**loopback_addresses(), "a task's node": where}))
ray.shutdown()
"""


def test_the_ray_a_run_starts_for_itself_is_on_loopback(ray_cluster):
    """Beside the tests' cluster, whose address RAY_ADDRESS names: ray_address=None still starts a Ray of its own."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=subprocess_pythonpath(), RAY_ADDRESS=ray_cluster.address)
    done = subprocess.run(
        [sys.executable, "-c", STARTED_BY_THE_RUN], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    addresses = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(addresses) == 3 and outside_loopback(addresses) == {}, addresses
