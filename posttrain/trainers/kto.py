"""KTO (Ethayarajh et al. 2024): alignment from unpaired examples, each marked desirable or undesirable.

The implicit reward beta * log(pi/pi_ref) of a desirable completion is pushed above a reference point z0
and that of an undesirable one below it. z0 estimates KL(pi || pi_ref) from mismatched pairs: within each
micro-batch, prompt i is scored with completion (i + 1) mod B, the completion of its neighbour. The estimate
is detached (as in the paper), computed without gradients, and pooled over all processes; it is not pooled
over gradient-accumulation steps, so each micro-batch has its own z0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..data.chat import require_chat_template, unpair_preference_dataset
from ..data.collators import pad
from ..data.formats import DatasetFormat, check_example, validate_dataset
from ..data.tokenize import tokenize_example
from ..errors import ConfigError, DataError
from ..losses.logprobs import next_token_logps
from ..losses.preference import KTO_LOSS_TYPES, kto_loss
from ..models.reference import create_reference_model, reference_forward
from .base import BaseTrainer, PosttrainConfig

logger = logging.getLogger("posttrain")

# The KTO paper recommends weights with desirable_weight * n_desirable / (undesirable_weight * n_undesirable)
# in [1, 4/3].
RECOMMENDED_WEIGHTED_RATIO = (1.0, 4 / 3)


@dataclass
class KTOConfig(PosttrainConfig):
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Truncate prompt + completion to this many tokens (the completion is cut)."})
    beta: float = field(default=0.1, metadata={"help": "Scale of the implicit reward beta * log(pi/pi_ref); higher "
                                                       "keeps the policy closer to the reference."})
    desirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of desirable examples' losses (to balance unequal class counts)."})
    undesirable_weight: float = field(
        default=1.0, metadata={"help": "Weight of undesirable examples' losses (to balance unequal class counts)."})
    loss_type: str = field(
        default="kto", metadata={"help": "'kto' (with the KL reference point) or 'apo_zero_unpaired' (without one)."})

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ConfigError(f"loss_type={self.loss_type!r} is not supported; choose from {list(KTO_LOSS_TYPES)}.")
        if self.beta <= 0:
            raise ConfigError(f"beta={self.beta} must be positive (it scales the implicit reward).")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError(f"desirable_weight={self.desirable_weight} and undesirable_weight="
                              f"{self.undesirable_weight} must both be positive.")


def _tokenize_row(example, row, tokenizer, fmt, completion_fmt, max_length):
    check_example(example, fmt, row)
    return tokenize_example(example, tokenizer, completion_fmt, row=row, max_length=max_length)


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
            "%.3g.", name, n_desirable, n_undesirable, args.desirable_weight, args.undesirable_weight, n_desirable,
            n_undesirable, ratio, args.undesirable_weight, base * low, base * high,
        )


class KTOCollator:
    """B unpaired examples -> `label` [B] and B sequences (prompt + completion) with `completion_mask`; with
    `mismatched_pairs`, B more rows follow: prompt i with the completion of example (i + 1) mod B, for the KL
    reference point (truncated to `max_length`). A batch of one pairs its example with itself."""

    def __init__(self, pad_token_id: int, mismatched_pairs: bool = True, max_length: int | None = None):
        self.pad_token_id = pad_token_id
        self.mismatched_pairs = mismatched_pairs
        self.max_length = max_length

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [list(e["input_ids"]) for e in examples]
        masks = [list(e["completion_mask"]) for e in examples]
        if self.mismatched_pairs:
            starts = [mask.index(1) for mask in masks]  # where each completion begins
            for i in range(len(examples)):
                j = (i + 1) % len(examples)
                sequences.append((sequences[i][: starts[i]] + sequences[j][starts[j]:])[: self.max_length])
                masks.append(([0] * starts[i] + masks[j][starts[j]:])[: self.max_length])
        return {
            "input_ids": pad(sequences, self.pad_token_id),
            "attention_mask": pad([[1] * len(s) for s in sequences], 0),
            "completion_mask": pad(masks, 0),
            "label": torch.tensor([e["label"] for e in examples], dtype=torch.bool),
        }


def completion_logps(model, input_ids, attention_mask, completion_mask) -> torch.Tensor:
    """Summed log-probs of each row's completion tokens [rows] (trailing all-padding columns are dropped)."""
    width = int(attention_mask.sum(-1).max())
    input_ids, attention_mask, completion_mask = (t[:, :width] for t in (input_ids, attention_mask, completion_mask))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return (next_token_logps(logits, input_ids) * completion_mask).sum(-1)


