"""Direct Preference Optimization (Rafailov et al. 2023) and its loss family: the policy learns to raise the
log-probability of chosen completions over rejected ones, relative to a fixed reference model.

Each step runs chosen and rejected through the policy in one forward (2B sequences, or one padding-free
row; `preference_common.sequence_logps` computes each shared prompt once and never builds the full logits).
The reference is a frozen copy, a model the user passes, the PEFT policy with its adapter disabled,
or log-probs computed once before training and cached on disk (`precompute_ref_log_probs`); otherwise each
row's reference log-probs are kept from their first forward for when the row comes back (`reference_memo.py`).
`ReferenceConfig` / `ReferenceTrainer` hold what DPO shares with KTO (reference handling, TR-DPO syncing; the
MoE auxiliary loss and the token metrics TRL logs come from `PreferenceMetricsMixin`); each sequence over
`max_length` is cut by the collator as `truncation_mode` says, exactly as TRL does.
"""

from __future__ import annotations

import logging

import torch

from posttrain.data.preference import FLOAT_COLUMNS, PreferenceCollator, prepare_preference_dataset
from posttrain.data.report import DataReport
from posttrain.data.tokenizer_setup import configure_tokenizer, sync_model_with_tokenizer
from posttrain.data.vision import (
    VisionPreferenceCollator,
    is_vision_dataset,
    tokenizer_of,
    validate_vision_dataset,
)
from posttrain.errors import ConfigError
from posttrain.losses.preference import dpo_loss, dpo_metrics, validate_dpo_loss_settings, wpo_weights
from posttrain.models.layouts import sequence_index
from posttrain.models.loading import load_tokenizer
from posttrain.models.reference import (
    is_peft_model,
)
from posttrain.trainers.dpo_config import DPOConfig
from posttrain.training.preference import SequenceLogps, sequence_logps
from posttrain.training.reference_trainer import ReferenceTrainer
from posttrain.training.vision import VisionSetup

logger = logging.getLogger("posttrain")

ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


