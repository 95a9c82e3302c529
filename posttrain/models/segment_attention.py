"""Causal attention of padding-free rows one sequence at a time, instead of over the whole row under a mask.

In a padding-free batch (packed rows, or rows ending in a padding dummy sequence) the position ids restart at each
sequence and there is no attention mask. From the restarts transformers builds a [row x row] block-diagonal causal
mask, and SDPA computes every query-key pair of the row under it. Run on each sequence alone with `is_causal=True`,
the same outputs and gradients cost sum(length^2) instead of row^2: on the tiny SFT benchmark's packed rows (256
tokens, 1-4 sequences each) the attention's forward and backward take 25-35% less CPU time, a training step 6-10%.

`segment_attention(model)` switches a model that `supports_segment_attention` to the "posttrain_segments"
implementation registered here, for the duration of the block (the trainer's step): its mask function builds no
mask for a forward without attention mask and cache (the attention reads the sequences from the position ids, as
transformers would), and hands every other case to transformers' sdpa mask, which then always materialises the mask
so that the attention can tell "no mask" from "mask given"; its attention function runs transformers' sdpa on any
forward with a mask or without restarting positions. A forward of many very short sequences costs more in SDPA calls
than one masked call per row (`_CALL_COST`): then the block-diagonal mask is built once and shared by all layers.

For training, SDPA per sequence and a `torch.cat` would keep the attention output twice per layer: SDPA keeps each
sequence's output for its backward, o_proj keeps the concatenation for its weight gradient (~48 MB of SmolLM2-135M's
~810 MB of activations at ~706 tokens). Where SDPA would run its flash CPU kernel, `_PerSequence` calls that kernel
itself and joins the sequences' outputs into the one [batch, tokens, heads, dim] tensor it returns and saves, which
o_proj's input is a view of: the output is kept once, and the results are SDPA's to the bit.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from posttrain.models.computes import kind_of

NAME = "posttrain_segments"
# Set on a mask `segment_mask` built only because the attention must tell "no mask" from "mask given": plain
# causal rows, which the attention runs as SDPA's `is_causal`, as transformers does.
PLAIN_CAUSAL = "_posttrain_plain_causal"
# The fixed cost of one SDPA call (forward and backward, its Python included) on the CPU in query-key pairs of
# work: about 30 us for a 4-head 64-dim attention, whose 256 x 256 square takes 4.4 ms.
_CALL_COST = 32 * 32
# The dtypes of SDPA's flash CPU kernel (it hands the others to its math kernel).
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class _Layout:
    """The sequences of a padding-free batch: their lengths along the flattened rows, and the block-diagonal
    causal mask when the rows are to be attended under it (None: per sequence, or plain causal rows)."""

    def __init__(self, position_ids: torch.Tensor):
        rows, width = position_ids.shape
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1  # transformers' rule for a new sequence
        edges = starts.flatten().nonzero().flatten().tolist() + [rows * width]
        self.lengths = [end - start for start, end in zip(edges, edges[1:])]
        self.row_lengths = [[] for _ in range(rows)]  # (a row's first token always starts a sequence)
        for start, n in zip(edges, self.lengths):
            self.row_lengths[start // width].append(n)
        self.whole_rows = len(self.lengths) == rows
        self.per_sequence = not self.whole_rows and (
            sum(n * n + _CALL_COST for n in self.lengths) < rows * (width * width + _CALL_COST)
        )
        self.mask = None
        if not self.whole_rows and not self.per_sequence:
            ids = starts.cumsum(-1)
            causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
            self.mask = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def _layout(position_ids: torch.Tensor, batch: int) -> _Layout:
    """The batch's layout, worked out at the first layer and kept on the position ids for the others (and for the
    recomputation of gradient checkpointing, which gets the same tensor)."""
    # Changed in place since, or broadcast to another batch: worked out anew. (Inference tensors have no version.)
    key = (None if position_ids.is_inference() else position_ids._version, batch)
    kept, layout = getattr(position_ids, "_posttrain_layout", (None, None))
    if kept != key:
        layout = _Layout(position_ids.expand(batch, -1))
        position_ids._posttrain_layout = key, layout
    return layout


def _flash_inputs(module, query, key, value, dropout):
    """(query, key, value) cast as autocast casts them for SDPA, when SDPA would run them through its flash CPU
    kernel (the one `_PerSequence` calls); None otherwise, for SDPA itself to run them as it would."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    device = query.device.type
    if device != "cpu" or dropout or not torch.backends.cuda.flash_sdp_enabled():  # (the flag covers the CPU's)
        return None
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t if t.dtype == torch.float64 else t.to(dtype) for t in (query, key, value))
    heads, kv_heads = query.shape[1], key.shape[1]
    tensors = (query, key, value)
    if (
        query.dtype not in _FLASH_DTYPES
        or any(t.dtype != query.dtype or t.stride(-1) != 1 for t in tensors)
        or value.shape[1] != kv_heads
        or not query.shape[-1] == key.shape[-1] == value.shape[-1]
    ):
        return None
    if kv_heads != heads and (
        getattr(module, "num_key_value_groups", 1) * kv_heads != heads or not use_gqa_in_sdpa(None, key, value)
    ):
        return None  # SDPA would get the key and value repeated (or fail): left to it
    return tensors


def _sequences(states: torch.Tensor, row_lengths) -> list[torch.Tensor]:
    """Each sequence of [batch, heads, tokens, dim] states as a [1, heads, its tokens, dim] view, as the kernel takes
    them (a split per row: fewer calls than slicing each)."""
    return [part for row, lengths in enumerate(row_lengths) for part in states[row : row + 1].split(lengths, 2)]