class KTOTrainer(BaseTrainer):
    """`KTOTrainer(model, args=KTOConfig(...), train_dataset=..., ref_model=None, peft_config=...)`.

    Data: unpaired rows (`prompt`, `completion`, boolean `label`, True = desirable), standard or
    conversational; paired preference data (`chosen`/`rejected`) is unpaired into one desirable and one
    undesirable row per pair. The reference is `ref_model`, else a frozen copy of the policy, else (with
    `peft_config`) the policy with its adapter disabled.
    """

    def __init__(self, model, args: KTOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, *, ref_model=None, **kwargs):
        args = args or KTOConfig(output_dir="outputs/kto")
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, **kwargs)
        self.ref_model = create_reference_model(self.model, ref_model, peft=peft_config is not None)
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        if args.loss_type == "kto" and args.per_device_train_batch_size == 1:
            logger.warning("per_device_train_batch_size=1: the KL reference point pairs each prompt with another "
                           "example's completion from the same batch, and a batch of one has none, so z0 is "
                           "estimated from the matched pair itself. Use a batch size of at least 2.")

    def prepare_dataset(self, dataset, tokenizer, args: KTOConfig, name: str):
        fmt: DatasetFormat = validate_dataset(dataset, ("unpaired_preference", "preference"), "KTOTrainer", name)
        if fmt.kind == "preference":
            logger.info("%s holds paired preference data: unpairing it into a desirable (chosen) and an undesirable "
                        "(rejected) example per pair.", name)
            dataset = unpair_preference_dataset(dataset, num_proc=args.dataset_num_proc)
            fmt = validate_dataset(dataset, ("unpaired_preference",), "KTOTrainer", name)
        if fmt.conversational:
            require_chat_template(tokenizer)
        completion_fmt = DatasetFormat("prompt_completion", fmt.conversational, ("prompt", "completion"))
        dataset = dataset.map(
            _tokenize_row, with_indices=True, num_proc=args.dataset_num_proc,
            remove_columns=[c for c in dataset.column_names if c != "label"],
            fn_kwargs=dict(tokenizer=tokenizer, fmt=fmt, completion_fmt=completion_fmt, max_length=args.max_length),
            desc=f"Tokenizing {name}",
        )
        if name == "train_dataset":
            check_class_balance(dataset["label"], args, name)
        return dataset

    def default_collator(self, tokenizer, args: KTOConfig):
        return KTOCollator(tokenizer.pad_token_id, mismatched_pairs=args.loss_type == "kto", max_length=args.max_length)

    def count_loss_items(self, batch):
        return len(batch["label"])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["label"]
        n = len(labels)
        rows = (inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"])
        logps = completion_logps(model, *(t[:n] for t in rows))
        with reference_forward(model, self.ref_model) as reference:
            ref_logps = completion_logps(reference, *rows)  # the examples and the mismatched pairs in one forward
        policy_kl = ref_kl = None
        if len(rows[0]) > n:
            with torch.no_grad():
                policy_kl = self.accelerator.gather(completion_logps(model, *(t[n:] for t in rows)))
            ref_kl = self.accelerator.gather(ref_logps[n:])
        losses, rewards, kl = kto_loss(
            logps, ref_logps[:n], labels, policy_kl, ref_kl, beta=self.args.beta,
            desirable_weight=self.args.desirable_weight, undesirable_weight=self.args.undesirable_weight,
            loss_type=self.args.loss_type,
        )
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, n, model.training)
        self._record_class_metrics(labels, rewards, logps.detach(), kl if policy_kl is not None else None)
        return (loss, {"rewards": rewards}) if return_outputs else loss

    def _record_class_metrics(self, labels, rewards, logps, kl=None) -> None:
        """Means over the desirable and the undesirable examples of all processes (a class may be absent),
        and the KL reference point z0 when there is one."""
        desirable = labels.float()
        undesirable = 1 - desirable
        stats = torch.stack([desirable.sum(), undesirable.sum(), (rewards * desirable).sum(),
                             (rewards * undesirable).sum(), (logps * desirable).sum(), (logps * undesirable).sum()])
        n_d, n_u, reward_d, reward_u, logp_d, logp_u = self.accelerator.gather(stats[None]).sum(0).tolist()
        metrics = {} if kl is None else {"kl": kl}
        if n_d:
            metrics.update({"rewards/chosen": reward_d / n_d, "logps/chosen": logp_d / n_d})
        if n_u:
            metrics.update({"rewards/rejected": reward_u / n_u, "logps/rejected": logp_u / n_u})
        if n_d and n_u:
            metrics["rewards/margins"] = reward_d / n_d - reward_u / n_u
        self.record_metrics(metrics)
