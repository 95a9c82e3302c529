"""Log-probabilities of given tokens, the quantity every preference and policy loss starts from.

`linear_logps` computes them straight from final hidden states and the output layer, a bounded number of rows at a
time, so that the [tokens x vocab] logits never exist at once: the backward pass recomputes each chunk's logits
instead of keeping them. Per token it can also give the detached statistics trainers log (mean logit, entropy,
whether the target is the argmax, log sum_v p_v^2 for WPO), from the same chunk of logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Floats of logits one chunk may hold (64 MiB in float32): rows per chunk = this // vocabulary size.
CHUNK_ELEMENTS = 1 << 24
# Floats of a chunk's softmax worked out together (1 MiB in float32): their temporary stays in the CPU's cache, and
# the chunk's logits are its only [chunk, vocab] tensor. Five rows of a 49k vocabulary, a whole chunk of a small one.
SOFTMAX_ELEMENTS = 1 << 18


def softmax_rows(vocab_size: int) -> int:
    """Rows of a chunk of logits whose softmax is worked out together."""
    return max(1, SOFTMAX_ELEMENTS // vocab_size)


class RowSoftmax(NamedTuple):
    """Per row of a chunk of logits: log sum_v exp(z_v), the (first) argmax, and, when asked for, the entropy and
    log sum_v p_v^2."""

    log_normalizer: torch.Tensor
    argmax: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq: torch.Tensor | None


def softmax_by_rows(
    z: torch.Tensor, *, probs: bool = False, entropy: bool = False, log_sum_sq: bool = False
) -> RowSoftmax:
    """The softmax statistics of logits z [N, V], exp(z - max) worked out `softmax_rows(V)` rows at a time so that
    the chunk itself is the only [N, V] tensor. z is overwritten: shifted by its row maxima, or with `probs` the
    probabilities. With m the row maximum and s = sum_v exp(z_v - m): log-normalizer m + log s, entropy
    log s - sum_v exp(z_v - m) (z_v - m) / s, log sum_v p_v^2 = log sum_v exp(2 (z_v - m)) - 2 log s."""
    rows = z.shape[0]
    log_normalizer, argmax = z.new_empty(rows), torch.empty(rows, dtype=torch.long, device=z.device)
    entropies = z.new_empty(rows) if entropy else None
    sums_sq = z.new_empty(rows) if log_sum_sq else None
    step = softmax_rows(z.shape[-1])
    for start in range(0, rows, step):
        few = slice(start, start + step)
        part = z[few]
        peak, top = part.max(-1, keepdim=True)
        argmax[few] = top.squeeze(-1)
        part -= peak
        exp = part.exp()
        total = exp.sum(-1)
        log_total = total.log()
        log_normalizer[few] = peak.squeeze(-1) + log_total
        if entropy:
            entropies[few] = log_total - dot_rows(exp, part) / total
        if log_sum_sq:
            sums_sq[few] = dot_rows(exp, exp).log() - 2 * log_total
        if probs:
            torch.div(exp, total[:, None], out=part)
        del exp  # before the next rows' temporary
    return RowSoftmax(log_normalizer, argmax, entropies, sums_sq)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., index] without keeping the full [.., vocab] log-softmax around.

    logits: [..., V]; index: [...] (same leading shape). Computed in float32 at least.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def gather_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, row_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """log_softmax(logits / temperature) at `index`, in the logits' dtype (TRL's `selective_log_softmax`). `index` has
    the logits' leading shape ([...] -> result [...]) or one more trailing dimension of k indices ([..., k] ->
    [..., k]). With `row_mask` (the logits' leading shape), rows where it is False are not computed and read 0.

    float32/float64 subtract one logsumexp per row from the picked logits; half precision takes the log-softmax row
    by row in its own dtype, so the values are exactly what `logits.log_softmax(-1).gather(...)` gives."""
    if temperature != 1.0:
        logits = logits / temperature
    if row_mask is not None:
        out = torch.zeros(index.shape, dtype=logits.dtype, device=logits.device)
        out[row_mask] = gather_log_softmax(logits[row_mask], index[row_mask])
        return out
    squeeze = index.dim() == logits.dim() - 1
    index = index.unsqueeze(-1) if squeeze else index
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, index) - torch.logsumexp(logits, dim=-1, keepdim=True)
    else:
        rows = [torch.gather(row.log_softmax(-1), -1, row_index) for row, row_index in zip(logits, index)]
        picked = torch.stack(rows)
    return picked.squeeze(-1) if squeeze else picked


def next_token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of `input_ids` under `logits` ([B, T, V]), aligned with input_ids: entry t is
    log p(input_ids[t] | input_ids[:t]); entry 0 has no prediction and is 0."""
    logps = selective_log_softmax(logits[:, :-1], input_ids[:, 1:])
    return torch.nn.functional.pad(logps, (1, 0), value=0.0)


class TokenScores(NamedTuple):
    """Per-row results of `linear_logps`; the statistics are detached and None unless asked for."""

    logps: torch.Tensor  # [N] log p(index), differentiable
    mean_logits: torch.Tensor | None = None  # [N] mean over the vocabulary of the logits
    entropy: torch.Tensor | None = None  # [N] -sum_v p_v log p_v
    top1: torch.Tensor | None = None  # [N] 1.0 where index is the (first) argmax
    log_sum_sq: torch.Tensor | None = None  # [N] log sum_v p_v^2


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def _logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits and their softmax sums in float32, or float64 for a float64 model (its references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(hidden, weight, bias, dtype) -> torch.Tensor:
    logits = hidden.to(dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    return logits.to(_logits_dtype(dtype))


def dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] * b[i, v] without an [N, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _LinearLogps(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias)[i, index[i]] by row chunks; the backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, chunk, stats: bool, log_sum_sq: bool, on_weight_grad):
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            rows, exact = hidden.shape[0], _logits_dtype(dtype)
            logz = hidden.new_empty(rows, dtype=exact)
            picked = hidden.new_empty(rows, dtype=exact)
            extra = {
                name: hidden.new_empty(rows, dtype=exact)
                for name, wanted in (
                    ("mean_logits", stats),
                    ("entropy", stats),
                    ("top1", stats),
                    ("log_sum_sq", log_sum_sq),
                )
                if wanted
            }
            for start in range(0, rows, chunk):
                part = slice(start, start + chunk)
                z = _chunk_logits(hidden[part], w, bias, dtype)
                target = index[part]
                picked[part] = z.gather(1, target[:, None]).squeeze(1)
                if stats:
                    extra["mean_logits"][part] = z.mean(-1)
                softmax = softmax_by_rows(z, entropy=stats, log_sum_sq=log_sum_sq)
                logz[part] = softmax.log_normalizer
                if stats:
                    extra["top1"][part] = (softmax.argmax == target).to(exact)
                    extra["entropy"][part] = softmax.entropy
                if log_sum_sq:
                    extra["log_sum_sq"][part] = softmax.log_sum_sq
                del z  # before the next chunk's logits
        ctx.save_for_backward(hidden, weight, bias, index, logz)
        ctx.chunk, ctx.dtype, ctx.on_weight_grad = chunk, dtype, on_weight_grad
        ctx.mark_non_differentiable(*extra.values())
        return (picked - logz, *extra.values())

    @staticmethod
    def backward(ctx, grad_logps, *_):
        hidden, weight, bias, index, logz = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        exact = _logits_dtype(dtype)
        grad_hidden = torch.zeros_like(hidden, dtype=exact) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=exact) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=exact) if need_bias else None
        w = weight.to(dtype)
        grad_logps = grad_logps.to(exact)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            h = hidden[part].to(dtype)
            g = grad_logps[part]
            # d log p_y / dz_v = 1[v = y] - p_v, times the incoming gradient of the row.
            grad_z = _chunk_logits(h, w, bias, dtype).sub_(logz[part, None]).exp_().mul_(-g[:, None])
            grad_z.scatter_add_(1, index[part, None], g[:, None])
            grad_z = grad_z.to(dtype)
            if grad_hidden is not None:
                grad_hidden[part] = grad_z @ w
            if grad_weight is not None and grad_weight.dtype == dtype:
                grad_weight.addmm_(grad_z.t(), h)
            elif grad_weight is not None:  # an autocast dtype: accumulate in float32 all the same
                grad_weight += (grad_z.t() @ h).to(exact)
            if grad_bias is not None:
                grad_bias += grad_z.sum(0)
            del grad_z  # before the next chunk's logits

        def cast(grad, like):
            return None if grad is None else grad.to(like.dtype)

        grad_weight = cast(grad_weight, weight)
        if ctx.on_weight_grad is not None and grad_weight is not None and ctx.on_weight_grad(grad_weight):
            grad_weight = None  # taken over: delivered to autograd with the embedding's rows added
        return cast(grad_hidden, hidden), grad_weight, cast(grad_bias, bias), None, None, None, None, None


