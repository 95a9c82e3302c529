"""The local Ray cluster of the tests stays on loopback: every node's address and the GCS address are in
127.0.0.0/8 (ray #59110: `ray start --address 127.0.0.1` was seen to pick the host's other address)."""

from __future__ import annotations

import pytest

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
