"""Joining (or starting) the Ray cluster of rollout actors, with the settings that keep a single machine's Ray on
loopback and silent: every process bound to 127.0.0.1, no dashboard, no usage report (Ray otherwise sends one to
the internet), no runtime-environment downloads."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import threading

import ray

__all__ = ["LOOPBACK", "QUIET_ENV", "connect", "loopback_addresses", "trainer_address"]

LOOPBACK = "127.0.0.1"
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
MIN_OBJECT_STORE = 96 << 20  # Ray refuses less than 75 MiB


def connect(address: str | None, num_actors: int, resource: str) -> bool:
    """Joins the cluster at `address` ('auto', 'IP:6379'), or with None starts one on this machine, on 127.0.0.1,
    offering `num_actors` units of `resource` (whatever RAY_ADDRESS says). Returns whether it started one (which
    `ray.shutdown` then ends)."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if ray.is_initialized():
        return False
    if address is not None:
        _join(address)
        return False
    with _loopback_kept():
        _init(
            address="local",  # a new Ray, even where RAY_ADDRESS names another (which ray.init would join)
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            num_cpus=num_actors,
            resources={resource: num_actors},
            object_store_memory=MIN_OBJECT_STORE,
            log_to_driver=True,
        )
    return True


@contextlib.contextmanager
def _loopback_kept():
    """ray #59110: ray.init replaces a loopback `_node_ip_address` (to start a node, or to join one) by the host's
    outward address unless it believes multi-node clusters are off; a cluster started so is then bound to that
    address, and one bound to 127.0.0.1 is not reached."""
    constants = ray._private.ray_constants
    saved, constants.ENABLE_RAY_CLUSTER = constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = saved


def _init(**options) -> None:
    """`ray.init`, keeping this process's SIGTERM handler: ray.init puts in its own, which exits at once (and,
    where it starts the head here, after killing the cluster), so the trainer's checkpoint on SIGTERM
    (checkpoint_on_signal) would never be written. The trainer's `close` ends the Ray it started instead."""
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**options)
    finally:
        if saved is not None:
            signal.signal(signal.SIGTERM, saved)


def _join(address: str) -> None:
    host = address.rpartition(":")[0] if ":" in address else address
    if host not in ("localhost", "127.0.0.1"):
        _init(address=address, log_to_driver=True)
        return
    with _loopback_kept():
        _init(address=address, _node_ip_address=LOOPBACK, log_to_driver=True)


def trainer_address() -> str:
    """The address the actors reach the trainer's weight groups at: this node's address in the cluster."""
    return ray.util.get_node_ip_address()


def loopback_addresses() -> dict[str, str]:
    """Every address the running cluster uses (the GCS, each node's), by what uses it; the ones outside
    127.0.0.0/8 are the ones a single-machine run must not have."""
    found = {"gcs": ray.get_runtime_context().gcs_address.rpartition(":")[0]}
    for node in ray.nodes():
        found[f"node {node['NodeID'][:8]}"] = node["NodeManagerAddress"]
    return found


def outside_loopback(addresses: dict[str, str]) -> dict[str, str]:
    return {what: host for what, host in addresses.items() if not ipaddress.ip_address(host).is_loopback}
