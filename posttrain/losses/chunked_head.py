"""TRL's chunked LM-head functions (`trl.kernels`) in PyTorch: per-token log-probabilities (with entropy and the other
per-token statistics TRL's kernel offers) and the student-teacher divergence, from hidden states and output layers,
without holding the [N, V] logits of all N tokens at once.

The tokens go through in chunks, each under activation checkpointing, so the backward pass recomputes a chunk's
logits instead of keeping them: peak memory is one chunk of logits. The logits are `hidden @ weight.T + bias`,
times `logit_scale`, soft-capped (`softcap * tanh(z / softcap)`) when a cap is given, over `temperature`, in float32
(float64 for float64 inputs), as TRL's. TRL runs the same arithmetic as a Triton kernel on CUDA/XPU and as torch
tiles elsewhere; this is posttrain's one implementation for every device (the trainers themselves use
`posttrain.losses.logprobs.linear_logps`)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.losses.distillation import generalized_jsd
from posttrain.runtime.distributed_backend import gather_partitioned

TOKEN_CHUNK_SIZE = 4096  # TRL's tile height: a chunk holds TOKEN_CHUNK_SIZE * chunk_size logits
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _logits(hidden, weight, bias, logit_scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _chunks(n: int, rows: int):
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def _run(fn, *tensors):
    """`fn(*tensors)`, under activation checkpointing when a gradient is being recorded."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return checkpoint(fn, *tensors, use_reentrant=False)
    return fn(*tensors)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
):
    """(log p(target), entropy, log sum_v p_v^2, mean logit, target is the first argmax) per row of hidden [N, H];
    each optional output None unless named in `outputs`. The log-probs and the entropy carry gradients to hidden,
    weight and bias; the other three are detached. `chunk_size` sets the chunk as TRL's vocabulary tile width does:
    a chunk holds TOKEN_CHUNK_SIZE * chunk_size logits."""
    vocab = getattr(weight, "ds_shape", weight.shape)[0]  # (ZeRO-3 holds a partitioned weight as an empty tensor)
    rows = max(1, TOKEN_CHUNK_SIZE * chunk_size // vocab)

    def chunk(h, w, b, t):
        with gather_partitioned(w, b):  # ZeRO-3: the weight is read directly, here and in the recomputation
            z = _logits(h, w, b, logit_scale, final_logit_softcapping, temperature)
        logp = z.log_softmax(-1)
        picked = logp.gather(-1, t[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        with torch.no_grad():
            stats = (torch.logsumexp(2 * logp, -1), z.mean(-1), z.argmax(-1) == t)
        return picked, entropy, *stats

    spans = _chunks(hidden.shape[0], rows) or [(0, 0)]  # no rows: an empty chunk, still connected to the graph
    parts = [_run(chunk, hidden[a:b], weight, bias, targets[a:b]) for a, b in spans]
    columns = list(zip(*parts)) if parts else [[]] * 5
    names = ("logprobs", *OPTIONAL_OUTPUTS)
    results = []
    for name, column in zip(names, columns):
        if name != "logprobs" and name not in outputs:
            results.append(None)
            continue
        value = torch.cat(column) if column else torch.zeros(0, device=hidden.device)
        results.append(value if name in ("logprobs", "entropy") else value.detach())
    return tuple(results)


def chunked_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    beta: float,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_final_logit_softcapping: float | None = None,
):
    """(divergence, student entropy) per token: `generalized_jsd` of the two heads' distributions at `temperature`
    (beta 0: KL(teacher || student), 1: KL(student || teacher), between: the generalized JSD). The gradient reaches
    the student only; the entropy is detached."""
    rows = max(1, TOKEN_CHUNK_SIZE * 32768 // student_weight.shape[0])  # TRL's vocabulary tile is 32768 wide

    def chunk(h, w, b, th):
        teacher = (teacher_logit_scale, teacher_final_logit_softcapping, 1.0)
        with gather_partitioned(w, b, teacher_weight, teacher_bias):  # ZeRO-3: the weights are read directly
            zs = _logits(h, w, b, student_logit_scale, student_final_logit_softcapping, 1.0)
            with torch.no_grad():
                zt = _logits(th, teacher_weight, teacher_bias, *teacher)
        with torch.no_grad():
            logp = (zs / temperature).log_softmax(-1)
            entropy = -(logp.exp() * logp).sum(-1)
        return generalized_jsd(zs, zt, beta, temperature=temperature), entropy

    n = student_hidden.shape[0]
    parts = [
        _run(chunk, student_hidden[a:b], student_weight, student_bias, teacher_hidden[a:b].detach())
        for a, b in _chunks(n, rows)
    ]
    if not parts:
        empty = torch.zeros(0, device=student_hidden.device)
        return empty, empty
    divergence, entropy = zip(*parts)
    return torch.cat(divergence), torch.cat(entropy).detach()


class ChunkedLogProbFunction:
    """TRL's `ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
    final_logit_softcapping=None, logit_scale=1.0, outputs=OPTIONAL_OUTPUTS)`: `chunked_logprobs`."""

    apply = staticmethod(chunked_logprobs)


class ChunkedDivergenceFunction:
    """TRL's `ChunkedDivergenceFunction.apply(student_hidden, student_weight, student_bias, teacher_hidden,
    teacher_weight, teacher_bias, beta, temperature=1.0, ...)`: `chunked_divergence`."""

    apply = staticmethod(chunked_divergence)


__all__ = [
    "OPTIONAL_OUTPUTS",
    "TOKEN_CHUNK_SIZE",
    "ChunkedDivergenceFunction",
    "ChunkedLogProbFunction",
    "chunked_divergence",
    "chunked_logprobs",
]
