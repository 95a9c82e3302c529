"""A decoder's last layer computed only at the positions a head reads (a reward model's scored tokens).

A sequence classifier reads one position per sequence, yet the decoder's last layer computes its attention queries,
its MLP and the final norm at every position. The positions after the last layer are independent of each other:
each needs its own query, the keys and values of every position, and its own residual stream. So the decoder is run
up to its last layer (a forward pre-hook stops it there), and the last layer is computed with its own modules
(norms, projections, MLP, the attention function its forward looks up) for the keys and values of every position and
for the queries, residuals and MLP of the read positions only. The result equals the full forward's at those
positions to float rounding (other matmul shapes). On the 2-layer, 32-wide reward model of the held-out script the
step became about a sixth shorter (docs/results/scaling.md); on a 24-layer model the last layer is at most about
4% of the work.

Used where the last layer is a known full-attention pre-norm layer with plain projections (`computes.KINDS`:
"pre_norm" layers, "projections" attention, a decoder without sliding-window masks) in one process without DDP,
FSDP or DeepSpeed (whose wrappers need the whole forward).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from posttrain.models.computes import kind_of


class _Stop(Exception):
    """Raised by the pre-hook on the last layer once its inputs are kept."""


def last_layer_parts(decoder: nn.Module) -> nn.Module | None:
    """The decoder's last layer when it can be computed at chosen positions (see the module docstring), else None."""
    layers = getattr(decoder, "layers", None)
    config = getattr(decoder, "config", None)
    if not isinstance(layers, nn.ModuleList) or config is None or len(layers) < 1:
        return None
    layer = layers[config.num_hidden_layers - 1] if len(layers) >= config.num_hidden_layers else None
    attention = getattr(layer, "self_attn", None)
    if (
        layer is None
        or kind_of(layer, "layer") != "pre_norm"
        or kind_of(attention, "attention") != "projections"
        or kind_of(decoder, "decoder") not in ("one_mask", "mask_per_layer_type")  # no sliding-window decoders
        or (getattr(config, "layer_types", None) or ["full_attention"])[-1] != "full_attention"
        or getattr(config, "use_bidirectional_attention", False)
        or config._attn_implementation not in ("sdpa", "eager")
        or not isinstance(getattr(decoder, "norm", None), nn.Module)
    ):
        return None
    return layer


def _attend_at(attention: nn.Module, normed: torch.Tensor, rows, columns, mask, cos, sin) -> torch.Tensor:
    """The attention output [N, hidden] of the queries at (rows[i], columns[i]) over every key of their row."""
    forward_globals = inspect.unwrap(type(attention).forward).__globals__
    rotate = forward_globals["apply_rotary_pos_emb"]
    function = forward_globals["ALL_ATTENTION_FUNCTIONS"].get_interface(
        attention.config._attn_implementation, forward_globals["eager_attention_forward"]
    )
    head_dim, (count, width) = attention.head_dim, normed.shape[:2]
    key = attention.k_proj(normed).view(count, width, -1, head_dim).transpose(1, 2)
    value = attention.v_proj(normed).view(count, width, -1, head_dim).transpose(1, 2)
    query = attention.q_proj(normed[rows, columns]).view(len(rows), 1, -1, head_dim).transpose(1, 2)
    _, key = rotate(key, key, cos, sin)
    cos, sin = cos.expand(count, width, -1), sin.expand(count, width, -1)  # (one row when positions are implied)
    query, _ = rotate(query, query, cos[rows, columns][:, None], sin[rows, columns][:, None])
    if mask is None:  # causal over the whole row
        mask = (torch.arange(width, device=normed.device)[None, :] <= columns[:, None])[:, None, None, :]
    else:
        mask = mask[rows, :, columns][:, :, None, :]
    out, _ = function(
        attention,
        query,
        key[rows],
        value[rows],
        mask,
        dropout=attention.attention_dropout if attention.training else 0.0,
        scaling=attention.scaling,
    )
    return attention.o_proj(out.reshape(len(rows), -1))


def hidden_at(model, decoder: nn.Module, layer: nn.Module, inputs: dict, where: torch.Tensor) -> torch.Tensor | None:
    """The decoder's final hidden states [N, hidden] at the flat positions `where` of `inputs`' rows x columns, with
    `layer` (the last, from `last_layer_parts`) computed at those positions only; `model(**inputs)` runs the decoder
    up to it. None when the mask that layer would get is not a plain 4D tensor or None, or its rotary embeddings
    are not passed by keyword (the forward then ran whole, unused: the caller runs its usual one; transformers'
    decoders of the recognised kinds do neither)."""
    kept = {}

    def stop(module, args, kwargs):
        mask, rotary = kwargs.get("attention_mask"), kwargs.get("position_embeddings")
        if rotary is None or (mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4)):
            return None
        kept.update(states=args[0] if args else kwargs["hidden_states"], mask=mask, rotary=rotary)
        raise _Stop

    handle = layer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(**inputs, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not kept:
        return None
    states, (cos, sin) = kept["states"], kept["rotary"]
    width = states.shape[1]
    rows, columns = where // width, where % width
    normed = layer.input_layernorm(states)
    residual = states[rows, columns] + _attend_at(layer.self_attn, normed, rows, columns, kept["mask"], cos, sin)
    residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
    return decoder.norm(residual)


__all__ = ["hidden_at", "last_layer_parts"]
