"""KTO (Ethayarajh et al. 2024): alignment from unpaired examples, each marked desirable or undesirable.

The implicit reward beta * log(pi/pi_ref) of a desirable completion is pushed above a reference point z0
and that of an undesirable one below it. z0 estimates KL(pi || pi_ref) from mismatched pairs: within each
micro-batch, prompt i is scored with the completion of a neighbour (see below). The estimate is detached
(as in the paper), computed without gradients, and pooled over all processes; it is not pooled over
gradient-accumulation steps, so each micro-batch has its own z0.

As in TRL, the mismatched pairs are fixed in the dataset: within each run of per_device_train_batch_size rows,
prompt i gets the completion of row i - 1 (the first gets the last's). With the sequential sampling KTO needs
(`train_sampling_strategy='sequential'`), those runs are exactly the micro-batches.
"""

from __future__ import annotations

import logging

import torch
from datasets import Dataset

from posttrain.data.batches import pad
from posttrain.data.chat import require_chat_template, unpair_preference_dataset
from posttrain.data.formats import DatasetFormat, check_example, validate_dataset
from posttrain.data.report import DataReport, cut_column
from posttrain.data.tokenize import tokenize_example
from posttrain.errors import DataError
from posttrain.losses.preference import kto_loss
from posttrain.models.reference import is_peft_model
from posttrain.trainers.kto_config import KTOConfig
from posttrain.training.class_metrics import ClassMetricsMixin, labelled_rows
from posttrain.training.preference import SequenceLogps, sequence_logps
from posttrain.training.prefix_cache import trained_and_continuation_logps
from posttrain.training.reference_trainer import ReferenceTrainer, load_processing_class

logger = logging.getLogger("posttrain")

# The KTO paper recommends weights with desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
# in [1, 4/3].
RECOMMENDED_WEIGHTED_RATIO = (1.0, 4 / 3)


def tokenize_kto_row(example, row, tokenizer, fmt, completion_fmt, max_length):
    check_example(example, fmt, row)
    out = tokenize_example(example, tokenizer, completion_fmt, row=row)
    n = len(out["input_ids"])
    out = {k: v[:max_length] for k, v in out.items()}  # keep_start, as TRL's collator cuts
    out[cut_column("max_length")] = n - len(out["input_ids"])
    # As TRL, the completion is every token after the prompt, the template's whitespace after the turn included.
    if 1 not in out["completion_mask"]:  # the prompt fills max_length: dropped by prepare_dataset
        return out
    start = out["completion_mask"].index(1)
    out["completion_mask"] = [0] * start + [1] * (len(out["completion_mask"]) - start)
    return out


def add_kl_pairs(dataset, batch_size: int, max_length: int | None):
    """`kl_input_ids` / `kl_completion_mask` per row: its prompt with the completion of the previous row of its run
    of `batch_size` rows (the first row takes the run's last), cut to `max_length`."""
    ids, masks = dataset["input_ids"], dataset["completion_mask"]
    kl_ids, kl_masks = [], []
    for start in range(0, len(ids), batch_size):
        run = range(start, min(start + batch_size, len(ids)))
        for i in run:
            j = i - 1 if i > start else run[-1]
            p, q = masks[i].index(1), masks[j].index(1)  # where each completion begins
            kl_ids.append((ids[i][:p] + ids[j][q:])[:max_length])
            kl_masks.append(([0] * p + masks[j][q:])[:max_length])
    return dataset.add_column("kl_input_ids", kl_ids).add_column("kl_completion_mask", kl_masks)


def check_class_balance(labels: list[bool], args: KTOConfig, name: str = "train_dataset") -> None:
    """Raises if KTO lacks a class; warns, with weights to use, if the weighted classes are out of balance."""
    n_desirable = sum(labels)
    n_undesirable = len(labels) - n_desirable
    if n_desirable == 0 or n_undesirable == 0:
        if args.loss_type == "kto":
            missing = "desirable (label True)" if n_desirable == 0 else "undesirable (label False)"
            raise DataError(
                f"KTO needs both desirable and undesirable examples, but {name} has no {missing} rows "
                f"({n_desirable} desirable, {n_undesirable} undesirable). Add examples of the missing kind, or use "
                "loss_type='apo_zero_unpaired', which scores each example against the reference on its own."
            )
        return
    ratio = args.desirable_weight * n_desirable / (args.undesirable_weight * n_undesirable)
    low, high = RECOMMENDED_WEIGHTED_RATIO
    if not low <= ratio <= high:
        # desirable_weight values that bring the ratio into range, keeping undesirable_weight.
        base = args.undesirable_weight * n_undesirable / n_desirable
        logger.warning(
            "%s has %d desirable and %d undesirable examples: with desirable_weight=%g and undesirable_weight=%g "
            "the weighted ratio (desirable_weight * %d) / (undesirable_weight * %d) is %.3g, outside [1, 4/3] "
            "that the KTO paper recommends. Keeping undesirable_weight=%g, set desirable_weight between %.3g and "
            "%.3g.",
            name,
            n_desirable,
            n_undesirable,
            args.desirable_weight,
            args.undesirable_weight,
            n_desirable,
            n_undesirable,
            ratio,
            args.undesirable_weight,
            base * low,
            base * high,
        )


