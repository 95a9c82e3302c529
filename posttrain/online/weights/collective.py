"""The weight transport over a torch process group of two ranks per trainer-worker pair, the trainer rank 0, the
worker rank 1: gloo over TCP on CPU, NCCL between GPUs. The trainer's TCP store and the group bind to the address
it gives (127.0.0.1 on one machine). Nothing goes through a disk or Ray's object store.

Both backends run the same code: a push is a header (version, number of buffers, their total elements) and then
each per-dtype flat buffer, broadcast from rank 0. The only difference is where the broadcast tensors live: NCCL
sends from and receives into the GPU, so there the buffers are staged on the device (the sender's copied up, the
receiver's copied down after the push when they are CPU buffers, as a CPU generation server's slots are). The CPU
tests run every line but the backend's name and that staging.

The receiver checks the header against its own layout before it writes, so two ends built from different models
fail with the version named instead of filling the wrong bytes. Every operation waits at most `timeout_s`; a
failure raises `WeightSyncError` naming the worker and the version.

Each pair has a group of its own, separate from any group training runs (DDP, FSDP2 or ZeRO on the trainer's
ranks), so a push never interleaves with a training collective: FSDP2 shards are gathered on every rank before
rank 0 sends (transport.gathered_params). A replaced worker gets a new group (a new store port), not the dead one's.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from posttrain.online.weights.transport import WeightSyncError

__all__ = ["BACKENDS", "PairReceiver", "PairSender", "open_store", "pair_backend"]

HEADER = 3  # version, number of buffers, total elements
BACKENDS = ("gloo", "nccl")


def pair_backend(trainer_device: torch.device, worker_has_cuda: bool) -> str:
    """NCCL where both ends have a GPU (the trainer's weights are on one), else gloo."""
    return "nccl" if trainer_device.type == "cuda" and worker_has_cuda else "gloo"


def open_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The trainer's end of a new pair: a TCP store on `host`, on a free port (`store.port`)."""
    return dist.TCPStore(
        host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True
    )


def _group(store, host: str, rank: int, timeout_s: float, backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"Unknown weight transport backend {backend!r}; one of {BACKENDS}.")
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _ordered(buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    return [buffers[dtype] for dtype in sorted(buffers, key=str)]


class _Staging:
    """The buffers as the backend sends them: the given ones where they already are on its device, else copies
    there, allocated once and reused."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.copies = device, {}

    def __call__(self, buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        staged = []
        for buffer in _ordered(buffers):
            if buffer.device == self.device:
                staged.append(buffer)
                continue
            copy = self.copies.get(buffer.dtype)
            if copy is None or copy.numel() != buffer.numel():
                copy = self.copies[buffer.dtype] = torch.empty(buffer.numel(), dtype=buffer.dtype, device=self.device)
            staged.append(copy)
        return staged


class PairSender:
    """The trainer's end of one pair. Construct it while the worker constructs its `PairReceiver` with the same
    `backend` (both wait for the other, at most `timeout_s`)."""

    def __init__(self, store, host: str, worker: str, timeout_s: float, backend: str = "gloo") -> None:
        self.worker, self.timeout_s, self.backend = worker, timeout_s, backend
        self.device = _device(backend)
        self.staging = _Staging(self.device)
        try:
            self.group = _group(store, host, 0, timeout_s, backend)
        except RuntimeError as error:
            raise WeightSyncError(f"Could not connect the weight group of {worker}: {error}") from error

    def start(self, buffers: dict[torch.dtype, torch.Tensor], version: int) -> list:
        """Starts sending `version`; returns the works `wait` takes (several pairs then send at once)."""
        total = sum(b.numel() for b in buffers.values())
        header = torch.tensor([version, len(buffers), total], dtype=torch.int64, device=self.device)
        staged = self.staging(buffers)
        for target, source in zip(staged, _ordered(buffers)):
            if target is not source:
                target.copy_(source)
        try:
            return [self.group.broadcast(t, 0) for t in [header, *staged]]
        except RuntimeError as error:
            raise WeightSyncError(f"Sending weights version {version} to {self.worker} failed: {error}") from error

    def wait(self, works: list, version: int) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            for work in works:
                if not work.wait(timeout):
                    raise RuntimeError(f"no answer within {self.timeout_s:g} s")
            if self.device.type == "cuda":  # NCCL's wait orders streams; the push is done when the GPU is
                torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError as error:
            raise WeightSyncError(f"Sending weights version {version} to {self.worker} failed: {error}") from error

    def send(self, buffers: dict[torch.dtype, torch.Tensor], version: int) -> None:
        self.wait(self.start(buffers, version), version)

    def close(self) -> None:
        self.group = None


class PairReceiver:
    """The worker's end of one pair: connects to the trainer's store at `host:port`."""

    def __init__(self, host: str, port: int, worker: str, timeout_s: float, backend: str = "gloo") -> None:
        self.worker, self.timeout_s, self.backend = worker, timeout_s, backend
        self.device = _device(backend)
        self.staging = _Staging(self.device)
        store = dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
        self.group = _group(store, host, 1, timeout_s, backend)

    def receive(self, buffers: dict[torch.dtype, torch.Tensor]) -> int:
        """Receives one push into `buffers` (the layout of `flat_buffers`); returns its version."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
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
        staged = self.staging(buffers)
        try:
            for buffer in staged:
                self.group.broadcast(buffer, 0).wait(timeout)
        except RuntimeError as error:
            raise WeightSyncError(f"{self.worker} failed receiving weights version {version}: {error}") from error
        for target, source in zip(_ordered(buffers), staged):
            if target is not source:
                target.copy_(source)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return version

    def close(self) -> None:
        self.group = None
