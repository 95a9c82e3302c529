"""GOLD with TRL's `trl.experimental.gold` API: on-policy distillation that also works when the teacher has a
different tokenizer (General Online Logit Distillation, Hugging Face 2025), through Universal Logit Distillation
(Boizard et al. 2024; the loss is in posttrain/losses/gold.py).

With `use_uld_loss=False` it is GKD (posttrain/trainers/on_policy_generation.py) whose divergence uses `temperature`
on both distributions. With `use_uld_loss=True` each micro-batch's prompts and completions are decoded to text,
re-tokenized by the teacher's tokenizer (its BOS/special tokens on the prompt, its EOS appended to the completion),
and the two tokenizations' completion tokens are aligned by their byte offsets before ULD compares them. Per
micro-batch the loss is

    uld_distillation_weight * sum_rows ULD_row + uld_crossentropy_weight * rows * mean-token NLL,

divided by the rows of the effective batch (TRL: the mean over the micro-batch's rows).
"""

from __future__ import annotations

from collections import deque

import torch

from posttrain.data.byte_offsets import token_byte_offsets
from posttrain.data.vision import tokenizer_of
from posttrain.errors import ConfigError
from posttrain.experimental.gold.gold_config import GOLDConfig
from posttrain.experimental.gold.uld import ULDLoss, build_teacher_inputs_from_texts
from posttrain.losses.sft import IGNORE_INDEX, nll_sum
from posttrain.models.loading import load_tokenizer
from posttrain.trainers.on_policy_generation import OnPolicyGenerationTrainer, generate_on_policy_outputs
from posttrain.training.sample_table import print_prompt_completions_sample


