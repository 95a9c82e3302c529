"""How many completions a generation round holds, in TRL's units: steps_per_generation counts micro-batches
(default gradient_accumulation_steps: one optimizer step a round) and generation_batch_size =
per_device_train_batch_size x processes x steps_per_generation. The engine trains a round as whole optimizer steps
(`OnlineConfig.optimizer_steps_per_generation`)."""

from __future__ import annotations

import math

from posttrain.errors import ConfigError

__all__ = ["resolve_generation_batch"]


def resolve_generation_batch(config) -> None:
    """Sets generation_batch_size and steps_per_generation from whichever the user gave, in TRL's units:
    steps_per_generation counts micro-batches (default gradient_accumulation_steps, one optimizer step a
    round) and generation_batch_size = per_device_train_batch_size x processes x steps_per_generation."""
    accumulation, processes = config.gradient_accumulation_steps, config.world_size
    micro = config.per_device_train_batch_size * processes  # completions of one micro-batch, all processes
    if config.generation_batch_size is not None:
        if config.generation_batch_size < 1 or config.generation_batch_size % micro:
            raise ConfigError(
                f"generation_batch_size={config.generation_batch_size} must be a multiple of "
                f"per_device_train_batch_size ({config.per_device_train_batch_size}) x processes ({processes}) "
                f"= {micro} (steps_per_generation is generation_batch_size / {micro})."
            )
        derived = config.generation_batch_size // micro
        if config.steps_per_generation not in (None, derived):
            raise ConfigError(
                f"generation_batch_size={config.generation_batch_size} means steps_per_generation={derived} "
                f"({config.generation_batch_size} / {micro}), but steps_per_generation="
                f"{config.steps_per_generation} was set too. Set only one of them."
            )
        config.steps_per_generation = derived
    config.steps_per_generation = config.steps_per_generation or accumulation
    if config.steps_per_generation % accumulation:
        valid = ", ".join(str(accumulation * k) for k in range(1, 5))
        raise ConfigError(
            f"steps_per_generation={config.steps_per_generation} (micro-batches per generation round, as in TRL) "
            f"must be a multiple of gradient_accumulation_steps={accumulation}: a round feeds whole optimizer "
            f"steps. Valid values: {valid}, ... (generation_batch_size: {micro * accumulation} x k). Fewer "
            f"micro-batches than one optimizer step would be sampled with the same weights as the rest of the "
            f"step, which steps_per_generation={accumulation} does in one round."
        )
    config.generation_batch_size = micro * config.steps_per_generation
    local = config.per_device_train_batch_size * config.steps_per_generation
    n = config.num_generations
    if local % n:
        divisors = [d for d in range(config.min_num_generations, local + 1) if local % d == 0]
        steps = accumulation * n // math.gcd(n, config.per_device_train_batch_size * accumulation)
        raise ConfigError(
            f"num_generations={n} must divide the {local} completions each process generates per round "
            f"(per_device_train_batch_size {config.per_device_train_batch_size} x steps_per_generation "
            f"{config.steps_per_generation}), because all completions of a prompt are generated on one process. "
            f"Valid num_generations here: {divisors}; or keep num_generations={n} and make that product a "
            f"multiple of {n} (e.g. steps_per_generation={steps})."
        )
