"""The CPU weight transport: a torch gloo group of two ranks per trainer-worker pair, the trainer rank 0, the worker
rank 1, over TCP (the trainer's TCP store and gloo's sockets bind to the address it gives; 127.0.0.1 on one
machine). Nothing goes through a disk or Ray's object store.

A push is a header (version, number of buffers, their total elements) and then each per-dtype buffer, broadcast
from rank 0. The receiver checks the header against its own layout before it writes, so two ends built from
different models fail with the version named instead of filling the wrong bytes. Every operation waits at most
`timeout_s`; a failure raises `WeightSyncError` naming the worker and the version.

Each pair has a group of its own, separate from any group training runs (DDP, FSDP2 or ZeRO on the trainer's
ranks), so a push never interleaves with a training collective. A replaced worker gets a new group (a new store
port), not the dead one's.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from posttrain.online.weights.transport import WeightSyncError

__all__ = ["GlooReceiver", "GlooSender", "open_store"]

HEADER = 3  # version, number of buffers, total elements


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The trainer's end of a new pair: a TCP store on `host`, on a free port (`store.port`)."""
    return dist.TCPStore(
        host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True
    )


def _group(store, host: str, rank: int, timeout_s: float) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _header(buffers: dict[torch.dtype, torch.Tensor], version: int) -> torch.Tensor:
    return torch.tensor([version, len(buffers), sum(b.numel() for b in buffers.values())], dtype=torch.int64)


def _ordered(buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    return [buffers[dtype] for dtype in sorted(buffers, key=str)]


class GlooSender:
    """The trainer's end of one pair. Construct it while the worker constructs its `GlooReceiver` (both wait for
    the other, at most `timeout_s`)."""

    def __init__(self, store, host: str, worker: str, timeout_s: float) -> None:
        self.worker, self.timeout_s = worker, timeout_s
        try:
            self.group = _group(store, host, 0, timeout_s)
        except RuntimeError as error:
            raise WeightSyncError(f"Could not connect the weight group of {worker}: {error}") from error

    def start(self, buffers: dict[torch.dtype, torch.Tensor], version: int) -> list:
        """Starts sending `version`; returns the works `wait` takes (several pairs then send at once)."""
        try:
            return [self.group.broadcast(t, 0) for t in [_header(buffers, version), *_ordered(buffers)]]
        except RuntimeError as error:
            raise WeightSyncError(f"Sending weights version {version} to {self.worker} failed: {error}") from error

    def wait(self, works: list, version: int) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            for work in works:
                if not work.wait(timeout):
                    raise RuntimeError(f"no answer within {self.timeout_s:g} s")
        except RuntimeError as error:
            raise WeightSyncError(f"Sending weights version {version} to {self.worker} failed: {error}") from error

    def send(self, buffers: dict[torch.dtype, torch.Tensor], version: int) -> None:
        self.wait(self.start(buffers, version), version)

    def close(self) -> None:
        self.group = None


class GlooReceiver:
    """The worker's end of one pair: connects to the trainer's store at `host:port`."""

    def __init__(self, host: str, port: int, worker: str, timeout_s: float) -> None:
        self.worker, self.timeout_s = worker, timeout_s
        store = dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
        self.group = _group(store, host, 1, timeout_s)

    def receive(self, buffers: dict[torch.dtype, torch.Tensor]) -> int:
        """Receives one push into `buffers` (the layout of `flat_buffers`); returns its version."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        header = torch.empty(HEADER, dtype=torch.int64)
        try:
            self.group.broadcast(header, 0).wait(timeout)
        except RuntimeError as error:
            raise WeightSyncError(f"{self.worker} received no weights header: {error}") from error
        version, count, total = header.tolist()
        expected = (len(buffers), sum(b.numel() for b in buffers.values()))
        if (count, total) != expected:
            raise WeightSyncError(
                f"{self.worker}: weights version {version} has {count} buffers of {total} elements, but this worker's "
                f"model has {expected[0]} of {expected[1]} (the trainer and the worker were built from other models)."
            )
        try:
            for buffer in _ordered(buffers):
                self.group.broadcast(buffer, 0).wait(timeout)
        except RuntimeError as error:
            raise WeightSyncError(f"{self.worker} failed receiving weights version {version}: {error}") from error
        return version

    def close(self) -> None:
        self.group = None
