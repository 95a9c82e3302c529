"""Llama forwards without transformers' per-module machinery, for the forwards that need no gradient.

A forward of a small model is mostly Python: `nn.Module.__call__` around every linear layer, norm and attention,
transformers' output-capturing and keyword-merging wrappers, attribute lookups through `nn.Module.__getattr__`.
On the tiny benchmark model (2 layers, hidden size 32) that is about a third of the 3 ms a decode step takes.
`llama_forward` runs what `LlamaForCausalLM.forward` runs: transformers' own mask function (a ready-made 4D mask
passes through it unchanged), the same tensor operations in the same order on the same tensors (the linear layers
as `F.linear` with their weights, the norms' and the rotary embedding's own code, transformers' attention
function, the cache's own `update`), so logits and cache are bitwise those of `model(...)`. It applies only where
that holds by construction: the exact Llama classes with plain `nn.Linear`/`nn.Embedding` layers and a SiLU MLP,
SDPA attention, no gradient, and no hooks anywhere (accelerate offloading, FSDP, DeepSpeed ZeRO-3 and test spies
all work through hooks); anything else (PEFT, quantized layers, other families) gets None and calls the model.
The decode loop uses it for its prefill and its steps, the online trainers for their old and reference log-probs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))


def _plain_linear(layer) -> bool:
    return type(layer) is nn.Linear and not _hooked(layer)


def _own_forward(module: nn.Module) -> bool:
    """No instance forward other than fused_layers' (which runs the class's forward when no gradient is wanted)."""
    from posttrain.models.fused_layers import is_fused_forward

    forward = vars(module).get("forward")
    return forward is None or is_fused_forward(forward)


def _eligible(model) -> bool:
    from transformers.activations import SiLUActivation
    from transformers.models.llama import modeling_llama as llama

    if type(model) is not llama.LlamaForCausalLM or torch.is_grad_enabled():
        return False
    if model.config._attn_implementation != "sdpa" or torch_module._has_any_global_hook():
        return False
    inner = model.model
    if (
        type(inner) is not llama.LlamaModel
        or type(inner.embed_tokens) is not nn.Embedding
        or not _plain_linear(model.lm_head)
        or type(inner.norm) is not llama.LlamaRMSNorm
    ):
        return False
    if any(_hooked(m) or not _own_forward(m) for m in model.modules()):
        return False
    for layer in inner.layers[: model.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            type(layer) is not llama.LlamaDecoderLayer
            or type(attn) is not llama.LlamaAttention
            or type(mlp) is not llama.LlamaMLP
            or not isinstance(mlp.act_fn, (SiLUActivation, nn.SiLU))
            or type(layer.input_layernorm) is not llama.LlamaRMSNorm
            or type(layer.post_attention_layernorm) is not llama.LlamaRMSNorm
        ):
            return False
        if not all(
            _plain_linear(p)
            for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ):
            return False
    return True


def llama_forward(model) -> Callable | None:
    """`forward(input_ids, attention_mask, position_ids, cache=None, logits_to_keep=0) -> logits`, equal to
    `model(input_ids=..., attention_mask=..., position_ids=..., cache=cache, use_cache=cache is not None,
    logits_to_keep=...).logits` (`attention_mask` 2D, or 4D ready for SDPA); with `hidden=True` the final
    hidden states the output layer would read instead of the logits. None when `model` is not one this
    module reproduces exactly (see the module docstring). The weights are looked up once: build a forward per use,
    not across optimizer steps that could replace parameters."""
    if not _eligible(model):
        return None
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
    from transformers.models.llama import modeling_llama as llama

    inner, config = model.model, model.config
    attention = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", llama.eager_attention_forward)
    rotate = llama.apply_rotary_pos_emb  # looked up as the attention's forward does (a patched one included)
    embedding, rotary, final_norm, head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
    layers = []
    for layer in inner.layers[: config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        projections = tuple(
            (p.weight, p.bias)
            for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        )
        dropout = attn.attention_dropout if attn.training else 0.0
        layers.append(
            (
                layer.input_layernorm,
                layer.post_attention_layernorm,
                attn,
                attn.head_dim,
                attn.layer_idx,
                attn.scaling,
                dropout,
                projections,
            )
        )

    def forward(
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        logits_to_keep: int = 0,
        hidden: bool = False,
    ) -> torch.Tensor:
        states = nn.Embedding.forward(embedding, input_ids)
        mask = create_causal_mask(
            config=config, inputs_embeds=states, attention_mask=attention_mask, cache=cache, position_ids=position_ids
        )
        cos, sin = rotary(states, position_ids)
        for norm_in, norm_post, attn, head_dim, layer_idx, scaling, dropout, weights in layers:
            (q_w, q_b), (k_w, k_b), (v_w, v_b), (o_w, o_b), (g_w, g_b), (u_w, u_b), (d_w, d_b) = weights
            residual = states
            x = llama.LlamaRMSNorm.forward(norm_in, states)
            input_shape = x.shape[:-1]
            shape = (*input_shape, -1, head_dim)
            query = F.linear(x, q_w, q_b).view(shape).transpose(1, 2)
            key = F.linear(x, k_w, k_b).view(shape).transpose(1, 2)
            value = F.linear(x, v_w, v_b).view(shape).transpose(1, 2)
            query, key = rotate(query, key, cos, sin)
            if cache is not None:
                key, value = cache.update(key, value, layer_idx)
            out, _ = attention(attn, query, key, value, mask, dropout=dropout, scaling=scaling)
            states = residual + F.linear(out.reshape(*input_shape, -1).contiguous(), o_w, o_b)
            residual = states
            x = llama.LlamaRMSNorm.forward(norm_post, states)
            states = residual + F.linear(F.silu(F.linear(x, g_w, g_b)) * F.linear(x, u_w, u_b), d_w, d_b)
        states = slice_logits_to_keep(llama.LlamaRMSNorm.forward(final_norm, states), logits_to_keep)
        return states if hidden else F.linear(states, head.weight, head.bias)

    return forward
