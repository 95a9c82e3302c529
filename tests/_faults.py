"""A reward function that fails on purpose, shared by the soak tests (tests/training/test_soak.py, tests/vllm/)."""

from __future__ import annotations

import asyncio
import random

SCHEDULED = {1: "raise", 2: "nan", 3: "timeout"}  # one fault of each kind first, then at random


def flaky_reward(rng: random.Random, injected: list, timeout_sleep_s: float = 3.0):
    """An async reward (the fraction of token ids below 192) that raises 5% of the time, returns NaN 1% and
    sleeps past its timeout 1%; every call appends its fault (or None) to `injected`."""

    async def flaky(completion_ids, **kwargs):
        u = rng.random()
        fault = SCHEDULED.get(len(injected) + 1) or (
            "raise" if u < 0.05 else "nan" if u < 0.06 else "timeout" if u < 0.07 else None
        )
        injected.append(fault)
        if fault == "raise":
            raise RuntimeError("injected failure")
        if fault == "timeout":
            await asyncio.sleep(timeout_sleep_s)
        values = [sum(t < 192 for t in ids) / max(len(ids), 1) for ids in completion_ids]
        return [float("nan")] * len(values) if fault == "nan" else values

    return flaky
