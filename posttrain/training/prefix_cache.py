"""Scoring sequences whose log-probs are needed without gradient next to sequences trained with it, when each
shares a prefix with one of them: KTO's KL pairs, where prompt i is scored with another example's completion.

Computing both sets in one forward (`sequence_logps` with the pair sharing its prompt) also runs the backward pass
through the no-gradient continuations, whose gradient is zero everywhere: real work for nothing. Here the trained
sequences run alone (packed, with a 4D mask, gradient on) keeping their attention keys and values, and the
continuations past each shared prefix run after them without gradient, reading that prefix from the cache. Every
sequence gets the log-probs it gets alone (to rounding).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from posttrain.losses.logprobs import linear_logps
from posttrain.models.layouts import (
    SequenceView,
    can_repack,
    common_prefix,
    forward_hidden,
    is_right_padded,
    layout_settings,
    output_head,
    prefix_layout,
    sequence_view,
)
from posttrain.models.reference import unwrap
from posttrain.training.preference import SequenceLogps, assemble_scores


def applicable(model, batch: dict) -> bool:
    """Masks built by `masking_utils` (sdpa/eager), a right-padded batch, no MoE router loss, no gradient
    checkpointing (which turns the cache off), no sliding-window cache layers (they keep the last slots of a packed
    row, which the continuations do not read). (The caller also needs a linear output layer, `output_head`.)"""
    inner = unwrap(model)
    return (
        can_repack(model, batch["input_ids"].shape[1])
        and not any(layer.is_sliding for layer in DynamicCache(config=inner.config).layers)
        and "attention_mask" in batch
        and is_right_padded(batch["input_ids"], batch["attention_mask"])
        and not getattr(inner.config, "output_router_logits", False)
        and not getattr(inner, "is_activation_checkpointing", False)
    )


def _continuation_layout(
    starts: list[tuple[int, int]],
    shared: list[int],
    tails: list[int],
    rows: int,
    width: int,
    ids: torch.Tensor,
    mask_dtype: torch.dtype | None,
):
    """Inputs for the continuations: tail i (its tokens past `shared[i]`) goes in the row of trained sequence i,
    after the tails before it; it sees the first `shared[i]` cached positions of sequence i and its own tail.
    Returns (model inputs, [n, max tail] flat slot of each tail token)."""
    device = ids.device
    fill = [0] * rows
    offsets = []
    for (row, _), tail in zip(starts, tails):
        offsets.append(fill[row])
        fill[row] += tail
    tail_width = max(fill)
    owner = torch.full((rows, tail_width), -1, dtype=torch.long, device=device)  # continuation of each tail slot
    cached_owner = torch.full((rows, width), -1, dtype=torch.long, device=device)  # sequence whose prefix it is
    new_ids = torch.zeros((rows, tail_width), dtype=ids.dtype, device=device)
    positions = torch.zeros((rows, tail_width), dtype=torch.long, device=device)
    span = torch.arange(tail_width, device=device)
    slots = torch.zeros((len(tails), max(max(tails), 1)), dtype=torch.long, device=device)
    for i, ((row, start), cut, tail, offset) in enumerate(zip(starts, shared, tails, offsets)):
        cached_owner[row, start : start + cut] = i
        owner[row, offset : offset + tail] = i
        new_ids[row, offset : offset + tail] = ids[i, cut : cut + tail]
        positions[row, offset : offset + tail] = span[:tail] + cut
        slots[i, :tail] = row * tail_width + offset + span[:tail]
    query = owner[:, :, None]
    sees_cache = (query == cached_owner[:, None, :]) & (query >= 0)
    column = torch.arange(tail_width, device=device)
    sees_tail = ((query == owner[:, None, :]) & (query >= 0) & (column[None, :] <= column[:, None])) | (
        (query < 0) & (column[None, :] == column[:, None])
    )  # a filler slot sees itself (no empty row)
    allowed = torch.cat([sees_cache, sees_tail], dim=-1)[:, None]
    if mask_dtype is not None:
        allowed = torch.zeros(allowed.shape, dtype=mask_dtype, device=device).masked_fill_(
            ~allowed, torch.finfo(mask_dtype).min
        )
    return {"input_ids": new_ids, "position_ids": positions, "attention_mask": allowed}, slots


def trained_and_continuation_logps(
    model, batch: dict, n: int, stats: bool = True
) -> tuple[SequenceLogps, torch.Tensor] | None:
    """For a right-padded batch of 2n sequences, where sequence n + i continues a prefix of sequence i: the first n
    scored with gradient (as `sequence_logps` scores them) and the summed completion log-probs of the other n,
    detached. None without a linear output layer or where `applicable` says no."""
    head = output_head(model)
    if head is None or not applicable(model, batch):
        return None
    view = sequence_view(batch)
    hidden_size, mask_dtype = layout_settings(model)
    trained = SequenceView(view.ids[:n], view.scored[:n], view.where[:n], view.lengths[:n])
    # Packed even where that saves little over padding: the cache needs this layout's 4D mask either way.
    inputs, where = prefix_layout(trained, [[i] for i in range(n)], [0] * n, hidden_size, mask_dtype, min_saving=0)
    rows, width = inputs["input_ids"].shape
    lengths = view.lengths.tolist()
    shared = common_prefix(view, list(range(n)), list(range(n, 2 * n)))
    # A continuation's last token predicts nothing: only the tokens before it past the prefix need a forward.
    tails = [max(lengths[n + i] - 1 - shared[i], 0) for i in range(n)]
    first_slots = where[:, 0].tolist()
    starts = [(slot // width, slot % width) for slot in first_slots]
    cache = DynamicCache(config=unwrap(model).config)
    hidden, outputs = forward_hidden(model, inputs, cache=cache, use_cache=True)
    predictors = where[:, :-1][trained.scored[:, 1:]]
    scores = linear_logps(
        hidden.reshape(-1, hidden.shape[-1])[predictors],
        head.weight,
        trained.ids[trained.scored],
        head.bias,
        stats=stats,
    )
    with torch.no_grad():
        cached = hidden.detach().reshape(-1, hidden.shape[-1])
        # Position t of continuation i is predicted by position t - 1: inside the shared prefix that is trained
        # sequence i's own hidden state, past it the continuation's.
        ids = view.ids[n:]
        columns = torch.arange(ids.shape[1], device=ids.device)[None, :]
        cut = torch.tensor(shared, device=ids.device)[:, None]
        source = where.gather(1, (columns - 1).clamp(min=0, max=where.shape[1] - 1).expand_as(ids))
        if max(tails) > 0:
            more, slots = _continuation_layout(starts, shared, tails, rows, width, ids, mask_dtype)
            tail_hidden, _ = forward_hidden(model, more, cache=cache, use_cache=True)
            past = (columns - 1 - cut).clamp(min=0, max=slots.shape[1] - 1)
            source = torch.where(columns - 1 >= cut, cached.shape[0] + slots.gather(1, past), source)
            cached = torch.cat([cached, tail_hidden.reshape(-1, hidden.shape[-1])])
        scored = view.scored[n:]
        kl = linear_logps(cached[source[scored]], head.weight, ids[scored], head.bias).logps
        continuation = (
            torch.zeros(scored.shape, dtype=torch.float32, device=ids.device).masked_scatter(scored, kl.float()).sum(-1)
        )
    return assemble_scores(trained.scored, scores, None, getattr(outputs, "aux_loss", None)), continuation
