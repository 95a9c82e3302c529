"""Generation with transformers' continuous batching engine (`model.generate_batch`).

The engine schedules requests itself and samples from torch's global random generator, so completions are
reproducible for a given round (the generator is seeded from the round's prompt seeds) but, unlike the
`generate` backend's per-completion streams, they depend on which prompts share the call. It reports no
log-probs. On a CPU it works but is slow (its scheduler is built for accelerators).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import GenerationConfig

from posttrain.errors import ConfigError
from posttrain.generation.base import Completion, GenerationBackend, SamplingParams, completion_seeds, derive_seed
from posttrain.generation.transformers_backend import completion_from_tokens


def request_order(request_ids: Sequence[str], num_prompts: int, n: int) -> list[str]:
    """generate_batch's request ids in prompt-major order: prompt i's parent request 'req_i' first, then its
    children 'req_i__child#0', ... (one per extra return sequence)."""
    order = []
    for i in range(num_prompts):
        order += [f"req_{i}"] + [f"req_{i}__child#{j}" for j in range(n - 1)]
    missing = sorted(set(order) - set(request_ids))
    if missing:
        raise RuntimeError(f"transformers' continuous batching returned no result for the requests {missing[:5]}.")
    return order


class ContinuousBatchingBackend(GenerationBackend):
    """Generates with `model.generate_batch` (the trainer's model object: always the current weights)."""

    def __init__(self, model, pad_token_id: int, eos_token_ids: Sequence[int], config: dict | None = None) -> None:
        from transformers.generation import ContinuousBatchingConfig

        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        try:
            self.config = ContinuousBatchingConfig(**(config or {}))
        except TypeError as err:
            raise ConfigError(
                f"transformers_continuous_batching_config={config!r}: {err}. Use the keyword "
                "arguments of transformers.generation.ContinuousBatchingConfig."
            ) from None

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | Sequence[int] | None = None,
    ) -> list[Completion]:
        if sampling.extra:
            unknown = sorted(set(sampling.extra) - set(GenerationConfig().to_dict()))
            if unknown:
                raise ConfigError(f"generation_kwargs has keys GenerationConfig does not know: {unknown}.")
        model = extract_model_from_parallel(self.model)
        config = GenerationConfig(
            **{
                **sampling.extra,
                "max_new_tokens": sampling.max_tokens,
                "do_sample": True,
                "num_return_sequences": n,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "min_p": sampling.min_p or None,
                "repetition_penalty": sampling.repetition_penalty,
                "eos_token_id": self.eos_token_ids,
                "pad_token_id": self.pad_token_id,
            }
        )
        seeds = completion_seeds(seed, len(prompt_ids), 1)
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[]):
                if seeds is not None:
                    torch.manual_seed(derive_seed(*seeds) % 2**63)
                outputs = model.generate_batch(
                    [list(ids) for ids in prompt_ids],
                    generation_config=config,
                    continuous_batching_config=self.config,
                    warmup=False,
                )
        finally:
            model.train(was_training)
        order = request_order(list(outputs), len(prompt_ids), n)
        return [
            completion_from_tokens(k // n, list(outputs[rid].generated_tokens), self.eos_token_ids)
            for k, rid in enumerate(order)
        ]
