"""Generation backends behind one interface (`GenerationBackend`); `create_generation_backend` is the one
place that decides which backend a trainer uses."""

from __future__ import annotations

from posttrain.generation.base import (
    Completion,
    GenerationBackend,
    SamplingParams,
    completion_seeds,
    derive_seed,
    stop_token_ids,
)
from posttrain.generation.transformers_backend import TransformersBackend


def create_generation_backend(model, tokenizer, args) -> GenerationBackend:
    """The backend for an online trainer: vLLM when `args.use_vllm` (docs/vllm.md), else transformers'
    `generate` on the training model."""
    stop_ids = stop_token_ids(tokenizer, model)
    # With rollout actors (rollout_backend="ray") vLLM runs in the actors; the trainer's own sampling (evaluation)
    # stays on transformers.
    if getattr(args, "use_vllm", False) and getattr(args, "rollout_backend", "local") != "ray":
        from posttrain.generation.vllm_backend import create_vllm_backend

        return create_vllm_backend(model, tokenizer, args, stop_ids)
    if getattr(args, "use_transformers_continuous_batching", False):
        from posttrain.generation.continuous_batching import ContinuousBatchingBackend

        return ContinuousBatchingBackend(
            model, tokenizer.pad_token_id, stop_ids, getattr(args, "transformers_continuous_batching_config", None)
        )
    return TransformersBackend(
        model, tokenizer.pad_token_id, stop_ids, cache_implementation=getattr(args, "cache_implementation", None)
    )


__all__ = [
    "Completion",
    "GenerationBackend",
    "SamplingParams",
    "TransformersBackend",
    "completion_seeds",
    "create_generation_backend",
    "derive_seed",
    "stop_token_ids",
]
