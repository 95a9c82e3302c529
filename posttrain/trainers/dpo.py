"""Direct Preference Optimization (Rafailov et al. 2023) and its loss family: the policy learns to raise the
log-probability of chosen completions over rejected ones, relative to a fixed reference model.

Each step runs chosen and rejected through the policy in one forward (2B sequences, or one padding-free
row). The reference is a frozen copy, a model the user passes, the PEFT policy with its adapter disabled,
or log-probs computed once before training and cached on disk (`precompute_ref_log_probs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..callbacks import SyncRefModelCallback
from ..data.preference import PreferenceCollator, prepare_preference_dataset
from ..errors import ConfigError
from ..losses.logprobs import next_token_logps
from ..losses.preference import dpo_loss, dpo_metrics, validate_dpo_loss_settings
from ..models.reference import (
    checkpoint_fingerprint,
    cached_tensors,
    create_reference_model,
    is_peft_model,
    reference_forward,
    weights_fingerprint,
)
from .base import BaseTrainer, PosttrainConfig

logger = logging.getLogger("posttrain")

REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass
class DPOConfig(PosttrainConfig):
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate."})
    beta: float = field(default=0.1, metadata={"help": "Strength of the pull towards the reference: rewards are "
                                                       "beta * log(pi / pi_ref)."})
    loss_type: str | list[str] = field(
        default="sigmoid", metadata={"help": "DPO loss, or several to sum (a list, or comma-separated names): "
                                             "sigmoid, hinge, ipo, robust, exo_pair, nca_pair, bco_pair, sppo_hard, "
                                             "aot, aot_unpaired, apo_zero, apo_down, discopop, sft."})
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss_type entry (default: 1 each)."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Assumed rate of flipped preference labels (cDPO / robust / EXO), in [0, 0.5]."})
    f_divergence_type: str = field(
        default="reverse_kl", metadata={"help": "Divergence to the reference for the sigmoid loss: reverse_kl (DPO), "
                                                "forward_kl, js_divergence or alpha_divergence."})
    f_alpha_divergence_coef: float = field(
        default=1.0, metadata={"help": "alpha of the alpha divergence (f_divergence_type='alpha_divergence')."})
    discopop_tau: float = field(default=0.05, metadata={"help": "Temperature of the discopop loss."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Bound on prompt + completion tokens; the completion is cut to fit."})
    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Keep at most the last this-many prompt tokens."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Keep at most the first this-many tokens of each completion."})
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "Compute the reference log-probs of the whole dataset once before training "
                                         "(cached on disk) instead of a reference forward every step."})
    ref_cache_dir: str = field(
        default=os.path.join("~", ".cache", "posttrain", "ref_logps"),
        metadata={"help": "Where precomputed reference log-probs are cached, keyed by reference weights, data and "
                          "tokenization."})
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: every ref_model_sync_steps, mix the policy into the reference."})
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "TR-DPO mixing weight: ref = alpha * policy + (1 - alpha) * ref."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO: optimizer steps between syncs."})
    padding_free: bool = field(
        default=False, metadata={"help": "Concatenate each batch's 2B sequences into one row without padding."})

    def __post_init__(self):
        # Comma-separated names (the command line's form) -> a list; a single name stays a string.
        entries = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        names = [name.strip() for entry in entries for name in entry.split(",")]
        self.loss_type = names[0] if len(names) == 1 else names
        validate_dpo_loss_settings(
            self.loss_type, self.loss_weights, beta=self.beta, label_smoothing=self.label_smoothing,
            f_divergence_type=self.f_divergence_type, f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            discopop_tau=self.discopop_tau,
        )
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1 (or None for no limit).")
        if self.max_length is not None and self.max_prompt_length is not None \
                and self.max_prompt_length >= self.max_length:
            raise ConfigError(
                f"max_prompt_length={self.max_prompt_length} leaves no room for the completion within "
                f"max_length={self.max_length}; set max_prompt_length below max_length."
            )
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ConfigError("sync_ref_model updates the reference during training, so its log-probs cannot be "
                              "precomputed; set precompute_ref_log_probs=False or sync_ref_model=False.")
        if not 0 < self.ref_model_mixup_alpha <= 1:
            raise ConfigError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must lie in (0, 1].")
        if self.ref_model_sync_steps < 1:
            raise ConfigError(f"ref_model_sync_steps={self.ref_model_sync_steps} must be at least 1.")
        super().__post_init__()


class SequenceLogps(NamedTuple):
    logps: torch.Tensor  # [N] log-prob of each sequence's completion (sum over its tokens)
    token_counts: torch.Tensor  # [N] completion tokens per sequence
    mean_logits: torch.Tensor  # [N] detached: mean over completion tokens of the vocabulary-mean logit


def sequence_index(batch: dict) -> torch.Tensor:
    """[rows, T] index of the sequence each token belongs to: the row in a padded batch; in a padding-free
    row, the count of position-id restarts so far."""
    if "position_ids" in batch and "attention_mask" not in batch:
        return (batch["position_ids"] == 0).long().cumsum(-1) - 1
    rows, length = batch["input_ids"].shape
    return torch.arange(rows, device=batch["input_ids"].device)[:, None].expand(rows, length)


def sequence_logps(model, batch: dict) -> SequenceLogps:
    """One forward of a `PreferenceCollator` batch; per-sequence completion log-probs, token counts, mean logits."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits
    token_logps = next_token_logps(logits, batch["input_ids"])
    # The logit that predicts token t sits at t - 1, as for the log-probs.
    token_logits = F.pad(logits[:, :-1].detach().float().mean(-1), (1, 0))
    mask = batch["completion_mask"].to(token_logps.dtype)
    index = sequence_index(batch).reshape(-1)
    count = int(index.max()) + 1

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(count).index_add(0, index, (values * mask).reshape(-1))

    counts = per_sequence(torch.ones_like(token_logps))
    return SequenceLogps(per_sequence(token_logps), counts, per_sequence(token_logits) / counts.clamp(min=1))


