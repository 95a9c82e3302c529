"""A causal LM with a scalar value head: the policy and the critic of PPO in one network.

The head reads the LM's final hidden states (after the last norm) and predicts one value per token, so a
single forward gives both the next-token logits and the values. Sharing the trunk saves the memory and
compute of a separate value model, at the price of the two objectives competing for the same weights.

    model = AutoModelForCausalLMWithValueHead.from_pretrained("builtin:SmolLM2-135M-Instruct")
    out = model(input_ids=ids, attention_mask=mask)     # out.logits [B, T, V], out.values [B, T]
    model.save_pretrained("ckpt")                        # the LM as usual + value_head.safetensors
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from posttrain.errors import ConfigError
from posttrain.models.loading import load_causal_lm, resolve_model_path

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_MODEL_DIR = "value_model"  # where PolicyAndValueModel saves the value model, beside the policy


@dataclass
class CausalLMWithValueOutput:
    """`logits` [B, T, V] and `values` [B, T]; `loss` is always None (the trainer computes its own).

    A plain dataclass, not a `ModelOutput` (a dict): its `values` field would hide `dict.values()`, which DDP calls
    on a forward's output to find the tensors that take part in the backward pass."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    values: torch.Tensor | None = None


class ValueHead(nn.Module):
    """Dropout (optional) then Linear(hidden, 1), kept in float32 whatever the LM's dtype.

    The weights start small (std 1e-3, bias 0) so that the first values are close to 0 and the first
    value-loss gradients do not swamp the policy's shared trunk.
    """

    def __init__(self, hidden_size: int, dropout: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"value_head_dropout={dropout} must be in [0, 1) (0 turns dropout off).")
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=1e-3)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(hidden_states.to(self.summary.weight.dtype))
        return self.summary(hidden_states).squeeze(-1)


class CausalLMWrapper(nn.Module):
    """A module around a causal LM (`pretrained_model`, possibly a PEFT model) that passes generation, adapter
    switching and the config through to it, so that trainers and generation backends can treat it as the LM."""

    pretrained_model: nn.Module

    def generate(self, *args: Any, **kwargs: Any):
        """Sampling is the LM's alone."""
        return self.pretrained_model.generate(*args, **kwargs)

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """The base LM without its PEFT adapter, for reference forwards (a PEFT model only)."""
        if not hasattr(self.pretrained_model, "disable_adapter"):
            raise ConfigError(
                "disable_adapter() needs a PEFT model; load with peft_config=... or keep a separate reference model."
            )
        with self.pretrained_model.disable_adapter():
            yield

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def generation_config(self):
        return self.pretrained_model.generation_config

    @property
    def name_or_path(self) -> str:
        return self.pretrained_model.name_or_path

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # What transformers' Trainer reads from the model it loads a checkpoint into: the LM's.
    @property
    def _keys_to_ignore_on_save(self):
        return getattr(self.pretrained_model, "_keys_to_ignore_on_save", None)

    def tie_weights(self) -> None:
        if hasattr(self.pretrained_model, "tie_weights"):
            self.pretrained_model.tie_weights()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        for module in self.children():
            if hasattr(module, "gradient_checkpointing_enable"):
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self) -> None:
        for module in self.children():
            if hasattr(module, "gradient_checkpointing_disable"):
                module.gradient_checkpointing_disable()


