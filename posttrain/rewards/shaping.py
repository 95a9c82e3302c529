"""Rewards that shape by length and repetition, computed from the completion's token ids (`completion_ids`).

Each factory returns a picklable object (a rollout worker in another process can receive it) named like the
function it stands for (`__name__`, which the logged metric takes). Called as TRL's are: the token ids first,
positionally or by keyword, any other keyword argument the trainer passes is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from posttrain.errors import ConfigError, DataError
from posttrain.rewards.library import Completion, accuracy_reward

TokenIds = Sequence[Sequence[int]]


def _token_ids(reward: str, completion_ids: TokenIds | None) -> TokenIds:
    if completion_ids is None:
        raise DataError(f"{reward} needs the 'completion_ids' argument (the completions' token ids).")
    return completion_ids


class SoftOverlongPunishment:
    """DAPO's length penalty (Yu et al., 2025, Eq. 13): 0 up to `max_completion_len - soft_punish_cache` tokens, then
    falling linearly to -1 at `max_completion_len`, and -1 beyond. It tells the model that it is about to be truncated
    before truncation happens."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if max_completion_len <= 0 or not 0 <= soft_punish_cache <= max_completion_len:
            raise ConfigError(
                f"soft overlong punishment needs 0 <= soft_punish_cache <= max_completion_len and "
                f"max_completion_len > 0, got soft_punish_cache={soft_punish_cache}, "
                f"max_completion_len={max_completion_len}."
            )
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: TokenIds | None = None, **kwargs: Any) -> list[float]:
        safe_len = self.max_completion_len - self.soft_punish_cache
        out = []
        for ids in _token_ids("soft_overlong_punishment", completion_ids):
            if len(ids) <= safe_len:
                out.append(0.0)
            elif len(ids) <= self.max_completion_len:  # only reachable when the cache is > 0
                out.append((safe_len - len(ids)) / self.soft_punish_cache)
            else:
                out.append(-1.0)
        return out


class RepetitionPenalty:
    """The fraction of token n-grams that repeat an earlier one (1 - distinct / total) times `max_penalty` (Yeo et
    al., 2025, appendix C.2). Range [max_penalty, 0]; 0 for completions shorter than `ngram_size` tokens."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0):
        if ngram_size < 1:
            raise ConfigError(f"repetition penalty ngram_size must be at least 1, got {ngram_size}.")
        if max_penalty > 0:
            raise ConfigError(f"repetition penalty max_penalty must be <= 0 (it is a penalty), got {max_penalty}.")
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: TokenIds | None = None, **kwargs: Any) -> list[float]:
        n, out = self.ngram_size, []
        for ids in _token_ids("repetition_penalty_reward", completion_ids):
            ids = list(ids)
            if len(ids) < n:
                out.append(0.0)
                continue
            ngrams = [tuple(ids[start : start + n]) for start in range(len(ids) - n + 1)]
            repeated = 1.0 - len(set(ngrams)) / len(ngrams)
            out.append(repeated * self.max_penalty if repeated else 0.0)
        return out


class CosineScaledReward:
    """Correctness scaled by length on a cosine schedule (Yeo et al., 2025, appendix C.1): a correct completion earns
    from `max_value_correct` (no tokens) down to `min_value_correct` (`max_len` tokens or more); a wrong one from
    `min_value_wrong` (no tokens) up to `max_value_wrong`, so shorter right answers and longer wrong ones (more
    exploration) score higher. Correctness is `accuracy_reward`'s; None where the gold solution does not parse."""

    __name__ = "cosine_scaled_reward"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
    ):
        if max_len <= 0:
            raise ConfigError(f"cosine scaled reward needs max_len > 0, got {max_len}.")
        self.max_len = max_len
        self.wrong = (max_value_wrong, min_value_wrong)  # (value at max_len, value at 0 tokens)
        self.correct = (min_value_correct, max_value_correct)

    def __call__(
        self,
        completions: Sequence[Completion],
        solution: Sequence[Any] | None = None,
        completion_ids: TokenIds | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        ids = _token_ids("cosine_scaled_reward", completion_ids)
        correct = accuracy_reward(completions, solution)
        if len(ids) != len(correct):
            raise DataError(f"cosine_scaled_reward got {len(correct)} completions but {len(ids)} completion_ids.")
        out: list[float | None] = []
        for is_correct, tokens in zip(correct, ids):
            if is_correct is None:
                out.append(None)
                continue
            at_max_len, at_zero = self.correct if is_correct else self.wrong
            progress = min(len(tokens) / self.max_len, 1.0)
            out.append(float(at_max_len + 0.5 * (at_zero - at_max_len) * (1.0 + math.cos(progress * math.pi))))
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO's soft overlong punishment as a reward function (see `SoftOverlongPunishment`)."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """The token n-gram repetition penalty as a reward function (see `RepetitionPenalty`)."""
    return RepetitionPenalty(ngram_size, max_penalty)


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> CosineScaledReward:
    """The length-scaled correctness reward (see `CosineScaledReward`)."""
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)
