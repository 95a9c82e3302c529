"""Asynchronous generation in a process of its own (generation_worker.py), and whether it can run here
(`placement`; the package's `make_rollout_producer` chooses between it and the background thread, thread.py).

Cores. The generation process is pinned to its own physical cores with one compute thread per core; the training
process is pinned to the others with as many threads, at most the ones it had (runtime/cores.py chooses the split
from the free cores; `posttrain env` shows it). Its affinity and thread count are restored when training ends.
With in-flight updates, the generation cores are lent to the update's forward and backward while the generation
process waits for its next request (core_lending.py; logged as async/borrowed_cores_s).

Weights. The sampler's parameters live in shared memory slots (weights/shared_memory.py): publishing a version is
one copy of the policy's parameters into a free slot, and the generation process takes it without a copy. With
in-flight updates (async_inflight_weight_updates, the default) the trainer publishes after every vllm_sync_steps
optimizer steps and the generation process takes the newest weights before each decode step, so a long round
picks up the updates made while it is sampled. Without them a round is sampled with the weights it was submitted
with, the thread's schedule, which makes a run reproducible.

Faults. When the generation process dies, it is started again with the same slots, the requests it had not
answered are sent again (their seeds make them sample the same tokens from the same weights), and the restart is
logged (a warning and async/generation_restarts). A request that raises stops training with the worker's
traceback; a process that dies again and again without answering stops it too.

Choice. With async_generation_rounds = k, async_generation_process=None (the default) takes the process for k >= 1
on a CPU machine with at least two free cores, with the transformers backend; otherwise, and for k = 0, the thread
(which k = 0 keeps bitwise equal to the synchronous run). True insists on the process (an error says why it cannot
run); False keeps the thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from multiprocessing import connection

import torch

from posttrain.models.fused_layers import unfuse_layers
from posttrain.models.reference import copy_model, freeze, unwrap
from posttrain.online.producers.base import ProducerContext, RoundsAhead
from posttrain.online.producers.core_lending import CoreLender
from posttrain.online.producers.generation_worker import Failure, Request, Result, episodes_of, serve, worker_settings
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode
from posttrain.online.weights.shared_memory import GenerationProcessDied, SharedWeights, shared_bytes
from posttrain.runtime.cores import CoreSplit, free_cores, generation_core_split, pin_process

__all__ = ["ProcessRolloutProducer", "placement"]

logger = logging.getLogger("posttrain")
MAX_RESTARTS = 3  # restarts in a row without an answer before training stops
POLL_S = 0.5  # how often a wait for an answer checks that the process lives
START_S = 120.0  # added to the answer deadline of a process just started (it imports torch, unpickles the model)


def placement(context: ProducerContext, wanted: bool | None) -> tuple[CoreSplit | None, str | None]:
    """The cores a generation process would get (None: not pinned) and why it cannot run here (None: it can).
    `wanted`: async_generation_process (True insists, so every core counts as free)."""
    args = context.args
    reason = _why_no_process(context)
    split = generation_core_split(free_cores(0) if wanted else free_cores(), args.async_generation_cores)
    if reason is None and split is None and wanted is None:
        reason = "fewer than two free cores"
    return split, reason


def weight_slots(lookahead: int) -> int:
    """Shared weight slots for `lookahead` rounds ahead: one per round that may wait for its own weights, the one
    in use and one to write into (at least 3: in use, newest, being written)."""
    return max(lookahead + 2, 3)


def _why_no_process(context: ProducerContext) -> str | None:
    """Why a generation process cannot serve the run, or None when it can."""
    args = context.args
    if args.use_vllm:
        return "use_vllm=True (the vLLM server is the generation process already)"
    if context.device.type != "cpu":
        return f"training runs on {context.device.type}, and the process split is for CPU cores"
    if args.use_transformers_continuous_batching or args.cache_implementation not in (None, "dynamic"):
        return "the generation process decodes with transformers' dynamic cache only"
    needed = shared_bytes(context.policy, weight_slots(args.async_generation_rounds))
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free < needed:
        return f"/dev/shm has less than the {needed >> 20} MiB the shared weight slots need"
    return None


class RemoteRound:
    """A round sent to the generation process; `result()` waits for its episodes."""

    def __init__(self, producer: ProcessRolloutProducer, request_id: int) -> None:
        self.producer, self.request_id = producer, request_id

    def result(self) -> tuple[list[Episode], float]:
        return self.producer.answer(self.request_id)


class ProcessRolloutProducer(RoundsAhead):
    """Generates the training rounds up to `lookahead` rounds ahead in a generation process on the cores `split`
    gives it (None: not pinned, one thread)."""

    def __init__(self, context: ProducerContext, lookahead: int, split: CoreSplit | None) -> None:
        super().__init__(context, lookahead)
        self.split, self.in_flight = split, context.args.async_inflight_weight_updates
        self.sampler_model = freeze(copy_model(unwrap(context.policy)))
        self.mp = torch.multiprocessing.get_context("spawn")
        unfuse_layers(self.sampler_model)  # its rebound forwards would not pickle
        self.weights = SharedWeights(self.sampler_model, weight_slots(self.lookahead), self.mp)
        cpus, threads = (None, 1) if split is None else (split.generation, split.generation_threads)
        self.settings = worker_settings(context, self.sampler_model, self.lookahead, self.in_flight, cpus, threads)
        self.pending: dict[int, Request] = {}  # sent and not answered, in order
        self.answers: dict[int, tuple[Request, Result]] = {}
        self.next_id = 0
        self.process = None
        self.restarts = 0  # since the last round was taken (logged then)
        self.answered = False  # whether a generation process ever answered
        self.failures_in_a_row = 0
        self._restore: tuple[set[int], int] | None = None  # the training process's affinity and threads before
        self.busy = self.mp.Value("b", 0, lock=False)  # 1 while the generation process samples
        self.lender: CoreLender | None = None  # borrows the generation cores while they idle (in-flight only)

    # -- requests and answers ----------------------------------------------------------------------------
    def _submit(self, rows: list[dict], seeds: list[int]) -> RemoteRound:
        if self.weights_due():
            self.publish(self.latest)
        slot = None if self.in_flight else self.weights.slot_of(self.version)
        prompt_ids = [row[PROMPT_IDS_COLUMN] for row in rows]
        request = Request(self.next_id, prompt_ids, self.context.args.num_generations, seeds, slot)
        self.next_id += 1
        if not self.pending:  # an idle process: the deadline of this answer counts from now
            self.progress = time.monotonic()
        self.pending[request.id] = request
        self.busy.value = 1  # raised here too, so that an update starting before the process reads it borrows nothing
        if self.process is None:
            self._start()
        else:
            self._send(request)
        return RemoteRound(self, request.id)

    def answer(self, request_id: int) -> tuple[list[Episode], float]:
        """The episodes of request `request_id`, waiting for them (and restarting a process that died)."""
        while request_id not in self.answers:
            if self.process is None:
                self._start()
            if time.monotonic() - self.progress > self.context.args.rollout_request_timeout_s:
                self._hung()
            ready = connection.wait([self.results, self.process.sentinel], timeout=POLL_S)
            if self.results in ready:
                try:
                    self._take(self.results.recv())
                    continue
                except (EOFError, OSError):  # its end is closed: it is exiting
                    self.process.join(timeout=POLL_S)
            if not self.process.is_alive():
                self._restart()
        request, result = self.answers.pop(request_id)
        return episodes_of(request, result), result.seconds

    def _take(self, message: Result | Failure) -> None:
        if isinstance(message, Failure):
            raise RuntimeError(f"The generation process failed on a round:\n{message.error}")
        request = self.pending.pop(message.id, None)
        if request is not None:  # else a round dropped meanwhile
            self.answers[message.id] = (request, message)
            self.failures_in_a_row, self.answered = 0, True
        self.progress = time.monotonic()

    def _hung(self) -> None:
        """The process lives but answered nothing for rollout_request_timeout_s: ended, then restarted below."""
        logger.warning(
            "posttrain: the generation process answered nothing for %g s (rollout_request_timeout_s); ending it.",
            self.context.args.rollout_request_timeout_s,
        )
        self.process.kill()
        self.process.join()

    def publish(self, version: int) -> None:
        """Copies the policy's weights into a free slot as `version` (restarting a dead process on the way)."""
        params = [p for _, p in unwrap(self.context.policy).named_parameters()]
        pinned = {r.slot for r in self.pending.values() if r.slot is not None}
        while True:
            try:
                self.weights.publish(params, version, pinned, alive=self._alive)
                break
            except GenerationProcessDied:
                self._restart()
        self.version = version

    def push_weights(self, version: int) -> None:
        """With in-flight updates, publishes the policy's weights every vllm_sync_steps optimizer steps while the
        process runs (else a round takes them when it is submitted)."""
        super().push_weights(version)
        if self.in_flight and self.process is not None and version - self.version >= self.sync_steps:
            self.publish(version)

    # -- the process -------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Starts the generation process, pins both processes to their cores and sends it the requests not yet
        answered."""
        requests, self._requests = self.mp.Pipe(duplex=False)
        self.results, results = self.mp.Pipe(duplex=False)
        self.busy.value = 1 if self.pending else 0  # up while requests wait (one that died sampling left it up)
        self.process = self.mp.Process(
            target=serve,
            args=(self.sampler_model, self.weights, self.settings, requests, results, self.busy),
            name="posttrain-generation",
            daemon=True,
        )
        self.process.start()
        self.progress = time.monotonic() + START_S  # the deadline of its first answer counts from its start-up
        requests.close()
        results.close()
        if self.split is not None and self._restore is None:
            self._restore = (pin_process(self.split.training), torch.get_num_threads())
            # one thread per training core, never more than the run was given (OMP_NUM_THREADS, the launcher)
            threads = min(self.split.training_threads, torch.get_num_threads())
            if self.in_flight:
                lender = CoreLender(self.split, self.busy, threads, limit=torch.get_num_threads())
                self.lender = lender if lender.useful else None  # None when the run has no thread to add
            torch.set_num_threads(threads)
        for request in self.pending.values():
            self._send(request)

    def _send(self, request: Request) -> None:
        try:
            self._requests.send(request)
        except (BrokenPipeError, OSError):  # the process died; answer() restarts it and sends this again
            pass

    def _alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def _restart(self) -> None:
        code = None if self.process is None else self.process.exitcode
        if code == 1 and not self.answered:  # an error before its first answer, e.g. the model would not unpickle
            raise RuntimeError(
                "The generation process could not start (exit code 1; its traceback is printed above). When the "
                "model cannot be sent to another process, set async_generation_process=False (a thread)."
            )
        self.failures_in_a_row += 1
        if self.failures_in_a_row > MAX_RESTARTS:
            raise RuntimeError(
                f"The generation process died {self.failures_in_a_row} times in a row without answering a round "
                f"(last exit code {code}); set async_generation_process=False to generate in a thread."
            )
        logger.warning(
            "posttrain: the generation process exited (code %s); restarting it and resending %d round(s).",
            code,
            len(self.pending),
        )
        self.restarts += 1
        self._stop_process()
        self._start()

    def record_staleness(self, episodes: list[Episode]) -> None:
        super().record_staleness(episodes)
        self.context.log_metric("async/generation_restarts", float(self.restarts))
        self.restarts = 0
        if self.lender is not None:
            self.context.log_metric("async/borrowed_cores_s", self.lender.take_lent_seconds())

    def update_phase(self, model):
        """The generation cores lent to the update while the process idles (core_lending.py, in-flight only)."""
        return self.lender.update(model) if self.lender is not None else super().update_phase(model)

    def _stop_process(self) -> None:
        """Ends the generation process and gives the weights a new table and lock: one that died holding the old
        lock must not block a restart, a resume or a publish."""
        if self.process is None:
            return
        try:
            self._requests.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for end in (self._requests, self.results):
            end.close()
        self.process = None
        self.weights.reset_table(self.mp)

    # -- checkpoints and shutdown -------------------------------------------------------------------------
    def sampler_weights(self) -> dict[str, torch.Tensor]:
        """The sampler's state dict with the parameters of the slot holding `self.version`."""
        views = self.weights.views(self.weights.slot_of(self.version))
        by_parameter = {id(p): view for p, view in zip(self.sampler_model.parameters(), views)}
        state = self.sampler_model.state_dict()
        for name, param in self.sampler_model.named_parameters(remove_duplicate=False):
            state[name] = by_parameter[id(param)]
        return state

    def _load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        names = [name for name, _ in self.sampler_model.named_parameters()]
        self.weights.publish([weights[name] for name in names], version, set())

    def close(self) -> None:
        """Drops the rounds still queued, stops the process and gives the training process its cores back."""
        self.rounds, self.pending, self.answers = {}, {}, {}
        self._stop_process()
        if self._restore is not None:
            cpus, threads = self._restore
            pin_process(cpus)
            torch.set_num_threads(threads)
            self._restore, self.lender = None, None
