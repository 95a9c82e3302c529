"""Asynchronous on-policy distillation with TRL's `trl.experimental.async_distillation` API, on the online engine's
asynchronous producer (posttrain/online/producers/thread.py): a background thread samples the student's completions
up to `max_staleness` rounds ahead of the one training, and the student is trained towards the teacher on them.

The teacher is a vLLM server (`teacher_server_urls`, TRL's protocol: `prompt_logprobs` of the student's tokens) or,
posttrain's addition, a local model (`teacher_model=`). Either way it is known only through its `teacher_top_k`
most likely tokens at each completion position (at `teacher_temperature`) and its log-prob of the sampled token, and
the loss is posttrain/losses/server_distillation.py's generalized JSD on that support: the teacher's top-k with
beta = 0 (forward KL), its top-1 and the sampled token otherwise, with the remaining mass as one more element when
`add_tail_bucket`. The student's side is exact (its full softmax at teacher_temperature). The loss is the token
mean over the optimizer step (TRL: over each micro-batch; the same with gradient_accumulation_steps=1). The
reward logged, `teacher_logprob`, is the teacher's mean log-prob of a completion's tokens: what distillation
raises.
"""

from __future__ import annotations

import torch

from posttrain.data.batches import pad_rows
from posttrain.errors import ConfigError
from posttrain.experimental.async_distillation.async_distillation_config import (
    DEFAULT_TEACHER_URL,
    AsyncDistillationConfig,
)
from posttrain.losses.policy import aggregate_loss
from posttrain.losses.server_distillation import server_support, sparse_teacher_divergence
from posttrain.models.reference import freeze
from posttrain.online.async_pipeline import (
    apply_dtype,
    refuse_trl_workers,
)
from posttrain.online.engine import Advantages, OnlineTrainer, Rollout
from posttrain.online.rollout import PROMPT_IDS_COLUMN
from posttrain.training.run_artifacts import default_output_dir

__all__ = ["AsyncDistillationConfig", "AsyncDistillationTrainer", "LocalTeacher"]


class LocalTeacher:
    """A teacher model in this process, answering what a teacher server answers."""

    def __init__(self, model, pad_token_id: int) -> None:
        self.model, self.pad_token_id = freeze(model), pad_token_id

    @torch.no_grad()
    def sequence_logprobs(
        self, sequences: list[list[int]], prompt_lengths: list[int], top_k: int, temperature: float
    ) -> list[tuple[list[list[int]], list[list[float]], list[float]]]:
        """Per sequence, for each position from its prompt length on: the teacher's top_k ids and log-probs (at
        `temperature`), and its log-prob of the sequence's token there."""
        device = next(self.model.parameters()).device
        ids, mask = pad_rows(sequences, self.pad_token_id, left=False)
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        logps = (logits.double()[:, :-1] / temperature).log_softmax(-1)
        top_logps, top_ids = logps.topk(top_k, dim=-1)
        sampled = logps.gather(-1, ids[:, 1:, None].to(device)).squeeze(-1)
        return [
            (
                top_ids[row, start - 1 : len(seq) - 1].tolist(),
                top_logps[row, start - 1 : len(seq) - 1].tolist(),
                sampled[row, start - 1 : len(seq) - 1].tolist(),
            )
            for row, (seq, start) in enumerate(zip(sequences, prompt_lengths))
        ]


