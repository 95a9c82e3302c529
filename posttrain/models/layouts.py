"""Sequence layouts: how a batch of sequences is laid out for one forward, and the output head's conditions.

A right-padded batch can be viewed as its sequences (`sequence_view`), repacked onto fewer, fuller rows with
position ids restarting at each sequence (`repacked`), or laid out so that the prompt a chosen and a rejected
sequence share is computed once (`shared_layout`, `prefix_layout`: a 4D mask keeps each sequence to itself, so
every sequence gets the log-probs it would get alone). `output_head` and `chunked_loss_unsupported` say when
log-probs may be computed from the decoder's hidden states and the output layer's weight, chunk by chunk.
"""

from __future__ import annotations

import inspect
import sys
from typing import NamedTuple

import torch
from torch import nn

from posttrain.data.collators import IGNORE_INDEX
from posttrain.errors import ConfigError
from posttrain.models.computes import kind_of
from posttrain.models.fast_forward import fast_forward
from posttrain.models.reference import unwrap

# Lay a padded batch out anew only if that saves at least this share of its cost (see `_cost`).
MIN_PACKING_SAVING = 0.1


def sequence_index(batch: dict) -> torch.Tensor:
    """[rows, T] index of the sequence each token belongs to: the row in a padded batch; in a padding-free
    row, the count of position-id restarts so far."""
    if "position_ids" in batch and "attention_mask" not in batch:
        return (batch["position_ids"] == 0).long().cumsum(-1) - 1
    rows, length = batch["input_ids"].shape
    return torch.arange(rows, device=batch["input_ids"].device)[:, None].expand(rows, length)


class SequenceView(NamedTuple):
    """A batch seen one right-padded row per sequence, whatever the layout the model is called with."""

    ids: torch.Tensor  # [N, L] token ids
    scored: torch.Tensor  # [N, L] bool: completion tokens that something predicts (never a sequence's first)
    where: torch.Tensor  # [N, L] flat index of each token among the model input's rows x columns
    lengths: torch.Tensor  # [N]


def is_right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bool:
    """Each row's tokens are its first `attention_mask.sum()` columns (posttrain's collators pad right; a user's
    may not)."""
    columns = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return input_ids.dim() == 2 and torch.equal(
        attention_mask.bool(), columns[None, :] < attention_mask.sum(-1)[:, None]
    )


