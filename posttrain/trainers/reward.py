"""Reward modelling: a sequence classifier with one output learns to score the chosen completion of each
preference pair above the rejected one (Bradley-Terry). The result scores any text and serves as the
reward model of the online trainers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import set_seed

from ..data.preference import PreferenceCollator, prepare_preference_dataset
from ..errors import ConfigError
from ..losses.preference import bradley_terry_loss
from ..models.loading import load_sequence_classifier
from .base import BaseTrainer, PosttrainConfig


@dataclass
class RewardConfig(PosttrainConfig):
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Truncate prompt + completion to this many tokens (the completion is cut)."})
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Weight of the penalty mean((r_chosen + r_rejected)^2) that keeps rewards "
                                        "centred on zero (Eisenstein et al. 2023 use 0.01)."})


def _load_reward_model(name: str, model_init_kwargs: dict | None):
    """A one-output sequence classifier; a causal LM checkpoint gets a new score head."""
    return load_sequence_classifier(name, num_labels=1, model_init_kwargs=model_init_kwargs)


class RewardTrainer(BaseTrainer):
    """`RewardTrainer(model, args=RewardConfig(...), train_dataset=..., processing_class=..., peft_config=...)`.

    `model` is a sequence classifier with one output, or the name or path of a causal LM or classifier
    checkpoint. Each pair is scored in one forward of 2B sequences; a sequence's reward is the classifier's
    output at its last non-padding token.
    """

    load_model = staticmethod(_load_reward_model)

    def __init__(self, model, args: RewardConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, **kwargs):
        args = args or RewardConfig(output_dir="outputs/reward")
        set_seed(args.seed)  # a checkpoint without a score head gets a new one: make its initialisation follow the seed
        if not isinstance(model, str):
            model = load_sequence_classifier(model, num_labels=1)  # checks the class and num_labels
        if peft_config is not None and peft_config.task_type != "SEQ_CLS":
            raise ConfigError(
                f"peft_config.task_type is {peft_config.task_type!r}, but a reward model needs task_type='SEQ_CLS': "
                "only then does PEFT train and save the new score head along with the adapter."
            )
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, **kwargs)
        # The classifier finds each sequence's last real token through the pad id: it must be the collator's.
        config = self.accelerator.unwrap_model(self.model).config
        config.get_text_config().pad_token_id = self.processing_class.pad_token_id

    def prepare_dataset(self, dataset, tokenizer, args: RewardConfig, name: str):
        return prepare_preference_dataset(dataset, tokenizer, trainer="RewardTrainer", name=name,
                                          max_length=args.max_length, num_proc=args.dataset_num_proc)

    def default_collator(self, tokenizer, args: RewardConfig):
        # Padded, not padding-free: the classifier reads one position per row.
        return PreferenceCollator(tokenizer.pad_token_id)

    def count_loss_items(self, batch):
        return len(batch["input_ids"]) // 2

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        scores = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False).logits
        chosen, rejected = scores.squeeze(-1).float().chunk(2)
        loss = bradley_terry_loss(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient)
        loss = self.effective_batch_mean(loss * len(chosen), num_items_in_batch, len(chosen), model.training)
        self.record_metrics({"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean()})
        if return_outputs:
            return loss, {"rewards": torch.stack([chosen, rejected], dim=-1).detach()}
        return loss