def linear_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stats: bool = False,
    log_sum_sq: bool = False,
    chunk_size: int | None = None,
    on_weight_grad=None,
) -> TokenScores:
    """log_softmax(hidden @ weight.T + bias)[i, index[i]] for rows hidden [N, H], weight [V, H], index [N].

    Peak memory is one chunk of `chunk_size` rows of logits (default: CHUNK_ELEMENTS // V rows) and a few rows
    more, in the forward and in the backward pass, which recomputes the chunk's logits rather than storing them.
    Logits are float32, float64 for a float64 model (under autocast the matmuls run in the autocast dtype).
    `stats` adds the mean logit, entropy and top-1 flag per row, `log_sum_sq` adds log sum_v p_v^2 (WPO's
    weights), all detached.
    `on_weight_grad`, if given, is called in the backward pass with the weight's gradient; when it returns True it
    has taken the gradient over (a tied input embedding delivers it with its own rows added:
    `models/tied_embedding.py`) and the weight gets none from here.
    """
    chunk = chunk_size or max(1, CHUNK_ELEMENTS // weight.shape[0])
    outputs = _LinearLogps.apply(hidden, weight, bias, index, chunk, stats, log_sum_sq, on_weight_grad)
    names = (("mean_logits", "entropy", "top1") if stats else ()) + (("log_sum_sq",) if log_sum_sq else ())
    return TokenScores(outputs[0], **dict(zip(names, outputs[1:])))
