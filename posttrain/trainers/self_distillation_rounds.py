"""Generation rounds of the self-distillation trainers (SDFT, SDPO), in TRL's units.

steps_per_generation counts micro-batches (default gradient_accumulation_steps: completions are sampled for each
optimizer step) and generation_batch_size = per_device_train_batch_size x processes x steps_per_generation. A round
is sampled when an optimizer step needs more micro-batches than are left, with that step's weights; when the
accumulation steps are not a multiple of the round, some rollouts are trained at a later step than they were
sampled in, so every rollout keeps the student's log-probs at sampling (`old_logps`) and the distillation loss is
weighted by min(pi / pi_old, distillation_is_clip), as TRL does. A round that divides an optimizer step is sampled
with the whole step, as at the default.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError
from posttrain.losses.sft import IGNORE_INDEX, shift_for_next_token

__all__ = [
    "GenerationRounds",
    "completion_logits",
    "resolve_generation_batch",
    "rollout_weights",
    "rollouts_go_stale",
    "token_logps",
]


def resolve_generation_batch(config) -> None:
    """steps_per_generation / generation_batch_size as TRL resolves them; a process's rollouts of a round hold whole
    groups of num_generations."""
    micro = config.per_device_train_batch_size * config.world_size
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
    steps = config.steps_per_generation = config.steps_per_generation or config.gradient_accumulation_steps
    config.generation_batch_size = micro * steps
    local = config.per_device_train_batch_size * steps
    if local % config.num_generations:
        raise ConfigError(
            f"per_device_train_batch_size x steps_per_generation ({local}) must be a multiple of num_generations "
            f"({config.num_generations}): a prompt's completions are sampled in one generation round on one "
            f"process. Set steps_per_generation (or generation_batch_size) so that it is."
        )


def rollouts_go_stale(config) -> bool:
    """Whether some rollouts are trained at a later optimizer step than they were sampled in (TRL's rule: the
    accumulation steps are not a multiple of the round), so they keep their log-probs at sampling."""
    return config.gradient_accumulation_steps % config.steps_per_generation != 0


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
    """The sampled micro-batches not trained yet. A round of steps_per_generation micro-batches is sampled whenever
    an optimizer step needs more than are left (with that step's weights, as TRL does), so a round may feed several
    steps, or several rounds one step."""

    def __init__(self) -> None:
        self.buffer: list[dict] = []
        self.step, self.drawn = -1, 0  # micro-batches sampled at this optimizer step so far (their seeds differ)

    def take(self, trainer, epoch_iterator, num_batches: int, device, sample) -> tuple[list[dict], object]:
        """This optimizer step's micro-batches and item count; `sample(epoch_iterator, n)` draws and samples n
        micro-batches (fewer, or none, at the end of the epoch)."""
        args = trainer.args
        stale = rollouts_go_stale(args)
        size = args.steps_per_generation if stale else num_batches  # a round within a step: the step at once
        if trainer.state.global_step != self.step:
            self.step, self.drawn = trainer.state.global_step, 0
        while len(self.buffer) < num_batches:
            trainer.sample_offset = self.drawn
            batches = sample(epoch_iterator, size)
            self.drawn += len(batches)
            if not batches:
                break
            if stale and trainer.keeps_rollout_logps:
                with torch.no_grad():
                    for batch in batches:
                        logits, tokens, _, _ = completion_logits(trainer.model, batch)
                        batch["old_logps"] = token_logps(logits, tokens, trainer.loss_temperature())
            trainer.round_sampled(batches)
            self.buffer += batches
        batches, self.buffer = self.buffer[:num_batches], self.buffer[num_batches:]
        return batches, trainer._get_num_items_in_batch(batches, device)

    def state(self) -> list[dict]:
        return [{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()} for batch in self.buffer]

    def load(self, batches: list[dict], device) -> None:
        self.buffer = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
