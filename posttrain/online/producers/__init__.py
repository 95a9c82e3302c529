"""Rollout producers: where the engine gets each training round's episodes.

The interface (base.py `RolloutProducer`), which the engine calls and nothing else:

- `episodes(round_index, rows, n, seeds)`: round `round_index`'s `n` episodes per prompt row, prompt-major, sampled
  with the given per-prompt seeds. The engine scores them and builds the round's `Rollout` (phases.py). Each
  episode's `info` carries `policy_version` (the oldest weights that sampled it) and `token_versions` (per token);
  `info["stale"] = True` leaves it out of the loss (max_staleness). A producer that generates ahead asks
  `context.round_source(index)` for a later round's rows and seeds (None past the last round).
- `push_weights(version)`: the policy now holds the weights of optimizer step `version`; called when training
  starts and after every optimizer step. The producer takes them from `context.policy` when its schedule says so
  (every vllm_sync_steps steps) and carries the version into the episodes it samples with them.
- `start()` / `close()`: training starts / ends (close also drops rounds in flight and gives back threads,
  processes and cores).
- `update_phase(model)`: a context around the update's forward and backward (the process lends its idle cores).
- `paused()`: a context in which evaluation samples with the policy's own weights.
- `state()` / `load_state(state)`: what a checkpoint keeps (the rounds in flight, the sampler's version and weights)
  so that a resumed run trains on exactly the rounds the uninterrupted run trains on; None for nothing.
- `generates_ahead` (a class attribute): whether rounds are sampled before the round that trains on them.

A producer reads the trainer only through its `ProducerContext` (base.py): the settings (`args`), the policy module,
the tokenizer and sampling parameters, the trainer's synchronous `generate` and `completion_logps`, the
`round_source`, a `log_metric` sink and `device`. `make_rollout_producer(context)` picks the implementation:

- synchronous.py  `SynchronousProducer`: async_generation_rounds=None; the trainer's own generation, on demand.
- thread.py       `ThreadRolloutProducer`: up to k rounds ahead in a background thread, on a copy of the policy.
- process.py      `ProcessRolloutProducer`: up to k rounds ahead in a generation process on its own cores
                  (generation_worker.py), weights through shared memory (weights/shared_memory.py), in-flight updates.
- ray.py          `RayRolloutProducer` (rollout_backend="ray"): the same server in rollout actors on a Ray cluster
                  (ray_actor.py), weights over a gloo (or NCCL) group per actor (weights/collective.py);
                  docs/scaling_rollouts.md. With several training processes every rank's producer is a
                  `RankRouter` (ray_ranks.py): rank 0's owns the actors and routes every rank's rounds.

A new producer (e.g. `producers/ray.py`) subclasses `RolloutProducer` (or `RoundsAhead`, the rounds-ahead schedule
with its staleness metrics and checkpoint state, implementing `_submit`, `sampler_weights`, `_load_weights` and
`close`), imports from `producers.base` (not from this package, which imports the implementations), and gets a
branch in `make_rollout_producer`.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from posttrain.errors import ConfigError
from posttrain.online.producers import process
from posttrain.online.producers.base import ProducerContext, RolloutProducer, RoundsAhead, autocast_dtype
from posttrain.online.producers.synchronous import SynchronousProducer
from posttrain.online.producers.thread import ThreadRolloutProducer

__all__ = [
    "ProducerContext",
    "ProducerEvents",
    "RolloutProducer",
    "RoundsAhead",
    "SynchronousProducer",
    "ThreadRolloutProducer",
    "autocast_dtype",
    "make_rollout_producer",
]

logger = logging.getLogger("posttrain")


def make_rollout_producer(context: ProducerContext) -> RolloutProducer:
    """The producer the run's settings ask for, after checking them: synchronous (async_generation_rounds=None),
    the thread, or the generation process (async_generation_process: None picks it for k >= 1 where it can run)."""
    args = context.args
    check_settings(args)
    k = args.async_generation_rounds
    if k is None:
        return SynchronousProducer(context)
    refuse_unsupported(context)
    if args.rollout_backend == "ray":  # rollout actors on a Ray cluster (the `ray` extra)
        from posttrain.online.producers.ray import make_ray_producer

        return make_ray_producer(context, k)
    wanted = args.async_generation_process
    if wanted is False or (wanted is None and k == 0):
        return ThreadRolloutProducer(context, k)
    split, reason = process.placement(context, wanted)
    if reason is not None:
        if wanted:
            raise ConfigError(
                f"async_generation_process=True, but a generation process cannot run here: {reason}. Set "
                "async_generation_process=None (a thread where it cannot) or False."
            )
        logger.info("posttrain: asynchronous generation runs in a thread (%s).", reason)
        return ThreadRolloutProducer(context, k)
    return process.ProcessRolloutProducer(context, k, split)


def check_settings(args) -> None:
    """The asynchronous settings need async_generation_rounds."""
    rounds = args.async_generation_rounds
    needs_rounds = {
        "async_generation_process=True": args.async_generation_process is True,
        f"async_generation_cores={args.async_generation_cores}": args.async_generation_cores is not None,
        f"max_staleness={args.max_staleness}": args.max_staleness is not None,
    }
    for setting, present in needs_rounds.items():
        if present and rounds is None:
            raise ConfigError(
                f"{setting} applies to asynchronous generation, which is off (async_generation_rounds=None); set "
                "async_generation_rounds=1 (or more), or drop the setting."
            )


def refuse_unsupported(context: ProducerContext) -> None:
    """Stops before training when the trainer generates in a way a producer generating ahead cannot take over.
    The config names the option that turned generation ahead on (its `async_rounds_option`)."""
    name = context.args.async_rounds_option
    fix = (
        "set async_generation_rounds=None (synchronous generation)"
        if name == "async_generation_rounds"
        else "use the synchronous trainer"
    )
    for what in context.unsupported:
        raise ConfigError(
            f"{name}={getattr(context.args, name)} generates ahead of training, which does not support {what} yet; "
            f"{fix} or drop that setting."
        )


class ProducerEvents(TrainerCallback):
    """Drives a producer from the training loop: `start` and the first version when training starts, each new
    version after an optimizer step, `close` when training ends."""

    def __init__(self, producer: RolloutProducer) -> None:
        self.producer = producer

    def on_train_begin(self, args, state, control, **kwargs):
        self.producer.start()
        self.producer.push_weights(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.producer.push_weights(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.producer.close()
