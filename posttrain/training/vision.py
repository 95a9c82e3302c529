"""Images in the trainers: the set-up a vision-language model needs (its processor and loader, the options the
image path cannot honour refused before training, the tower frozen), shared by SFT, DPO and the online engine."""

from __future__ import annotations

import copy
from dataclasses import field

from posttrain.data.vision import check_vision_inputs, is_vision_dataset, is_vision_model, pad_token_view
from posttrain.errors import ConfigError
from posttrain.models.vision import (
    adapt_vision_model,
    freeze_vision_tower,
    is_vision_checkpoint,
    load_processor,
    load_vision_model,
)


def check_vision_config(args, trainer: str) -> None:
    """Options the image path cannot honour are refused before training."""
    if getattr(args, "packing", False):
        raise ConfigError(
            f"{trainer}: packing=True is not supported with images (an image's tokens and its pixel "
            "values would have to be split across packed rows). Set packing=False."
        )
    if getattr(args, "padding_free", False):
        raise ConfigError(
            f"{trainer}: padding_free=True is not supported with images (the vision-language models' "
            "forward builds image features per padded row). Set padding_free=False."
        )
    if args.max_length is not None and getattr(args, "truncation_mode", "keep_start") == "keep_end":
        raise ConfigError(
            f"{trainer}: truncation_mode='keep_end' would cut image tokens at the start of the prompt "
            "while keeping their pixel values. Use truncation_mode='keep_start' or max_length=None."
        )
    if getattr(args, "precompute_ref_log_probs", False):
        raise ConfigError(
            f"{trainer}: precompute_ref_log_probs=True is not supported with images (rows are "
            "processed in the collator, not tokenized ahead). Set precompute_ref_log_probs=False."
        )
    for name in ("max_prompt_length", "max_completion_length"):
        if getattr(args, name, None) is not None:
            raise ConfigError(
                f"{trainer}: {name} is not applied to image rows (they are processed whole in the "
                f"collator); bound them with max_length, or set {name}=None."
            )
    if getattr(args, "chunked_loss", False):
        raise ConfigError(f"{trainer}: chunked_loss=True is not supported with images; set chunked_loss=False.")


def freeze_vision_tower_field():
    """The `freeze_vision_tower` config field the vision-capable trainers share."""
    return field(
        default=True,
        metadata={
            "help": "posttrain extra: with a vision-language model, keep the vision "
            "tower's weights fixed (the projector and the language model train; "
            "with LoRA, the tower gets no adapter and the projector is trained "
            "in full). TRL trains every weight."
        },
    )


class VisionSetup:
    """Trainer glue for images (SFT, DPO): which processing class and loader a vision-language model needs, the
    checks that refuse what the image path cannot do, LoRA / freezing of the tower."""

    _vision = False  # the train dataset has images
    _vision_model = False  # the model is a vision-language model

    def setup_vision(self, model, args, train_dataset, eval_dataset, processing_class, peft_config, load_tokenizer):
        """Returns the processing class (the model's processor for a vision-language model) and the peft config
        to use (a copy, completed once the model is loaded)."""
        trainer = type(self).__name__
        evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
        with_images = [d for d in [train_dataset, *evals] if d is not None and is_vision_dataset(d)]
        self._vision = bool(with_images)
        self._vision_model = (
            is_vision_checkpoint(model, args.trust_remote_code) if isinstance(model, str) else is_vision_model(model)
        )
        if processing_class is None:
            if self._vision_model:
                processing_class = load_processor(model, args.trust_remote_code)
            else:
                model_id = model if isinstance(model, str) else model.config._name_or_path
                processing_class = load_tokenizer(model_id, trust_remote_code=args.trust_remote_code)
        if self._vision:
            check_vision_config(args, trainer)
            if isinstance(model, str) and not self._vision_model:
                raise ConfigError(
                    f"{trainer}: the dataset has images, but {model!r} is a text-only model (its "
                    "config has no vision_config). Train a vision-language model, or drop the image "
                    "column."
                )
            check_vision_inputs(None if isinstance(model, str) else model, processing_class, with_images[0])
        if peft_config is not None and self._vision_model:
            peft_config = copy.copy(peft_config)
        if (
            self._vision_model
            and args.ddp_find_unused_parameters is None
            and not (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        ):
            # A batch without images leaves the projector without gradients, which DDP must be told about (as TRL).
            args.ddp_find_unused_parameters = True
        return processing_class, peft_config

    def vision_loader(self, model, args):
        """How a vision-language model given by name is loaded (None: the trainer's own loader)."""
        return load_vision_model if self._vision_model else None

    def adapt_vision_model(self, loaded, peft_config, freeze_tower: bool) -> None:
        adapt_vision_model(loaded, peft_config, freeze_tower)

    processor_pad_token = staticmethod(pad_token_view)

    def finish_vision_setup(self, freeze_tower: bool) -> None:
        if freeze_tower and is_vision_model(self.accelerator.unwrap_model(self.model)):
            freeze_vision_tower(self.model)
