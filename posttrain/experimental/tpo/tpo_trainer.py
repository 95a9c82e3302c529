"""Triple Preference Optimization (Saeidi et al. 2024, arXiv:2405.16681), at TRL's import path
`trl.experimental.tpo`: each row holds a prompt and three completions, `chosen`, `rejected` and a gold `reference`.
The policy learns to prefer chosen over rejected (no reference model: the scores are the policy's own
log-probabilities, see `posttrain.losses.tpo`) while imitating the gold completion (`tpo_alpha` * its NLL).

Data is the preference format plus a `reference` column, standard or conversational; with an implicit prompt
(no `prompt` column) the prompt shared by chosen and rejected is also cut from the start of `reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.batches import pad
from posttrain.data.chat import extract_prompt
from posttrain.data.formats import DatasetFormat, check_example, validate_dataset
from posttrain.data.preference import (
    PreferenceCollator,
    drop_overlong_rows,
    tokenize_preference,
    warn_identical_pairs,
)
from posttrain.data.report import DataReport, DatasetReport
from posttrain.errors import ConfigError, DataError
from posttrain.experimental.tpo.tpo_config import TPOConfig
from posttrain.losses.tpo import tpo_loss, tpo_scores
from posttrain.training.base import BaseTrainer
from posttrain.training.preference import PreferenceMetricsMixin, sequence_logps
from posttrain.training.reference_trainer import PreparesEvalDatasets, load_processing_class


def _strip_prompt(example: dict, row: int) -> dict:
    """Implicit prompt -> explicit, for all three completions (the gold one must start with the same prompt)."""
    explicit = extract_prompt(example)
    prompt, gold = explicit["prompt"], example["reference"]
    if gold[: len(prompt)] != prompt:
        raise DataError(
            f"Row {row}: 'reference' does not start with the implicit prompt that 'chosen' and 'rejected' share, "
            "so the gold completion cannot be told apart. Add an explicit 'prompt' column."
        )
    return {**explicit, "reference": gold[len(prompt) :]}


def _tokenize_triple(example, row, tokenizer, fmt):
    check_example(example, fmt, row)
    check_example(example, DatasetFormat(fmt.kind, fmt.conversational, ("reference",)), row)
    if not fmt.has_explicit_prompt:
        example = _strip_prompt(example, row)
    explicit = DatasetFormat(fmt.kind, fmt.conversational, ("prompt", "chosen", "rejected"))
    pair = tokenize_preference(example, tokenizer, explicit, row=row)
    gold = tokenize_preference(
        {**example, "chosen": example["reference"], "rejected": example["reference"]}, tokenizer, explicit, row=row
    )
    return {**pair, "reference_ids": gold["chosen_ids"]}


def prepare_triple_dataset(dataset, tokenizer, args: TPOConfig, name: str, report: DatasetReport | None = None):
    """prompt_ids / chosen_ids / rejected_ids / reference_ids per row (see `tokenize_preference`). `report`
    receives the rows dropped and the sequences the collator will cut to max_length."""
    fmt = validate_dataset(dataset, ("preference",), "TPOTrainer", name)
    if "reference" not in dataset.column_names:
        raise DataError(
            f"TPOTrainer needs a gold completion per row in a 'reference' column besides 'chosen' and "
            f"'rejected', but {name} has columns {dataset.column_names}. Add it."
        )
    dataset = dataset.map(
        _tokenize_triple,
        with_indices=True,
        num_proc=args.dataset_num_proc,
        remove_columns=dataset.column_names,
        fn_kwargs=dict(tokenizer=tokenizer, fmt=fmt),
        desc=f"Tokenizing {name}",
    )
    report = report if report is not None else DatasetReport(rows_in=len(dataset))
    dataset = drop_overlong_rows(dataset, args.max_length, args.truncation_mode, name, report)
    if args.max_length is not None:
        columns = ("chosen_ids", "rejected_ids") + (("reference_ids",) if args.tpo_alpha != 0 else ())
        over = [
            sum(max(len(row["prompt_ids"]) + len(row[c]) - args.max_length, 0) for c in columns)
            for row in dataset.select_columns(["prompt_ids", *columns])
        ]
        kept = "start" if args.truncation_mode == "keep_start" else "end"
        report.truncated(
            sum(n > 0 for n in over),
            sum(over),
            f"prompt + chosen/rejected/reference longer than max_length (the collator keeps each sequence's {kept})",
        )
    warn_identical_pairs(dataset, name)
    return dataset


@dataclass
class TriplePreferenceCollator(PreferenceCollator):
    """B rows -> prompt+chosen (rows 0..B-1), prompt+rejected (B..2B-1) and, with `include_reference`,
    prompt+reference (2B..3B-1), each cut to max_length as `truncation_mode` says, right padded."""

    include_reference: bool = True

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        columns = ("chosen_ids", "rejected_ids") + (("reference_ids",) if self.include_reference else ())
        sequences, masks = [], []
        for column in columns:
            for e in examples:
                sequences.append(self._cut(list(e["prompt_ids"]) + list(e[column])))
                mask = self._cut([0] * len(e["prompt_ids"]) + [1] * len(e[column]))
                mask[0] = 0  # nothing predicts a sequence's first token
                masks.append(mask)
        multiple = self.pad_to_multiple_of
        return {
            "input_ids": pad(sequences, self.pad_token_id, pad_to_multiple_of=multiple),
            "attention_mask": pad([[1] * len(s) for s in sequences], 0, pad_to_multiple_of=multiple),
            "completion_mask": pad(masks, 0, pad_to_multiple_of=multiple),
        }


class TPOTrainer(PreferenceMetricsMixin, PreparesEvalDatasets, BaseTrainer):
    """`TPOTrainer(model, args=TPOConfig(...), train_dataset=..., processing_class=..., peft_config=...)`, TRL's
    keyword arguments in TRL's order. The loss is summed over pairs and divided by the pairs of the whole effective
    batch; the gold NLL is the token mean over the micro-batch's gold completions, added to each pair's loss."""

    _name = "TPO"

    def __init__(
        self,
        model,
        args: TPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        quantization_config=None,
        **kwargs,
    ):
        args = args or TPOConfig(output_dir="outputs/tpo")
        if train_dataset is None:
            raise ConfigError("TPOTrainer needs a train_dataset (rows with prompt, chosen, rejected and reference).")
        self._branches = 3 if args.tpo_alpha != 0 else 2
        self._total_train_tokens = 0
        processing_class = load_processing_class(model, processing_class, args)
        super().__init__(
            model,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            peft_config,
            data_collator,
            callbacks,
            optimizers,
            quantization_config,
            compute_metrics=compute_metrics,
            **kwargs,
        )

    def prepare_dataset(self, dataset, tokenizer, args: TPOConfig, name: str):
        return prepare_triple_dataset(dataset, tokenizer, args, name, DataReport.of(self).start(name, len(dataset)))

    def default_collator(self, tokenizer, args: TPOConfig):
        return TriplePreferenceCollator(
            tokenizer.pad_token_id,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            pad_to_multiple_of=args.pad_to_multiple_of,
            include_reference=args.tpo_alpha != 0,
        )

    def count_loss_items(self, batch):
        return len(batch["input_ids"]) // self._branches

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True, the columns the collator reads are kept (as in TRL)."""
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        n = len(inputs["input_ids"]) // self._branches
        policy = sequence_logps(model, inputs)
        scores = tpo_scores(policy.logps[: 2 * n], policy.token_counts[: 2 * n], args.loss_type)
        losses, chosen_rewards, rejected_rewards = tpo_loss(
            scores[:n],
            scores[n:],
            loss_type=args.loss_type,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            tpo_l_gamma=args.tpo_l_gamma,
        )
        if self._branches == 3:  # the gold completions' token-mean NLL over the micro-batch, as in TRL
            nll = -policy.token_logps[2 * n :].sum() / policy.token_counts[2 * n :].sum().clamp(min=1)
            losses = losses + args.tpo_alpha * nll
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, n, model.training)
        self._record(policy, scores.detach(), chosen_rewards, rejected_rewards, inputs, n)
        return (loss, None) if return_outputs else loss

    def _record(self, policy, scores, chosen_rewards, rejected_rewards, inputs, n: int) -> None:
        parts = {"chosen": slice(None, n), "rejected": slice(n, 2 * n)}
        # entropy and num_tokens cover every sequence of the batch, the gold ones included (as TRL logs them)
        self.record_token_metrics(policy.stats, policy.token_counts, inputs["attention_mask"].sum(), parts)
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": scores[:n].mean(),
            "logps/rejected": scores[n:].mean(),
        }
        counts = policy.token_counts
        top1 = self.accelerator.gather(torch.stack([policy.stats["top1"][:n].sum(), counts[:n].sum()])[None])
        metrics["mean_token_accuracy"] = top1[:, 0].sum() / top1[:, 1].sum().clamp(min=1)
        self.record_metrics(metrics)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss; with `compute_metrics`, also the logits of every sequence (an extra forward), as TRL returns."""
        loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            logits = model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
            ).logits
        return loss, logits, inputs["input_ids"]

    def checkpoint_state(self) -> dict:
        return {"num_tokens": self._total_train_tokens}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        self._total_train_tokens = state.pop("num_tokens", 0)
        super().load_checkpoint_state(state)


DataCollatorForTriplePreference = TriplePreferenceCollator  # TRL's name

__all__ = ["DataCollatorForTriplePreference", "TPOConfig", "TPOTrainer", "TriplePreferenceCollator"]