def _token_fingerprint(dataset) -> str:
    """A hash of the tokenized rows: it changes with the data and with every tokenization setting."""
    digest = hashlib.sha256()
    for batch in dataset.select_columns(list(ID_COLUMNS)).iter(batch_size=1024):
        digest.update(json.dumps([batch[c] for c in ID_COLUMNS]).encode())
    return digest.hexdigest()


class DPOTrainer(BaseTrainer):
    """`DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=..., processing_class=...,
    peft_config=...)`.

    `ref_model` (a model, name or path) is the reference; without one it is a frozen copy of `model`, or the
    PEFT policy with its adapter disabled. The loss is summed over pairs and divided by the number of pairs
    in the whole effective batch (all accumulation steps and processes).
    """

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, *a, **kw):
        args = args or DPOConfig(output_dir="outputs/dpo")
        super().__init__(model, args, *a, **kw)
        self._loss_types, self._loss_weights = validate_dpo_loss_settings(
            args.loss_type, args.loss_weights, beta=args.beta, label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type, f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
        )
        self._bco_reward_sum = self._bco_reward_count = 0.0
        peft = is_peft_model(self.model)
        if args.precompute_ref_log_probs:
            self.ref_model = None
            self._precompute(ref_model, peft)
            return
        reference = create_reference_model(self.model, ref_model, peft=peft, model_init_kwargs=args.model_init_kwargs)
        if reference is None:
            self.ref_model = None
        else:
            self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
        if args.sync_ref_model:
            if self.ref_model is None:
                raise ConfigError("sync_ref_model needs a separate reference model, but with a PEFT policy the "
                                  "reference is the adapter-disabled base; pass ref_model or set sync_ref_model=False.")
            self.add_callback(
                SyncRefModelCallback(self.ref_model, args.ref_model_mixup_alpha, args.ref_model_sync_steps))

    # -- data ------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: DPOConfig, name: str):
        return prepare_preference_dataset(
            dataset, tokenizer, trainer="DPOTrainer", name=name, max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length, max_length=args.max_length,
            num_proc=args.dataset_num_proc,
        )

    def default_collator(self, tokenizer, args: DPOConfig):
        return PreferenceCollator(tokenizer.pad_token_id, padding_free=args.padding_free)

    # -- precomputed reference log-probs -----------------------------------------------------------
    def _precompute(self, ref_model, peft: bool) -> None:
        """Adds REF_COLUMNS to the train and eval datasets, from the disk cache when it has them."""
        if isinstance(ref_model, str):
            identity = {"checkpoint": checkpoint_fingerprint(ref_model), "init": self.args.model_init_kwargs}
        else:
            source = self.model if ref_model is None else ref_model
            identity = {"name": source.config._name_or_path,
                        "weights": weights_fingerprint(source, skip_trainable=peft and ref_model is None)}
        identity["precision"] = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"
        loaded = {}

        def reference():  # loaded only on a cache miss, once
            if "module" not in loaded:
                if ref_model is None:
                    loaded["module"] = None if peft else self.model
                else:
                    loaded["module"] = create_reference_model(
                        self.model, ref_model, model_init_kwargs=self.args.model_init_kwargs
                    ).to(self.accelerator.device)
            return loaded["module"]

        self.train_dataset = self._with_ref_logps(self.train_dataset, identity, reference)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._with_ref_logps(v, identity, reference) for k, v in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._with_ref_logps(self.eval_dataset, identity, reference)

    def _with_ref_logps(self, dataset, identity: dict, reference):
        if dataset is None or set(REF_COLUMNS) <= set(dataset.column_names):
            return dataset
        key = {"reference": identity, "data": _token_fingerprint(dataset)}

        def compute() -> dict[str, torch.Tensor]:
            loader = DataLoader(dataset.select_columns(list(ID_COLUMNS)), collate_fn=self.data_collator,
                                batch_size=self.args.per_device_eval_batch_size)
            chosen, rejected = [], []
            with reference_forward(self.model, reference()) as ref, self.accelerator.autocast():
                for batch in loader:
                    batch = self._prepare_inputs(batch)
                    logps = sequence_logps(ref, batch).logps.float()
                    half = logps.shape[0] // 2
                    chosen.append(logps[:half])
                    rejected.append(logps[half:])
            return {"chosen": torch.cat(chosen), "rejected": torch.cat(rejected)}

        with self.accelerator.main_process_first():
            logps, from_cache = cached_tensors(self.args.ref_cache_dir, key, compute)
        logger.info("Reference log-probs for %d rows %s.", len(dataset),
                    "loaded from the cache" if from_cache else "computed and cached")
        return (dataset.add_column(REF_COLUMNS[0], logps["chosen"].tolist())
                .add_column(REF_COLUMNS[1], logps["rejected"].tolist()))

    # -- loss ------------------------------------------------------------------------------------
    def count_loss_items(self, batch):
        return (int(sequence_index(batch).max()) + 1) // 2

    def _bco_delta(self, rewards: torch.Tensor, update: bool) -> float:
        """BCO's shift: the running mean of all rewards seen in training so far (all processes)."""
        if update:
            rewards = self.accelerator.gather(rewards.detach().float())
            self._bco_reward_sum += rewards.sum().item()
            self._bco_reward_count += rewards.numel()
        return self._bco_reward_sum / max(self._bco_reward_count, 1)

    def _reference_logps(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if all(c in inputs for c in REF_COLUMNS):
            return inputs[REF_COLUMNS[0]], inputs[REF_COLUMNS[1]]
        with reference_forward(model, self.ref_model) as ref:
            logps = sequence_logps(ref, inputs).logps
        half = logps.shape[0] // 2
        return logps[:half], logps[half:]

    def _losses(self, policy: SequenceLogps, ref_chosen, ref_rejected, training: bool):
        """Per-pair losses, chosen rewards and rejected rewards. 'ipo' gets length-averaged log-probs, the
        other types summed ones (so one loss_type list may mix them). `training` updates BCO's running mean."""
        args = self.args
        half = policy.logps.shape[0] // 2
        chosen, rejected = policy.logps[:half], policy.logps[half:]
        counts = policy.token_counts.clamp(min=1)
        extra = {}
        if "sft" in self._loss_types:
            extra["chosen_nll"] = -chosen / counts[:half]
        if "bco_pair" in self._loss_types:
            all_rewards = torch.cat([chosen - ref_chosen, rejected - ref_rejected]) * args.beta
            extra["bco_delta"] = self._bco_delta(all_rewards, update=training)
        total, rewards = 0.0, None
        for averaged in (False, True):
            group = [(t, w) for t, w in zip(self._loss_types, self._loss_weights) if (t == "ipo") == averaged]
            if not group:
                continue
            norm_c, norm_r = (counts[:half], counts[half:]) if averaged else (1.0, 1.0)
            losses, chosen_rewards, rejected_rewards = dpo_loss(
                chosen / norm_c, rejected / norm_r, ref_chosen / norm_c, ref_rejected / norm_r,
                loss_type=[t for t, _ in group], loss_weights=[w for _, w in group], beta=args.beta,
                label_smoothing=args.label_smoothing, f_divergence_type=args.f_divergence_type,
                f_alpha_divergence_coef=args.f_alpha_divergence_coef, discopop_tau=args.discopop_tau, **extra,
            )
            total = total + losses
            rewards = rewards or (chosen_rewards, rejected_rewards)
        return total, *rewards

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        policy = sequence_logps(model, inputs)
        ref_chosen, ref_rejected = self._reference_logps(model, inputs)
        losses, chosen_rewards, rejected_rewards = self._losses(policy, ref_chosen, ref_rejected, model.training)
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, len(losses), model.training)
        self._record(policy, chosen_rewards, rejected_rewards)
        return (loss, None) if return_outputs else loss

    def _record(self, policy: SequenceLogps, chosen_rewards, rejected_rewards) -> None:
        half = policy.logps.shape[0] // 2
        counts = policy.token_counts
        metrics = dpo_metrics(chosen_rewards, rejected_rewards)
        for name, part in (("chosen", slice(None, half)), ("rejected", slice(half, None))):
            metrics[f"logps/{name}"] = policy.logps[part].detach().mean()
            # Token-weighted: the mean logit over all completion tokens of the batch.
            weighted = (policy.mean_logits[part] * counts[part]).sum()
            metrics[f"logits/{name}"] = weighted / counts[part].sum().clamp(min=1)
        self.record_metrics(metrics)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation computes the DPO loss (the batches carry no `labels` for the default step to find)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
