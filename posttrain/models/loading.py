"""Loading models and tokenizers from a hub id, a local path, a built-in name or an object.

Every trainer goes through these functions, so the same rules hold everywhere: built-in names are
resolved to the converted local checkpoint, weights load in float32 unless another dtype is asked for
(the Trainer's `bf16`/`fp16` flags then run mixed precision over float32 master weights), remote code
is never trusted by default, and a tokenizer always ends up with a pad token.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.errors import ConfigError
from posttrain.models.builtin import BUILTIN_MODEL_ID, HUB_MODEL_ID, builtin_model_path

logger = logging.getLogger(__name__)


def resolve_model_path(name_or_path: str) -> str:
    """Maps the built-in model's names to a local checkpoint directory; returns anything else unchanged.

    `"builtin:SmolLM2-135M-Instruct"` is the converted built-in copy. The hub id
    `"HuggingFaceTB/SmolLM2-135M-Instruct"` is the hub's own snapshot when the local Hugging Face cache
    has it, else the built-in copy (nothing is downloaded).
    """
    if name_or_path == BUILTIN_MODEL_ID:
        return builtin_model_path()
    if name_or_path.startswith("builtin:"):
        raise ConfigError(f"Unknown built-in model {name_or_path!r}; the built-in model is {BUILTIN_MODEL_ID!r}.")
    if name_or_path == HUB_MODEL_ID and not os.path.isdir(name_or_path):
        snapshot = _cached_hub_snapshot(HUB_MODEL_ID)
        if snapshot is not None:
            return snapshot
        logger.info(
            "%s is not in the local Hugging Face cache; using the built-in copy %s (Q4_1 weights, "
            "dequantized to float32).",
            HUB_MODEL_ID,
            BUILTIN_MODEL_ID,
        )
        return builtin_model_path()
    return name_or_path


def _cached_hub_snapshot(repo_id: str) -> str | None:
    """The local snapshot directory of `repo_id` if its config and weights are in the HF cache."""
    from huggingface_hub import try_to_load_from_cache

    found = [try_to_load_from_cache(repo_id, name) for name in ("config.json", "model.safetensors")]
    if all(isinstance(path, str) for path in found):
        return os.path.dirname(found[0])
    return None


def from_pretrained_kwargs(model_init_kwargs: dict | None) -> dict:
    """from_pretrained keyword arguments with posttrain's defaults, `dtype` given by name or as a torch dtype."""
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.get("dtype", torch.float32)
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(
                f"model_init_kwargs['dtype']={dtype!r} is not a torch dtype; use 'float32', "
                "'bfloat16', 'float16' or 'auto' (the checkpoint's own dtype)."
            )
        dtype = resolved
    kwargs["dtype"] = dtype
    kwargs.setdefault("trust_remote_code", False)
    return kwargs


def _reject_kwargs_for_object(model_init_kwargs: dict | None) -> None:
    if model_init_kwargs:
        raise ConfigError(
            "model_init_kwargs only applies when the model is given by name or path; the model you "
            "passed is already loaded. Drop model_init_kwargs or pass the model's name."
        )


def load_causal_lm(model: str | PreTrainedModel, model_init_kwargs: dict | None = None) -> PreTrainedModel:
    """The causal LM named by `model` (hub id, path or built-in name), or `model` itself if already loaded."""
    if isinstance(model, PreTrainedModel):
        _reject_kwargs_for_object(model_init_kwargs)
        return model
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(model), **from_pretrained_kwargs(model_init_kwargs))


def load_tokenizer(
    model_name_or_path: str | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """The tokenizer for a model (or `tokenizer` itself / the one at that name), with a pad token set.

    Batching needs a pad token; a tokenizer without one pads with its eos token (padding is masked
    out of attention and loss, so which token fills it does not matter).
    """
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        source = tokenizer or model_name_or_path
        if not isinstance(source, str):  # a model, PEFT-wrapped ones included: the name it was loaded from
            source = getattr(source, "name_or_path", None) or source.config._name_or_path
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(source), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"The tokenizer of {tokenizer.name_or_path!r} has neither a pad token nor an eos "
                "token; set tokenizer.pad_token before training."
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning(
            "The tokenizer of %r has no pad token; padding with its eos token %r (id %d).",
            tokenizer.name_or_path,
            tokenizer.eos_token,
            tokenizer.eos_token_id,
        )
    return tokenizer


def load_sequence_classifier(
    model: str | PreTrainedModel,
    num_labels: int = 1,
    model_init_kwargs: dict | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """A sequence classifier (reward model: `num_labels=1`) from a classifier or a causal LM checkpoint.

    A causal LM checkpoint gets a fresh linear head. The classifier scores the last token that is not
    padding, found through `config.pad_token_id`; it is set to the tokenizer's pad token (or the eos
    token when there is no tokenizer and no pad id) so that batched, padded scoring is correct.
    """
    if isinstance(model, PreTrainedModel) or hasattr(model, "get_base_model"):  # a model object, PEFT-wrapped too
        _reject_kwargs_for_object(model_init_kwargs)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not type(base).__name__.endswith("ForSequenceClassification"):
            raise ConfigError(
                f"A {type(base).__name__} is not a sequence classifier; pass its name or path "
                "instead and it is loaded with a new classification head."
            )
        _check_num_labels(base.config, num_labels, base.name_or_path)
    else:
        path = resolve_model_path(model)
        kwargs = from_pretrained_kwargs(model_init_kwargs)
        config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs["trust_remote_code"])
        if any(arch.endswith("ForSequenceClassification") for arch in config.architectures or []):
            _check_num_labels(config, num_labels, model)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, **kwargs)
    text_config = model.config.get_text_config()  # where the classifier looks for pad_token_id
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        text_config.pad_token_id = tokenizer.pad_token_id
    elif text_config.pad_token_id is None:
        eos = text_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if eos is None:
            raise ConfigError(
                f"{model.name_or_path!r} has neither a pad nor an eos token id; pass the tokenizer "
                "(with pad_token set) so that padded batches can be scored."
            )
        text_config.pad_token_id = eos
        logger.info("Set config.pad_token_id of %r to its eos token id %d.", model.name_or_path, eos)
    return model


def _check_num_labels(config, num_labels: int, name: str) -> None:
    if config.num_labels != num_labels:
        raise ConfigError(
            f"{name!r} is already a classifier with num_labels={config.num_labels}, but "
            f"num_labels={num_labels} is needed (reward models require `num_labels=1`). Pass a checkpoint with "
            f"{num_labels} label(s), or its base causal LM to get a new head."
        )
