"""TRL's `add_fused_lm_head` and `FusedCausalLMOutput` (`trl.trainer.utils`), for code written against TRL that
patches a model and calls `model(..., labels=labels, fused_lm_head=True)`.

posttrain's own trainers never patch a forward (they score hidden states with `losses.logprobs.linear_logps`); this
is the same per-token scoring offered TRL's way: the patched forward runs the backbone and sends only the positions
with a label through the LM head, in chunks (`losses.chunked_head.chunked_logprobs`, the arithmetic TRL's kernel
runs, logit scale and soft cap included), so the (batch, seq_len, vocab) logits never exist at once."""

from __future__ import annotations

import functools
import types
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from posttrain.losses.chunked_head import OPTIONAL_OUTPUTS, chunked_logprobs
from posttrain.models.router import balancing_loss_function

IGNORE_INDEX = -100
_VOCAB_TILE = 32768  # TRL's vocabulary tile width: sets the rows per chunk as TRL's does


@dataclass
class FusedCausalLMOutput(ModelOutput):
    """What a forward patched by `add_fused_lm_head` returns with `fused_lm_head=True`: per-token fields of shape
    (batch, seq_len - 1), or (batch, seq_len) with `shift_labels`, zero where the label is -100; the fields not asked
    for in `outputs` are None. `loss` is the mean negative log-likelihood over the labelled tokens (or their sum over
    `num_items_in_batch`), plus the weighted MoE load-balancing loss when router logits are asked for."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def _logit_scale(text_config) -> float:
    """The factor the model multiplies its logits by before any soft cap, under the names families give it."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return value
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is None:
        return 1.0
    return scaling if text_config.model_type == "hyperclovax" else 1 / scaling  # HyperCLOVA X multiplies


def _full(tensor):
    """An FSDP2-sharded parameter (a DTensor) gathered whole; anything else as it is."""
    return tensor.full_tensor() if tensor is not None and hasattr(tensor, "full_tensor") else tensor


def _balancing_loss(model, text_config, router_logits, attention_mask) -> torch.Tensor:
    found = balancing_loss_function(model)
    if found is None:  # the function every MoE family takes from Mixtral, with the config's expert counts
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        experts = getattr(text_config, "num_experts", None) or text_config.num_local_experts
        found = load_balancing_loss_func, experts, text_config.num_experts_per_tok
    function, experts, top_k = found
    return function(router_logits, experts, top_k, attention_mask)


def _score(model, settings, backbone_outputs, labels, shift_labels):
    """(per-token outputs in label shape, label mask) from the backbone's last hidden state."""
    temperature, cast_fp32, outputs = settings
    if shift_labels is None:
        hidden, labels = backbone_outputs.last_hidden_state[:, :-1], labels[:, 1:]
    else:
        hidden, labels = backbone_outputs.last_hidden_state, shift_labels
    head = model.get_output_embeddings()  # looked up per call: FSDP and PEFT replace it after patching
    hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
    mask = labels != IGNORE_INDEX
    context = nullcontext()
    if cast_fp32:
        hidden = hidden.float()
        context = torch.autocast(hidden.device.type, enabled=False)
    text_config = model.config.get_text_config()
    weight, bias = _full(head.weight), _full(head.bias)
    with context:
        scored = chunked_logprobs(
            hidden[mask],
            weight,
            bias,
            labels[mask],
            temperature,
            _VOCAB_TILE,
            getattr(text_config, "final_logit_softcapping", None),
            _logit_scale(text_config),
            tuple(outputs),
        )
    # masked_scatter keeps a batch without any label connected to the graph: its loss is a differentiable zero
    return [None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in scored], mask


def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    """Patch `model.forward` (TRL's `add_fused_lm_head`): with `fused_lm_head=True` it returns a
    `FusedCausalLMOutput` of per-token log-probs (and the other `outputs`: "entropy", "log_sum_sq_probs",
    "mean_logits", "is_top1") at `temperature`, the LM head in float32 outside autocast with
    `cast_lm_head_to_fp32`; without it, the original forward runs, so generation is unchanged. Patch before PEFT."""
    unknown = [name for name in outputs if name not in ("log_probs", *OPTIONAL_OUTPUTS)]
    if unknown:
        raise ValueError(
            f"add_fused_lm_head: outputs {unknown} are not per-token fields it computes; "
            f"choose among {('log_probs', *OPTIONAL_OUTPUTS)}."
        )
    original_forward = model.forward
    text_config = model.config.get_text_config()
    settings = (temperature, cast_lm_head_to_fp32, outputs)

    @functools.wraps(type(model).forward)  # the original signature: `generate` checks its kwargs against it
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            given = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original_forward(*args, **kwargs, **{k: v for k, v in given.items() if v is not None})
        if labels is None and shift_labels is None:
            raise ValueError("model(..., fused_lm_head=True) scores labels: pass labels= (or shift_labels=).")
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_outputs = self.base_model(*args, **kwargs)
        per_token, mask = _score(self, settings, backbone_outputs, labels, shift_labels)
        log_probs = per_token[0]
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _balancing_loss(self, text_config, backbone_outputs.router_logits, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
        return FusedCausalLMOutput(loss=loss, label_mask=mask, aux_loss=aux_loss, **dict(zip(names, per_token)))

    model.forward = types.MethodType(forward, model)


__all__ = ["FusedCausalLMOutput", "add_fused_lm_head"]
