"""A decoder's last layer computed only at the positions a head reads (a reward model's scored tokens).

A sequence classifier reads one position per sequence, yet the decoder's last layer computes its attention, its MLP
and the final norm at every position. After the last layer's keys and values the positions are independent, so the
decoder runs up to its last layer (a forward pre-hook keeps that layer's inputs and stops it), and the last layer is
computed with its own modules: the attention module's own forward (its projections, its rotary embedding) under an
attention function registered through transformers' public `AttentionInterface`, which keeps only the read queries
and hands them to the function the model was set to use ("sdpa": transformers' own; "eager": softmax(q k^T) v as
transformers' eager computes it); then `o_proj`, the residual, the MLP and the final norm at the read positions
only. Nothing is looked up in a modeling file's module globals, so a transformers release that renames or re-signs
its helpers changes nothing here. The result equals the full forward's at those positions to float rounding (other
matmul shapes).

Anything else runs the whole forward (`why_not` says why): silently correct, never silently different. That is a
last layer that is not a recognised pre-norm layer (`computes.KINDS`), attention other than the recognised plain
projections, an MoE or unrecognised MLP, a decoder whose tail is not known to be the final norm, sliding-window or
alternating attention, bidirectional attention, attention implementations other than sdpa and eager, requested
attentions or hidden states, PEFT adapters, gradient checkpointing, DDP, FSDP (1 and 2), DeepSpeed, torch.compile,
and at run time a mask that is neither None nor a 4D tensor the read queries' rows can be taken from.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from posttrain.models.computes import kind_of

_FUNCTION_NAME = "posttrain_scored_positions"
_active: list[dict] = []  # the call in progress: read positions and the implementation the model was set to use


class _Stop(Exception):
    """Raised by the pre-hook on the last layer once its inputs are kept, and by the attention function with the
    read queries' output."""


def _wrapped(model: nn.Module) -> str | None:
    """Why `model` (as the trainer calls it) needs its whole forward: a distributed, compiled or adapter wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        return "a DDP or DataParallel wrapper"
    for module in model.modules():
        name = type(module).__module__ or ""
        if name.startswith(("torch.distributed", "deepspeed", "torch._dynamo")) or "FSDP" in type(module).__name__:
            return "FSDP, DeepSpeed or torch.compile"
        if name.startswith("peft."):
            return "a PEFT adapter"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "DeepSpeed ZeRO-3 parameters"
    return None


def _windowed(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return any(kind != "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is not None or bool(getattr(config, "attention_chunk_size", None))


def why_not(model: nn.Module, decoder: nn.Module) -> str | None:
    """Why the last layer of `decoder` (inside `model`) cannot be computed at chosen positions, or None if it can."""
    layers, config = getattr(decoder, "layers", None), getattr(decoder, "config", None)
    if not isinstance(layers, nn.ModuleList) or config is None or len(layers) != config.num_hidden_layers:
        return "not a decoder with one ModuleList of its config's layers"
    layer = layers[-1]
    attention = getattr(layer, "self_attn", None)
    checks = (
        (kind_of(layer, "layer") != "pre_norm", "the last layer is not a recognised pre-norm layer"),
        (kind_of(attention, "attention") != "projections", "its attention is not recognised plain projections"),
        (kind_of(getattr(layer, "mlp", None), "mlp") not in ("gated", "fused_gated"), "its MLP is MoE or unknown"),
        (kind_of(decoder, "decoder") not in ("one_mask", "mask_per_layer_type", "window_mask"), "unknown decoder"),
        (_windowed(config), "sliding-window or alternating attention"),
        (getattr(config, "use_bidirectional_attention", False), "bidirectional attention"),
        (not getattr(attention, "is_causal", True), "non-causal attention"),
        (config._attn_implementation not in ("sdpa", "eager"), f"attention {config._attn_implementation!r}"),
        (getattr(getattr(attention, "config", None), "sub_configs", None), "an attention config with sub-configs"),
        (
            getattr(config, "output_attentions", False) or getattr(config, "output_hidden_states", False),
            "attentions or hidden states requested",
        ),
        (not isinstance(getattr(decoder, "norm", None), nn.Module), "no final norm"),
        (
            getattr(decoder, "gradient_checkpointing", False) or getattr(layer, "gradient_checkpointing", False),
            "gradient checkpointing",
        ),
    )
    reason = next((why for failed, why in checks if failed), None)
    return reason or _wrapped(model)


def _eager(query, key, value, mask, dropout, scaling, training):
    """softmax(q k^T * scaling + mask) v, the softmax in float32, as transformers' eager attention computes it."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        weights = weights.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else weights + mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def _read_queries(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: attention of the read queries only, raised (the rest of the forward,
    `o_proj` at every position, is not needed)."""
    call = _active[-1]
    rows, columns = call["rows"], call["columns"]
    count, width = query.shape[0], query.shape[2]
    if attention_mask is None:  # causal over the whole row
        mask = (torch.arange(key.shape[2], device=query.device)[None, :] <= columns[:, None])[:, None, None, :]
    else:
        mask = attention_mask.expand(count, attention_mask.shape[1], width, attention_mask.shape[3])
        mask = mask[rows, :, columns][:, :, None, :]
    query, key, value = query[rows, :, columns][:, :, None, :], key[rows], value[rows]
    dropout, scaling = kwargs.get("dropout", 0.0), kwargs.get("scaling", query.shape[-1] ** -0.5)
    if call["implementation"] == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, dropout=dropout, scaling=scaling)
    else:
        out = _eager(query, key, value, mask, dropout, scaling, module.training)
    raise _Stop(out.reshape(len(rows), -1))


@contextlib.contextmanager
def _reading(config, rows, columns):
    """The model's config set to `_read_queries` for the duration (restored after, on errors too; a model is not
    run by two threads at once here)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _FUNCTION_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_FUNCTION_NAME, _read_queries)
    implementation = config._attn_implementation
    _active.append({"rows": rows, "columns": columns, "implementation": implementation})
    config._attn_implementation = _FUNCTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = implementation
        _active.pop()


