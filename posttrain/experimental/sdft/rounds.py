"""Generation rounds of the self-distillation trainers (SDFT, SDPO), in TRL's units.

steps_per_generation counts micro-batches (default gradient_accumulation_steps: completions are sampled for each
optimizer step) and generation_batch_size = per_device_train_batch_size x processes x steps_per_generation. A round
of k optimizer steps samples all its micro-batches at its first step, with the weights of that step; the later
steps train on them after the student has moved, so each rollout keeps the student's log-probs at sampling time
(`old_logps`) and the distillation loss is weighted by min(pi / pi_old, distillation_is_clip), as TRL does. A
round of fewer micro-batches than an optimizer step samples with the same weights as the rest of the step, which
is what sampling the whole step at once does.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError
from posttrain.losses.sft import IGNORE_INDEX, shift_for_next_token

__all__ = [
    "GenerationRounds",
    "completion_logits",
    "optimizer_steps_per_round",
    "resolve_generation_batch",
    "rollout_weights",
    "token_logps",
]


def resolve_generation_batch(config) -> None:
    """steps_per_generation / generation_batch_size as TRL resolves them; checked against what a round can be."""
    accumulation, micro = config.gradient_accumulation_steps, config.per_device_train_batch_size * config.world_size
    given = config.generation_batch_size
    if given is not None:
        if given < 1 or given % micro:
            raise ConfigError(
                f"generation_batch_size={given} must be a multiple of per_device_train_batch_size "
                f"({config.per_device_train_batch_size}) x processes ({config.world_size}) = {micro}."
            )
        if config.steps_per_generation not in (None, given // micro):
            raise ConfigError(
                f"generation_batch_size={given} means steps_per_generation={given // micro}, but "
                f"steps_per_generation={config.steps_per_generation} was set too. Set only one of them."
            )
        config.steps_per_generation = given // micro
    steps = config.steps_per_generation = config.steps_per_generation or accumulation
    if steps % accumulation and accumulation % steps:
        raise ConfigError(
            f"steps_per_generation={steps} (micro-batches per generation round, as in TRL) must be a multiple or a "
            f"divisor of gradient_accumulation_steps={accumulation}: a round feeds whole optimizer steps, or "
            f"part of one. Valid values: {sorted({d for d in range(1, accumulation + 1) if accumulation % d == 0})} "
            f"or {accumulation * 2}, {accumulation * 3}, ..."
        )
    config.generation_batch_size = micro * steps
    local = config.per_device_train_batch_size * accumulation
    if local % config.num_generations:
        raise ConfigError(
            f"per_device_train_batch_size * gradient_accumulation_steps ({local}) must be a multiple "
            f"of num_generations ({config.num_generations}): each prompt's completions are sampled "
            "in one optimizer step."
        )


def optimizer_steps_per_round(config) -> int:
    """Optimizer steps trained on one generation round (1 when a round is one step or part of one)."""
    return max(config.steps_per_generation // config.gradient_accumulation_steps, 1)


def completion_logits(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the model's logits at the completion tokens laid out [rows, width, vocab], those tokens [rows, width], which
    of the width are tokens, the raw logits) for a batch whose labels mark the completions."""
    targets = shift_for_next_token(inputs["labels"])
    mask = targets != IGNORE_INDEX
    raw = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False).logits
    lengths = mask.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    slots = torch.arange(width, device=mask.device)[None, :] < lengths[:, None]
    tokens = torch.zeros(slots.shape, dtype=torch.long, device=mask.device).masked_scatter(slots, targets[mask])
    logits = raw.new_zeros(*slots.shape, raw.shape[-1]).masked_scatter(slots[..., None], raw[mask])
    return logits, tokens, slots, raw


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]


def rollout_weights(logps: torch.Tensor, old_logps: torch.Tensor, clip: float) -> torch.Tensor:
    """min(pi / pi_old, clip) per token, detached (the log-ratio bounded to +-20 first, as TRL does)."""
    return torch.exp((logps.detach() - old_logps).clamp(-20.0, 20.0)).clamp(max=clip)


class GenerationRounds:
    """The micro-batches of the round being trained, one list per optimizer step, sampled at the round's first
    step (`take`)."""

    def __init__(self) -> None:
        self.steps: list[list[dict]] = []

    def take(self, trainer, epoch_iterator, num_batches: int, device, sample) -> tuple[list[dict], object]:
        """This optimizer step's micro-batches and item count; `sample(epoch_iterator, n)` draws and samples n
        micro-batches (fewer at the end of the epoch)."""
        steps = optimizer_steps_per_round(trainer.args)
        if steps == 1:
            batches = sample(epoch_iterator, num_batches)
            return batches, trainer._get_num_items_in_batch(batches, device)
        if not self.steps:
            batches = sample(epoch_iterator, num_batches * steps)
            if trainer.keeps_rollout_logps:
                with torch.no_grad():
                    for batch in batches:
                        logits, tokens, _, _ = completion_logits(trainer.model, batch)
                        batch["old_logps"] = token_logps(logits, tokens, trainer.loss_temperature())
            self.steps = [batches[i : i + num_batches] for i in range(0, len(batches), num_batches)]
        batches = self.steps.pop(0)
        return batches, trainer._get_num_items_in_batch(batches, device)

    def state(self) -> list[list[dict]]:
        return [[{k: v.cpu() if torch.is_tensor(v) else v for k, v in b.items()} for b in step] for step in self.steps]

    def load(self, steps: list[list[dict]], device) -> None:
        self.steps = [[{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in s] for s in steps]