def right_padded_view(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SequenceView | None:
    """The rows as a `SequenceView` (no scored mask) when the batch is right-padded, else None."""
    if not is_right_padded(input_ids, attention_mask):
        return None
    return SequenceView(
        input_ids,
        None,
        torch.arange(input_ids.numel(), device=input_ids.device).view_as(input_ids),
        attention_mask.sum(-1),
    )


def sequence_view(batch: dict) -> SequenceView:
    ids, mask = batch["input_ids"], batch["completion_mask"]
    if "attention_mask" in batch or "position_ids" not in batch:
        rows, width = ids.shape
        where = torch.arange(rows * width, device=ids.device).view(rows, width)
        lengths = (
            batch["attention_mask"].sum(-1)
            if "attention_mask" in batch
            else torch.full((rows,), width, device=ids.device)
        )
    else:  # padding-free: one row, split at each position-id restart
        lengths = torch.bincount(sequence_index(batch)[0])
        split = lengths.tolist()

        def per_sequence(values):
            return nn.utils.rnn.pad_sequence(list(torch.split(values, split)), batch_first=True)

        ids, mask = per_sequence(ids[0]), per_sequence(mask[0])
        where = per_sequence(torch.arange(batch["input_ids"].shape[1], device=ids.device))
    scored = mask.bool().clone()
    scored[:, 0] = False
    return SequenceView(ids, scored, where, lengths)


def output_head(model) -> nn.Linear | None:
    """The output layer when log-probs may be computed from the decoder's hidden states (a plain linear layer whose
    logits the model does not transform further, on a text model that exposes its decoder), else None."""
    if not isinstance(model, nn.Module):
        return None
    inner = unwrap(model)
    if not hasattr(inner, "get_decoder") or getattr(inner.config, "vision_config", None) is not None:
        return None
    try:
        check_chunked_loss_supported(inner)  # the conditions of SFT's chunked loss apply
        inner.get_decoder()
    except (ConfigError, AttributeError, NotImplementedError):
        return None
    return inner.get_output_embeddings()


def can_repack(model, width: int | None = None, windowed: bool = False) -> bool:
    """Whether sequences may share rows: transformers models that build their masks with `masking_utils` (which
    cuts a row at each position-id restart, and passes a custom 4D mask through unchanged) and attend with sdpa or
    eager, without linear-attention layers. With `width`, under a custom 4D mask (`shared_layout`): also no sliding
    window shorter than `width` tokens, since that mask does not apply it, unless `windowed` (the caller applies it
    with `windowed_masks`) and the decoder takes such masks."""
    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    module = sys.modules.get(type(inner).__module__)
    config = inner.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in kinds if kinds else window is not None
    too_short = width is not None and sliding and width > (window or 0)
    return (
        getattr(inner.config, "_attn_implementation", None) in ("sdpa", "eager")
        and module is not None
        and hasattr(module, "create_causal_mask")
        and kinds <= {"full_attention", "sliding_attention"}
        and not (too_short and not (windowed and _sliding_window(model) is not None))
    )


def _sliding_window(model) -> tuple[str, int] | None:
    """(decoder kind, window) when the model's decoder computes a kind with sliding-window layers whose masks can
    be given ready-made (`computes.KINDS`: one mask for all layers, or one per layer type); else None."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT
    decoder = getattr(inner, "base_model", inner)
    kind = kind_of(decoder, "decoder")
    window = getattr(decoder.config, "sliding_window", None)
    if kind == "window_mask" and window is not None:
        return kind, window
    if kind in ("mask_per_layer_type", "mask_and_rotary_per_layer_type"):
        if "sliding_attention" in decoder.config.layer_types:
            return kind, window
    return None


def windowed_masks(model, inputs: dict) -> dict:
    """`inputs` of a layout with a 4D mask (`prefix_layout`), for a model with sliding-window layers: their mask
    also keeps each query within the window of its sequence positions (as transformers' sliding mask: q - k <
    window), given alone where every layer slides, else by layer type. Unchanged for other models."""
    spec = _sliding_window(model)
    if spec is None:
        return inputs
    kind, window = spec
    mask, positions = inputs["attention_mask"], inputs["position_ids"]
    near = (positions[:, None, :, None] - positions[:, None, None, :]) < window
    sliding = mask & near if mask.dtype == torch.bool else mask.masked_fill(~near, torch.finfo(mask.dtype).min)
    masks = sliding if kind == "window_mask" else {"full_attention": mask, "sliding_attention": sliding}
    return {**inputs, "attention_mask": masks}


def _first_fit_decreasing(lengths: list[int], capacity: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(fill of each row, (row, offset) of each item) with rows of at most `capacity` tokens."""
    fills: list[int] = []
    placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for s in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, fill in enumerate(fills) if fill + lengths[s] <= capacity), len(fills))
        if row == len(fills):
            fills.append(0)
        placed[s] = (row, fills[row])
        fills[row] += lengths[s]
    return fills, placed


def _cost(rows: int, width: int, hidden_size: int | None) -> float:
    """Work of a forward over rows x width positions: the per-token layers (about 24 H^2 FLOPs a token) plus
    attention (4 H per pair of positions in a row), in units of one token's layers; attention ignored without H."""
    return rows * width * (1 + (width / (6 * hidden_size) if hidden_size else 0))


