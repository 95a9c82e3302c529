"""TRL's self-distillation callback events, dispatched by SDFT and SDPO with TRL's names and keyword arguments.

A callback (a `transformers.TrainerCallback`, or any object in the trainer's callbacks) that defines one of these
methods is called with `args`, `state`, `control`, `model` and `processing_class`, plus, per generation round (every
`steps_per_generation` training micro-batches; every evaluation batch) in this order:

- `on_generation_prompts_selected(generation_prompts, generation_prompt_text=None)`: the raw prompt of each rollout
  of the round (the teacher's prompt with SDFT's `generate_from_teacher`);
- `on_teacher_context_built(teacher_input_ids, teacher_attention_mask, completion_mask, self_distillation_mask)`
  (SDPO only);
- `on_self_distillation_batch_prepared(old_per_token_logps, prompt_ids, completion_ids, teacher_input_ids,
  teacher_attention_mask[, self_distillation_mask with SDPO])`;
- `on_generation_batch_built(generate_every, steps_per_generation)` (training only).

The tensors are in TRL's layout, one row per rollout of the round: prompts left-padded, completions right-padded
(`completion_mask` marks their tokens), the teacher's rows its left-padded prompt followed by the same completion
block (so `teacher_attention_mask[:, -width:]` equals `completion_mask`); `old_per_token_logps` [rows, width] are the
student's log-probs at sampling where the round's rollouts keep them (accumulation steps not a multiple of the
round, as TRL), else None. posttrain trains the same rollouts in its own micro-batch layout; the events describe
them, and changing their tensors changes nothing in training."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.batches import pad


@dataclass
class RolloutRow:
    """One rollout of a round: the student's prompt ids, the completion ids, the teacher's prompt ids, whether it
    is distilled, and its raw generation prompt (text or messages)."""

    prompt: list[int]
    completion: list[int]
    teacher_prompt: list[int]
    active: bool
    generation_prompt: object


def dispatch(trainer, event: str, **payload) -> None:
    """Calls `event` on every callback that defines it, with TRL's common keyword arguments and `payload`."""
    for callback in trainer.callback_handler.callbacks:
        method = getattr(callback, event, None)
        if method is not None:
            method(
                args=trainer.args,
                state=trainer.state,
                control=trainer.control,
                model=trainer.model,
                processing_class=trainer.processing_class,
                **payload,
            )


def _padded(rows: list[list[int]], pad_id: int, side: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = pad([torch.tensor(r, dtype=torch.long) for r in rows], pad_id, side).to(device)
    mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], 0, side).to(device)
    return ids, mask


def _old_logps(batches: list[dict], width: int) -> torch.Tensor | None:
    """The round's micro-batches' log-probs at sampling as [rows, width] (0 past each completion), or None."""
    if not batches or any("old_logps" not in b for b in batches):
        return None
    parts = [b["old_logps"][:, :width] for b in batches]
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def round_events(trainer, rows: list[RolloutRow], batches: list[dict], mode: str, pad_id: int) -> None:
    """Dispatches one round's events (see the module) for its rollouts `rows`, sampled into `batches`."""
    if not rows or not any(hasattr(c, name) for c in trainer.callback_handler.callbacks for name in EVENTS):
        return
    device = batches[0]["input_ids"].device
    prompts = [r.generation_prompt for r in rows]
    dispatch(trainer, "on_generation_prompts_selected", generation_prompts=prompts, generation_prompt_text=None)
    prompt_ids, _ = _padded([r.prompt for r in rows], pad_id, "left", device)
    completion_ids, completion_mask = _padded([r.completion for r in rows], pad_id, "right", device)
    teacher_prompt_ids, teacher_prompt_mask = _padded([r.teacher_prompt for r in rows], pad_id, "left", device)
    teacher = {
        "teacher_input_ids": torch.cat([teacher_prompt_ids, completion_ids], 1),
        "teacher_attention_mask": torch.cat([teacher_prompt_mask, completion_mask], 1),
    }
    sd_mask = torch.tensor([float(r.active) for r in rows], device=device)
    extra = {}
    if trainer.reports_teacher_context:
        context = dict(completion_mask=completion_mask, self_distillation_mask=sd_mask)
        dispatch(trainer, "on_teacher_context_built", **teacher, **context)
        extra["self_distillation_mask"] = sd_mask
    dispatch(
        trainer,
        "on_self_distillation_batch_prepared",
        old_per_token_logps=_old_logps(batches, completion_ids.shape[1]),
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        **teacher,
        **extra,
    )
    if mode == "train":
        steps = trainer.args.steps_per_generation
        every = steps * getattr(trainer.args, "num_iterations", 1)
        dispatch(trainer, "on_generation_batch_built", generate_every=every, steps_per_generation=steps)


EVENTS = (
    "on_generation_prompts_selected",
    "on_teacher_context_built",
    "on_self_distillation_batch_prepared",
    "on_generation_batch_built",
)

__all__ = ["EVENTS", "RolloutRow", "dispatch", "round_events"]