class KTOCollator:
    """B unpaired examples -> `label` [B] and B sequences (prompt + completion) with `completion_mask`; when the rows
    carry their mismatched pair (`kl_input_ids`, see `add_kl_pairs`), B more sequences follow. Precomputed
    reference log-probs travel along."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [list(e["input_ids"]) for e in examples]
        masks = [list(e["completion_mask"]) for e in examples]
        if "kl_input_ids" in examples[0]:
            sequences += [list(e["kl_input_ids"]) for e in examples]
            masks += [list(e["kl_completion_mask"]) for e in examples]
        multiple = self.pad_to_multiple_of
        batch = {
            "input_ids": pad(sequences, self.pad_token_id, pad_to_multiple_of=multiple),
            "attention_mask": pad([[1] * len(s) for s in sequences], 0, pad_to_multiple_of=multiple),
            "completion_mask": pad(masks, 0, pad_to_multiple_of=multiple),
            "label": torch.tensor([e["label"] for e in examples], dtype=torch.bool),
        }
        for column in KTOTrainer.ALL_REF_COLUMNS:
            if column in examples[0]:
                batch[column] = torch.tensor([float(e[column]) for e in examples], dtype=torch.float32)
        return batch


def first_sequences(scores: SequenceLogps, n: int) -> SequenceLogps:
    """The first `n` sequences' part of `scores` (the aux loss, a batch total, unchanged)."""
    return scores._replace(
        logps=scores.logps[:n],
        token_counts=scores.token_counts[:n],
        token_logps=scores.token_logps[:n],
        mask=scores.mask[:n],
        stats={k: v[:n] for k, v in scores.stats.items()},
    )


