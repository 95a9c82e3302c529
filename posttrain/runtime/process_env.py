"""Process-group rendezvous variables, and running a block on the main processes first (caches written once)."""

from __future__ import annotations

import contextlib
import os
import socket


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_master_addr_port(addr: str | None = None, port: int | None = None) -> None:
    """Sets MASTER_ADDR (to `addr`, else localhost) and MASTER_PORT (to `port`, else a free local port) where they
    are unset; a MASTER_PORT of "0" or "auto" is replaced by a free port. Values already set are kept."""
    os.environ.setdefault("MASTER_ADDR", addr or "localhost")
    current = os.environ.get("MASTER_PORT", "").strip().lower()
    if current in ("", "0", "auto"):
        os.environ["MASTER_PORT"] = str(port if port is not None and current == "" else _free_port())


@contextlib.contextmanager
def global_then_local_main_first():
    """The block runs on the global main process first, then on each node's local main, then everywhere else:
    work that fills a cache is done once per shared cache and once per node-local one."""
    from accelerate import PartialState

    state = PartialState()
    with state.main_process_first(), state.local_main_process_first():
        yield


__all__ = ["ensure_master_addr_port", "global_then_local_main_first"]
