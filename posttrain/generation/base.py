"""The interface every generation backend implements, and what it exchanges with the online trainers.

A backend turns prompts (token ids) into completions (token ids). Token ids go in and come out so that
what the policy is trained on is exactly what was sampled: text is never decoded and re-tokenized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. Filters apply in this order: repetition penalty, temperature, top-k,
    top-p, min-p; 0 (top_k, min_p) and 1.0 (top_p, repetition_penalty) switch a filter off. `extra` holds
    backend-specific settings (the config's generation_kwargs); `regex` constrains completions (vLLM only)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    regex: str | None = None

    def __post_init__(self) -> None:
        checks = {
            "max_completion_length": (self.max_tokens, self.max_tokens >= 1, "at least 1"),
            "temperature": (self.temperature, self.temperature > 0, "> 0 (1.0 samples from the model as is)"),
            "top_p": (self.top_p, 0 < self.top_p <= 1, "in (0, 1] (1.0 keeps every token)"),
            "top_k": (self.top_k, self.top_k >= 0, ">= 0 (0 keeps every token)"),
            "min_p": (self.min_p, 0 <= self.min_p < 1, "in [0, 1) (0 keeps every token)"),
            "repetition_penalty": (self.repetition_penalty, self.repetition_penalty > 0, "> 0 (1.0 is no penalty)"),
        }
        for name, (value, ok, expected) in checks.items():
            if not ok:
                raise ConfigError(f"{name}={value} is invalid: it must be {expected}.")


@dataclass
class Completion:
    """One sampled completion. `token_ids` end with the stop token when `finished_with_eos` (nothing after
    it, no padding); otherwise the completion was cut at max_tokens. `logprobs` are the sampler's own
    log-probabilities of `token_ids`, when the backend reports them."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finished_with_eos: bool


class GenerationBackend(ABC):
    """Samples completions for the online trainers (GRPO, RLOO, PPO)."""

    @abstractmethod
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt in prompt-major order: result[i * n + j] is prompt i's j-th.

        `seed` makes sampling reproducible: one int for the call, or one int per prompt. With one seed per
        prompt a prompt's completions do not depend on which other prompts share the call, so splitting a
        batch across processes or calls does not change what is sampled.
        """

    def sync_weights(self, model, force: bool = False) -> None:
        """Makes the sampler use `model`'s current weights: when its schedule says so (once per training
        round), or now with `force` (evaluation). Nothing to do for a backend that samples with the training
        model itself, hence this default."""
        return

    def pop_metrics(self) -> dict[str, float]:
        """Counts of backend events since the last call, for the trainer's logs (the same keys on every
        process; e.g. the vLLM server backend's `vllm/reconnects`)."""
        return {}


def completion_seeds(seed: int | Sequence[int] | None, num_prompts: int, n: int) -> list[int] | None:
    """One seed per completion (prompt-major), derived from a call seed or from one seed per prompt."""
    if seed is None:
        return None
    if isinstance(seed, int):
        prompt_seeds = [derive_seed(seed, i) for i in range(num_prompts)]
    else:
        prompt_seeds = list(seed)
        if len(prompt_seeds) != num_prompts:
            raise ConfigError(
                f"Got {len(prompt_seeds)} seeds for {num_prompts} prompts; pass one seed per prompt or a single int."
            )
    return [derive_seed(s, j) for s in prompt_seeds for j in range(n)]


def derive_seed(*entropy: int) -> int:
    """A well-mixed 63-bit seed from non-negative integers (numpy's SeedSequence), stable across runs."""
    state = np.random.SeedSequence([int(e) for e in entropy]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS plus the model's generation_config EOS ids
    (chat models often stop on an end-of-turn token that the tokenizer does not call EOS)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids += list(config_eos) if isinstance(config_eos, (list, tuple)) else [config_eos]
    return list(dict.fromkeys(int(i) for i in ids))
