"""`SFTConfig`: the settings of supervised fine-tuning, with TRL's field names, order, defaults and help."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from posttrain.errors import ConfigError
from posttrain.losses.sft import LOSS_TYPES
from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import (
    config_field,
    learning_rate_field,
    max_length_field,
    pad_to_multiple_of_field,
    parse_pad_to_multiple_of,
    remove_unused_columns_field,
    router_aux_loss_coef_field,
    truncation_mode_field,
)
from posttrain.training.vision import freeze_vision_tower_field

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


DATASET_KWARGS = ("skip_prepare_dataset",)


@dataclass
class SFTConfig(PosttrainConfig):
    """Settings of `SFTTrainer`: TRL's SFT fields and defaults on top of transformers' `TrainingArguments`, plus
    posttrain's guards and memory options.

    See docs/trainers/sft.md.
    """

    remove_unused_columns: bool = remove_unused_columns_field()  # TRL's default

    learning_rate: float = learning_rate_field(2e-5)
    router_aux_loss_coef: float | None = router_aux_loss_coef_field(
        "Weight of a Mixture-of-Experts model's load-balancing loss added to the training loss (default: the "
        "model config's own; 0 turns it off). Only for MoE models.",
    )
    chat_template_path: str | None = config_field(
        None,
        "A Jinja chat template file (.jinja/.j2) to use, or a tokenizer directory / hub id whose chat "
        "template, added tokens and EOS token are cloned (the embeddings grow to hold the new tokens).",
    )
    dataset_text_field: str = config_field("text", "Column holding the text of standard language-modeling data.")
    dataset_kwargs: dict[str, Any] | str | None = config_field(
        None,
        "Dataset preparation options; the one key is skip_prepare_dataset (use the dataset as it is: rows of "
        "input_ids [+ labels] for the collator).",
    )
    eos_token: str | None = config_field(
        None,
        "Token (in the vocabulary) to use as the tokenizer's EOS: appended to standard text and set in the "
        "model's (generation) config.",
    )
    max_length: int | None = max_length_field(1024, "Truncate (or pack) sequences to this many tokens.")
    truncation_mode: str = truncation_mode_field(
        "keep_start", "Which end of a longer sequence to keep: 'keep_start' or 'keep_end'."
    )
    shuffle_dataset: bool = config_field(False, "Shuffle the prepared dataset (before packing too) with `seed`.")
    packing: bool = config_field(False, "Pack several sequences into each row of max_length.")
    packing_strategy: str = config_field(
        "bfd",
        "'bfd' (sequences kept whole, longer ones truncated), 'bfd_split' (longer ones split) or 'wrapped' "
        "(concatenated and cut every max_length).",
        choices=PACKING_STRATEGIES,
    )
    padding_free: bool = config_field(
        False,
        "Collate without an attention mask, positions restarting per sequence (always on with packing): the "
        "batch in one row with flash attention, else one row per example.",
    )
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field(
        "auto",
        "Pad batches to a multiple of this many tokens ('auto': no padding except on Neuron devices, which "
        "posttrain does not run on).",
    )
    eval_packing: bool | None = config_field(None, "Pack the eval dataset (default: as `packing`).")
    completion_only_loss: bool | None = config_field(
        None, "Train only on completion tokens of prompt-completion data (default: on)."
    )
    assistant_only_loss: bool = config_field(
        False, "Train only on assistant turns of conversations (any chat template)."
    )
    freeze_vision_tower: bool = freeze_vision_tower_field()
    loss_type: str = config_field(
        "nll",
        "'nll' (negative log-likelihood) or 'dft' (Dynamic Fine-Tuning: each token's NLL weighted by its "
        "detached probability).",
        choices=LOSS_TYPES,
    )
    pad_token: str | None = config_field(
        None, "Token (in the vocabulary) to pad with (default: the tokenizer's pad token, else its EOS)."
    )
    # posttrain's own options
    add_eos: bool = config_field(True, "Append the EOS token to standard (non-chat) text.")
    packing_split_long: bool = config_field(
        False,
        "With bfd packing, split sequences longer than max_length instead of truncating them (as "
        "packing_strategy='bfd_split').",
    )
    chunked_loss: bool | None = config_field(
        None,
        "Compute the loss in chunks of trained tokens without materialising [tokens, vocab] logits (less "
        "memory, same numbers). Default (None): on wherever it gives the same result (a plain linear output "
        "layer, no compute_loss_func, no images, no FSDP/DeepSpeed, no torch_compile); True insists, False "
        "computes the full logits.",
    )
    loss_chunk_size: int = config_field(256, "Tokens per chunk with chunked_loss.", min=1)

    unsupported_options: ClassVar[dict[str, str]] = {**PosttrainConfig.unsupported_options}

    def __post_init__(self):
        if isinstance(self.dataset_kwargs, str):
            self.dataset_kwargs = json.loads(self.dataset_kwargs)
        unknown = sorted(set(self.dataset_kwargs or {}) - set(DATASET_KWARGS))
        if unknown:
            raise ConfigError(
                f"dataset_kwargs has unknown keys {unknown}; the only key is 'skip_prepare_dataset'. Remove the others."
            )
        self.pad_to_multiple_of = parse_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.loss_type == "chunked_nll":
            warnings.warn(
                "loss_type='chunked_nll' is an old name of 'nll'; use loss_type='nll' (set chunked_loss=True "
                "for posttrain's chunked computation).",
                FutureWarning,
                stacklevel=3,
            )
            self.loss_type = "nll"
        if self.loss_type == "dft" and self.label_smoothing_factor:
            raise ConfigError(
                f"label_smoothing_factor={self.label_smoothing_factor} smooths the NLL loss and has no "
                "meaning for loss_type='dft'; set label_smoothing_factor=0 or loss_type='nll'."
            )
        if self.packing_strategy == "bfd-requeue":
            self.packing_strategy = "bfd_split"  # the old name
        if (self.packing or self.eval_packing) and self.max_length is None:
            raise ConfigError(
                "Packing needs max_length (the length of a packed row); set max_length or turn "
                "packing / eval_packing off."
            )
        super().__post_init__()