def _packing(units: list[int], hidden_size: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """First-fit decreasing with the row width (from the longest unit to twice it) that costs least."""
    capacities = {max(units) * (4 + k) // 4 for k in range(5 if hidden_size else 1)}
    return min(
        (_first_fit_decreasing(units, c) for c in sorted(capacities)),
        key=lambda layout: _cost(len(layout[0]), max(layout[0]), hidden_size),
    )


def repacked(view: SequenceView, hidden_size: int | None = None) -> tuple[dict, torch.Tensor] | None:
    """The sequences packed side by side into fewer rows, position ids restarting at 0 for each (models whose masks
    come from `masking_utils` keep them apart from that alone): (model inputs, new `where`), or None when that
    would not save MIN_PACKING_SAVING of the padded batch's cost (see `_cost`; `hidden_size` None counts positions
    only). Leftover room in a row is one filler sequence of token 0, whose outputs nothing reads."""
    lengths = view.lengths.tolist()
    count, width = view.ids.shape
    fills, placed = _packing(lengths, hidden_size)
    rows, packed_width = len(fills), max(fills)
    if _cost(rows, packed_width, hidden_size) > (1 - MIN_PACKING_SAVING) * _cost(count, width, hidden_size):
        return None
    device = view.ids.device
    starts = torch.tensor([row * packed_width + offset for row, offset in placed], device=device)
    columns = torch.arange(width, device=device)
    real = columns[None, :] < view.lengths[:, None]
    where = starts[:, None] + columns[None, :]
    positions = torch.arange(packed_width, device=device)[None, :] - torch.tensor(fills, device=device)[:, None]
    positions = positions.clamp(min=0).flatten()
    positions[where[real]] = columns.expand_as(where)[real]
    ids = torch.zeros(rows * packed_width, dtype=view.ids.dtype, device=device)
    ids[where[real]] = view.ids[real]
    inputs = {"input_ids": ids.view(rows, packed_width), "position_ids": positions.view(rows, packed_width)}
    return inputs, torch.where(real, where, 0)


def repacked_tokens(model, inputs: dict) -> tuple[dict, torch.Tensor] | None:
    """A right-padded batch of a per-token model (a token classifier on a causal decoder) on fewer, fuller rows
    (`repacked`): (model inputs, index [real tokens] of each real token of the padded batch, in row order, among
    the packed rows' flattened positions), or None when the batch has more than ids and mask, is not right-padded,
    would not save enough, or the model's decoder is not a causal decoder this library recognises (`computes.KINDS`:
    its masks keep each packed sequence to itself). Every real token then gets the output it gets in the padded
    batch."""
    base = unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base  # PEFT
    decoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if inputs.keys() != {"input_ids", "attention_mask"} or decoder is None or kind_of(decoder, "decoder") is None:
        return None
    view = right_padded_view(inputs["input_ids"], inputs["attention_mask"])
    packed = (
        None if view is None or not can_repack(model) else repacked(view, base.config.get_text_config().hidden_size)
    )
    if packed is None:
        return None
    packed_inputs, where = packed
    return packed_inputs, where[inputs["attention_mask"].bool()]


def shared_layout(
    view: SequenceView, hidden_size: int, mask_dtype: torch.dtype | None
) -> tuple[dict, torch.Tensor] | None:
    """`prefix_layout` of a right-padded batch of 2B sequences (chosen i and rejected i = sequence B + i): each
    pair is one unit sharing the prompt and any common start of its two completions. (An odd count: no pairs.)"""
    count = view.ids.shape[0]
    if count % 2:
        return prefix_layout(view, [[i] for i in range(count)], [0] * count, hidden_size, mask_dtype)
    pairs = count // 2
    return prefix_layout(
        view,
        [[i, pairs + i] for i in range(pairs)],
        common_prefix(view, list(range(pairs)), list(range(pairs, count))),
        hidden_size,
        mask_dtype,
    )


def common_prefix(view: SequenceView, firsts: list[int], others: list[int]) -> list[int]:
    """For each pair (firsts[i], others[i]) of sequences, how many leading tokens they have in common."""
    a, b = (torch.tensor(index, device=view.ids.device) for index in (firsts, others))
    columns = torch.arange(view.ids.shape[1], device=view.ids.device)
    both = torch.minimum(view.lengths[a], view.lengths[b])
    same = (view.ids[a] == view.ids[b]) & (columns[None, :] < both[:, None])
    return same.int().cumprod(-1).sum(-1).tolist()


def prefix_layout(
    view: SequenceView,
    units: list[list[int]],
    shared: list[int],
    hidden_size: int,
    mask_dtype: torch.dtype | None,
    min_saving: float = MIN_PACKING_SAVING,
) -> tuple[dict, torch.Tensor] | None:
    """A cheaper layout of a right-padded batch whose sequences come in groups ("units", lists of sequence
    indices) that start alike: the first sequence of unit u is laid out whole, and the others read its first
    `shared[u]` tokens (which they must equal: the prompt of DPO's pair, or of an online group's completions)
    and add only the rest of their own. Units are packed first-fit decreasing into rows. A 4D attention mask lets
    each token see its unit's shared prefix and its own sequence, and position ids continue the prefix in every
    branch, so every sequence gets exactly the hidden states it gets alone.

    Returns (model inputs, new `where`), or None when it would not save `min_saving` of the padded batch's cost
    (see `_cost`; the layout never costs more). `mask_dtype`: None for a boolean mask (sdpa), else the dtype of an
    additive one (eager)."""
    count, width = view.ids.shape
    device = view.ids.device
    columns = torch.arange(width, device=device)
    real = columns[None, :] < view.lengths[:, None]
    lengths = view.lengths.tolist()
    sizes = [lengths[m[0]] + sum(lengths[s] - shared[u] for s in m[1:]) for u, m in enumerate(units)]
    fills, placed = _packing(sizes, hidden_size)
    rows, packed_width = len(fills), max(fills)
    if _cost(rows, packed_width, hidden_size) > (1 - min_saving) * _cost(count, width, hidden_size):
        return None
    # Token t of sequence s sits at its unit's start + t, and past what it reads from the unit's first sequence
    # (`reads`), `jump` further: behind the sequences of its unit laid out before it.
    start, reads, jump, cut, unit_of, branch = ([0] * count for _ in range(6))
    for u, members in enumerate(units):
        base, cursor = placed[u][0] * packed_width + placed[u][1], lengths[members[0]]
        for k, s in enumerate(members):
            start[s], cut[s], unit_of[s], branch[s] = base, shared[u], u, k + 1
            if k:
                reads[s], jump[s] = shared[u], cursor - shared[u]
                cursor += lengths[s] - shared[u]

    def tensor(values):
        return torch.tensor(values, device=device)[:, None]

    where = tensor(start) + columns[None, :] + (columns[None, :] >= tensor(reads)) * tensor(jump)
    slots = rows * packed_width
    row_of_slot = torch.arange(slots, device=device) // packed_width
    unit = (len(units) + row_of_slot).clone()  # filler: one block per row
    segment = torch.zeros(slots, dtype=torch.long, device=device)  # 0: a unit's shared prefix, k: its k-th branch
    positions = torch.arange(slots, device=device) % packed_width - torch.tensor(fills, device=device)[row_of_slot]
    positions = positions.clamp(min=0)
    ids = torch.zeros(slots, dtype=view.ids.dtype, device=device)
    taken = where[real]
    unit[taken] = tensor(unit_of).expand_as(where)[real]
    positions[taken] = columns.expand_as(where)[real]
    ids[taken] = view.ids[real]
    past = real & (columns[None, :] >= tensor(cut))
    segment[where[past]] = tensor(branch).expand_as(where)[past]
    unit, segment = unit.view(rows, 1, packed_width), segment.view(rows, 1, packed_width)
    column = torch.arange(packed_width, device=device)
    allowed = (
        (unit.transpose(1, 2) == unit)
        & (column[None, None, :] <= column[None, :, None])
        & ((segment == 0) | (segment == segment.transpose(1, 2)))
    )[:, None]
    if mask_dtype is not None:
        allowed = torch.zeros(allowed.shape, dtype=mask_dtype, device=device).masked_fill_(
            ~allowed, torch.finfo(mask_dtype).min
        )
    inputs = {
        "input_ids": ids.view(rows, packed_width),
        "position_ids": positions.view(rows, packed_width),
        "attention_mask": allowed,
    }
    return inputs, torch.where(real, where, 0)


def model_shared_layout(model, view: SequenceView) -> tuple[dict, torch.Tensor] | None:
    """`shared_layout` of a right-padded batch for `model`, with the 4D mask its attention takes (boolean for sdpa,
    additive in the model's dtype for eager; sliding-window layers' own, `windowed_masks`); None where that mask
    cannot be used (`can_repack` with the width) or the layout would not save enough."""
    if not can_repack(model, view.ids.shape[1], windowed=True):
        return None
    layout = shared_layout(view, *layout_settings(model))
    return None if layout is None else (windowed_masks(model, layout[0]), layout[1])


def layout_settings(model) -> tuple[int, torch.dtype | None]:
    """(hidden size, mask dtype) that `prefix_layout` needs for `model`: a boolean mask for sdpa, an additive one in
    the model's dtype for eager attention."""
    config = unwrap(model).config
    eager = config._attn_implementation == "eager"
    return config.get_text_config().hidden_size, next(model.parameters()).dtype if eager else None


def forward_hidden(model, inputs: dict, **options):
    """(final hidden states [rows, T, H], model outputs); the model computes one position's logits only. `options`
    go to the model (default `use_cache=False`). A forward without gradient runs without the module wrappers where
    the model allows (`fast_forward`: the same hidden states; no outputs then)."""
    fast = fast_forward(model) if inputs.keys() <= {"input_ids", "attention_mask", "position_ids"} else None
    if fast is not None and options.keys() <= {"cache", "use_cache"}:
        cache = options.get("cache") if options.get("use_cache") else None
        positions = inputs.get("position_ids")
        if positions is None:  # as the model numbers them
            past = cache.get_seq_length() if cache is not None else 0
            positions = (torch.arange(inputs["input_ids"].shape[1], device=inputs["input_ids"].device) + past)[None]
        return fast(inputs["input_ids"], inputs.get("attention_mask"), positions, cache, hidden=True), None
    captured = {}

    def keep(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handle = unwrap(model).get_decoder().register_forward_hook(keep)
    try:
        outputs = model(**inputs, **{"use_cache": False, **options}, logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"], outputs


def chunked_loss_unsupported(model) -> str | None:
    """Why the chunked loss would compute this model's loss wrongly, or None. It computes logits as
    hidden @ W^T + b from the decoder's output and the output layer's own weight: models that transform their
    logits further, an adapter on the output layer, or a model without `get_decoder` / `logits_to_keep` break that."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attribute, None) not in (None, 1, 1.0):
            return (
                f"chunked_loss=True does not support models whose logits are transformed "
                f"({attribute}={getattr(config, attribute)}); set chunked_loss=False."
            )
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return (
            "chunked_loss=True does not support prompt learning (prompt tuning, p-tuning, prefix tuning), whose "
            "virtual tokens make the decoder's output longer than the labels; set chunked_loss=False."
        )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or any("lora" in name for name, _ in head.named_modules()):
        return (
            "chunked_loss=True needs a plain linear output layer; this one is "
            f"{type(head).__name__} (e.g. a LoRA adapter on lm_head). Set chunked_loss=False or "
            "leave lm_head out of the adapter's target modules."
        )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "get_decoder", lambda: None)()
    if decoder is None or decoder is base or "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return (
            f"chunked_loss=True needs a model with a separate decoder and a `logits_to_keep` argument; "
            f"{type(base).__name__} has not. Set chunked_loss=False."
        )
    return None


def check_chunked_loss_supported(model) -> None:
    """Raises ConfigError when `chunked_loss=True` cannot compute this model's loss (see `chunked_loss_unsupported`)."""
    reason = chunked_loss_unsupported(model)
    if reason is not None:
        raise ConfigError(reason)


def repack_padded_batch(
    inputs: dict, labels: torch.Tensor, hidden_size: int
) -> tuple[dict, torch.Tensor, torch.Tensor] | None:
    """A right-padded batch laid out on fewer, fuller rows (`preference_common.repacked`: sequences side by side,
    position ids restarting at 0, which keeps attention within each), with its labels moved along and -100 on each
    sequence's first token (the previous sequence's last token must not predict it), and [rows, width] 1.0 where a
    token of the padded batch sits, 0.0 on filler; None when the batch is not right-padded or repacking would not
    save enough. Every token then gets the loss it gets in the padded batch."""
    view = right_padded_view(inputs["input_ids"], inputs["attention_mask"])
    packed = None if view is None else repacked(view, hidden_size)
    if packed is None:
        return None
    real = inputs["attention_mask"].bool()
    packed_inputs, where = packed
    packed_labels = torch.full(
        (packed_inputs["input_ids"].numel(),), IGNORE_INDEX, dtype=labels.dtype, device=labels.device
    )
    packed_labels[where[real]] = labels[real]
    packed_labels[where[:, 0]] = IGNORE_INDEX
    taken = torch.zeros(packed_inputs["input_ids"].numel(), device=labels.device)
    taken[where[real]] = 1.0
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    shape = packed_inputs["input_ids"].shape
    return {**extra, **packed_inputs}, packed_labels.view(shape), taken.view(shape)


def uses_flash_attention(model) -> bool:
    """Whether the model attends with a flash-attention kernel (e.g. "flash_attention_2",
    "kernels-community/flash-attn3"), which sees packed sequence boundaries only in a one-row batch."""
    return "flash" in (model.config._attn_implementation or "")
