"""Distillation from a teacher served remotely, with TRL's `trl.experimental.server_distillation` API.

The teacher is never loaded here: each micro-batch's sequences (prompt + completion, the student's own samples
or the data's, as in `DistillationTrainer`) are sent to an OpenAI-compatible vLLM server hosting the teacher
(`vllm serve TEACHER`, or `posttrain vllm-serve TEACHER`), whose `/v1/completions` route scores them without
generating (`prompt_logprobs`): per completion position, the teacher's top-`loss_top_k` tokens and its log-prob of
the token in the sequence. The divergence is therefore computed on a small support of token ids
(posttrain/losses/server_distillation.py): the teacher's top-k for forward KL (beta = 0), its top-1 and the
sampled token when beta > 0. Everything else (sampling, alpha's NLL mix, normalisation by the effective batch's
completion tokens, metrics) is `DistillationTrainer`'s. The server must use the student's tokenizer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from posttrain.errors import ConfigError, DataError
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError
from posttrain.losses.server_distillation import server_support, sparse_teacher_divergence
from posttrain.losses.sft import IGNORE_INDEX
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer
from posttrain.training.fields import config_field

CONNECT_TIMEOUT_S = 60.0  # how long the trainer waits for the teacher server to answer when it is built (as TRL)
START_HINT = (
    "start the teacher with `vllm serve TEACHER --port 8000` (or `posttrain vllm-serve TEACHER --port "
    "8000`) and set teacher_model_server_url to its address, e.g. 'http://localhost:8000'"
)


@dataclass
class ServerDistillationConfig(DistillationConfig):
    teacher_model_server_url: str | None = config_field(
        None, "Base URL of the vLLM server hosting the teacher, e.g. 'http://localhost:8000'. Required."
    )
    vllm_server_port: int = config_field(
        8001,
        "Port of the student's vLLM server (only with use_vllm); 8001 keeps it apart from the teacher's usual 8000.",
    )
    loss_top_k: int = config_field(
        1,
        "Teacher tokens per position the server reports and the divergence compares: any k >= 1 with beta=0 "
        "(forward KL), exactly 1 with beta > 0.",
        min=1,
    )
    loss_add_tail: bool = config_field(
        True,
        "Compare the mass outside the compared tokens as one more element (False: renormalise both "
        "distributions over the compared tokens).",
    )
    reverse_kl_top_1_mode: str = config_field(
        "sampled",
        "Which token the reverse-KL side of beta > 0 compares: 'sampled' (the completion's token; the only "
        "one a server can score).",
        choices=("sampled", "argmax"),
    )

    def __post_init__(self):
        if self.use_liger_kernel:
            raise ConfigError(
                "use_liger_kernel=True is not supported by ServerDistillationTrainer: a fused loss needs the "
                "teacher's full logits, and the server reports a few log-probs per position."
            )
        if self.reverse_kl_top_1_mode not in ("sampled", "argmax"):
            raise ConfigError(
                f"reverse_kl_top_1_mode must be one of ('sampled', 'argmax'), got {self.reverse_kl_top_1_mode!r}."
            )
        if self.reverse_kl_top_1_mode == "argmax":
            raise ConfigError(
                "reverse_kl_top_1_mode='argmax' is not supported: it compares the student's most likely token, "
                "which the teacher server cannot score (it reports its own top tokens and the sequence's). Use "
                "'sampled'."
            )
        if self.teacher_model_server_url is None or not self.teacher_model_server_url.strip():
            raise ConfigError(f"teacher_model_server_url must be set for ServerDistillationTrainer: {START_HINT}.")
        if self.beta > 0 and self.loss_top_k != 1:
            raise ConfigError(
                f"loss_top_k must be 1 with beta>0 (got loss_top_k={self.loss_top_k}, beta={self.beta}): with a "
                "reverse-KL part the support is the teacher's top-1 and the sampled token; set loss_top_k=1 (or "
                "beta=0)."
            )
        if self.padding_free or self.packing:
            raise ConfigError(
                "padding_free / packing: the teacher server scores each sequence on its own; set "
                "padding_free=False and packing=False."
            )
        super().__post_init__()


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


class ServerDistillationTrainer(DistillationTrainer):
    """`ServerDistillationTrainer(model, args=ServerDistillationConfig(teacher_model_server_url=...),
    train_dataset=...)`, TRL's keyword arguments in TRL's order. The server is reached once when the trainer is
    built, so a wrong address stops before any data is prepared."""

    _name = "Server Distillation"

    def __init__(
        self,
        model,
        args: ServerDistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        **kwargs,
    ):
        args = args or ServerDistillationConfig(output_dir="outputs/server_distillation")
        if kwargs.get("teacher_model") is not None or args.teacher_model_name_or_path is not None:
            raise ConfigError(
                "ServerDistillationTrainer's teacher is the one at teacher_model_server_url; drop "
                "teacher_model / teacher_model_name_or_path (or use DistillationTrainer for a local "
                "teacher)."
            )
        kwargs.pop("teacher_model", None)
        self.teacher_server = TeacherServer(args.teacher_model_server_url)
        super().__init__(
            model,
            None,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            **kwargs,
        )

    @staticmethod
    def _resolve_teacher(model, teacher_model, args):
        return None  # no local teacher

    def _divergence(self, inputs, student_logits, mask, temperature: float):
        """The sparse divergence against the server's log-probs at the masked positions (which predict the
        trained tokens), and the teacher's top-1 token there."""
        return server_divergence(self.teacher_server, self.args, inputs, student_logits, mask, temperature)


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


__all__ = [
    "ServerDistillationConfig",
    "ServerDistillationTrainer",
    "TeacherServer",
    "build_teacher_request_inputs",
    "server_divergence",
    "teacher_server_scores",
]
