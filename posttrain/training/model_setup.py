"""The model a trainer trains: loaded by name or taken as given, seeded first as TRL seeds it, then fused layers and
a PEFT adapter where asked."""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel, TrainingArguments, enable_full_determinism, set_seed

from posttrain.errors import ConfigError
from posttrain.models.fused_layers import fuse_layers
from posttrain.models.loading import load_causal_lm
from posttrain.models.quantized import keep_training_layout
from posttrain.models.tied_embedding import allow_tied_embedding
from posttrain.training.device_paths import describe_run

logger = logging.getLogger("posttrain")


def prepare_model(
    model: str | PreTrainedModel,
    args: TrainingArguments,
    peft_config=None,
    load=load_causal_lm,
    quantization_config=None,
) -> PreTrainedModel:
    """Loads `model` with `load(name, model_init_kwargs)` if given by name or path (quantized with
    `quantization_config`, e.g. a `BitsAndBytesConfig`), then wraps it in a PEFT adapter if `peft_config` is set."""
    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        if args.trust_remote_code:
            init_kwargs["trust_remote_code"] = True
        if quantization_config is not None:
            init_kwargs["quantization_config"] = quantization_config
        model = load(model, init_kwargs)
    elif quantization_config is not None:
        raise ConfigError(
            "quantization_config only applies when `model` is a name or path; the model you passed "
            "is already loaded. Quantize it when loading, or pass its name."
        )
    elif args.model_init_kwargs:  # TRL warns and goes on (its example scripts set both): the same here
        logger.warning(
            "model_init_kwargs=%r is not used: the model passed is already loaded (they apply when `model` is a "
            "name or path).",
            args.model_init_kwargs,
        )
    keep_training_layout(model)  # a 4-bit model's layers keep their trainable layout on a CPU (models/quantized.py)
    if getattr(args, "disable_dropout", False):
        disable_dropout_in_model(model)
    if args.fused_layers and not args.use_liger_kernel:
        fuse_layers(model)
        allow_tied_embedding(model)
    if peft_config is not None:
        from peft import get_peft_model

        if args.gradient_checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, peft_config)
    for line in describe_run(args, model):  # the device and the paths chosen (training/device_paths.py)
        logger.info(line)
    return model


def seed_before_model(args) -> None:
    """As TRL: seeded before the model is made, so that a new head's and a PEFT adapter's random init follow
    `seed` (transformers' Trainer seeds only later, in its own __init__)."""
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)


def disable_dropout_in_model(model: torch.nn.Module) -> None:
    """Sets every dropout probability to 0 (preference and RL losses compare log-probs of the same sequences
    across forwards, which dropout would make noisy)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
