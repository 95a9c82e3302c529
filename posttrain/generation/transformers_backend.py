"""Generation with the training model itself through transformers' `generate` (KV cache, left padding).

Sampling uses the Gumbel-max trick with one random stream per completion: after the repetition penalty,
temperature, top-k, top-p and min-p filters, each row adds Gumbel noise drawn from its own seeded
generator and takes the arg-max, which is an exact sample from the filtered softmax. Because no row
draws from a shared random state, a completion depends only on its prompt, its seed and the weights,
not on which other prompts are in the batch or on which process it is generated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..errors import ConfigError
from .base import Completion, GenerationBackend, SamplingParams, completion_seeds, derive_seed


class SeededGumbelSampler(LogitsProcessor):
    """Adds Gumbel(0, 1) noise to each row's scores from that row's own generator; greedy decoding on the
    result samples from softmax(scores)."""

    def __init__(self, seeds: Sequence[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab_size = scores.shape[-1]
        uniform = torch.stack([
            torch.rand(vocab_size, generator=g, device=scores.device, dtype=torch.float32) for g in self.generators
        ])
        tiny = torch.finfo(torch.float32).tiny
        gumbel = -torch.log((-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny))
        return scores.float() + gumbel


def _filters(sampling: SamplingParams) -> list[LogitsProcessor]:
    filters: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        filters.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        filters.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        filters.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p > 0:
        filters.append(MinPLogitsWarper(sampling.min_p))
    return filters


def generation_config(sampling: SamplingParams, eos_token_ids: Sequence[int], pad_token_id: int,
                      **settings) -> GenerationConfig:
    """Greedy decoding over the filtered, Gumbel-noised scores, plus `sampling.extra` (generation_kwargs),
    each key of which must be a GenerationConfig setting (an unknown one would be ignored without a word)."""
    known = GenerationConfig().to_dict()
    unknown = sorted(set(sampling.extra) - set(known))
    if unknown:
        raise ConfigError(f"generation_kwargs has keys that transformers' GenerationConfig does not know: {unknown}. "
                          "Fix their spelling or drop them (vLLM-only settings need use_vllm=True).")
    return GenerationConfig(**{
        **sampling.extra, "max_new_tokens": sampling.max_tokens, "do_sample": False, "num_beams": 1,
        "repetition_penalty": sampling.repetition_penalty, "eos_token_id": list(eos_token_ids),
        "pad_token_id": pad_token_id, **{k: v for k, v in settings.items() if v is not None}})


class TransformersBackend(GenerationBackend):
    """Generates with `model` (the trainer's model object, so it always has the current weights).

    All n * len(prompts) completions are generated in one left-padded batch with the KV cache, in eval
    mode without gradients; the model's train/eval mode is restored afterwards.
    """

    def __init__(self, model, pad_token_id: int, eos_token_ids: Sequence[int],
                 cache_implementation: str | None = None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.cache_implementation = cache_implementation

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | Sequence[int] | None = None,
        vision: Sequence[dict] | None = None,
        suppress_tokens: Sequence[int] | None = None,
    ) -> list[Completion]:
        """`vision`: per prompt, its image inputs (`split_vision_inputs`, with unpadded per-token inputs), which
        every completion of the prompt is generated with; `suppress_tokens` are never sampled (image tokens)."""
        model = extract_model_from_parallel(self.model)  # DDP/compile wrappers off; a PEFT model stays as is
        device = next(model.parameters()).device
        rows = [list(ids) for ids in prompt_ids for _ in range(n)]
        seeds = completion_seeds(seed, len(prompt_ids), n)
        if seeds is None:  # fresh randomness, drawn from the global generator (which seeding reproduces)
            seeds = [derive_seed(int(torch.randint(2**62, ()))) for _ in rows]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        config = generation_config(sampling, self.eos_token_ids, self.pad_token_id,
                                   cache_implementation=self.cache_implementation,
                                   suppress_tokens=list(suppress_tokens) if suppress_tokens else None)
        images = {}
        if vision is not None:
            from ..data.vision import vision_batch

            dtype = next(model.parameters()).dtype
            images = {k: v.to(device, dtype) if k.startswith("pixel_values") else v.to(device)
                      for k, v in vision_batch([part for part in vision for _ in range(n)], width).items()}
        processors = LogitsProcessorList([*_filters(sampling), SeededGumbelSampler(seeds, device)])
        was_training = model.training
        model.eval()
        try:
            output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                    logits_processor=processors, **images)
        finally:
            model.train(was_training)
        return [completion_from_tokens(i // n, generated, self.eos_token_ids)
                for i, generated in enumerate(output[:, width:].tolist())]


def completion_from_tokens(prompt_index: int, generated: list[int], eos_token_ids: Sequence[int]) -> Completion:
    """Keeps the tokens up to and including the first stop token (what follows is padding)."""
    for position, token in enumerate(generated):
        if token in eos_token_ids:
            return Completion(prompt_index, generated[: position + 1], None, True)
    return Completion(prompt_index, generated, None, False)
