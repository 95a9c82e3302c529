"""Self-distillation on posttrain's DistillationTrainer: the base SDFT and SDPO (posttrain.experimental.sdft, .sdpo)
share.

The student samples a completion for the plain `prompt`; the teacher, a copy of the student itself (`base`: the
initial weights, `ema`: an exponential moving average, `live`: the current weights), scores the same completion
given the prompt plus privileged context; the student is pulled towards the teacher's next-token distributions
(posttrain/losses/self_distillation.py), averaged per completion, then over completions, as TRL does. Each method
gives how the teacher's prompt is built (`_teacher_prompts`) and how the per-token losses become the loss
(`_objective`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils.data import SequentialSampler

from posttrain.data.batches import pad
from posttrain.data.chat import require_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.report import DataReport
from posttrain.data.vision import tokenizer_of
from posttrain.errors import ConfigError, DataError
from posttrain.losses.policy import aggregate_loss
from posttrain.losses.self_distillation import DISTILLATION_MODES, self_distillation_token_losses
from posttrain.losses.sft import IGNORE_INDEX, shift_for_next_token
from posttrain.models.reference import is_peft_model
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer
from posttrain.trainers.self_distillation_data import (
    PromptSwapSampler,
    RepeatedSampler,
    RowCollator,
    prompt_ids,
    tokenize_prompt_row,
)
from posttrain.trainers.self_distillation_events import RolloutRow, round_events
from posttrain.trainers.self_distillation_rounds import (
    GenerationRounds,
    completion_logits,
    resolve_generation_batch,
    rollout_weights,
    token_logps,
)
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_completion_length_field,
    max_prompt_length_field,
    num_generations_eval_field,
)
from posttrain.training.streaming import PreparesEvalOnUse
from posttrain.training.sync_ref import SyncRefModelCallback, load_sync_ref_checkpoint_state, sync_ref_checkpoint_state

TEACHER_KINDS = ("base", "live", "ema")
logger = logging.getLogger(__name__)
_NOT_SELF_DISTILLATION = (
    "DistillationTrainer's {} (teacher/student mixing of GKD) does not apply to "
    "self-distillation, whose objective is set by distillation_mode / distillation_alpha."
)


@dataclass
class SelfDistillationConfig(DistillationConfig):
    """The settings SDFT and SDPO share (TRL's names); each method's config sets TRL's defaults."""

    unsupported_options: ClassVar[dict[str, str]] = {
        **DistillationConfig.unsupported_options,
        "use_teacher_server": "teacher log-probs from a vLLM server need vLLM (use_vllm), which posttrain does not "
        "wire for self-distillation; the teacher is scored locally.",
        "num_iterations": "posttrain samples fresh completions for every micro-batch and updates on them once "
        "(TRL's default); re-using a generation batch for several updates is not implemented.",
        "teacher_model_name_or_path": "the teacher is the student itself (teacher_model_kind); drop it.",
        "lmbda": _NOT_SELF_DISTILLATION.format("lmbda"),
        "alpha": _NOT_SELF_DISTILLATION.format("alpha"),
    }

    learning_rate: float = learning_rate_field(5e-5)
    disable_dropout: bool = disable_dropout_field(True, "Switch off dropout in student and teacher.")
    max_prompt_length: int | None = max_prompt_length_field(
        512, "Keep at most this many prompt tokens (the last ones)."
    )
    max_completion_length: int | None = max_completion_length_field(
        256, "Most tokens the student samples per completion."
    )
    num_generations: int = config_field(8, "Completions sampled per prompt (consecutive rows of a batch).", min=1)
    num_generations_eval: int | None = num_generations_eval_field(
        "Completions per prompt in evaluation (None: num_generations)."
    )
    generation_batch_size: int | None = config_field(
        None, "Completions per generation round: per_device_train_batch_size x processes x steps_per_generation."
    )
    steps_per_generation: int | None = config_field(
        None, "Micro-batches per generation round, as in TRL (None: gradient_accumulation_steps, one optimizer step)."
    )
    num_iterations: int = config_field(1, "Updates per generation batch (only 1).")
    use_teacher_server: bool = config_field(False, "Teacher log-probs from the vLLM server (not supported).")
    teacher_model_kind: str = config_field(
        "base",
        "The teacher: 'base' (the initial student, frozen), 'live' (the current student) or 'ema' (an "
        "exponential moving average of the student).",
        choices=TEACHER_KINDS,
    )
    teacher_update_rate: float = config_field(
        0.05, "EMA teacher: teacher <- (1 - rate) * teacher + rate * student (1.0: copy).", gt=0, max=1
    )
    teacher_sync_steps: int = config_field(1, "EMA teacher: optimizer steps between updates.", min=1)
    distillation_alpha: float = config_field(
        0.5, "Divergence: 0 forward KL(teacher‖student), 1 reverse KL, in between the generalized JSD.", min=0, max=1
    )
    distillation_mode: str = config_field(
        "topk_logits",
        "'topk_logits' (the student's top-k tokens), 'full_logits' (the whole vocabulary) or 'sampled_token' "
        "(reverse KL on the sample).",
        choices=DISTILLATION_MODES,
    )
    distillation_topk: int | None = config_field(
        100, "topk_logits: how many of the student's most likely tokens to compare."
    )
    distillation_is_clip: float | None = config_field(
        2.0,
        "Importance-weight clip for re-used rollouts; with fresh rollouts per step (the only mode here, and "
        "TRL's default) TRL applies no weight either.",
    )
    distillation_add_tail: bool = config_field(
        False, "topk_logits: add the mass outside the top k as one more element (else renormalise over the top k)."
    )

    def __post_init__(self):
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ConfigError(
                "distillation_mode='sampled_token' estimates reverse KL only: set distillation_alpha="
                f"1.0 (got {self.distillation_alpha}) or use 'full_logits' / 'topk_logits'."
            )
        if self.distillation_mode == "topk_logits" and (self.distillation_topk is None or self.distillation_topk < 1):
            raise ConfigError(
                f"distillation_mode='topk_logits' needs distillation_topk >= 1 (got {self.distillation_topk})."
            )
        if self.teacher_model_init_kwargs is None and isinstance(self.model_init_kwargs, dict):
            self.teacher_model_init_kwargs = dict(self.model_init_kwargs)  # the teacher loads as the student does
        super().__post_init__()
        resolve_generation_batch(self)


class SelfDistillationTrainer(PreparesEvalOnUse, DistillationTrainer):
    """The shared machinery of SDFT and SDPO (see the module); subclasses give `_teacher_prompts`."""

    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulation steps itself, as TRL does
    reports_teacher_context = False  # TRL's on_teacher_context_built event: SDPO's

    def __init__(
        self,
        model,
        args: SelfDistillationConfig,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        **kwargs,
    ):
        if train_dataset is None:
            raise ConfigError(f"{type(self).__name__} needs a train_dataset (rows with a 'prompt').")
        from peft import PeftModel  # noqa: PLC0415 (peft is a dependency; imported where it is needed)

        if args.teacher_model_kind == "ema" and (peft_config is not None or isinstance(model, PeftModel)):
            raise ConfigError(
                "teacher_model_kind='ema' with PEFT: TRL averages a separate teacher adapter, which "
                "posttrain does not implement. Use teacher_model_kind='base' or 'live', or train "
                "without peft_config."
            )
        if peft_config is None and isinstance(model, PeftModel):
            logger.warning(  # TRL's warning, then what posttrain does
                "The provided self-distillation student model already contains a PEFT adapter. In TRL, "
                "`teacher_model_kind='base'` may refer to the underlying base weights rather than the exact initially "
                "loaded student state including its adapter; posttrain's 'base' teacher is that state (a copy with "
                "the adapter merged in)."
            )
        self._rows: list[dict] = []  # the raw dataset rows; prepared rows point into it (`sd_row`)
        self._rounds = GenerationRounds()  # the sampled micro-batches of the round being trained
        super().__init__(
            model,
            None,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            **kwargs,
        )
        if args.teacher_model_kind == "live":
            self.teacher_model = self.model  # the student itself, scored without gradients
        elif args.teacher_model_kind == "ema":
            self.add_callback(
                SyncRefModelCallback(
                    self.teacher_model, alpha=args.teacher_update_rate, sync_steps=args.teacher_sync_steps
                )
            )

    @staticmethod
    def _resolve_teacher(model, teacher_model, args):
        """The teacher starts as the student: a copy of the loaded model (a PEFT student's adapter merged in), or
        the same name loaded again; a live teacher is the student itself, so nothing is loaded."""
        if args.teacher_model_kind == "live":
            return None
        if isinstance(model, str):
            return model
        return copy.deepcopy(model).merge_and_unload() if is_peft_model(model) else copy.deepcopy(model)

    def _check_teacher(self, teacher, teacher_tokenizer) -> None:
        """The teacher is the student's own copy: same tokenizer by construction."""

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "completion_mask", "sd_row"]

    # -- data --------------------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: SelfDistillationConfig, name: str):
        """Rows with a 'prompt' (text or messages): the tokenized prompt, and the row's place in `_rows` (the other
        columns are read from there when the teacher's prompt is built and rewards are scored)."""
        if "prompt" not in dataset.column_names:
            raise DataError(
                f"{name} has no 'prompt' column (columns: {dataset.column_names}); "
                f"{type(self).__name__} samples completions for prompts."
            )
        if len(dataset) and is_message_list(dataset[0]["prompt"]):
            require_chat_template(tokenizer_of(tokenizer), "conversational prompts")
        offset = len(self._rows)
        self._rows.extend(dataset.to_list())
        report = DataReport.of(self).start(name, len(dataset))  # prompts cut to max_prompt_length
        return report.take_cuts(
            dataset.map(
                tokenize_prompt_row,
                with_indices=True,
                remove_columns=dataset.column_names,
                num_proc=args.dataset_num_proc,
                desc=f"Tokenizing the prompts of {name}",
                fn_kwargs=dict(
                    tokenizer=tokenizer_of(tokenizer),
                    keep=args.max_prompt_length,
                    template_kwargs=args.chat_template_kwargs or {},
                    offset=offset,
                ),
            )
        )

    def _prompt_ids(self, prompt, row: int, keep: int | None) -> list[int]:
        """A teacher or generation prompt's ids, made as the student's are."""
        return prompt_ids(prompt, row, tokenizer_of(self.processing_class), keep, self.args.chat_template_kwargs or {})

    def default_collator(self, tokenizer, args):
        self._own_collator = RowCollator(tokenizer_of(tokenizer).pad_token_id)
        return self._own_collator

    def _get_train_sampler(self, train_dataset=None):
        return RepeatedSampler(super()._get_train_sampler(train_dataset), self.args.num_generations)

    def _get_eval_sampler(self, eval_dataset):
        return RepeatedSampler(
            SequentialSampler(eval_dataset), self.args.num_generations_eval or self.args.num_generations
        )

    # -- rollouts and the teacher's inputs ---------------------------------------------------------------------
    def _generation_prompts(self, rows: list[dict]) -> list[list[int]] | None:
        """Hook: prompt ids to sample from instead of the student's (None: the student's)."""
        return None

    def _student_batch(self, batch: dict, seed: int, mode: str, sampler=None) -> dict:
        rows = batch["sd_row"]
        if sampler is None:
            swapped = self._generation_prompts([self._rows[i] for i in rows.tolist()])
            sampler = PromptSwapSampler(self._sampler, swapped) if swapped is not None else None
        out = super()._student_batch(batch, seed, mode, sampler)
        out["sd_row"] = rows.to(out["input_ids"].device)
        return out

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """This optimizer step's micro-batches, sampled with the teacher's inputs attached (self_distillation_rounds:
        a round of several steps is sampled at its first)."""

        def sample(iterator, n: int) -> list[dict]:
            batches, _ = super(SelfDistillationTrainer, self).get_batch_samples(iterator, n, device)
            self._attach_teacher_inputs(batches, "train")
            return batches

        return self._rounds.take(self, epoch_iterator, num_batches, device, sample)

    def round_sampled(self, batches: list[dict], mode: str = "train") -> None:
        """TRL's self-distillation callback events for the micro-batches just sampled (and given their teacher
        inputs), one generation round of steps_per_generation micro-batches at a time (self_distillation_events)."""
        size = self.args.steps_per_generation if mode == "train" else len(batches)
        pad_id = self._own_collator.pad_token_id
        for start in range(0, len(batches), size):
            rows = [row for rows in self._round_rows[start : start + size] for row in rows]
            round_events(self, rows, batches[start : start + size], mode, pad_id)

    def _generation_raw_prompts(self, rows: list[dict]) -> list:
        """Hook: the raw prompt (text or messages) each rollout was sampled from (here the row's prompt)."""
        return [row["prompt"] for row in rows]

    @property
    def keeps_rollout_logps(self) -> bool:
        """Whether a round's rollouts keep the student's log-probs at sampling (for distillation_is_clip)."""
        return True

    def _teacher_prompts(
        self, rows: list[dict], prompts: list[list[int]], completions: list[list[int]], mode: str
    ) -> tuple[list[list[int]], list[bool]]:
        """Hook: each rollout's teacher prompt ids and whether the rollout is distilled (all rollouts of the
        optimizer step in order; `prompts` / `completions` are the student's ids)."""
        raise NotImplementedError

    def _attach_teacher_inputs(self, batches: list[dict], mode: str) -> None:
        """Adds to each batch the teacher's rows (its prompt + the same completion) and a per-row distill flag."""
        parts = []  # (batch, row, prompt ids, completion ids)
        for b, batch in enumerate(batches):
            for r, (ids, labels) in enumerate(zip(batch["input_ids"], batch["labels"])):
                trained = labels != IGNORE_INDEX
                start = int(trained.nonzero()[0]) if trained.any() else int(batch["attention_mask"][r].sum())
                parts.append((b, r, ids[:start].tolist(), labels[trained].tolist()))
        rows = [self._rows[int(batches[b]["sd_row"][r])] for b, r, _, _ in parts]
        teacher_prompts, active = self._teacher_prompts(rows, [p[2] for p in parts], [p[3] for p in parts], mode)
        generation = self._generation_raw_prompts(rows)
        rollouts = [RolloutRow(p[2], p[3], teacher_prompts[i], active[i], generation[i]) for i, p in enumerate(parts)]
        self._round_rows = [[r for r, p in zip(rollouts, parts) if p[0] == b] for b in range(len(batches))]
        skip = getattr(self.args, "num_loss_tokens_to_skip", 0)
        for b, batch in enumerate(batches):
            mine = [(i, p) for i, p in enumerate(parts) if p[0] == b]
            ids = [teacher_prompts[i] + p[3] for i, p in mine]
            labels = [
                [IGNORE_INDEX] * len(teacher_prompts[i]) + [IGNORE_INDEX] * min(skip, len(p[3])) + p[3][skip:]
                for i, p in mine
            ]
            device = batch["input_ids"].device
            pad_id = self._own_collator.pad_token_id
            batch["teacher_input_ids"] = pad(ids, pad_id).to(device)
            batch["teacher_attention_mask"] = pad([[1] * len(x) for x in ids], 0).to(device)
            batch["teacher_labels"] = pad(labels, IGNORE_INDEX).to(device)
            batch["sd_mask"] = torch.tensor([float(active[i]) for i, _ in mine], device=device)
            if skip:  # the student's first completion tokens leave the loss too
                for row_labels in batch["labels"]:
                    trained = (row_labels != IGNORE_INDEX).nonzero().flatten()[:skip]
                    row_labels[trained] = IGNORE_INDEX

    # -- the loss ----------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ConfigError(f"{type(self).__name__}.compute_loss does not return model outputs.")
        mode = "train" if model.training else "eval"
        if "teacher_input_ids" not in inputs:  # evaluation batches are sampled one at a time
            self._attach_teacher_inputs([inputs], mode)
            self.round_sampled([inputs], mode)
        # Completion tokens sit at different offsets in the two rows; select them, then lay them out [B, T].
        student_logits, tokens, slots, student = completion_logits(model, inputs)
        mask = shift_for_next_token(inputs["labels"]) != IGNORE_INDEX
        if not mask.any():  # nothing to distil (e.g. every completion masked): a zero loss that keeps the graph
            return student.sum() * 0.0
        teacher_logits = None
        if self._needs_teacher():
            teacher_model = model if self.args.teacher_model_kind == "live" else self.teacher_model
            with torch.no_grad():
                teacher = teacher_model(
                    input_ids=inputs["teacher_input_ids"],
                    attention_mask=inputs["teacher_attention_mask"],
                    use_cache=False,
                ).logits
                teacher_mask = shift_for_next_token(inputs["teacher_labels"]) != IGNORE_INDEX
                teacher = teacher[..., : student.shape[-1]]
                teacher_logits = teacher.new_zeros(*slots.shape, teacher.shape[-1]).masked_scatter(
                    slots[..., None], teacher[teacher_mask]
                )
        loss = self._objective(student_logits, teacher_logits, tokens, slots, inputs, mode)
        if model.training:
            self._count_tokens(mask, inputs["attention_mask"])
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def _count_tokens(self, mask, attention_mask) -> None:
        """SFT's num_tokens / num_tokens_trained counters (completion tokens are the trained ones)."""
        counts = torch.stack([mask.sum(), attention_mask.sum()]).float()[None]
        trained, seen = self.accelerator.gather(counts).sum(0).tolist()
        self._trained_tokens += int(trained)
        self._input_tokens += int(seen)
        self._metrics["train"]["num_tokens"] = [float(self._input_tokens)]

    def _needs_teacher(self) -> bool:
        return True

    def _distillation_loss(self, student_logits, teacher_logits, tokens, slots, inputs, mode) -> torch.Tensor:
        """TRL's aggregation: per-token losses averaged over each distilled completion, then over all rows."""
        args = self.args
        per_token = self_distillation_token_losses(
            student_logits,
            teacher_logits,
            tokens,
            args.distillation_mode,
            args.distillation_alpha,
            args.distillation_topk,
            args.distillation_add_tail,
            self.loss_temperature(),
        )
        if "old_logps" in inputs and args.distillation_is_clip is not None:  # a rollout sampled steps ago
            logps = token_logps(student_logits, tokens, self.loss_temperature())
            per_token = per_token * rollout_weights(logps, inputs["old_logps"], args.distillation_is_clip)
        loss_mask = slots & (inputs["sd_mask"][:, None] > 0)
        value = per_token[loss_mask].detach().float()
        total = self.accelerator.gather(
            torch.stack([value.sum(), torch.tensor(float(value.numel()), device=value.device)])[None]
        ).sum(0)
        mean = (total[0] / total[1].clamp(min=1)).item()
        metrics = self._metrics[mode]
        metrics["self_distillation/distillation_loss"].append(mean)
        metrics[f"{self._name.lower()}/distillation_loss"].append(mean)
        return aggregate_loss(per_token, loss_mask, "grpo")

    def _objective(self, student_logits, teacher_logits, tokens, slots, inputs, mode) -> torch.Tensor:
        """Hook: the loss of this micro-batch (here the distillation loss alone)."""
        return self._distillation_loss(student_logits, teacher_logits, tokens, slots, inputs, mode)

    # -- resuming ----------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The distillation trainer's state, with an EMA teacher the teacher's weights, and the rest of a round
        the checkpoint falls inside (a resumed run trains on the same rollouts)."""
        return {**super().checkpoint_state(), **sync_ref_checkpoint_state(self), "sd_round": self._rounds.state()}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        self._rounds.load(state.pop("sd_round", []), self.accelerator.device)
        load_sync_ref_checkpoint_state(self, state)
        super().load_checkpoint_state(state)


__all__ = ["SelfDistillationConfig", "SelfDistillationTrainer"]
