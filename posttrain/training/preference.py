"""What the preference trainers share (DPO, KTO, ORPO, CPO, BCO, TPO): one forward of a batch of sequences to
per-sequence completion log-probs, and the token metrics / MoE auxiliary loss they log the way TRL does.

`sequence_logps` scores only the completion tokens. When the model's output layer is a plain linear layer it
never builds the [tokens x vocab] logits: the decoder's hidden states at the positions that predict a completion
token go through `posttrain.losses.logprobs.linear_logps`, chunk by chunk. A right-padded batch is also laid out
anew when that saves enough work (`shared_layout`): the prompt a chosen and a rejected sequence share is computed
once, and pairs are packed into rows without padding; a 4D attention mask keeps each sequence to itself, so every
sequence gets the log-probs it would get alone (and a Mixture-of-Experts model the padded batch's load-balancing
loss: `models/router.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from posttrain.data.vision import vision_inputs
from posttrain.losses.logprobs import TokenScores, linear_logps, selective_log_softmax
from posttrain.losses.preference import length_desensitized_logps
from posttrain.models.layouts import forward_hidden, is_right_padded, model_shared_layout, output_head, sequence_view
from posttrain.models.reference import unwrap
from posttrain.models.router import balancing_loss_on_layouts, with_balancing_loss
from posttrain.models.tied_embedding import tied_embedding

STAT_NAMES = {"mean_logits": "logits", "entropy": "entropy", "top1": "top1"}


class SequenceLogps(NamedTuple):
    logps: torch.Tensor  # [N] log-prob of each sequence's completion (sum over its tokens; LD-DPO weighted)
    token_counts: torch.Tensor  # [N] completion tokens per sequence
    token_logps: torch.Tensor  # [N, L] per completion-token log-probs (0 elsewhere), for the 'sft' term
    mask: torch.Tensor  # [N, L] 1 on completion tokens
    stats: dict  # detached per-sequence sums [N] for the metrics (logits, entropy, top1); [N, L] log_sum_sq for WPO
    aux_loss: torch.Tensor | None  # a Mixture-of-Experts model's load-balancing loss


@torch.no_grad()
def _logits_stats(logits: torch.Tensor, index: torch.Tensor, log_sum_sq: bool, chunk: int = 256) -> dict:
    """The statistics of `linear_logps` from given logits rows [n, V], `chunk` rows at a time."""
    names = ("mean_logits", "entropy", "top1") + (("log_sum_sq",) if log_sum_sq else ())
    out = {name: logits.new_empty(index.shape, dtype=torch.float32) for name in names}
    for start in range(0, logits.shape[0], chunk):
        part = slice(start, start + chunk)
        z = logits[part].float()
        logp = z.log_softmax(-1)
        out["mean_logits"][part] = z.mean(-1)
        out["entropy"][part] = -(logp.exp() * logp).sum(-1)
        out["top1"][part] = (z.argmax(-1) == index[part]).float()
        if log_sum_sq:
            out["log_sum_sq"][part] = torch.logsumexp(2 * logp, -1)
    return out


def sequence_logps(
    model,
    batch: dict,
    ld_alpha: float | None = None,
    wpo: bool = False,
    router_logits: bool = False,
    stats: bool = True,
) -> SequenceLogps:
    """One forward of a `PreferenceCollator` batch (2B sequences, chosen first; or any batch of sequences with a
    `completion_mask`): per-sequence completion log-probs, token counts and, with `stats`, the detached
    per-sequence sums behind the metrics (and WPO's per-token log sum p^2 with `wpo`).

    `model` is a module or any callable returning `.logits` (then the full logits are computed)."""
    view = sequence_view(batch)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    vision = vision_inputs(batch)  # pixel values etc. of a vision-language batch
    head = None if vision else output_head(model)
    where = view.where
    # A Mixture-of-Experts model computes its load-balancing loss over the padded batch's 2D mask: on a new
    # layout its router logits are recorded and the loss weighted by the tokens each position stands for.
    moe = head is not None and (router_logits or getattr(unwrap(model).config, "output_router_logits", False))
    packed = None
    if (
        head is not None
        and (not moe or balancing_loss_on_layouts(model))
        and "attention_mask" in batch
        and is_right_padded(view.ids, batch["attention_mask"])
    ):
        packed = model_shared_layout(model, view)
        if packed is not None:
            inputs, where = packed
    inputs.update(vision)
    if moe and packed is not None:
        inputs["output_router_logits"] = False  # (recorded here instead)
    elif router_logits:
        inputs["output_router_logits"] = True
    # Position t of a sequence is predicted by its position t - 1.
    predictors = where[:, :-1][view.scored[:, 1:]]
    targets = view.ids[view.scored]
    if head is not None:
        with tied_embedding(unwrap(model), head.weight) as head_gradient:  # no second [vocab, hidden] gradient
            if router_logits and packed is not None:
                real = torch.arange(view.ids.shape[1], device=where.device)[None, :] < view.lengths[:, None]
                weights = torch.zeros(inputs["input_ids"].numel(), device=where.device).index_add_(
                    0, where[real], torch.ones(int(real.sum()), device=where.device)
                )  # the padded batch's tokens each position stands for
                (hidden, _), aux_loss = with_balancing_loss(
                    model, lambda: forward_hidden(model, inputs), weights.view_as(inputs["input_ids"])
                )
            else:
                hidden, outputs = forward_hidden(model, inputs)
                aux_loss = getattr(outputs, "aux_loss", None)
        rows = hidden.reshape(-1, hidden.shape[-1])[predictors]
        scores = linear_logps(
            rows, head.weight, targets, head.bias, stats=stats, log_sum_sq=wpo, on_weight_grad=head_gradient
        )
    else:
        outputs = model(**inputs, use_cache=False)
        aux_loss = getattr(outputs, "aux_loss", None)
        logits = outputs.logits.reshape(-1, outputs.logits.shape[-1])[predictors]
        extra = _logits_stats(logits.detach(), targets, wpo) if stats or wpo else {}
        scores = TokenScores(selective_log_softmax(logits, targets), **extra)
    return assemble_scores(view.scored, scores, ld_alpha, aux_loss)


def assemble_scores(scored: torch.Tensor, scores: TokenScores, ld_alpha: float | None, aux_loss) -> SequenceLogps:
    """`SequenceLogps` from the scores of the `scored` [N, L] tokens, in their row-major order."""
    mask = scored.to(torch.float32)

    def per_token(values: torch.Tensor) -> torch.Tensor:
        return mask.new_zeros(mask.shape).masked_scatter(scored, values.to(mask.dtype))

    token_logps = per_token(scores.logps)
    counts = mask.sum(-1)
    sums = {
        name: per_token(getattr(scores, field)).sum(-1)
        for field, name in STAT_NAMES.items()
        if getattr(scores, field) is not None
    }
    if scores.log_sum_sq is not None:
        sums["log_sum_sq"] = per_token(scores.log_sum_sq)
    if ld_alpha is None:
        logps = token_logps.sum(-1)
    else:
        half = counts.shape[0] // 2
        shared = torch.minimum(counts[:half], counts[half:]).repeat(2)
        logps = length_desensitized_logps(token_logps, mask, shared, ld_alpha)
    return SequenceLogps(logps, counts, token_logps, mask, sums, aux_loss)


class PreferenceMetricsMixin:
    """The metrics and MoE auxiliary loss of the trainers that score chosen/rejected (or desirable/undesirable)
    completions: entropy, num_tokens and token-weighted logits/<part> means as TRL logs them, and the router
    load-balancing loss joined with `router_aux_loss_coef` when `aux_loss_enabled`. Needs `_total_train_tokens`."""

    def add_aux_loss(self, loss: torch.Tensor, aux_loss) -> torch.Tensor:
        if not self.aux_loss_enabled or aux_loss is None:
            return loss
        self.record_metrics({"aux_loss": aux_loss.detach()})
        return loss + self.router_aux_loss_coef * aux_loss

    def record_token_metrics(self, stats: dict, counts: torch.Tensor, attention_tokens, parts: dict) -> None:
        """entropy, num_tokens and the token-weighted logits/<part> means, as TRL logs them."""
        totals = {"entropy": stats["entropy"].sum(), "tokens": counts.sum()}
        for name, part in parts.items():
            totals[f"logits/{name}"] = stats["logits"][part].sum()
            totals[f"tokens/{name}"] = counts[part].sum()
        summed = self.accelerator.gather(torch.stack(list(totals.values()))[None].float()).sum(0).tolist()
        totals = dict(zip(totals, summed))
        metrics = {"entropy": totals["entropy"] / max(totals["tokens"], 1)}
        for name in parts:
            if totals[f"tokens/{name}"]:
                metrics[f"logits/{name}"] = totals[f"logits/{name}"] / totals[f"tokens/{name}"]
        if self.model.training:
            tokens = self.accelerator.gather(attention_tokens.reshape(1)).sum().item()
            self._total_train_tokens += int(tokens)
        self._metrics["train" if self.model.training else "eval"]["num_tokens"] = [float(self._total_train_tokens)]
        self.record_metrics(metrics)
