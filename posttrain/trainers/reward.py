"""Reward modelling: a sequence classifier with one output learns to score the chosen completion of each
preference pair above the rejected one (Bradley-Terry). The result scores any text and serves as the
reward model of the online trainers."""

from __future__ import annotations

import functools
import warnings

import torch
from transformers import set_seed

from posttrain.data.preference import (
    FLOAT_COLUMNS,
    TOKENIZED_PAIR_COLUMNS,
    PreferenceCollator,
    drop_overlong_rows,
    prepare_preference_dataset,
    tokenized_pairs_as_prompt_and_completions,
)
from posttrain.data.report import DataReport
from posttrain.data.tokenizer_setup import configure_tokenizer, make_added_tokens_trainable, sync_model_with_tokenizer
from posttrain.data.vision import tokenizer_of
from posttrain.errors import ConfigError
from posttrain.losses.preference import bradley_terry_loss
from posttrain.models.layouts import can_repack, repacked, right_padded_view
from posttrain.models.loading import load_sequence_classifier
from posttrain.models.reference import unwrap
from posttrain.models.scored_positions import scored_hidden, why_not
from posttrain.trainers.reward_config import RewardConfig
from posttrain.training.base import BaseTrainer
from posttrain.training.preference import model_shared_layout
from posttrain.training.reference_trainer import PreparesEvalDatasets, load_processing_class


def _score_parts(model):
    """(decoder, score head, pad id) of a decoder-only sequence classifier whose score can be read from the decoder's
    hidden states, or None: the head must be a linear layer (or PEFT's trained copy of one) applied per position."""
    inner = unwrap(model)
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    config = inner.config
    decoder = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    head = getattr(inner, "score", None)
    linear = getattr(head, "original_module", head)  # PEFT's ModulesToSaveWrapper calls its trained copy
    if (
        decoder is None
        or not isinstance(linear, torch.nn.Linear)
        or getattr(config, "vision_config", None)
        or config.get_text_config().pad_token_id is None
        or not can_repack(model)
    ):
        return None
    return decoder, head, config.get_text_config().pad_token_id


def _load_reward_model(name: str, model_init_kwargs: dict | None, tokenizer=None):
    """A one-output sequence classifier; a causal LM checkpoint gets a new score head. Its config.pad_token_id is
    the tokenizer's pad token, as in TRL (the tokenizer is loaded from the same name when none is given)."""
    return load_sequence_classifier(name, num_labels=1, model_init_kwargs=model_init_kwargs, tokenizer=tokenizer)