class AsyncDistillationTrainer(OnlineTrainer):
    """`AsyncDistillationTrainer(model, args=AsyncDistillationConfig(...), train_dataset=...)`, with the teacher at
    teacher_server_urls, or `teacher_model=` (a model or its name) in this process."""

    _name = "Asynchronous On-Policy Distillation"
    config_class = AsyncDistillationConfig
    kl_in_loss = False
    loss_ignores_the_sampler = True  # a divergence to the teacher on the samples, whatever weights drew them

    def __init__(
        self,
        model,
        args: AsyncDistillationConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        rollout_worker=None,
        weight_transfer=None,
        teacher_model=None,
        **kwargs,
    ):
        refuse_trl_workers("AsyncDistillationTrainer", rollout_worker, weight_transfer)
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = AsyncDistillationConfig(output_dir=default_output_dir(name, "AsyncDistillation"))
        apply_dtype(model, args)
        self._scored: dict[tuple, tuple] = {}  # the teacher's answers for the round's sequences
        if teacher_model is not None and args.teacher_server_urls is not None:
            raise ConfigError(
                "Both teacher_model and teacher_server_urls are set; keep the one teacher to distil from."
            )
        if teacher_model is None:
            from posttrain.generation.teacher_server import TeacherServer

            self.teacher = TeacherServer(
                next(iter((args.teacher_server_urls or {"default": DEFAULT_TEACHER_URL}).values()))
            )
        super().__init__(
            model,
            [self.teacher_logprob],
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            **kwargs,
        )
        self.reward_columns.append(PROMPT_IDS_COLUMN)  # the teacher scores the prompt's tokens too
        if teacher_model is not None:
            from transformers import AutoModelForCausalLM

            if isinstance(teacher_model, str):
                teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=self.model.dtype)
            self.teacher = LocalTeacher(teacher_model.to(self.accelerator.device), self.processing_class.pad_token_id)
        if self.teacher_vocabulary() > self.model.get_output_embeddings().weight.shape[0]:
            raise ConfigError(
                "The teacher's vocabulary is larger than the student's: the teacher must use the "
                "student's tokenizer (its token ids index the student's vocabulary)."
            )

    def teacher_vocabulary(self) -> int:
        if isinstance(self.teacher, LocalTeacher):
            return self.teacher.model.get_output_embeddings().weight.shape[0]
        return 0  # a server is checked through the ids it reports

    # -- the logged reward ----------------------------------------------------------------------------------
    def teacher_logprob(self, completion_ids, **kwargs) -> list[float]:
        """The teacher's mean log-prob of each completion's tokens (at teacher_temperature)."""
        prompt_ids = kwargs[PROMPT_IDS_COLUMN]
        self._scored = {}  # this round's, so that its micro-batches need not ask the teacher again
        scored = self.teacher_scores(
            [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)], [len(p) for p in prompt_ids]
        )
        return [sum(own) / max(len(own), 1) for _, _, own in scored]

    def teacher_scores(self, sequences: list[list[int]], prompt_lengths: list[int]) -> list[tuple]:
        """The teacher's top-k ids and log-probs and its log-prob of the sequence's token at each completion
        position, from this round's scores where the sequence was scored already (else asked now)."""
        missing = [i for i, sequence in enumerate(sequences) if tuple(sequence) not in self._scored]
        if missing:
            fresh = self.teacher.sequence_logprobs(
                [sequences[i] for i in missing],
                [prompt_lengths[i] for i in missing],
                self.args.teacher_top_k,
                self.args.teacher_temperature,
            )
            self._scored.update({tuple(sequences[i]): answer for i, answer in zip(missing, fresh)})
        return [self._scored[tuple(sequence)] for sequence in sequences]

    # -- no advantages, no reference: the loss is the divergence ------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        return False  # beta is the divergence's interpolation here, not a KL coefficient

    @property
    def needs_old_logps(self) -> bool:
        return False

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        return Advantages(torch.zeros(len(rollout), device=rollout.rewards.device))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mask = self.args, inputs["loss_mask"].bool()
        _, _, outputs = self.completion_logps(model, inputs, return_outputs=True)
        logits = outputs.logits[:, :-1]  # position t predicts completion token t
        prompts = [row[m.bool()].tolist() for row, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
        completions = [row[m.bool()].tolist() for row, m in zip(inputs["completion_ids"], inputs["completion_mask"])]
        scored = self.teacher_scores([p + c for p, c in zip(prompts, completions)], [len(p) for p in prompts])
        shape = (*mask.shape, args.teacher_top_k)
        top_ids = torch.zeros(shape, dtype=torch.long)
        top_logps = torch.full(shape, float("-inf"), dtype=torch.float64)
        own = torch.full(mask.shape, float("-inf"), dtype=torch.float64)
        for row, (row_ids, row_logps, row_own) in enumerate(scored):
            top_ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long).view(-1, args.teacher_top_k)
            top_logps[row, : len(row_ids)] = torch.tensor(row_logps, dtype=torch.float64).view(-1, args.teacher_top_k)
            own[row, : len(row_own)] = torch.tensor(row_own, dtype=torch.float64)
        device = logits.device
        support, teacher, valid = server_support(
            top_ids.to(device)[mask],
            top_logps.to(device)[mask],
            inputs["completion_ids"][mask],
            own.to(device)[mask],
            args.beta,
        )
        per_token = torch.zeros(mask.shape, dtype=logits.dtype, device=device)
        per_token[mask] = sparse_teacher_divergence(
            logits[mask], support, teacher, valid, args.beta, args.add_tail_bucket, args.teacher_temperature
        ).to(logits.dtype)
        metrics = {}
        loss = aggregate_loss(per_token, mask, "dapo", total_tokens=inputs["total_tokens"])
        loss = self.add_router_aux_loss(loss * self.accelerator.num_processes, outputs, metrics)
        self.record_metrics(metrics)
        return (loss, None) if return_outputs else loss
