"""The generation process of asynchronous generation (process.py starts it): the transformers sampler in a
process of its own, pinned to its own cores with its own thread count, so that sampling and training run at once
without sharing a core or the Python interpreter.

It answers `Request`s in order. Its parameters are views of the shared weight slots (weights/shared_memory.py): a
request names the slot to sample with, or none, and then the process takes the newest weights at the start and, with
in-flight updates, again before every decode step, without draining its batch. Each token records the version
(optimizer step) of the weights that gave its logits. The sampler's log-probs come with the completions: the
decode loop's own, each token's under the weights that sampled it; or, with `exact_logps` (k = 0) and one version
for the whole request, computed as the trainer computes its own (the same forward, temperature and micro-batches),
so that with unchanged weights they agree exactly and the correction is exactly 1. That forward costs about as much
as the sampling, so rounds that are stale anyway (k >= 1) skip it.

Precision. With the trainer's bf16 / fp16 mixed precision the server runs its model's forward under the same
autocast (`WorkerSettings.autocast_dtype`), so its tokens and log-probs are the trainer's. The weights cross the
process boundary (the shared slots, a Ray actor's pushes) as the float32 master weights: autocast changes only
the compute, and casting them to bf16 on the way would change the numbers. A vLLM actor (ray_vllm.py) samples
in vLLM's own dtype, but its exact_logps forward runs under the same autocast.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from posttrain.data.batches import pad_rows
from posttrain.generation import Completion, SamplingParams, TransformersBackend, stop_token_ids
from posttrain.online.logps import completion_logps
from posttrain.online.producers.base import autocast_forward
from posttrain.online.rollout import Episode
from posttrain.online.weights.shared_memory import SharedWeights
from posttrain.runtime.cores import pin_process

__all__ = ["Failure", "GenerationServer", "Request", "Result", "WorkerSettings", "serve"]


@dataclass(frozen=True)
class WorkerSettings:
    pad_token_id: int
    stop_ids: tuple[int, ...]
    sampling: SamplingParams
    logps_temperature: float
    micro_batch_size: int
    pad_multiple: int | None
    in_flight: bool  # take newer weights before each decode step
    exact_logps: bool  # the sampler's log-probs by the trainer's forward where one version sampled a request
    cpus: tuple[int, ...] | None  # None: not pinned
    threads: int
    autocast_dtype: torch.dtype | None = None  # the trainer's autocast (ProducerContext), over float32 weights


def worker_settings(context, sampler_model, lookahead: int, in_flight: bool, cpus, threads: int) -> WorkerSettings:
    """The settings a generation server (the process's or a Ray actor's) samples with, from the producer's
    context (ProducerContext) and its frozen copy of the policy."""
    tokenizer = context.tokenizer
    return WorkerSettings(
        pad_token_id=tokenizer.pad_token_id,
        stop_ids=tuple(stop_token_ids(tokenizer, sampler_model)),
        sampling=context.sampling,
        logps_temperature=context.logps_temperature,
        micro_batch_size=context.micro_batch_size,
        pad_multiple=context.pad_multiple,
        in_flight=in_flight,
        exact_logps=lookahead == 0,
        cpus=cpus,
        threads=threads,
        autocast_dtype=context.autocast_dtype,  # with vLLM, its exact_logps forward's (vLLM samples in its own)
    )


@dataclass
class Request:
    id: int
    prompt_ids: list[list[int]]
    n: int
    seeds: list[int]
    slot: int | None  # the weights to sample with; None: the newest


@dataclass
class Result:
    id: int
    completions: list[Completion]
    token_versions: list[list[int]]  # per completion, per token
    seconds: float


@dataclass
class Failure:
    id: int
    error: str  # the worker's traceback


class GenerationServer:
    """Samples requests with `model`, whose parameters it points at the slots of `weights`."""

    def __init__(self, model, weights: SharedWeights, settings: WorkerSettings) -> None:
        self.model, self.weights, self.settings = autocast_forward(model, settings.autocast_dtype), weights, settings
        self.params = [p for _, p in model.named_parameters()]
        self.backend = TransformersBackend(model, settings.pad_token_id, settings.stop_ids, return_logprobs=True)
        if settings.in_flight:
            self.backend.before_decode_step = self._before_decode_step
        self.version = -1
        self.step_versions: list[int] = []  # the version of each decode step's logits

    def generate(self, request: Request) -> Result:
        start = time.perf_counter()
        self.version = self.weights.take(self.params, request.slot, self.version, block=True)
        self.step_versions = [self.version]
        completions = self.backend.generate(request.prompt_ids, request.n, self.settings.sampling, request.seeds)
        last = len(self.step_versions) - 1
        versions = [[self.step_versions[min(j, last)] for j in range(len(c.token_ids))] for c in completions]
        one_version = len(set(self.step_versions)) == 1
        if (self.settings.exact_logps and one_version) or any(c.logprobs is None for c in completions):
            self._forward_logps(request.prompt_ids, completions)
        return Result(request.id, completions, versions, time.perf_counter() - start)

    def _before_decode_step(self, step: int) -> None:
        self.version = self.weights.take(self.params, None, self.version, block=False)
        self.step_versions.append(self.version)

    @torch.no_grad()
    def _forward_logps(self, prompt_ids: list[list[int]], completions: list[Completion]) -> None:
        """Each completion's log-probs under the current weights, by the trainer's own forward."""
        settings, size = self.settings, self.settings.micro_batch_size
        for start in range(0, len(completions), size):
            chunk = completions[start : start + size]
            prompts, prompt_mask = pad_rows(
                [prompt_ids[c.prompt_index] for c in chunk], settings.pad_token_id, True, settings.pad_multiple
            )
            ids, mask = pad_rows([c.token_ids for c in chunk], settings.pad_token_id, False, settings.pad_multiple)
            batch = {"prompt_ids": prompts, "prompt_mask": prompt_mask, "completion_ids": ids, "completion_mask": mask}
            logps, _ = completion_logps(self.model, batch, settings.logps_temperature)
            for completion, row in zip(chunk, logps.float().tolist()):
                completion.logprobs = row[: len(completion.token_ids)]


def serve(model, weights: SharedWeights, settings: WorkerSettings, requests, results, busy=None) -> None:
    """The process's main function: answers the requests read from the `requests` connection on the `results`
    connection (a `Failure` for one that raised), until it reads None or the trainer's end closes. `busy`: a shared
    byte set to 1 while a request is sampled (training borrows the cores while it is 0; core_lending.py)."""
    if settings.cpus is not None:
        pin_process(settings.cpus)
    torch.set_num_threads(settings.threads)
    server = GenerationServer(model, weights, settings)
    inbox: queue.Queue = queue.Queue()
    outbox: queue.Queue = queue.Queue()
    # Requests are read and results written by threads of their own, so that neither side's send waits for a
    # generation in progress.
    threading.Thread(target=_receive, args=(requests, inbox), daemon=True).start()
    sender = threading.Thread(target=_send, args=(results, outbox), daemon=True)
    sender.start()
    while (request := inbox.get()) is not None:
        if busy is not None:
            busy.value = 1
        try:
            outbox.put(server.generate(request))
        except Exception:
            outbox.put(Failure(request.id, traceback.format_exc()))
        finally:
            if busy is not None and inbox.empty():
                busy.value = 0
    outbox.put(None)
    sender.join()


def _receive(connection, inbox: queue.Queue) -> None:
    try:
        while True:
            inbox.put(connection.recv())
    except (EOFError, OSError):
        inbox.put(None)


def _send(connection, outbox: queue.Queue) -> None:
    while (message := outbox.get()) is not None:
        connection.send(message)
    connection.close()


def episodes_of(request: Request, result: Result) -> list[Episode]:
    """The episodes of an answered request, each with its tokens' versions (the oldest as its policy version)."""
    episodes = []
    for completion, versions in zip(result.completions, result.token_versions):
        episode = Episode.single_turn(completion)
        episode.prompt_ids = list(request.prompt_ids[completion.prompt_index])
        episode.info["policy_version"] = min(versions, default=-1)
        episode.info["token_versions"] = versions
        episodes.append(episode)
    return episodes