class RewardTrainer(PreparesEvalDatasets, BaseTrainer):
    """Trains a reward model on preference pairs (Bradley-Terry): a sequence classifier whose score ranks chosen above
    rejected, for use as a reward in GRPO, RLOO or PPO.

    `RewardTrainer(model, args=RewardConfig(...), train_dataset=..., processing_class=..., peft_config=...)`,
    TRL's keyword arguments in TRL's order.

    `model` is a sequence classifier with one output, or the name or path of a causal LM or classifier
    checkpoint. Each pair is scored in one forward of 2B sequences; a sequence's reward is the classifier's
    output at its last non-padding token.

    See docs/trainers/reward.md.
    """

    requires_train_dataset = True  # as TRL's

    _name = "Reward"  # the method the model card names and cites (posttrain/training/model_card.py)
    _tag_names = ["trl", "reward-trainer"]  # the Hub tags TRL's RewardTrainer gives the model

    load_model = staticmethod(_load_reward_model)

    def __init__(
        self,
        model,
        args: RewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
        **kwargs,
    ):
        args = args or RewardConfig(output_dir="outputs/reward")
        set_seed(args.seed)  # a checkpoint without a score head gets a new one: make its initialisation follow the seed
        if not isinstance(model, str):
            model = load_sequence_classifier(model, num_labels=1)  # checks the class and num_labels
        if peft_config is not None and peft_config.task_type is None and not peft_config.modules_to_save:
            warnings.warn(  # TRL trains such a config as it is; so does posttrain, saying what it means
                "peft_config.task_type is None: the adapter trains the backbone only, and the score head stays as it "
                "was loaded (a new one is random) and is not saved with the adapter. Set task_type='SEQ_CLS' (or "
                "modules_to_save=['score']) to train and save the score head too.",
                UserWarning,
                stacklevel=2,
            )
        elif peft_config is not None and peft_config.task_type not in (None, "SEQ_CLS"):
            raise ConfigError(
                f"peft_config.task_type is {peft_config.task_type!r}, but a reward model needs task_type='SEQ_CLS': "
                "only then does PEFT train and save the new score head along with the adapter."
            )
        processing_class = load_processing_class(model, processing_class, args)
        added = configure_tokenizer(processing_class, args)
        if isinstance(model, str):  # the classifier finds each sequence's last token by the tokenizer's pad id
            self.load_model = functools.partial(_load_reward_model, tokenizer=tokenizer_of(processing_class))
        make_added_tokens_trainable(peft_config, added)
        self._total_train_tokens = 0
        if optimizer_cls_and_kwargs is not None:
            kwargs["optimizer_cls_and_kwargs"] = optimizer_cls_and_kwargs
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
        # The classifier finds each sequence's last real token through the pad id: it must be the collator's.
        sync_model_with_tokenizer(
            self.accelerator.unwrap_model(self.model),
            self.processing_class,
            added,
            eos_changed=args.eos_token is not None,
        )

    def prepare_dataset(self, dataset, tokenizer, args: RewardConfig, name: str):
        dataset = tokenized_pairs_as_prompt_and_completions(dataset, name)
        if "prompt_ids" in dataset.column_names:  # tokenized already: only the length rule applies
            report = DataReport.of(self).start(name, len(dataset))
            return drop_overlong_rows(dataset, args.max_length, "drop", name, report)
        return prepare_preference_dataset(
            dataset,
            tokenizer,
            trainer="RewardTrainer",
            name=name,
            max_length=args.max_length,
            truncation_mode="drop",
            num_proc=args.dataset_num_proc,
            report=DataReport.of(self).start(name, len(dataset)),
        )

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True (TRL's default) the columns the collator reads stay, the others go."""
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", *TOKENIZED_PAIR_COLUMNS, *FLOAT_COLUMNS]

    def default_collator(self, tokenizer, args: RewardConfig):
        # Padded, not padding-free: the classifier reads one position per row.
        return PreferenceCollator(tokenizer.pad_token_id, pad_to_multiple_of=args.pad_to_multiple_of)

    def count_loss_items(self, batch):
        return len(batch["input_ids"]) // 2

    def _scores(self, model, input_ids, attention_mask) -> torch.Tensor:
        """[2B] scores. The right-padded rows get a cheaper layout when that saves enough work: each pair's shared
        prompt computed once under a 4D mask (`preference_common.shared_layout`), else the sequences repacked into
        fewer, fuller rows (`repacked`). The score head is applied to the decoder's hidden state at each sequence's
        scored position (the rightmost non-padding token, as the classifier itself picks it), with the decoder's last
        layer computed at those positions only where the model allows (`models/scored_positions.py`)."""
        parts = None if self.is_fsdp_enabled or self.is_deepspeed_enabled else _score_parts(model)
        view = None if parts is None else right_padded_view(input_ids, attention_mask)
        packed = None
        if view is not None:
            packed = model_shared_layout(model, view) or repacked(
                view, unwrap(model).config.get_text_config().hidden_size
            )
        decoder, head, pad_id = parts or (None, None, None)
        fast = view is not None and why_not(model, decoder) is None
        if packed is None and not fast:
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.squeeze(-1)
        inputs, where = packed or ({"input_ids": input_ids, "attention_mask": attention_mask}, view.where)
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (columns * (input_ids != pad_id)).argmax(-1)
        scored = where[torch.arange(len(last), device=last.device), last]
        # Through the (possibly wrapped) model, whose own pooled output is not used; the last layer at the scored
        # positions only where the model allows (models/scored_positions.py), else the whole forward.
        hidden, _ = scored_hidden(model, decoder, inputs, scored)
        return head(hidden).squeeze(-1)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        scores = self._scores(model, inputs["input_ids"], inputs["attention_mask"])
        chosen, rejected = scores.float().chunk(2)
        loss = bradley_terry_loss(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient)
        loss = self.effective_batch_mean(loss * len(chosen), num_items_in_batch, len(chosen), model.training)
        self._record(chosen.detach(), rejected.detach(), inputs["attention_mask"])
        if return_outputs:
            return loss, {"rewards": torch.stack([chosen, rejected], dim=-1).detach()}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss; with `compute_metrics`, also the scores [2B, 1] (chosen rows first) as predictions and no
        labels, which is what TRL's reward trainer hands it."""
        loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            scores = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        return loss, scores.logits, ()

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "num_tokens": self._total_train_tokens}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        self._total_train_tokens = state.pop("num_tokens", 0)
        super().load_checkpoint_state(state)

    def _record(self, chosen, rejected, attention_mask) -> None:
        """TRL's reward metrics: num_tokens, min/mean/max_reward over all sequences, accuracy and margin."""
        mode = "train" if self.model.training else "eval"
        if self.model.training:
            self._total_train_tokens += int(self.accelerator.gather(attention_mask.sum().reshape(1)).sum().item())
        self._metrics[mode]["num_tokens"] = [float(self._total_train_tokens)]
        rewards = self.accelerator.gather(torch.cat([chosen, rejected]))
        self._metrics[mode]["min_reward"].append(rewards.min().item())
        self._metrics[mode]["max_reward"].append(rewards.max().item())
        self.record_metrics(
            {
                "mean_reward": torch.cat([chosen, rejected]).mean(),
                "accuracy": (chosen > rejected).float().mean(),
                "margin": (chosen - rejected).mean(),
            }
        )
