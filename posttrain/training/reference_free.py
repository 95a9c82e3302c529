"""The public base of the reference-free preference trainers (ORPO, CPO/SimPO): `ReferenceFreeConfig` and
`ReferenceFreeTrainer` prepare preference pairs, score chosen and rejected completions in one forward and log the
reward metrics; a method adds its pair loss (`pair_losses`)."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch

from posttrain.data.preference import FLOAT_COLUMNS, PreferenceCollator, prepare_preference_dataset
from posttrain.errors import ConfigError
from posttrain.losses.preference import dpo_metrics
from posttrain.models.layouts import sequence_index
from posttrain.training.base import BaseTrainer, PosttrainConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_completion_length_field,
    max_length_field,
)
from posttrain.training.preference import PreferenceMetricsMixin, SequenceLogps, sequence_logps
from posttrain.training.reference_trainer import PreparesEvalDatasets, load_processing_class


@dataclass
class ReferenceFreeConfig(PosttrainConfig):
    """Options ORPO and CPO share (TRL's names and defaults)."""

    learning_rate: float = learning_rate_field(1e-6)
    max_length: int | None = max_length_field(
        1024,
        "Bound on each prompt + completion sequence; the end of the completion is cut (rows whose prompt "
        "alone fills it are dropped, with a warning).",
    )
    max_completion_length: int | None = max_completion_length_field(
        None, "Keep at most the first this-many tokens of each completion."
    )
    beta: float = config_field(0.1, "Weight of the preference term.", min=0)
    disable_dropout: bool = disable_dropout_field(True)
    generate_during_eval: bool = config_field(
        False,
        "At each evaluation, sample completions for a random batch of eval prompts and log them "
        "(output_dir/game_log.jsonl, and a W&B table with wandb).",
    )
    is_encoder_decoder: bool | None = config_field(
        None, "Whether the model is an encoder-decoder (posttrain trains decoder-only causal LMs: leave None or False)."
    )
    padding_free: bool = config_field(
        False, "posttrain extra: concatenate each batch's 2B sequences into one row without padding."
    )

    def __post_init__(self):
        if self.is_encoder_decoder:
            raise ConfigError(
                "is_encoder_decoder=True: posttrain trains decoder-only causal language models, not "
                "encoder-decoders; use a causal LM and leave is_encoder_decoder unset."
            )
        super().__post_init__()


class ReferenceFreeTrainer(PreferenceMetricsMixin, PreparesEvalDatasets, BaseTrainer):
    """Preference training on the policy's own log-probs: DPO's data layer and forward, a subclass's loss.

    `pair_losses(policy, logits, inputs)` returns the per-pair losses (NLL term included), chosen and rejected
    rewards and extra metrics. The losses are summed and divided by the number of pairs in the whole effective batch.
    A subclass names its `config_class`: without `args`, one with output_dir="outputs/<name>" is made.
    """

    config_class: type[ReferenceFreeConfig] = ReferenceFreeConfig

    def __init__(
        self,
        model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        compute_metrics=None,
        quantization_config=None,
        **kwargs,
    ):
        args = args or self.config_class(output_dir=f"outputs/{self._name.lower()}")
        if model is None:
            if model_init is None:
                raise ConfigError(
                    f"{type(self).__name__} needs a model: pass model=... (a model, name or path) or "
                    "model_init=<a function returning one>."
                )
            model = model_init()
        elif model_init is not None:
            raise ConfigError("Pass either model or model_init, not both (model_init would replace the model).")
        if train_dataset is None:
            raise ConfigError(f"{type(self).__name__} needs a train_dataset (prompt, chosen, rejected).")
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            raise ConfigError(
                f"{type(config).__name__} is an encoder-decoder model; posttrain's "
                f"{type(self).__name__} trains decoder-only causal LMs."
            )
        processing_class = load_processing_class(model, processing_class, args)
        self._total_train_tokens = 0
        self._last_logits = (0.0, 0.0)
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
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **kwargs,
        )
        # As TRL: the aux loss joins when the model config asks for router logits, at the config's coefficient.
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        self.aux_loss_enabled = bool(getattr(config, "output_router_logits", False))
        self.router_aux_loss_coef = getattr(config, "router_aux_loss_coef", 0.0)

    # -- data ------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args, name: str):
        return prepare_preference_dataset(
            dataset,
            tokenizer,
            trainer=type(self).__name__,
            name=name,
            max_completion_length=args.max_completion_length,
            max_length=args.max_length,
            truncation_mode="keep_start",
            num_proc=args.dataset_num_proc,
        )

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True (TRL's default for CPO and ORPO), the columns the collator reads stay."""
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", *FLOAT_COLUMNS]

    def default_collator(self, tokenizer, args):
        pad = getattr(args, "padding_value", None)
        return PreferenceCollator(
            tokenizer.pad_token_id if pad is None else pad,
            padding_free=args.padding_free,
            max_length=args.max_length,
            truncation_mode="keep_start",
        )

    def count_loss_items(self, batch):
        return (int(sequence_index(batch).max()) + 1) // 2

    # -- loss ------------------------------------------------------------------------------------
    def pair_losses(self, policy: SequenceLogps, logits: torch.Tensor, inputs: dict):
        """(per-pair losses, chosen rewards, rejected rewards, extra metrics)."""
        raise NotImplementedError

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        captured = {}

        def forward(**kw):  # keeps the logits for losses that need more than the completion log-probs
            captured["outputs"] = model(**kw)
            return captured["outputs"]

        policy = sequence_logps(forward, inputs, router_logits=self.aux_loss_enabled)
        losses, chosen_rewards, rejected_rewards, extra = self.pair_losses(policy, captured["outputs"].logits, inputs)
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, len(losses), model.training)
        loss = self.add_aux_loss(loss, policy.aux_loss)
        self._record(policy, chosen_rewards, rejected_rewards, inputs, extra)
        return (loss, None) if return_outputs else loss

    @staticmethod
    def chosen_nll(policy: SequenceLogps) -> torch.Tensor:
        """Token-mean NLL of the micro-batch's chosen completions (TRL's cross-entropy over their labels)."""
        half = policy.logps.shape[0] // 2
        return -policy.token_logps[:half].sum() / policy.token_counts[:half].sum().clamp(min=1)

    def sequence_scores(self, policy: SequenceLogps) -> torch.Tensor:
        """The per-sequence log-probs the loss compares (and logps/* logs): per-token averages by default."""
        return policy.logps / policy.token_counts.clamp(min=1)

    def _record(self, policy: SequenceLogps, chosen_rewards, rejected_rewards, inputs, extra: dict) -> None:
        half = policy.logps.shape[0] // 2
        counts = policy.token_counts
        parts = {"chosen": slice(None, half), "rejected": slice(half, None)}
        attention = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
        self.record_token_metrics(policy.stats, counts, torch.as_tensor(attention, device=counts.device), parts)
        metrics = dpo_metrics(chosen_rewards, rejected_rewards)
        scores = self.sequence_scores(policy).detach()
        for name, part in parts.items():
            metrics[f"logps/{name}"] = scores[part].mean()
        if not self.model.training:  # what prediction_step hands compute_metrics
            self._last_logits = tuple(
                (policy.stats["logits"][part].sum() / counts[part].sum().clamp(min=1)).item() for part in parts.values()
            )
        self.record_metrics({**metrics, **extra})

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """As TRL: with compute_metrics, the predictions are the batch's mean chosen and rejected logits."""
        loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        if ignore_keys is None:
            ignore_keys = getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", []) or []
        values = [
            v for k, v in zip(("eval_logits/chosen", "eval_logits/rejected"), self._last_logits) if k not in ignore_keys
        ]
        logits = torch.tensor(values, device=self.accelerator.device)
        return loss, logits, torch.zeros(logits.shape[0], device=self.accelerator.device)

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        return {"num_tokens": self._total_train_tokens, **super().checkpoint_state()}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        self._total_train_tokens = state.pop("num_tokens", 0)
        super().load_checkpoint_state(state)

    # -- generate_during_eval --------------------------------------------------------------------
    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        if self.args.generate_during_eval:
            self._log_game(dataloader.dataset)
        return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)

    @torch.no_grad()
    def _log_game(self, dataset) -> None:
        """Samples one completion (up to max_length tokens in all) for eval_batch_size random eval prompts and
        logs the (prompt, completion) rows: output_dir/game_log.jsonl, and a `game_log` W&B table with wandb."""
        tokenizer = self.processing_class
        rows = random.sample(range(len(dataset)), k=min(self.args.eval_batch_size, len(dataset)))
        prompts = [dataset[i]["prompt_ids"] for i in rows]
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        width = max(len(p) for p in prompts)
        ids = torch.tensor(
            [[tokenizer.pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=self.accelerator.device
        )
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ids.device)
        try:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_length=max(self.args.max_length or 512, width + 1),
                do_sample=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        finally:
            model.train(was_training)
        table = [
            [tokenizer.decode(p, skip_special_tokens=True), tokenizer.decode(o[width:], skip_special_tokens=True)]
            for p, o in zip(prompts, out.tolist())
        ]
        if not self.accelerator.is_main_process:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "game_log.jsonl"), "a") as f:
            for prompt, completion in table:
                f.write(json.dumps({"step": self.state.global_step, "prompt": prompt, "policy": completion}) + "\n")
        if "wandb" in (self.args.report_to or []):
            import wandb

            if wandb.run is not None:
                wandb.log({"game_log": wandb.Table(columns=["Prompt", "Policy"], data=table)})
