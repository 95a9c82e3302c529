"""Asynchronous rollouts on a Ray cluster (rollout_backend="ray"): the trainer's rank 0 sends each round to one of
`num_rollout_actors` rollout actors (ray_actor.py) placed on the nodes that offer the custom resource
`rollout_resource`, and pushes every new version of the weights to all of them over a process group per actor
(weights/collective.py: gloo, or NCCL where the trainer and the actor have GPUs). Ray carries the requests, the
answers and, once, the model; never a version of the weights.

The schedule is the generation process's: async_generation_rounds rounds ahead, a push every vllm_sync_steps
steps, in-flight updates with a version per token (async_inflight_weight_updates), max_staleness. A round goes to
the actor with the fewest requests in flight (the lowest index on a tie); its seeds, not the actor, decide its
tokens. Where the rounds in flight leave actors idle (k = 0: one round at a time), a round is split into contiguous
parts of its prompts, one request per actor (`split_round`), and its episodes are put back together in order.

Faults. An actor that dies (its process, or its whole node) is restarted by Ray (`max_restarts`), elsewhere if its
node is gone; the trainer then gives it a new weight group, pushes the versions its rounds need (the newest last)
before it samples again, and sends its unanswered rounds again with their seeds, so the run's tokens and final
weights are those of an uninterrupted run when rounds name their weights (async_inflight_weight_updates=False).
An actor that stays alive but answers nothing for rollout_request_timeout_s is killed and handled the same way.
Each restart is logged (a warning and async/generation_restarts). A round that raises stops training with the
actor's name and traceback; an actor that fails MAX_RESTARTS times in a row without answering stops it too.
"""

from __future__ import annotations

import logging
import math
import time

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from posttrain.errors import ConfigError
from posttrain.models.fused_layers import unfuse_layers
from posttrain.models.reference import copy_model, freeze, unwrap
from posttrain.online.producers.base import ProducerContext, RoundsAhead
from posttrain.online.producers.generation_worker import Request, Result, episodes_of, worker_settings
from posttrain.online.producers.ray_actor import rollout_actor_class
from posttrain.online.producers.ray_cluster import connect, trainer_address
from posttrain.online.producers.ray_vllm import vllm_engine_options
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode
from posttrain.online.weights.collective import PairSender, open_store, pair_backend
from posttrain.online.weights.transport import WeightSyncError, flat_buffers, flat_layout, gathered_params, pack

__all__ = ["RayRolloutProducer", "split_round"]

logger = logging.getLogger("posttrain")
MAX_RESTARTS = 3  # failures of one actor in a row without an answer before training stops
POLL_S = 0.5  # how often a wait for an answer checks the deadlines
START_S = 300.0  # how long an actor may take to start (or restart) and join its weight group