class AutoModelForCausalLMWithValueHead(CausalLMWrapper):
    """A policy with its critic on top, for PPO (`use_value_head=True`): one network gives the next-token logits and a
    value per token.

    A causal LM (`pretrained_model`, possibly a PEFT model) plus a `ValueHead` (`v_head`).

    With PEFT only the adapter is wrapped: the head is outside it and always trainable, and
    `disable_adapter()` gives the base LM back (the reference model of PPO, without a second copy).

    See docs/trainers/ppo.md.
    """

    def __init__(self, pretrained_model: nn.Module, value_head_dropout: float = 0.0) -> None:
        super().__init__()
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(pretrained_model.config.get_text_config().hidden_size, value_head_dropout)

    # -- loading and saving --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path_or_model: str | PreTrainedModel,
        *,
        peft_config=None,
        value_head_dropout: float = 0.0,
        **model_init_kwargs: Any,
    ) -> AutoModelForCausalLMWithValueHead:
        """Loads the LM (through `load_causal_lm`, so built-in names and posttrain's dtype defaults apply) and
        the head from `value_head.safetensors` in its directory when there is one, else a new small head.

        `model_init_kwargs` go to the LM's `from_pretrained`; `peft_config` wraps the LM in an adapter.
        """
        lm = load_causal_lm(name_or_path_or_model, model_init_kwargs or None)
        if peft_config is not None:
            from peft import get_peft_model

            lm = get_peft_model(lm, peft_config)
        model = cls(lm, value_head_dropout)
        if isinstance(name_or_path_or_model, str):
            head_file = Path(resolve_model_path(name_or_path_or_model)) / VALUE_HEAD_FILE
            if head_file.is_file():
                model.load_value_head(head_file.parent)
        model.v_head.to(lm.device)
        return model

    def load_value_head(self, directory: str | os.PathLike) -> None:
        """The head's weights from `value_head.safetensors` in `directory` (a saved model or a checkpoint)."""
        head_file = Path(directory) / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise ConfigError(
                f"{directory} has no {VALUE_HEAD_FILE}, so the value head cannot be loaded from it; "
                "point to a folder saved from an AutoModelForCausalLMWithValueHead (or its trainer)."
            )
        weight = self.v_head.summary.weight
        self.v_head.load_state_dict(load_file(head_file, device=str(weight.device)))

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Saves the LM with its own `save_pretrained` (only the adapter for a PEFT model) and the head beside it.

        `kwargs` go to the LM's `save_pretrained`; a `state_dict` of the whole wrapper (as the Trainer
        passes it) is split between the LM and the head.
        """
        state_dict = kwargs.pop("state_dict", None)
        head_state = {k: v.detach().contiguous().cpu() for k, v in self.v_head.state_dict().items()}
        if state_dict is not None:
            lm_prefix, head_prefix = "pretrained_model.", "v_head."
            head_state = {
                k[len(head_prefix) :]: v.contiguous().cpu() for k, v in state_dict.items() if k.startswith(head_prefix)
            }
            kwargs["state_dict"] = {k[len(lm_prefix) :]: v for k, v in state_dict.items() if k.startswith(lm_prefix)}
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        if kwargs.get("is_main_process", True):
            save_file(head_state, os.path.join(save_directory, VALUE_HEAD_FILE), metadata={"format": "pt"})

    # -- running -------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMWithValueOutput:
        """Logits and one value per token from a single forward of the LM."""
        kwargs.pop("output_hidden_states", None)
        kwargs.pop("labels", None)  # the LM's own loss is never wanted here
        outputs = self.pretrained_model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs
        )
        return CausalLMWithValueOutput(logits=outputs.logits, values=self.v_head(outputs.hidden_states[-1]))


# -- a separate critic (PPO) ------------------------------------------------------------------------------------
class PolicyAndValueModel(CausalLMWrapper):
    """The policy and a separate value model (a sequence classifier) as the one module the Trainer optimises.

    The value of every position is the classifier's score head applied to its backbone's hidden state there
    (the classifier itself would keep only the last token's).
    """

    def __init__(self, policy: nn.Module, value_model: PreTrainedModel) -> None:
        super().__init__()
        self.pretrained_model = policy
        self.value_model = value_model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMWithValueOutput:
        logits = self.pretrained_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).logits
        backbone = getattr(self.value_model, self.value_model.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return CausalLMWithValueOutput(logits=logits, values=self.value_model.score(hidden).squeeze(-1).float())

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """The policy in `save_directory` (loadable as a causal LM as is), the value model in its `value_model/`."""
        kwargs.pop("state_dict", None)  # each model saves its own weights
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        self.value_model.save_pretrained(os.path.join(save_directory, VALUE_MODEL_DIR), **kwargs)


def check_value_model(value_model: PreTrainedModel, value_tokenizer, policy, tokenizer, source: str) -> None:
    """The value model reads the policy's token ids, so both must have the same vocabulary and a per-token head."""
    if not isinstance(getattr(value_model, "score", None), nn.Linear):
        raise ConfigError(
            f"The value model ({source}, a {type(value_model).__name__}) has no per-token `score` "
            "head; use a causal-LM-based sequence classifier (e.g. a reward model trained with "
            "RewardTrainer) or set use_value_head=True."
        )
    same = (
        value_tokenizer.get_vocab() == tokenizer.get_vocab()
        if value_tokenizer is not None
        else value_model.get_input_embeddings().num_embeddings == policy.get_input_embeddings().num_embeddings
    )
    if not same:
        raise ConfigError(
            f"The value model ({source}) has a different vocabulary from the policy, and it must read the "
            "policy's token ids (no mapping between tokenizers is done). Pass a value_model built on the "
            "policy's tokenizer (e.g. a reward model trained from the policy), or set use_value_head=True."
        )
