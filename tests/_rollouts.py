"""Shared by the producer tests (tests/online, tests/ray, tests/vllm): every Rollout a trainer makes, in order."""

from __future__ import annotations


def record_rollouts(trainer) -> list:
    rollouts, make = [], trainer.make_rollout

    def recording(*args):
        rollouts.append(make(*args))
        return rollouts[-1]

    trainer.make_rollout = recording
    return rollouts