def split_round(prompts: int, parts: int, n: int, micro_batch_size: int) -> list[range]:
    """A round's `prompts` in at most `parts` contiguous, nearly equal ranges (fewer where the round is small).
    Each range starts at a multiple of the prompts whose `n` completions fill whole micro-batches, so an actor's
    log-prob forward (exact_logps) takes the micro-batches of the unsplit round, and the parts' episodes, put back
    together, are the unsplit round's."""
    unit = micro_batch_size // math.gcd(micro_batch_size, n)
    units = -(-prompts // unit)
    parts = max(1, min(parts, units))
    bounds = [min(prompts, unit * (units * j // parts)) for j in range(parts + 1)]
    return [range(start, end) for start, end in zip(bounds, bounds[1:])]


class RemoteRound:
    """A round sent to the actors as one request per part; `result()` waits for their episodes, in order."""

    def __init__(self, producer: RayRolloutProducer, request_ids: list[int]) -> None:
        self.producer, self.request_ids = producer, request_ids

    def result(self) -> tuple[list[Episode], float]:
        episodes, seconds = [], 0.0
        for request_id in self.request_ids:
            part, took = self.producer.answer(request_id)
            episodes += part
            seconds = max(seconds, took)  # the parts are sampled at once
        return episodes, seconds


class RayRolloutProducer(RoundsAhead):
    """Generates the training rounds up to `lookahead` ahead on rollout actors of a Ray cluster."""

    def __init__(self, context: ProducerContext, lookahead: int) -> None:
        super().__init__(context, lookahead)
        args = context.args
        self.in_flight = args.async_inflight_weight_updates
        self.sampler_model = freeze(copy_model(unwrap(context.policy)))
        self.num_actors, self.timeout_s = args.num_rollout_actors, args.rollout_request_timeout_s
        self.resource, self.started_ray = args.rollout_resource, False
        unfuse_layers(self.sampler_model)  # its rebound forwards would not pickle
        threads = args.async_generation_cores or 1
        self.settings = worker_settings(context, self.sampler_model, self.lookahead, self.in_flight, None, threads)
        self.layout = flat_layout(self.sampler_model)
        self.vllm = vllm_engine_options(args, self.sampler_model, context.tokenizer) if args.use_vllm else None
        self.kept: dict[int, dict[torch.dtype, torch.Tensor]] = {}  # versions that rounds in flight may need
        self.pending: dict[int, tuple[Request, int]] = {}  # request id -> (request, its weights' version)
        self.inflight: dict[int, tuple[int, ray.ObjectRef]] = {}  # request id -> (actor index, answer)
        self.answers: dict[int, tuple[Request, Result]] = {}
        self.actors: list | None = None
        self.next_id, self.restarts = 0, 0
        self.model_ref = None

    # -- requests and answers ----------------------------------------------------------------------------
    def _submit(self, rows: list[dict], seeds: list[int]) -> RemoteRound:
        if self.weights_due():
            self.publish(self.latest)
        if self.actors is None:
            self._start()
        n, ids = self.context.args.num_generations, []
        idle = max(1, self.num_actors // (self.lookahead + 1))  # the actors the other rounds in flight leave
        for part in split_round(len(rows), idle, n, self.context.micro_batch_size):
            prompts = [rows[i][PROMPT_IDS_COLUMN] for i in part]
            request = Request(self.next_id, prompts, n, [seeds[i] for i in part], None)
            self.next_id += 1
            self.pending[request.id] = (request, self.version)
            self._dispatch(request.id, self._least_loaded())
            ids.append(request.id)
        return RemoteRound(self, ids)

    def _least_loaded(self) -> int:
        loads = [0] * self.num_actors
        for index, _ in self.inflight.values():
            loads[index] += 1
        return loads.index(min(loads))

    def _dispatch(self, request_id: int, index: int) -> None:
        request, version = self.pending[request_id]
        if not self.inflight or all(i != index for i, _ in self.inflight.values()):
            self.progress[index] = time.monotonic()  # its deadline counts from now
        self.inflight[request_id] = (index, self.actors[index].generate.remote(request, version, self.timeout_s))

    def answer(self, request_id: int) -> tuple[list[Episode], float]:
        """The episodes of request `request_id`, waiting for them (and replacing actors that die or hang)."""
        while request_id not in self.answers:
            refs = {ref: rid for rid, (_, ref) in self.inflight.items()}
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
            for ref in ready:
                self._take(refs[ref])
            self._check_deadlines()
        request, result = self.answers.pop(request_id)
        return episodes_of(request, result), result.seconds

    def _take(self, request_id: int) -> None:
        if request_id not in self.inflight:  # its actor was replaced meanwhile and the round resent
            return
        index, ref = self.inflight[request_id]
        try:
            result = ray.get(ref)
        except RayActorError as error:
            self._recover(index, f"died ({type(error).__name__})")
            return
        except Exception as error:  # the round raised on the actor: not retried
            raise RuntimeError(
                f"The {self.names[index]} failed on a round (request {request_id}); training stops:\n{error}"
            ) from None
        del self.inflight[request_id]
        request, _ = self.pending.pop(request_id)
        self.answers[request_id] = (request, result)
        self.failures[index], self.progress[index] = 0, time.monotonic()

    def _check_deadlines(self) -> None:
        now, busy = time.monotonic(), {index for index, _ in self.inflight.values()}
        for index in sorted(busy):
            if now - self.progress[index] > self.timeout_s:
                ray.kill(self.actors[index], no_restart=False)
                self._recover(index, f"answered nothing for {self.timeout_s:g} s (rollout_request_timeout_s)")

    # -- weights -------------------------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        """Packs the policy's weights as `version` and pushes them to every actor (replacing one that fails)."""
        params = self.gathered(version)
        needed = {v for _, v in self.pending.values()}
        spare = [v for v in self.kept if v not in needed and v != self.version]
        buffers = self.kept.pop(spare[0]) if spare else flat_buffers(self.layout)
        for old in spare[1:]:
            del self.kept[old]
        self.kept[version] = pack(params, buffers)
        self.version = version
        if self.actors is not None:
            self._push_all(version)

    def gathered(self, version: int) -> list:
        """The policy's whole parameters for `version` (ray_ranks.py replaces this on rank 0 of a sharded run by
        the ones every rank gathered together)."""
        return gathered_params(unwrap(self.context.policy))

    def _push_all(self, version: int) -> None:
        started = []
        for index in range(self.num_actors):
            pinned = sorted({v for rid, (_, v) in self.pending.items() if self.inflight.get(rid, (-1,))[0] == index})
            try:
                ref = self.actors[index].receive.remote(pinned)
                started.append((index, ref, self.senders[index].start(self.kept[version], version)))
            except WeightSyncError:
                started.append((index, None, None))
        for index, ref, works in started:
            try:
                if works is None:
                    raise WeightSyncError(f"{self.names[index]}: the push of version {version} did not start")
                self.senders[index].wait(works, version)
                ray.get(ref, timeout=self.timeout_s)
            except (WeightSyncError, RayActorError, GetTimeoutError) as error:
                logger.warning(
                    "posttrain: weight sync of version %d to %s failed: %s", version, self.names[index], error
                )
                self._recover(index, f"failed the weight sync of version {version}")

    def _push(self, index: int, versions: list[int]) -> None:
        for version in versions:
            ref = self.actors[index].receive.remote([v for v in versions if v != version])
            self.senders[index].send(self.kept[version], version)
            ray.get(ref, timeout=self.timeout_s)

    def push_weights(self, version: int) -> None:
        """With in-flight updates, pushes the policy's weights every vllm_sync_steps optimizer steps while the
        actors run (else a round takes them when it is submitted)."""
        super().push_weights(version)
        if self.in_flight and self.actors is not None and version - self.version >= self.sync_steps:
            self.publish(version)

    # -- actors ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        args = self.context.args
        self.started_ray = connect(args.ray_address, self.num_actors, self.resource) or self.started_ray
        self.host = trainer_address()
        self.model_ref = ray.put(self.sampler_model)
        self.names = [f"rollout actor {i}" for i in range(self.num_actors)]
        self.actors = [self._create(i) for i in range(self.num_actors)]
        self.senders, self.stores = [None] * self.num_actors, [None] * self.num_actors
        self.failures, self.progress = [0] * self.num_actors, [time.monotonic()] * self.num_actors
        self.where: list[dict | None] = [None] * self.num_actors
        for index in range(self.num_actors):
            self._bring_up(index)

    def _create(self, index: int):
        remote = rollout_actor_class(
            resources={self.resource: 1},
            num_cpus=0,
            max_restarts=-1,
            max_task_retries=0,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": str(self.settings.threads)}},
        )
        slots = max(self.lookahead + 2, 3)  # in use, newest, one to write into, one per round ahead
        return remote.remote(self.model_ref, self.settings, slots, self.names[index], self.vllm)

    def _bring_up(self, index: int) -> None:
        """Waits for actor `index` to run, connects its weight group, pushes the versions its rounds need (the
        newest last) and sends its unanswered rounds again."""
        where = self._wait_alive(index)
        self.where[index] = where
        self.names[index] = f"rollout actor {index} (node {where['ip']}, pid {where['pid']})"
        store = open_store(self.host, START_S)
        backend = pair_backend(self.context.device, where["cuda"])
        ref = self.actors[index].connect.remote(self.host, store.port, self.timeout_s, backend)
        self.senders[index] = PairSender(store, self.host, self.names[index], self.timeout_s, backend)
        self.stores[index] = store
        ray.get(ref, timeout=START_S)
        mine = sorted(rid for rid, (i, _) in self.inflight.items() if i == index)
        versions = sorted({self.pending[rid][1] for rid in mine} - {self.version}) + [self.version]
        self._push(index, versions)
        self.progress[index] = time.monotonic()  # the deadline of its rounds counts from now
        for request_id in mine:
            self._dispatch(request_id, index)

    def _wait_alive(self, index: int) -> dict:
        deadline = time.monotonic() + START_S
        while True:
            try:
                return ray.get(self.actors[index].where.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError) as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Rollout actor {index} did not start within {START_S:g} s; is a node with the resource "
                        f"{self.resource!r} free (`ray status`)?"
                    ) from error
                time.sleep(0.2)

    def _recover(self, index: int, why: str) -> None:
        self.failures[index] += 1
        if self.failures[index] > MAX_RESTARTS:
            raise RuntimeError(
                f"{self.names[index]} {why}, and has failed {self.failures[index]} times in a row without answering "
                "a round; training stops."
            )
        resent = sum(1 for i, _ in self.inflight.values() if i == index)
        logger.warning("posttrain: %s %s; restarting it and resending %d round(s).", self.names[index], why, resent)
        self.restarts += 1
        self.senders[index] = None
        self._bring_up(index)

    def record_staleness(self, episodes: list[Episode]) -> None:
        super().record_staleness(episodes)
        self.context.log_metric("async/generation_restarts", float(self.restarts))
        self.restarts = 0

    # -- checkpoints and shutdown -------------------------------------------------------------------------
    def sampler_weights(self) -> dict[str, torch.Tensor]:
        """The sampler's state dict with the weights of `self.version` (the keys of the other producers)."""
        buffers, offsets, views = self.kept[self.version], dict.fromkeys(self.kept[self.version], 0), {}
        for (_, param), (dtype, shape, numel) in zip(self.sampler_model.named_parameters(), self.layout):
            views[id(param)] = buffers[dtype][offsets[dtype] : offsets[dtype] + numel].view(shape)
            offsets[dtype] += numel
        state = self.sampler_model.state_dict()
        for name, param in self.sampler_model.named_parameters(remove_duplicate=False):
            state[name] = views[id(param)]
        return state

    def _load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        names = [name for name, _ in self.sampler_model.named_parameters()]
        self.kept = {version: pack([weights[name] for name in names], flat_buffers(self.layout))}

    def close(self) -> None:
        """Drops the rounds still queued and ends the actors (and the Ray this run started)."""
        self.rounds, self.pending, self.inflight, self.answers = {}, {}, {}, {}
        for actor in self.actors or []:
            ray.kill(actor, no_restart=True)
        self.actors, self.senders, self.stores = None, None, None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False


def make_ray_producer(context: ProducerContext, lookahead: int) -> RayRolloutProducer:
    """The Ray producer (rollout_backend='ray'), after checking that the run's settings can run there."""
    args = context.args
    why = {
        "use_vllm=True with async_inflight_weight_updates=True (a vLLM engine samples each request with one version "
        "of the weights; set async_inflight_weight_updates=False)": args.use_vllm
        and args.async_inflight_weight_updates,
        "async_generation_process=True (the actors are the generation processes)": args.async_generation_process,
        "transformers' continuous batching or a static cache (the actors decode with the dynamic cache)": (
            args.use_transformers_continuous_batching or args.cache_implementation not in (None, "dynamic")
        ),
    }
    for what, present in why.items():
        if present:
            raise ConfigError(f"rollout_backend='ray' does not support {what}; drop that setting.")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        from posttrain.online.producers.ray_ranks import RankRouter  # several training processes

        return RankRouter.around(context, lambda whole: RayRolloutProducer(whole, lookahead))
    return RayRolloutProducer(context, lookahead)