class KTOTrainer(ClassMetricsMixin, ReferenceTrainer):
    """Kahneman-Tversky Optimization: trains a policy on completions labelled desirable or undesirable one at a time,
    no pairs needed.

    `KTOTrainer(model, ref_model=None, args=KTOConfig(...), train_dataset=..., processing_class=...,
    peft_config=...)`, TRL's keyword arguments in TRL's order.

    Data: unpaired rows (`prompt`, `completion`, boolean `label`, True = desirable), standard or
    conversational; paired preference data (`chosen`/`rejected`) is unpaired into one desirable and one
    undesirable row per pair. The reference is `ref_model`, else a frozen copy of the policy, else (with
    `peft_config`) the policy with its adapter disabled, or log-probs precomputed once (`precompute_ref_log_probs`).

    See docs/trainers/kto.md.
    """

    requires_train_dataset = True  # as TRL's

    _name = "KTO"  # the method the model card names and cites (posttrain/training/model_card.py)

    ALL_REF_COLUMNS = ("ref_logps", "ref_kl_logps")
    PREPARED_COLUMN = "input_ids"

    def __init__(
        self,
        model,
        ref_model=None,
        args: KTOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        **kwargs,
    ):
        args = args or KTOConfig(output_dir="outputs/kto")
        kl = args.loss_type == "kto"
        self.REF_COLUMNS = self.ALL_REF_COLUMNS if kl else self.ALL_REF_COLUMNS[:1]
        self.ID_COLUMNS = ("input_ids", "completion_mask", "label") + (
            ("kl_input_ids", "kl_completion_mask") if kl else ()
        )
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
        self.setup_reference(ref_model, pretrained_adapter=peft_config is None and is_peft_model(model))

    def prepare_dataset(self, dataset, tokenizer, args: KTOConfig, name: str):
        fmt: DatasetFormat = validate_dataset(dataset, ("unpaired_preference", "preference"), "KTOTrainer", name)
        paired = fmt.kind == "preference"
        if paired:
            logger.info(
                "%s holds paired preference data: unpairing it into a desirable (chosen) and an undesirable "
                "(rejected) example per pair.",
                name,
            )
            dataset = unpair_preference_dataset(dataset, num_proc=args.dataset_num_proc)
            fmt = validate_dataset(dataset, ("unpaired_preference",), "KTOTrainer", name)
        if fmt.conversational:
            require_chat_template(tokenizer)
        completion_fmt = DatasetFormat("prompt_completion", fmt.conversational, ("prompt", "completion"))
        report = DataReport.of(self).start(name, len(dataset))
        report.note(len(dataset) // 2 if paired else 0, "pairs unpaired into two rows each (counted as rows)")
        dataset = dataset.map(
            tokenize_kto_row,
            with_indices=True,
            num_proc=args.dataset_num_proc,
            remove_columns=[c for c in dataset.column_names if c not in ("label", *self.ALL_REF_COLUMNS)],
            fn_kwargs=dict(tokenizer=tokenizer, fmt=fmt, completion_fmt=completion_fmt, max_length=args.max_length),
            desc=f"Tokenizing {name}",
        )
        empty = [i for i, mask in enumerate(dataset["completion_mask"]) if 1 not in mask]
        report.dropped(len(empty), f"prompt alone fills max_length={args.max_length}")
        if empty:  # as TRL does, drop rows whose prompt alone fills max_length
            if len(empty) == len(dataset):
                raise DataError(
                    f"Every row of {name} has a prompt that fills max_length={args.max_length}, leaving "
                    "no completion token; raise max_length (or set it to None)."
                )
            logger.warning(
                "Dropping %d of %d rows of %s: their prompt alone fills max_length=%s. Raise max_length to keep them.",
                len(empty),
                len(dataset),
                name,
                args.max_length,
            )
            dataset = dataset.select(sorted(set(range(len(dataset))) - set(empty)))
        dataset = report.take_cuts(dataset)  # the truncation of the rows kept
        if name == "train_dataset":
            check_class_balance(dataset["label"], args, name)
        if args.loss_type == "kto" and isinstance(dataset, Dataset):
            dataset = add_kl_pairs(dataset, args.per_device_train_batch_size, args.max_length)
        return dataset

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True (TRL's default) the columns the collator reads stay, the others go."""
        if self._signature_columns is None:
            kl = ["kl_input_ids", "kl_completion_mask"]
            self._signature_columns = ["input_ids", "completion_mask", "label", *kl, *self.ALL_REF_COLUMNS]

    def default_collator(self, tokenizer, args: KTOConfig):
        return KTOCollator(tokenizer.pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of)

    def reference_columns(self, reference, batch):
        n = len(batch["label"])
        # The examples and KL pairs in one forward; no metrics are logged from the reference.
        logps = sequence_logps(reference, labelled_rows(batch, slice(None)), stats=False).logps
        return dict(zip(self.REF_COLUMNS, (logps[:n], logps[n:])))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["label"]
        n = len(labels)
        policy, kl_logps = self._policy_logps(model, inputs, n)
        ref = self.reference_logps(model, inputs)
        policy_kl = ref_kl = None
        if "ref_kl_logps" in ref:
            policy_kl = self.accelerator.gather(kl_logps)
            ref_kl = self.accelerator.gather(ref["ref_kl_logps"])
        losses, rewards, kl = kto_loss(
            policy.logps,
            ref["ref_logps"],
            labels,
            policy_kl,
            ref_kl,
            beta=self.args.beta,
            desirable_weight=self.args.desirable_weight,
            undesirable_weight=self.args.undesirable_weight,
            loss_type=self.args.loss_type,
        )
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, n, model.training)
        loss = self.add_aux_loss(loss, policy.aux_loss)
        self.record_token_metrics(
            policy.stats,
            policy.token_counts,
            inputs["attention_mask"][:n].sum(),
            {"chosen": labels, "rejected": ~labels},
        )
        self.record_class_metrics(labels, rewards, policy.logps.detach(), kl if policy_kl is not None else 0.0)
        return (loss, {"rewards": rewards}) if return_outputs else loss

    def _policy_logps(self, model, inputs, n: int) -> tuple[SequenceLogps, torch.Tensor | None]:
        """The examples' log-probs with gradient and their KL pairs' (rows n..2n, when present) without, which TRL
        computes in a separate no-grad forward. Each pair shares its example's prompt: the examples run first and
        the pairs read that prompt from their attention cache (`prefix_cache`); where that cannot be used, both run
        in one forward that computes the prompt once (the pairs then go through the backward pass for nothing). With
        a load-balancing loss, which is over the examples alone, the pairs get a forward of their own."""
        if inputs["input_ids"].shape[0] == n:
            return sequence_logps(model, labelled_rows(inputs, slice(None)), router_logits=self.aux_loss_enabled), None
        if self.aux_loss_enabled:
            policy = sequence_logps(model, labelled_rows(inputs, slice(None, n)), router_logits=True)
            with torch.no_grad():
                return policy, sequence_logps(model, labelled_rows(inputs, slice(n, None)), stats=False).logps
        cached = trained_and_continuation_logps(model, labelled_rows(inputs, slice(None)), n)
        if cached is not None:
            return cached
        both = sequence_logps(model, labelled_rows(inputs, slice(None)))
        return first_sequences(both, n), both.logps[n:].detach()
