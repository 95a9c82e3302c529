"""The null producer: each round is generated when it is asked for, with the policy's current weights, by the
trainer's own generation (its backend, tools and environments, image prompts), so the engine asks every producer
the same way."""

from __future__ import annotations

from typing import ClassVar

from posttrain.online.producers.base import RolloutProducer
from posttrain.online.rollout import Episode

__all__ = ["SynchronousProducer"]


class SynchronousProducer(RolloutProducer):
    """Generates each round on demand, in the training loop (async_generation_rounds=None)."""

    generates_ahead: ClassVar[bool] = False

    def episodes(self, round_index: int, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        return self.context.generate(rows, n, seeds)
