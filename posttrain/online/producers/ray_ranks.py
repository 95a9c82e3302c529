"""The Ray producer under several training processes (accelerate launch: DDP, ZeRO-1/2 or FSDP2): rank 0 owns the
rollout actors and routes whole rounds; every rank trains on exactly the rows it would have generated itself.

Each round, every rank sends its prompts' ids and seeds to rank 0 (`gather_object`); rank 0 asks its
`RayRolloutProducer` for the whole round (every rank's prompts in rank order, as one request split over the
actors), then hands each rank its own episodes (`scatter_object_list`). Since a prompt's seed, not who samples it,
decides its tokens, each rank gets the episodes the synchronous engine would have generated on it. Rounds ahead
(k >= 1) are looked up for every rank at once (`ProducerContext.every_round_source`). Cost: one pickled copy of
the round's episodes (token ids, sampler log-probs, versions, prompt ids: about 17 bytes per completion token)
crosses the training group from rank 0 each round, plus the prompts' ids the other way.

Weights. Under DDP and ZeRO-1/2 every rank holds the whole policy and rank 0 pushes its own copy, as with one
process. Under FSDP2 every rank gathers the shards (`gathered_params`, a collective) after each optimizer step
where rank 0's schedule needs that version (rank 0 says so with a broadcast: versions and staleness stay those
of one process), and rank 0 alone sends them. DeepSpeed ZeRO-3 (its partitioned parameters are not gathered for
the push) is refused."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch.distributed as dist

from posttrain.errors import ConfigError
from posttrain.models.reference import unwrap
from posttrain.online.producers.base import ProducerContext, RolloutProducer, RoundsAhead
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Episode
from posttrain.online.weights.transport import gathered_params

__all__ = ["RankRouter"]


def _refuse_zero3(policy) -> None:
    """Stops on a policy DeepSpeed ZeRO-3 partitions: at construction where the model was loaded under zero.Init,
    else at the first push (every rank), once the engine has partitioned it."""
    if any(hasattr(p, "ds_id") for p in unwrap(policy).parameters()):
        raise ConfigError(
            "rollout_backend='ray' with several training processes supports DDP, ZeRO-1/2 and FSDP2, not "
            "DeepSpeed ZeRO-3 (its partitioned parameters are not gathered for the weight push); launch with "
            "FSDP2 (examples/accelerate_configs/fsdp2.yaml) or ZeRO-2."
        )


def _answers(episodes: list[Episode], prompts: list, n: int) -> bool:
    """Whether `episodes` are the n completions of each of `prompts`, in order."""
    return [e.prompt_ids for e in episodes] == [ids for ids in prompts for _ in range(n)]


class RankRouter(RolloutProducer):
    """Every rank's producer with several training processes: rank 0's wraps the producer of whole rounds."""

    generates_ahead: ClassVar[bool] = True

    def __init__(self, context: ProducerContext, inner: RoundsAhead | None) -> None:
        super().__init__(context)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.inner = inner
        self.snapshot: tuple[int, list] | None = None  # FSDP2: the version rank 0 will push, gathered by all
        if inner is not None:
            inner.gathered = self._gathered

    @classmethod
    def around(cls, context: ProducerContext, make: Callable[[ProducerContext], RoundsAhead]) -> RankRouter:
        """The router of this rank; on rank 0 around `make(context)`, whose rounds are every rank's."""
        _refuse_zero3(context.policy)
        if dist.get_rank() != 0:
            return cls(context, None)
        return cls(context, make(dataclasses.replace(context, round_source=context.every_round_source)))

    # -- rounds ----------------------------------------------------------------------------------------
    def episodes(self, round_index: int, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        mine = [row[PROMPT_IDS_COLUMN] for row in rows]
        asked = [None] * self.world if self.rank == 0 else None
        dist.gather_object((mine, list(seeds)), asked, dst=0)
        parts, failed = self._route(round_index, asked, n) if self.rank == 0 else (None, None)
        got: list = [None]
        dist.scatter_object_list(got, parts, src=0)  # every rank waits here, also when rank 0 failed
        if failed is not None:
            raise failed
        episodes = got[0]
        if isinstance(episodes, str):  # rank 0 failed on this round (and raises it there)
            raise RuntimeError(f"Rank 0's rollout producer failed on round {round_index}; training stops:\n{episodes}")
        if not _answers(episodes, mine, n):  # (rank 0 checked every rank's already: a corrupted transfer)
            raise RuntimeError(
                f"Rank {self.rank} got round {round_index}'s episodes of other prompts than its own from rank 0."
            )
        return episodes

    def _route(self, round_index: int, asked: list, n: int) -> tuple[list, Exception | None]:
        """Rank 0: the whole round from the producer, cut into every rank's episodes (or the error, for every
        rank, and the exception to raise here)."""
        rows = [{PROMPT_IDS_COLUMN: ids} for prompts, _ in asked for ids in prompts]
        seeds = [seed for _, part in asked for seed in part]
        try:
            episodes = self.inner.episodes(round_index, rows, n, seeds)
            parts, start = [], 0
            for prompts, _ in asked:
                parts.append(episodes[start : start + len(prompts) * n])
                start += len(prompts) * n
            wrong = [
                rank for rank, ((prompts, _), part) in enumerate(zip(asked, parts)) if not _answers(part, prompts, n)
            ]
            if wrong or start != len(episodes):  # checked here, so that every rank stops, not only those concerned
                raise RuntimeError(
                    f"the producer answered round {round_index} with {len(episodes)} episodes, not the {start} of "
                    f"every rank's prompts in rank order (ranks {wrong} would get episodes of other prompts)"
                )
        except Exception as error:
            return [f"{type(error).__name__}: {error}"] * self.world, error
        return parts, None

    def _gathered(self, version: int) -> list:
        """What rank 0's producer pushes as `version`: its own parameters, or under FSDP2 those every rank
        gathered after that version's optimizer step."""
        if not self._sharded():
            return gathered_params(unwrap(self.context.policy))
        if self.snapshot is None or self.snapshot[0] != version:
            raise RuntimeError(f"Version {version} of the weights was not gathered by every rank before its push.")
        params, self.snapshot = self.snapshot[1], None
        return params

    def _sharded(self) -> bool:
        return any(hasattr(p, "full_tensor") for p in unwrap(self.context.policy).parameters())

    # -- weights ---------------------------------------------------------------------------------------
    def push_weights(self, version: int) -> None:
        """Every rank: under FSDP2, gathers `version` when rank 0's schedule will push it (its sampler's weights
        are vllm_sync_steps old or more); then rank 0's producer takes the version."""
        _refuse_zero3(self.context.policy)  # (the same model on every rank: all stop, none waits)
        if self._sharded():
            due = [None]
            if self.rank == 0:
                last, steps = self.inner.version, self.inner.sync_steps
                due[0] = last is None or version - last >= steps
            dist.broadcast_object_list(due, src=0)
            if due[0]:
                params = gathered_params(unwrap(self.context.policy))  # a collective: every rank, in order
                self.snapshot = (version, params) if self.rank == 0 else None
        if self.inner is not None:
            self.inner.push_weights(version)

    # -- the rest goes to rank 0's producer --------------------------------------------------------------
    def start(self) -> None:
        if self.inner is not None:
            self.inner.start()

    def update_phase(self, model):
        return self.inner.update_phase(model) if self.inner is not None else contextlib.nullcontext()

    def paused(self):
        return self.inner.paused() if self.inner is not None else contextlib.nullcontext()

    def state(self) -> dict | None:
        return self.inner.state() if self.inner is not None else None

    def load_state(self, state: dict) -> None:
        if self.inner is not None:
            self.inner.load_state(state)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