class GOLDTrainer(OnPolicyGenerationTrainer):
    """`GOLDTrainer(model, teacher_model, args=GOLDConfig(...), train_dataset=...)`, TRL's keyword arguments in TRL's
    order (posttrain's extras after them). Data as for GKD (TRL's `messages` rows, or prompt-completion rows).
    With use_uld_loss the teacher may use any byte-level BPE tokenizer. Logged besides distillation's metrics:
    TRL's on_policy_loss / off_policy_loss and, with hybrid ULD, matched_loss / unmatched_loss."""

    _name = "GOLD"
    prepares_eval_on_use = False  # TRL's GOLD (an SFTTrainer) tokenizes its eval sets up front; GKD keeps them as given

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: GOLDConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        *,
        teacher_processing_class=None,
        quantization_config=None,
        **kwargs,
    ):
        args = args or GOLDConfig(output_dir="outputs/gold")
        self.teacher_tokenizer, self._shared_ids = None, None
        self._on_policy_flags: deque[bool] = deque()
        self._policy_totals = torch.zeros(2, 2, dtype=torch.float64)  # [on, off] x [loss sum, optimizer steps]
        if args.use_uld_loss and args.teacher_tokenizer_name_or_path is not None:
            if teacher_processing_class is not None:
                raise ConfigError(
                    "Two teacher tokenizers: teacher_processing_class and "
                    "teacher_tokenizer_name_or_path; give only one."
                )
            teacher_processing_class = load_tokenizer(
                args.teacher_tokenizer_name_or_path, trust_remote_code=args.trust_remote_code
            )
        super().__init__(
            model,
            teacher_model,
            args,
            data_collator,
            train_dataset,
            eval_dataset,
            processing_class,
            compute_metrics,
            callbacks,
            optimizers,
            preprocess_logits_for_metrics,
            peft_config,
            teacher_processing_class=teacher_processing_class,
            quantization_config=quantization_config,
            **kwargs,
        )

    def _check_teacher(self, teacher, teacher_tokenizer) -> None:
        if not self.args.use_uld_loss:
            return super()._check_teacher(teacher, teacher_tokenizer)
        if teacher_tokenizer is None:
            raise ConfigError(
                "use_uld_loss=True re-tokenizes the text for the teacher, but the teacher came without "
                "a tokenizer: set teacher_tokenizer_name_or_path (or pass teacher_processing_class)."
            )
        if teacher_tokenizer.pad_token is None:
            teacher_tokenizer.pad_token = teacher_tokenizer.eos_token
        self.teacher_tokenizer = teacher_tokenizer
        self.uld_loss = ULDLoss(self.args, tokenizer_of(self.processing_class), teacher_tokenizer)
        self._shared_ids = self.uld_loss.shared_ids

    def generate_on_policy_outputs(self, model, inputs, generation_config):
        """GKD's on-policy sampling step (posttrain.trainers.on_policy_generation's `generate_on_policy_outputs`)
        plus, as TRL's
        GOLD returns them, each row's prompt text (its unpadded ids) and completion text (its labelled ids), decoded
        with the special tokens kept, for the teacher's re-tokenization."""
        ids, attention_mask, labels = generate_on_policy_outputs(model, inputs, generation_config)
        width = inputs["prompts"].shape[1]

        def decode(tokens):
            return self.processing_class.decode(
                tokens.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )

        prompts = [decode(row[mask.bool()]) for row, mask in zip(inputs["prompts"], inputs["prompt_attention_mask"])]
        completions = [decode(row[width:][label[width:] != IGNORE_INDEX]) for row, label in zip(ids, labels)]
        return ids, attention_mask, labels, prompts, completions

    def loss_temperature(self) -> float:
        return self.args.temperature  # TRL's GOLD tempers the JSD (its GKD does not)

    def count_loss_items(self, batch):
        return len(batch["input_ids"]) if self.args.use_uld_loss else super().count_loss_items(batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.args.use_uld_loss:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        args, labels = self.args, inputs["labels"]
        forward = {k: v for k, v in inputs.items() if k not in ("labels", "num_input_tokens")}
        student_logits = model(**forward, use_cache=False).logits

        def decode(ids):
            return self.processing_class.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        prompts, completions, student_offsets = [], [], torch.zeros((*labels.shape, 2), dtype=torch.long)
        for i, row in enumerate(labels):
            trained = (row != IGNORE_INDEX).nonzero()
            start = int(trained[0]) if len(trained) else int(inputs["attention_mask"][i].sum())
            end = int(trained[-1]) + 1 if len(trained) else start
            ids = inputs["input_ids"][i, start:end].tolist()
            prompts.append(decode(inputs["input_ids"][i, :start].tolist()))
            completions.append(decode(ids))
            if args.use_extended_uld and ids:
                student_offsets[i, start:end] = torch.tensor(token_byte_offsets(self.processing_class, ids))
        t_ids, t_labels, t_mask, t_offsets = (
            x.to(student_logits.device)
            for x in build_teacher_inputs_from_texts(
                self.teacher_tokenizer, prompts, completions, args.use_extended_uld
            )
        )
        with torch.no_grad():
            teacher_logits = self.teacher_model(input_ids=t_ids, attention_mask=t_mask).logits
        parts = self.uld_loss.row_parts(
            student_logits,
            teacher_logits,
            labels,
            t_labels,
            inputs["input_ids"],
            t_ids,
            student_offsets,
            t_offsets.cpu(),
        )
        per_row = torch.stack([loss for loss, _, _ in parts])
        rows = len(labels)
        loss_sum = args.uld_distillation_weight * per_row.sum()
        nll, correct, count = nll_sum(student_logits, labels)
        if args.uld_crossentropy_weight > 0:
            loss_sum = loss_sum + args.uld_crossentropy_weight * rows * nll / count.clamp(min=1)
        loss = self.effective_batch_mean(loss_sum, num_items_in_batch, rows, model.training)
        metrics = self._metrics["train" if model.training else "eval"]
        totals = (
            self.accelerator.gather(
                torch.stack(
                    [
                        per_row.detach().sum(),
                        nll.detach(),
                        correct.float(),
                        count.float(),
                        torch.tensor(float(rows)).to(nll.device),
                    ]
                ).reshape(1, 5)
            )
            .sum(0)
            .tolist()
        )
        metrics["distill_loss"].append(totals[0] / max(totals[4], 1))
        metrics["nll"].append(totals[1] / max(totals[3], 1))
        metrics["mean_token_accuracy"].append(totals[2] / max(totals[3], 1))
        if self._shared_ids is not None:
            self._record_hybrid_parts(parts, metrics, student_logits.device)
        return (loss, {}) if return_outputs else loss

    def _record_hybrid_parts(self, parts, metrics, device) -> None:
        """TRL's matched_loss / unmatched_loss: hybrid ULD's two terms (before their weights), the mean over the
        micro-batch's compared rows. TRL keeps the last row's and divides its sum over the logging window by
        optimizer steps, not micro-batches: the same with one row per micro-batch and no accumulation."""
        compared = [(m.detach(), u.detach()) for _, m, u in parts if m is not None]
        sums = torch.tensor(
            [sum(float(m) for m, _ in compared), sum(float(u) for _, u in compared), float(len(compared))],
            device=device,
        )
        matched, unmatched, rows = self.accelerator.gather(sums.reshape(1, 3)).sum(0).tolist()
        if rows:
            metrics["matched_loss"].append(matched / rows)
            metrics["unmatched_loss"].append(unmatched / rows)

    # -- TRL's on_policy_loss / off_policy_loss ------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Keeps, in order, whether each micro-batch drawn for the step is on-policy (for training_step)."""
        drawn = len(self._metrics["train"]["on_policy"])
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._on_policy_flags.extend(bool(f) for f in self._metrics["train"]["on_policy"][drawn:])
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Adds the micro-batch's loss to the on- or off-policy total: at each log, TRL's on_policy_loss /
        off_policy_loss are the totals per optimizer step's worth of micro-batches (sum / (count / accumulation)),
        i.e. the step loss as if every micro-batch had been of that kind. (TRL's GOLD does not divide a
        micro-batch's loss by the accumulation steps, so its values, like its loss, are that many times ours.)"""
        loss = super().training_step(model, inputs, num_items_in_batch)
        on_policy = self._on_policy_flags.popleft() if self._on_policy_flags else False
        self._policy_totals[0 if on_policy else 1] += torch.tensor(
            [float(loss), 1.0 / self.args.gradient_accumulation_steps], dtype=torch.float64
        )
        return loss

    def log(self, logs, start_time=None):
        if "loss" in logs:  # a training log
            totals = self.accelerator.reduce(self._policy_totals.to(self.accelerator.device), reduction="sum")
            for key, (loss, steps) in zip(("on_policy_loss", "off_policy_loss"), totals.tolist()):
                if steps > 0:
                    logs[key] = loss / steps
            self._policy_totals.zero_()
        super().log(logs, start_time)

    def _write_completions(self) -> None:
        if self.state.global_step % self.args.log_completions_steps == 0:
            super()._write_completions()


def print_prompt_completions_sample_uld(prompts: list, completions: list, step: int, num_samples: int | None = None):
    """TRL's GOLD console table: the run's sample table (training/sample_table.py) with prompts and completions only;
    `num_samples` rows drawn at random (all when None or not fewer than the rows; none when <= 0)."""
    if num_samples is not None and num_samples < len(prompts) and num_samples <= 0:
        return
    print_prompt_completions_sample(prompts, completions, {}, None, step, num_samples)


__all__ = [
    "GOLDConfig",
    "GOLDTrainer",
    "ULDLoss",
    "build_teacher_inputs_from_texts",
    "print_prompt_completions_sample_uld",
]