def _joined(parts, batch: int) -> torch.Tensor:
    """The kernel's per-sequence [1, heads, tokens, dim] results, laid out tokens first, in one [batch, heads,
    tokens, dim] tensor laid out so too (as the projections' outputs; a transposed view of a contiguous one)."""
    whole = torch.cat([part.transpose(1, 2) for part in parts], 1)
    return whole.view(batch, -1, *whole.shape[2:]).transpose(1, 2)


class _PerSequence(torch.autograd.Function):
    """Causal attention of each sequence by SDPA's flash CPU kernel (as `F.scaled_dot_product_attention` runs it),
    the outputs joined into one [batch, tokens, heads, dim] tensor that is both returned and saved: the kernel's
    backward needs the output, o_proj keeps its input, and these are then one tensor instead of two."""

    @staticmethod
    def forward(ctx, query, key, value, row_lengths, scale):
        outputs, logsumexps = [], []
        for q, k, v in zip(*(_sequences(states, row_lengths) for states in (query, key, value))):
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal=True, scale=scale
            )
            outputs.append(out)
            logsumexps.append(logsumexp)
        out = _joined(outputs, query.shape[0]).transpose(1, 2)  # contiguous
        ctx.row_lengths, ctx.scale = row_lengths, scale
        ctx.save_for_backward(query, key, value, out, *logsumexps)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        query, key, value, out, *logsumexps = ctx.saved_tensors
        states = (grad.transpose(1, 2), query, key, value, out.transpose(1, 2))
        grads = [
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, q, k, v, o, logsumexp, 0.0, True, scale=ctx.scale
            )
            for (g, q, k, v, o), logsumexp in zip(zip(*(_sequences(t, ctx.row_lengths) for t in states)), logsumexps)
        ]
        return (
            *(
                _joined([g[i] for g in grads], grad.shape[0]) if needed else None
                for i, needed in enumerate(ctx.needs_input_grad[:3])
            ),
            None,
            None,
        )


def segment_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
):
    """transformers' attention-function interface; [batch, heads, tokens, dim] in, [batch, tokens, heads, dim] out."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

    if getattr(attention_mask, PLAIN_CAUSAL, False):  # causal rows without padding (`segment_mask`)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    batch, _, length, _ = query.shape
    layout = None
    causal = kwargs.get("is_causal")
    if (
        attention_mask is None
        and position_ids is not None
        and key.shape[2] == length
        and (getattr(module, "is_causal", True) if causal is None else causal)
    ):
        layout = _layout(position_ids, batch)
    if layout is None or not layout.per_sequence:
        mask = attention_mask if layout is None else layout.mask
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    flash = _flash_inputs(module, query, key, value, dropout)
    if flash is not None:
        return _PerSequence.apply(*flash, layout.row_lengths, scaling), None
    extra = {}
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and use_gqa_in_sdpa(None, key, value):
        extra["enable_gqa"] = True
    elif groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, **extra)
        for q, k, v in zip(*(_sequences(states, layout.row_lengths) for states in (query, key, value)))
    ]
    return _joined(outputs, batch).transpose(1, 2), None


def segment_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    use_vmap=False,
    **kwargs,
):
    """transformers' mask-function interface: None (no mask to build) for a full causal forward without attention
    mask, transformers' sdpa mask, always materialised, otherwise. Where transformers would have skipped that mask
    (an attention mask without padding: plain causal rows, SDPA's `is_causal`), the materialised mask is marked
    (`PLAIN_CAUSAL`) and the attention runs `is_causal` as transformers would: the flash kernel then skips the
    blocks above the diagonal, half the work of a long row, which an explicit mask does not let it skip."""
    from transformers.masking_utils import sdpa_mask

    if (
        attention_mask is None
        and local_size is None
        and not use_vmap
        and not q_offset
        and not kv_offset
        and q_length == kv_length
    ):
        return None
    arguments = (batch_size, q_length, kv_length, q_offset, kv_offset)
    options = dict(attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap)
    mask = sdpa_mask(*arguments, **options, **kwargs) if local_size is None else None  # None: skippable
    if mask is not None:
        return mask
    kwargs["allow_is_causal_skip"] = False
    mask = sdpa_mask(*arguments, **options, **kwargs)
    if local_size is None and mask is not None:
        setattr(mask, PLAIN_CAUSAL, True)
    return mask


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, segment_attention_forward)
    AttentionMaskInterface.register(NAME, segment_mask)


def _attention_config(model):
    """The config object the model's attention layers read their implementation from, when the model is a causal
    decoder whose decoder, layers and attention compute known kinds (`computes.KINDS`: they build their masks with
    transformers' mask functions from that config, hand the position ids to the attention function and look that
    function up by the config's implementation) with sdpa attention; else None. Sliding-window layers get their
    masks from transformers' sdpa mask as before; full-attention layers attend per sequence."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    decoder = getattr(base, "get_decoder", lambda: None)()
    layers = getattr(decoder, "layers", None)
    config = getattr(decoder, "config", None)
    if layers is None or not len(layers) or config is None or kind_of(decoder, "decoder") is None:
        return None
    if (
        config._attn_implementation != "sdpa"
        or not getattr(config, "is_causal", True)
        or getattr(config, "use_bidirectional_attention", False)
    ):
        return None
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if (
            kind_of(layer, "layer") is None
            or attention is None
            or kind_of(attention, "attention") is None
            or attention.config is not config
        ):
            return None
    return config


def supports_segment_attention(model) -> bool:
    """Whether `segment_attention` applies to `model` (see `_attention_config`)."""
    return _attention_config(model) is not None


@contextlib.contextmanager
def segment_attention(model, enabled: bool = True):
    """Within the block, `model` (if `enabled` and supported) attends with the implementation registered here."""
    config = _attention_config(model) if enabled else None
    if config is None:
        yield
        return
    _register()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