class DPOTrainer(VisionSetup, ReferenceTrainer):
    """Direct Preference Optimization and its loss variants: trains a policy on preference pairs against a frozen
    reference, without a reward model or sampling.

    `DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=..., processing_class=...,
    peft_config=...)`, TRL's keyword arguments in TRL's order.

    `ref_model` (a model, name or path) is the reference; without one it is a frozen copy of `model`, or the
    PEFT policy with its adapter disabled. The loss is summed over pairs and divided by the number of pairs
    in the whole effective batch (all accumulation steps and processes). A dataset with an `images` / `image`
    column (and an explicit prompt) trains a vision-language model: see docs/vision.md.

    See docs/trainers/dpo.md.
    """

    requires_train_dataset = True  # as TRL's

    _name = "DPO"  # the method the model card names and cites (posttrain/training/model_card.py)

    REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
    ID_COLUMNS = ID_COLUMNS

    def __init__(
        self,
        model,
        ref_model=None,
        args: DPOConfig | None = None,
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
        args = args or DPOConfig(output_dir="outputs/dpo")
        processing_class, peft_config = self.setup_vision(
            model, args, train_dataset, eval_dataset, processing_class, peft_config, load_tokenizer
        )
        configure_tokenizer(tokenizer_of(processing_class), args)  # pad_token
        freeze = args.freeze_vision_tower
        if isinstance(model, str) and self._vision_model:
            load = self.vision_loader(model, args)
            self.load_model = lambda name, kw: self._adapted(load(name, kw), peft_config, freeze)
        elif not isinstance(model, str):
            self.adapt_vision_model(model, peft_config, freeze)
        if isinstance(ref_model, str) and self._vision_model:  # a vision-language reference by name
            ref_model = self.vision_loader(model, args)(ref_model, args.model_init_kwargs)
        self._loss_types, self._loss_weights = validate_dpo_loss_settings(
            args.loss_type,
            args.loss_weights,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
            use_weighting=args.use_weighting,
            ld_alpha=args.ld_alpha,
        )
        self._total_train_tokens = 0
        with self.processor_pad_token(processing_class):
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
        self.finish_vision_setup(freeze)
        sync_model_with_tokenizer(
            self.accelerator.unwrap_model(self.model), tokenizer_of(self.processing_class), eos_changed=False
        )
        self.setup_reference(ref_model, pretrained_adapter=peft_config is None and is_peft_model(model))

    def _adapted(self, loaded, peft_config, freeze: bool):
        self.adapt_vision_model(loaded, peft_config, freeze)
        return loaded

    # -- data ------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: DPOConfig, name: str):
        if is_vision_dataset(dataset):  # validated here; images are processed in the collator
            if "prompt" not in dataset.column_names:
                raise ConfigError(
                    f"{name} has images but no 'prompt' column: with images, give the prompt (with its "
                    "image placeholders) explicitly, e.g. with posttrain.data_utils.extract_prompt."
                )
            validate_vision_dataset(dataset, tokenizer, ("preference",), "DPOTrainer", name)
            return dataset
        return prepare_preference_dataset(
            dataset,
            tokenizer_of(tokenizer),
            trainer="DPOTrainer",
            name=name,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            num_proc=args.dataset_num_proc,
            report=DataReport.of(self).start(name, len(dataset)),
        )

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True (TRL's default) the columns the collator reads stay, the others go."""
        if self._signature_columns is None:
            read = ["prompt", "chosen", "rejected", "image", "images"] if self._vision else list(ID_COLUMNS)
            self._signature_columns = [*read, *FLOAT_COLUMNS]

    def default_collator(self, tokenizer, args: DPOConfig):
        if self._vision:
            return VisionPreferenceCollator(tokenizer, args.max_length, args.pad_to_multiple_of)
        tokenizer = tokenizer_of(tokenizer)
        return PreferenceCollator(
            tokenizer.pad_token_id,
            padding_free=args.padding_free,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )

    def precompute_settings(self) -> dict:
        return {
            "ld_alpha": self.args.ld_alpha,
            "max_length": self.args.max_length,
            "truncation_mode": self.args.truncation_mode,
        }

    def reference_columns(self, reference, batch):
        logps = sequence_logps(reference, batch, self.args.ld_alpha, stats=False).logps
        return dict(zip(self.REF_COLUMNS, logps.chunk(2)))

    # -- loss ------------------------------------------------------------------------------------
    def count_loss_items(self, batch):
        return (int(sequence_index(batch).max()) + 1) // 2

    def _reference_logps(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.reference_logps(model, inputs)
        return tuple(values[c] for c in self.REF_COLUMNS)

    def _losses(self, policy: SequenceLogps, ref_chosen, ref_rejected):
        """Per-pair losses, chosen rewards and rejected rewards."""
        args = self.args
        half = policy.logps.shape[0] // 2
        counts = policy.token_counts
        extra = {}
        if "sft" in self._loss_types:  # the chosen completions' token-mean NLL over the micro-batch, as in TRL
            nll = -policy.token_logps[:half].sum() / counts[:half].sum().clamp(min=1)
            extra["chosen_nll"] = nll.expand(half)
        if args.use_weighting:
            weights = wpo_weights(policy.token_logps.detach(), policy.stats["log_sum_sq"], policy.mask)
            extra["pair_weights"] = weights[:half] * weights[half:]
        return dpo_loss(
            policy.logps[:half],
            policy.logps[half:],
            ref_chosen,
            ref_rejected,
            loss_type=list(self._loss_types),
            loss_weights=list(self._loss_weights),
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
            chosen_lengths=counts[:half],
            rejected_lengths=counts[half:],
            **extra,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        policy = sequence_logps(
            model, inputs, self.args.ld_alpha, wpo=self.args.use_weighting, router_logits=self.aux_loss_enabled
        )
        ref_chosen, ref_rejected = self._reference_logps(model, inputs)
        losses, chosen_rewards, rejected_rewards = self._losses(policy, ref_chosen, ref_rejected)
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, len(losses), model.training)
        loss = self.add_aux_loss(loss, policy.aux_loss)
        self._record(policy, chosen_rewards, rejected_rewards, inputs)
        return (loss, None) if return_outputs else loss

    def _record(self, policy: SequenceLogps, chosen_rewards, rejected_rewards, inputs) -> None:
        half = policy.logps.shape[0] // 2
        counts = policy.token_counts
        parts = {"chosen": slice(None, half), "rejected": slice(half, None)}
        attention = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
        self.record_token_metrics(policy.stats, counts, torch.as_tensor(attention, device=counts.device), parts)
        metrics = dpo_metrics(chosen_rewards, rejected_rewards)
        # Over all chosen completion tokens of all processes (a token-weighted ratio, as TRL computes it).
        top1 = self.accelerator.gather(torch.stack([policy.stats["top1"][:half].sum(), counts[:half].sum()])[None])
        metrics["mean_token_accuracy"] = top1[:, 0].sum() / top1[:, 1].sum().clamp(min=1)
        for name, part in parts.items():
            metrics[f"logps/{name}"] = policy.logps[part].detach().mean()
        self.record_metrics(metrics)
