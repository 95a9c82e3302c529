"""A rollout worker as a Ray actor: today's generation server (generation_worker.py) on a rollout node, with its
weights received over the network (weights/collective.py) instead of read from the trainer's shared memory.

The actor keeps a few weight slots of its own (a `SharedWeights` local to its process), so that the server points
its parameters at a slot without a copy, exactly as in the generation process: a request names the version it
must be sampled with, or, with in-flight updates, the oldest it may start with (then the newest received is taken
before every decode step, and every token records its version). A push is received into a slot that is neither in
use, nor the newest, nor named by a request not yet answered.

Methods run in two lanes: "generate" (one request at a time, in the order sent) and "weights" (a push), so a push
lands while a round is sampled; the default lane answers the trainer's questions (where it runs, its weights'
hashes) at any time.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import ray
import torch

from posttrain.online.producers.generation_worker import GenerationServer, Request, Result, WorkerSettings
from posttrain.online.weights.collective import PairReceiver
from posttrain.online.weights.shared_memory import NEWEST, USING, VERSIONS, SharedWeights
from posttrain.online.weights.transport import WeightSyncError, buffer_hashes

__all__ = ["RolloutActor", "rollout_actor_class"]

LANES = {"generate": 1, "weights": 1}


class RolloutActor:
    """Samples requests with `model` (its weights replaced by every push) under `settings`, keeping `num_slots`
    versions. `name` appears in every error it raises. `vllm`: the options of a vLLM engine to sample with
    (ray_vllm.py) instead of the transformers loop."""

    def __init__(self, model, settings: WorkerSettings, num_slots: int, name: str, vllm: dict | None = None) -> None:
        torch.set_num_threads(settings.threads)
        self.name = name
        self.weights = SharedWeights(model, num_slots, multiprocessing.get_context("spawn"))
        if vllm is None:
            self.server = GenerationServer(model, self.weights, settings)
        else:
            from posttrain.online.producers.ray_vllm import VLLMGenerationServer

            self.server = VLLMGenerationServer(model, self.weights, settings, vllm)
        self.in_flight = settings.in_flight
        self.receiver: PairReceiver | None = None
        self.arrived = threading.Condition()

    def where(self) -> dict:
        """The node, address and process this actor runs in, and whether Ray restarted it."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "restarted": context.was_current_actor_reconstructed,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
        }

    def connect(self, host: str, port: int, timeout_s: float, backend: str = "gloo") -> None:
        """Joins the trainer's weight group at `host:port` (the trainer joins at the same time), over `backend`
        (gloo, or NCCL where both have a GPU)."""
        self.receiver = PairReceiver(host, port, self.name, timeout_s, backend)

    @ray.method(concurrency_group="weights")
    def receive(self, pinned: list[int]) -> int:
        """Receives one push into a free slot and makes it the newest; returns its version. `pinned`: versions
        that requests not yet answered name (their slots are kept)."""
        if self.receiver is None:
            raise WeightSyncError(f"{self.name} has no weight group (connect() first).")
        table, lock = self.weights.table, self.weights.lock
        with lock:
            busy = {table[USING], table[NEWEST]} | {self.weights.slot_of(v) for v in pinned}
            free = [slot for slot in range(self.weights.num_slots) if slot not in busy]
            if not free:
                raise WeightSyncError(f"{self.name}: no free weight slot ({self.weights.num_slots}, busy {busy}).")
            slot = min(free, key=self.weights.version)
            table[VERSIONS + slot] = -1
        version = self.receiver.receive(self.weights.buffers[slot])
        with lock:
            table[VERSIONS + slot] = version
            table[NEWEST] = slot
        with self.arrived:
            self.arrived.notify_all()
        return version

    @ray.method(concurrency_group="generate")
    def generate(self, request: Request, version: int, timeout_s: float) -> Result:
        """Samples `request` with weights `version` (in-flight: `version` or newer, then the newest each step)."""
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while not self._holds(version):
                if not self.arrived.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise WeightSyncError(f"{self.name} never received weights version {version} for a round.")
        request.slot = None if self.in_flight else self.weights.slot_of(version)
        return self.server.generate(request)

    def _holds(self, version: int) -> bool:
        if self.weights.slot_of(version) is not None:
            return True
        newest = self.weights.table[NEWEST]
        return self.in_flight and newest >= 0 and self.weights.version(newest) >= version

    @ray.method(concurrency_group="generate")
    def pause(self, seconds: float) -> None:
        """Holds the generation lane for `seconds`: an actor alive but silent (tests and benchmarks of the
        trainer's deadline)."""
        time.sleep(seconds)

    def hashes(self, version: int) -> dict[str, str]:
        """sha256 of each flat buffer of `version` (the trainer compares them with its own)."""
        return buffer_hashes(self.weights.buffers[self._slot(version)])

    def buffers(self, version: int) -> dict[str, torch.Tensor]:
        """A copy of the flat buffers of `version` (through Ray's object store: a test's oracle only)."""
        return {str(dtype): buffer.clone() for dtype, buffer in self.weights.buffers[self._slot(version)].items()}

    def _slot(self, version: int) -> int:
        slot = self.weights.slot_of(version)
        if slot is None:
            raise KeyError(f"{self.name} holds no weights version {version}.")
        return slot


def rollout_actor_class(**options):
    """`RolloutActor` as a Ray actor class with its lanes, and `options` (resources, restarts, ...)."""
    return ray.remote(concurrency_groups=LANES, max_concurrency=2)(RolloutActor).options(**options)
