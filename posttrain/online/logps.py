"""The online trainers' forward: per-token log-probs (and entropies) of a rollout's completions under a model.

A micro-batch of an online round holds groups of completions of one prompt (GRPO's `num_generations`). Computed the
obvious way, every completion carries its own copy of the prompt through the model: with SmolLM2 chat prompts of
~60 tokens and 16-token completions, most of the training forward and backward is the same prompt again. Where the
model allows it (`preference_common.can_repack`, a plain output layer, no images), each group's prompt is computed
once and its completions follow it under a 4D mask (`preference_common.prefix_layout`, as DPO does with a pair's
prompt), and the log-probs come from the hidden states through `linear_logps`, chunk by chunk, without the
[tokens x vocab] logits. The numbers are the padded forward's up to float rounding (tests/online/test_logps.py).

Either way, a forward that needs no gradient runs without the model's module wrappers where it can
(`models/fast_forward.py`, bitwise the model's); where the shared layout does not apply, the model runs on the
padded batch. Padded completion positions get log-prob and entropy 0 on every route.
"""

from __future__ import annotations

import torch

from posttrain.losses.logprobs import linear_logps, selective_log_softmax
from posttrain.losses.policy import entropy_from_logits
from posttrain.models.fast_forward import fast_forward
from posttrain.models.layouts import SequenceView, can_repack, common_prefix, layout_settings, prefix_layout
from posttrain.models.reference import unwrap
from posttrain.online.vision import forward_vision_inputs, uses_own_positions
from posttrain.training.preference import forward_hidden, output_head


def completion_logps(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = False,
    return_outputs: bool = False,
    entropy_grad: bool = False,
):
    """Per-token log-probs [B, T] of the completion tokens under `model` (logits divided by the sampling
    `temperature`, as they were sampled), and their entropies when `with_entropy` (with a gradient only if
    `entropy_grad`). With `return_outputs` the model's outputs (every completion position's logits, PPO's values)
    come third; the shared-prompt route is then not taken."""
    images = forward_vision_inputs(batch, model)
    mask = batch["completion_mask"].bool()
    grad_entropy = with_entropy and entropy_grad and torch.is_grad_enabled()
    if not (images or return_outputs or grad_entropy):
        shared = shared_prompt_logps(model, batch, temperature, with_entropy)
        if shared is not None:
            return shared
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    width = batch["completion_ids"].shape[1]
    fast = None if images or return_outputs else fast_forward(model)  # no gradient: the same logits, faster
    outputs = (
        None
        if fast is not None
        else model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            logits_to_keep=width + 1,
            use_cache=False,
            position_ids=None if uses_own_positions(images) else position_ids,
            **images,
        )
    )
    logits = (
        outputs.logits if fast is None else fast(input_ids, attention_mask, position_ids, logits_to_keep=width + 1)
    )[:, :-1] / temperature
    logps = selective_log_softmax(logits, batch["completion_ids"]).masked_fill(~mask, 0.0)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(grad_entropy):
            entropy = entropy_from_logits(logits).masked_fill(~mask, 0.0)
    return (logps, entropy, outputs) if return_outputs else (logps, entropy)


def shared_prompt_layout(model, batch: dict[str, torch.Tensor]):
    """(model inputs, `where` [B, P + T] of each sequence position among the inputs' slots, prompt lengths [B]) of
    the shared-prompt route, or None where it does not apply or would not save enough (`prefix_layout`)."""
    if output_head(model) is None or getattr(unwrap(model).config, "output_router_logits", False):
        return None  # (a Mixture-of-Experts balancing loss would count the layout's filler tokens)
    prompt_mask, completion_mask = batch["prompt_mask"].bool(), batch["completion_mask"].bool()
    prompt_width, width = prompt_mask.shape[1], completion_mask.shape[1]
    prompt_lengths, completion_lengths = prompt_mask.sum(1), completion_mask.sum(1)
    columns = torch.arange(prompt_width + width, device=prompt_mask.device)
    left_padded = torch.equal(prompt_mask, columns[None, :prompt_width] >= (prompt_width - prompt_lengths)[:, None])
    right_padded = torch.equal(completion_mask, columns[None, :width] < completion_lengths[:, None])
    if not (left_padded and right_padded and can_repack(model, prompt_width + width)):
        return None
    # Each sequence right-padded: its prompt's real tokens, then its completion's.
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    order = torch.argsort((~torch.cat([prompt_mask, completion_mask], dim=1)).int(), dim=1, stable=True)
    view = SequenceView(ids.gather(1, order), None, None, prompt_lengths + completion_lengths)
    groups: dict[tuple, list[int]] = {}
    for row, (prompt, length) in enumerate(zip(batch["prompt_ids"].tolist(), prompt_lengths.tolist())):
        groups.setdefault(tuple(prompt[prompt_width - length :]), []).append(row)
    units = list(groups.values())
    firsts, others = [m[0] for m in units for _ in m[1:]], [s for m in units for s in m[1:]]
    common = iter(common_prefix(view, firsts, others) if others else [])
    shared = [min([next(common) for _ in m[1:]], default=0) for m in units]
    layout = prefix_layout(view, units, shared, *layout_settings(model))
    return None if layout is None else (*layout, prompt_lengths)


def shared_prompt_logps(model, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
    """(log-probs [B, T], entropies [B, T] or None) by the shared-prompt route, or None where it does not apply."""
    layout = shared_prompt_layout(model, batch)
    if layout is None:
        return None
    inputs, where, prompt_lengths = layout
    completion_ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
    columns = torch.arange(completion_ids.shape[1], device=mask.device)
    # Completion token t of a row is predicted at its sequence position prompt length + t - 1.
    before = (prompt_lengths[:, None] + columns[None, :] - 1).clamp(max=where.shape[1] - 1)
    predictors = where.gather(1, before)[mask]
    hidden = forward_hidden(model, inputs)[0]  # (without gradient, the fast forward's)
    head = output_head(model)
    # (A float32 head on a lower-precision model, cast_lm_head_to_fp32, takes float32 inputs, as its forward does.)
    rows = hidden.reshape(-1, hidden.shape[-1])[predictors].to(head.weight.dtype) / temperature
    scores = linear_logps(
        rows,
        head.weight,
        completion_ids[mask],
        None if head.bias is None else head.bias / temperature,
        stats=with_entropy,
    )
    zeros = torch.zeros(mask.shape, dtype=scores.logps.dtype, device=mask.device)
    logps = zeros.masked_scatter(mask, scores.logps)
    entropy = zeros.masked_scatter(mask, scores.entropy) if with_entropy else None
    return logps, entropy