def _last_layer_at(layer, states, kwargs, rows, columns) -> torch.Tensor | None:
    """The last (pre-norm) layer's output [N, hidden] at (rows[i], columns[i]); None when its mask cannot be read."""
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        return None
    if mask is not None and (mask.shape[0] not in (1, states.shape[0]) or mask.shape[2] not in (1, states.shape[1])):
        return None
    attention = layer.self_attn
    try:
        with _reading(attention.config, rows, columns):
            attention(hidden_states=layer.input_layernorm(states), **kwargs)
    except _Stop as stop:
        attended = stop.args[0]
    else:  # (the attention forward did not call the attention function: not the forward recognised)
        return None
    residual = states[rows, columns] + attention.o_proj(attended)
    return residual + layer.mlp(layer.post_attention_layernorm(residual))


def _run(model, decoder: nn.Module, inputs: dict, stop_at: nn.Module | None) -> tuple[dict, dict]:
    """`model(**inputs)`, stopped before `stop_at` (its inputs kept) when given, else whole (the decoder's output
    kept)."""
    kept, captured = {}, {}

    def stop(module, args, kwargs):
        if len(args) > 1:  # (only the hidden states positional, as transformers' decoders call their layers)
            return None
        kept.update(states=args[0] if args else kwargs["hidden_states"], kwargs=kwargs)
        raise _Stop

    def keep(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    handles = [decoder.register_forward_hook(keep)]
    if stop_at is not None:
        handles.append(stop_at.register_forward_pre_hook(stop, with_kwargs=True))
    try:
        model(**inputs, use_cache=False)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return kept, captured


def scored_hidden(model, decoder: nn.Module, inputs: dict, where: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The decoder's final hidden states [N, hidden] at the flat positions `where` of `inputs`' rows x columns, and
    None, or the reason (`why_not`) the whole forward ran instead. `model(**inputs)` runs the decoder; its own
    output (a classifier's pooled logits) is not used."""
    reason = why_not(model, decoder)
    if reason is None and (inputs.get("output_attentions") or inputs.get("output_hidden_states")):
        reason = "attentions or hidden states requested"
    kept, captured = _run(model, decoder, inputs, None if reason else decoder.layers[-1])
    if kept:
        states, layer = kept["states"], decoder.layers[-1]
        rows, columns = where // states.shape[1], where % states.shape[1]
        kwargs = {k: v for k, v in kept["kwargs"].items() if k != "hidden_states"}
        hidden = _last_layer_at(layer, states, kwargs, rows, columns)
        if hidden is not None:
            return decoder.norm(hidden), None
        reason = "a mask or attention forward it cannot read"
        _, captured = _run(model, decoder, inputs, None)
    hidden = captured["hidden"]
    return hidden.reshape(-1, hidden.shape[-1])[where], reason or "the last layer was called with other arguments"


__all__ = ["scored_hidden", "why_not"]
