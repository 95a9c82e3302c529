"""A teacher model served by vLLM (`vllm serve`, `posttrain vllm-serve`), scored without generating: the client
that server distillation and IW-OPD's teacher server send their sequences to, the request builder that trims
each row's padding, and the scoring both methods share (`teacher_server_scores`, `server_divergence`)."""

from __future__ import annotations

import math
import time

import torch

from posttrain.errors import ConfigError, DataError
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError
from posttrain.losses.server_distillation import server_support, sparse_teacher_divergence
from posttrain.losses.sft import IGNORE_INDEX

CONNECT_TIMEOUT_S = 60.0  # how long the trainer waits for the teacher server to answer when it is built (as TRL)


START_HINT = (
    "start the teacher with `vllm serve TEACHER --port 8000` (or `posttrain vllm-serve TEACHER --port "
    "8000`) and set teacher_model_server_url to its address, e.g. 'http://localhost:8000'"
)


class TeacherServer:
    """A teacher behind an OpenAI-compatible vLLM server: log-probs of given token sequences, nothing generated."""

    def __init__(self, base_url: str, connect_timeout_s: float | None = None):
        self.client = VLLMClient(base_url)
        connect_timeout_s = CONNECT_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                models = self.client.request(
                    "GET", "/v1/models", what="reading the teacher server's model", timeout_s=10.0
                )["data"]
                break
            except (VLLMServerError, KeyError, TypeError) as err:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"teacher_model_server_url={base_url!r}: no teacher server answered within "
                        f"{connect_timeout_s:g} s ({err}). To fix it, {START_HINT}."
                    ) from None
                time.sleep(1.0)
        self.model = models[0]["id"]

    def sequence_logprobs(
        self, sequences: list[list[int]], prompt_lengths: list[int], top_k: int, temperature: float
    ) -> list[tuple[list[list[int]], list[list[float]], list[float]]]:
        """Per sequence, for each position from its prompt length on: (the teacher's top_k ids, their log-probs,
        padded with id 0 / -inf), and its log-prob of the sequence's token there (-inf if not reported)."""
        body = {
            "model": self.model,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": top_k,
        }
        answer = self.client.request("POST", "/v1/completions", body, what="scoring completions with the teacher")
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(sequences):
            raise VLLMServerError(f"The teacher server answered {len(choices)} choices for {len(sequences)} sequences.")
        return [
            _position_logprobs(c["prompt_logprobs"], seq, start, top_k)
            for c, seq, start in zip(choices, sequences, prompt_lengths)
        ]


def _logprob(entry: dict) -> float:
    value = float(entry["logprob"])
    return -math.inf if math.isnan(value) else value


def _position_logprobs(prompt_logprobs: list, sequence: list[int], start: int, top_k: int):
    ids, logps, actual = [], [], []
    for position in range(start, len(sequence)):
        reported = prompt_logprobs[position] or {}
        ranked = sorted(reported.items(), key=lambda item: item[1]["rank"])[:top_k]
        ids.append([int(token) for token, _ in ranked] + [0] * (top_k - len(ranked)))
        logps.append([_logprob(entry) for _, entry in ranked] + [-math.inf] * (top_k - len(ranked)))
        own = reported.get(str(sequence[position]))
        actual.append(-math.inf if own is None else _logprob(own))
    return ids, logps, actual


