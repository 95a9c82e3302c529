"""Supervised fine-tuning: next-token NLL on the trained tokens of text, conversations or
prompt-completion pairs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..data.chat import normalize_example, require_chat_template
from ..data.collators import IGNORE_INDEX, LanguageModelingCollator
from ..data.formats import DatasetFormat, check_example, is_message_list, validate_dataset
from ..data.packing import pack_dataset
from ..data.tokenize import tokenize_example
from ..errors import ConfigError
from ..losses.sft import chunked_nll_sum, nll_sum
from .base import BaseTrainer, PosttrainConfig


@dataclass
class SFTConfig(PosttrainConfig):
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak learning rate."})
    max_length: int | None = field(default=1024, metadata={"help": "Truncate (or pack) sequences to this many tokens."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Train only on completion tokens of prompt-completion data (default: on)."})
    assistant_only_loss: bool = field(
        default=False, metadata={"help": "Train only on assistant turns of conversations (any chat template)."})
    add_eos: bool = field(default=True, metadata={"help": "Append the EOS token to standard (non-chat) text."})
    packing: bool = field(default=False, metadata={"help": "Pack several sequences into each row of max_length."})
    packing_strategy: str = field(default="bfd", metadata={"help": "'bfd' (sequences kept whole) or 'wrapped'."})
    packing_split_long: bool = field(
        default=False, metadata={"help": "With bfd packing, split sequences longer than max_length instead of "
                                         "truncating them."})
    padding_free: bool = field(
        default=False, metadata={"help": "Collate without an attention mask, positions restarting per sequence (always "
                                         "on with packing): the batch in one row with flash attention, else one row "
                                         "per example."})
    chunked_loss: bool = field(
        default=False, metadata={"help": "Compute the loss in chunks without materialising [tokens, vocab] logits "
                                         "(less memory, same result)."})
    loss_chunk_size: int = field(default=1024, metadata={"help": "Tokens per chunk with chunked_loss."})


def _tokenize_row(example, row, tokenizer, fmt, max_length, completion_only_loss, assistant_only_loss, add_eos):
    check_example(example, fmt, row)
    return tokenize_example(
        example, tokenizer, fmt, row=row, max_length=max_length, completion_only_loss=completion_only_loss,
        assistant_only_loss=assistant_only_loss, add_eos=add_eos,
    )


def check_chunked_loss_supported(model) -> None:
    """The chunked loss computes logits as hidden @ W^T + b from the output layer's own weight: models that
    transform their logits further, or an adapter on the output layer, would be computed wrongly."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attribute, None) not in (None, 1, 1.0):
            raise ConfigError(f"chunked_loss=True does not support models whose logits are transformed "
                              f"({attribute}={getattr(config, attribute)}); set chunked_loss=False.")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or any("lora" in name for name, _ in head.named_modules()):
        raise ConfigError("chunked_loss=True needs a plain linear output layer; this one is "
                          f"{type(head).__name__} (e.g. a LoRA adapter on lm_head). Set chunked_loss=False or "
                          "leave lm_head out of the adapter's target modules.")


def uses_flash_attention(model) -> bool:
    """Whether the model attends with a flash-attention kernel (e.g. "flash_attention_2",
    "kernels-community/flash-attn3"), which sees packed sequence boundaries only in a one-row batch."""
    return "flash" in (model.config._attn_implementation or "")


class SFTTrainer(BaseTrainer):
    """`SFTTrainer(model, args=SFTConfig(...), train_dataset=..., processing_class=..., peft_config=...)`.

    Packed / padding-free batches keep one row per example (cheaper attention) unless the model uses flash
    attention, which needs the whole batch in one row; a collator passed by the caller is left as it is.
    """

    def __init__(self, model, args: SFTConfig | None = None, *a, **kw):
        args = args or SFTConfig(output_dir="outputs/sft")
        self._own_collator: LanguageModelingCollator | None = None
        super().__init__(model, args, *a, **kw)
        if self.data_collator is self._own_collator:
            self.data_collator.one_row = uses_flash_attention(self.model)
        self._trained_tokens = 0
        if args.chunked_loss:
            check_chunked_loss_supported(self.model)

    def prepare_dataset(self, dataset, tokenizer, args: SFTConfig, name: str):
        first = dataset[0] if len(dataset) else {}
        if any(is_message_list(v) and any("from" in m for m in v) for v in first.values()):
            dataset = dataset.map(normalize_example, desc="Converting ShareGPT rows")
        fmt: DatasetFormat = validate_dataset(dataset, ("language_modeling", "prompt_completion"), "SFTTrainer", name)
        if args.assistant_only_loss and not fmt.conversational:
            raise ConfigError(
                "assistant_only_loss=True needs conversational data (lists of {'role', 'content'} messages), but "
                f"{name} is in standard (string) form. Set assistant_only_loss=False, or for prompt-completion "
                "strings rely on completion_only_loss."
            )
        if fmt.conversational:
            require_chat_template(tokenizer)
        completion_only = args.completion_only_loss is not False
        dataset = dataset.map(
            _tokenize_row, with_indices=True, remove_columns=dataset.column_names, num_proc=args.dataset_num_proc,
            fn_kwargs=dict(tokenizer=tokenizer, fmt=fmt, max_length=args.max_length,
                           completion_only_loss=completion_only, assistant_only_loss=args.assistant_only_loss,
                           add_eos=args.add_eos),
            desc=f"Tokenizing {name}",
        )
        if args.packing:
            dataset = pack_dataset(dataset, args.max_length, args.packing_strategy, args.packing_split_long,
                                   num_proc=args.dataset_num_proc)
        return dataset

    def default_collator(self, tokenizer, args: SFTConfig):
        # The model is not known yet: `__init__` picks the padding-free layout once it is.
        self._own_collator = LanguageModelingCollator(tokenizer.pad_token_id,
                                                      padding_free=args.padding_free or args.packing)
        return self._own_collator

    def _forward_nll(self, model, inputs, labels):
        if not self.args.chunked_loss:
            outputs = model(**inputs)
            return nll_sum(outputs.logits, labels)
        # Capture the decoder's final hidden states and ask the model for a single position's logits.
        unwrapped = self.accelerator.unwrap_model(model)
        captured = {}

        def keep_hidden(module, args, output):
            captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

        handle = unwrapped.get_decoder().register_forward_hook(keep_hidden)
        try:
            model(**inputs, logits_to_keep=1)
        finally:
            handle.remove()
        head = unwrapped.get_output_embeddings()
        return chunked_nll_sum(captured["hidden"], head.weight, labels, head.bias, self.args.loss_chunk_size)

    def count_loss_items(self, batch):
        return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {"use_cache": False, **inputs}
        labels = inputs.pop("labels")
        loss_sum, correct, count = self._forward_nll(model, inputs, labels)
        loss = self.effective_batch_mean(loss_sum, num_items_in_batch, count, model.training)
        # Accuracy over the trained tokens of all processes (a mean of per-process accuracies would
        # weight a process with few tokens like one with many): one gather of both counts.
        correct_all, count_all = self.accelerator.gather(torch.stack([correct, count]).reshape(1, 2)).sum(0).tolist()
        self._metrics["train" if model.training else "eval"]["mean_token_accuracy"].append(
            correct_all / max(count_all, 1))
        if model.training:
            self._trained_tokens += count_all
        return (loss, {}) if return_outputs else loss

    def log(self, logs, start_time=None):
        if "loss" in logs:
            logs["num_tokens_trained"] = float(self._trained_tokens)
        super().log(logs, start_time)