def build_teacher_request_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[int], list[int]]:
    """(each row's unpadded token ids, its prompt length, its completion length): what the teacher server is sent.
    The prompt length is the row's `prompt_attention_mask` sum, or else its tokens minus its labelled ones."""
    if input_ids.shape != attention_mask.shape:
        raise DataError(
            f"input_ids and attention_mask must have the same shape, got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}."
        )
    keep = attention_mask.detach().cpu().bool()
    lengths = keep.sum(1)
    if prompt_attention_mask is not None:
        prompt_lengths = prompt_attention_mask.detach().cpu().sum(1)
    elif labels is None:
        raise DataError("labels are required when prompt_attention_mask is not provided.")
    elif labels.shape != input_ids.shape:
        raise DataError(f"labels must match input_ids shape, got {tuple(labels.shape)} and {tuple(input_ids.shape)}.")
    else:
        prompt_lengths = lengths - (labels.detach().cpu() != IGNORE_INDEX).sum(1)
    sequences = [row[mask].tolist() for row, mask in zip(input_ids.detach().cpu(), keep)]
    prompts = [int(n) for n in prompt_lengths]
    for sequence, prompt in zip(sequences, prompts):
        if not 0 <= prompt <= len(sequence):
            raise DataError(f"Invalid prompt length {prompt} for trimmed sequence of length {len(sequence)}.")
    return sequences, prompts, [len(seq) - prompt for seq, prompt in zip(sequences, prompts)]


def teacher_server_scores(server: TeacherServer, inputs: dict, mask: torch.Tensor, k: int, temperature: float, needed):
    """The server's (top-k ids [B, T, k], their log-probs, its log-prob of the sequence's next token [B, T]) at
    each position p of `mask` (which predicts token p + 1), on the inputs' device; `needed(topk_logps, actual)` is
    what must be reported at every masked position (else a DataError)."""
    ids, valid_len = inputs["input_ids"], inputs["attention_mask"].sum(-1).tolist()
    rows = mask.nonzero()  # (row, position) of every compared logit, position p predicting token p + 1
    sequences, starts = [], []
    for row in range(len(ids)):
        positions = rows[rows[:, 0] == row, 1]
        sequences.append(ids[row, : int(valid_len[row])].tolist())
        starts.append(int(positions[0]) + 1 if len(positions) else len(sequences[-1]))
    shape = (*mask.shape, k)
    topk_ids = torch.zeros(shape, dtype=torch.long)
    topk_logps = torch.full(shape, -math.inf, dtype=torch.float64)
    actual = torch.full(mask.shape, -math.inf, dtype=torch.float64)
    for row, (start, (row_ids, row_logps, row_actual)) in enumerate(
        zip(starts, server.sequence_logprobs(sequences, starts, k, temperature))
    ):
        if row_ids:
            span = slice(start - 1, start - 1 + len(row_ids))
            topk_ids[row, span] = torch.tensor(row_ids)
            topk_logps[row, span] = torch.tensor(row_logps, dtype=torch.float64)
            actual[row, span] = torch.tensor(row_actual, dtype=torch.float64)
    device = mask.device
    topk_ids, topk_logps, actual = topk_ids.to(device), topk_logps.to(device), actual.to(device)
    missing = mask & ~torch.isfinite(needed(topk_logps, actual))
    if missing.any():
        raise DataError(
            f"The teacher server reported no log-prob for {int(missing.sum())} of {int(mask.sum())} "
            "completion positions. Check that it serves a model with the student's tokenizer and "
            f"allows prompt_logprobs={k} (vLLM's --max-logprobs)."
        )
    return topk_ids, topk_logps, actual


def server_divergence(server: TeacherServer, args, inputs, student_logits, mask, temperature: float):
    """(The summed sparse divergence of the masked positions against the server's log-probs, the teacher's top-1
    token there): forward KL on its top loss_top_k with beta = 0, the mixed top-1 support with beta > 0."""
    topk_ids, topk_logps, actual = teacher_server_scores(
        server,
        inputs,
        mask,
        args.loss_top_k,
        temperature,
        lambda topk, own: own if args.beta > 0 else topk[..., 0],
    )
    ids = inputs["input_ids"]
    sampled = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # the token each position predicts
    support, teacher, valid = server_support(topk_ids[mask], topk_logps[mask], sampled[mask], actual[mask], args.beta)
    divergence = sparse_teacher_divergence(
        student_logits[mask], support, teacher, valid, args.beta, args.loss_add_tail, temperature
    )
    return divergence.sum(), topk_ids[mask][:, 0]
