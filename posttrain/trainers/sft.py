"""Supervised fine-tuning: next-token NLL (or DFT) on the trained tokens of text, conversations,
prompt-completion pairs or pre-tokenized rows."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers import TrainingArguments

from posttrain.data.collators import IGNORE_INDEX, LanguageModelingCollator
from posttrain.data.report import DataReport
from posttrain.data.sft import completion_only, prepare_sft_dataset
from posttrain.data.tokenizer_setup import configure_tokenizer, make_added_tokens_trainable, sync_model_with_tokenizer
from posttrain.data.vision import VisionSFTCollator, is_vision_dataset, tokenizer_of, validate_vision_dataset
from posttrain.errors import ConfigError
from posttrain.losses.sft import chunked_token_loss_sums, token_loss_sums
from posttrain.models.layouts import (
    can_repack,
    check_chunked_loss_supported,
    chunked_loss_unsupported,
    repack_padded_batch,
    uses_flash_attention,
)
from posttrain.models.loading import load_tokenizer
from posttrain.models.router import balancing_loss_on_layouts, with_balancing_loss
from posttrain.models.segment_attention import segment_attention, supports_segment_attention
from posttrain.models.tied_embedding import tied_embedding
from posttrain.runtime.paths import fast_path_on
from posttrain.trainers.sft_config import SFTConfig
from posttrain.training.base import BaseTrainer, setup_router_aux_loss
from posttrain.training.metric_values import as_floats
from posttrain.training.run_artifacts import default_output_dir
from posttrain.training.streaming import is_prepared, prepare_any
from posttrain.training.vision import VisionSetup


def _sft_args(args, model) -> SFTConfig:
    """The config to train with: the default one (output to '<model name>-SFT'), or a plain TrainingArguments
    carried over into an SFTConfig."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return SFTConfig(default_output_dir(name, "SFT"))
    if isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        return SFTConfig(**values)
    return args


def _check_loss_options(args: SFTConfig, compute_loss_func, formatting_func, train_dataset) -> None:
    if compute_loss_func is not None and (args.loss_type != "nll" or args.chunked_loss):
        raise ConfigError(
            f"compute_loss_func replaces the loss, so loss_type={args.loss_type!r} / chunked_loss="
            f"{args.chunked_loss} would not apply; pass one or the other (loss_type='nll', "
            "chunked_loss=False)."
        )
    if formatting_func is not None and completion_only(args, train_dataset):
        raise ConfigError(
            "formatting_func turns each example into plain text, so there is no completion to "
            "train on alone, but completion_only_loss is on (explicitly, or by default for "
            "prompt-completion data). Set completion_only_loss=False, or format the dataset "
            "into prompt/completion columns yourself and drop formatting_func."
        )


class SFTTrainer(VisionSetup, BaseTrainer):
    """Supervised fine-tuning: trains a causal language model on text, conversations or prompt-completion pairs with
    next-token cross-entropy.

    `SFTTrainer(model, args=SFTConfig(...), train_dataset=..., processing_class=..., peft_config=...,
    formatting_func=...)`, with TRL's keyword arguments in TRL's order.

    Packed / padding-free batches keep one row per example (cheaper attention) unless the model uses flash
    attention, which needs the whole batch in one row; a collator passed by the caller is left as it is. On the CPU
    a model's padding-free rows attend one sequence at a time (docs/speed_memory.md).
    `compute_loss_func(outputs, labels, num_items_in_batch=...)` replaces the loss (it gets the full logits).
    Datasets with an `images` / `image` column train a vision-language model (`processing_class`: its processor,
    loaded by default): rows are validated up front and processed in the collator (docs/vision.md);
    image tokens are never trained; the vision tower is frozen unless `freeze_vision_tower=False`.
    Logged: loss, mean_token_accuracy and entropy (over trained tokens), num_tokens (input tokens trained on
    so far, padding excluded), num_tokens_trained (trained tokens so far), aux_loss for MoE models.

    See docs/trainers/sft.md.
    """

    requires_train_dataset = True  # as TRL's

    _name = "SFT"  # the method the model card names and cites (posttrain/training/model_card.py)

    def __init__(
        self,
        model,
        args: SFTConfig | TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config=None,
        peft_config=None,
        formatting_func: Callable[[dict], str] | None = None,
    ):
        args = _sft_args(args, model)
        _check_loss_options(args, compute_loss_func, formatting_func, train_dataset)
        self._formatting_func = formatting_func
        self._skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset"))
        processing_class, peft_config = self.setup_vision(
            model, args, train_dataset, eval_dataset, processing_class, peft_config, load_tokenizer
        )
        if self._vision and formatting_func is not None:
            raise ConfigError(
                "formatting_func turns rows into plain text, which would drop the images of this "
                "dataset; format the dataset with map() instead and drop formatting_func."
            )
        self._vision_completion_only = completion_only(args, train_dataset)
        tokenizer = tokenizer_of(processing_class)
        added_tokens = configure_tokenizer(tokenizer, args)
        make_added_tokens_trainable(peft_config, added_tokens)
        self._own_collator: LanguageModelingCollator | None = None
        self._trained_tokens = 0
        self._input_tokens = 0
        self._adapt_model(model, tokenizer, added_tokens, peft_config, args)
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
                compute_loss_func=compute_loss_func,
                compute_metrics=compute_metrics,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            )
        self.finish_vision_setup(args.freeze_vision_tower)
        if self.data_collator is self._own_collator:
            self.data_collator.one_row = uses_flash_attention(self.model)
        self._chunked_loss = self._resolve_chunked_loss(args)
        self._choose_layouts(args)

    def _adapt_model(self, model, tokenizer, added_tokens, peft_config, args: SFTConfig) -> None:
        """Before PEFT wrapping and data preparation: the model agrees with the tokenizer and its MoE loss is set
        up; a model given by name, as it loads."""

        def adapt(loaded):
            sync_model_with_tokenizer(
                loaded, tokenizer, added_tokens, eos_changed=args.eos_token is not None or bool(added_tokens)
            )
            self.router_aux_loss_coef = setup_router_aux_loss(loaded, args.router_aux_loss_coef)
            self.aux_loss_enabled = self.router_aux_loss_coef != 0.0  # TRL's attribute: the MoE loss is trained
            self.adapt_vision_model(loaded, peft_config, args.freeze_vision_tower)
            return loaded

        if isinstance(model, str):
            load = self.vision_loader(model, args) or type(self).load_model
            self.load_model = lambda name, init_kwargs: adapt(load(name, init_kwargs))
        else:
            adapt(model)

    def _choose_layouts(self, args: SFTConfig) -> None:
        """Padded batches are computed on repacked rows (same losses, no work on padding) where the model keeps
        packed sequences apart; not with compute_loss_func (it gets the padded batch's logits) or an MoE auxiliary
        loss (the router statistics would count the filler tokens), nor in a subclass with its own forward (e.g. a
        teacher model that would need to keep packed sequences apart too). Padding-free rows attend one sequence at
        a time on the CPU, where that was measured to be faster; not under torch_compile, FSDP or DeepSpeed (left as
        they were)."""
        self._repack_padded = (
            type(self)._forward_nll is SFTTrainer._forward_nll
            and not self._vision
            and self.compute_loss_func is None
            and (not getattr(self, "router_aux_loss_coef", 0.0) or balancing_loss_on_layouts(self.model))
            and can_repack(self.model)
        )
        self._segment_attention = (
            fast_path_on("segment_attention", self.args.device.type)  # where measured (runtime/measured.py)
            and not args.torch_compile
            and not self.is_fsdp_enabled
            and not self.is_deepspeed_enabled
            and supports_segment_attention(self.model)
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        with segment_attention(self.model, self._segment_attention):  # the backward's recomputations included
            return super().training_step(model, inputs, num_items_in_batch)

    def _resolve_chunked_loss(self, args: SFTConfig) -> bool:
        """chunked_loss=True is checked (an error if it cannot apply); None turns it on wherever it computes the
        same loss as the full logits: not with compute_loss_func (it gets the logits), images, sharded weights
        (FSDP / DeepSpeed gather the output layer only inside the model's forward) or torch_compile (the hook that
        captures the hidden states would make the compiled model recompile)."""
        if args.chunked_loss:
            check_chunked_loss_supported(self.model)
            return True
        if args.chunked_loss is False or self.compute_loss_func is not None or self._vision or args.torch_compile:
            return False
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return False
        return chunked_loss_unsupported(self.model) is None

    # -- data ----------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: SFTConfig, name: str):
        if self._skip_prepare:
            return dataset
        if is_vision_dataset(dataset):  # validated here; images are processed in the collator
            fmt = validate_vision_dataset(
                dataset,
                tokenizer,
                ("language_modeling", "prompt_completion"),
                "SFTTrainer",
                name,
                args.dataset_text_field,
            )
            if args.assistant_only_loss and not (fmt.conversational and fmt.kind == "language_modeling"):
                raise ConfigError(
                    "assistant_only_loss=True needs conversations in a 'messages' column; "
                    f"{name} is {fmt.kind.replace('_', '-')} data. Set assistant_only_loss=False."
                )
            return dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset
        return prepare_sft_dataset(
            dataset, tokenizer_of(tokenizer), args, name, DataReport.of(self), self._formatting_func
        )

    def default_collator(self, tokenizer, args: SFTConfig):
        if self._vision:
            return VisionSFTCollator(
                tokenizer,
                args.max_length,
                self._vision_completion_only,
                args.assistant_only_loss,
                args.dataset_text_field,
                args.pad_to_multiple_of,
            )
        tokenizer = tokenizer_of(tokenizer)
        # The model is not known yet: `__init__` picks the padding-free layout once it is.
        self._own_collator = LanguageModelingCollator(
            tokenizer.pad_token_id,
            padding_free=args.padding_free or args.packing,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )
        return self._own_collator

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True (TRL's default) the columns the collator reads stay, the others go."""
        if self._signature_columns is None:
            if self._vision:
                raw = ["messages", "prompt", "completion", "image", "images", self.args.dataset_text_field]
                self._signature_columns = list(dict.fromkeys(raw))
            else:
                self._signature_columns = ["input_ids", "labels", "completion_mask", "assistant_masks", "seq_lengths"]

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """A raw dataset passed here is prepared as the eval_dataset given to the constructor would be."""

        def prepared(dataset, name):
            if self._skip_prepare or is_prepared(dataset, "input_ids"):
                return dataset
            return prepare_any(self, dataset, self.processing_class, self.args, name)

        if isinstance(eval_dataset, dict):
            eval_dataset = {k: prepared(v, f"eval_dataset[{k!r}]") for k, v in eval_dataset.items()}
        elif eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = prepared(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # -- loss ----------------------------------------------------------------------------------------
    def _forward_nll(self, model, inputs, labels):
        """(loss sum, correct, count, entropy sum, MoE aux loss or None) over this micro-batch's trained tokens."""
        loss_type, smoothing = self.args.loss_type, self.args.label_smoothing_factor
        if not self._chunked_loss:
            outputs = model(**inputs)
            # PEFT prompt learning puts its virtual tokens before the sequence: their positions have no label
            logits = outputs.logits[:, outputs.logits.shape[1] - labels.shape[1] :]
            sums = token_loss_sums(logits, labels, loss_type, smoothing)
            return (*sums, getattr(outputs, "aux_loss", None))
        # Capture the decoder's final hidden states and ask the model for a single position's logits.
        unwrapped = self.accelerator.unwrap_model(model)
        captured = {}

        def keep_hidden(module, args, output):
            captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

        head = unwrapped.get_output_embeddings()
        handle = unwrapped.get_decoder().register_forward_hook(keep_hidden)
        try:
            with tied_embedding(unwrapped, head.weight) as head_gradient:  # no second [vocab, hidden] gradient
                outputs = model(**inputs, logits_to_keep=1)
        finally:
            handle.remove()
        sums = chunked_token_loss_sums(
            captured["hidden"],
            head.weight,
            labels,
            head.bias,
            self.args.loss_chunk_size,
            loss_type,
            smoothing,
            on_weight_grad=head_gradient,
        )
        return (*sums, getattr(outputs, "aux_loss", None))

    def count_loss_items(self, batch):
        return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = {"use_cache": False, **inputs}
        labels = inputs.pop("labels")
        row_tokens = inputs.pop("num_input_tokens", None)
        taken = None
        if self._repack_padded and "attention_mask" in inputs:
            hidden_size = self.accelerator.unwrap_model(model).config.get_text_config().hidden_size
            packed = repack_padded_batch(inputs, labels, hidden_size)
            if packed is not None:
                row_tokens = inputs["attention_mask"].sum(-1)
                inputs, labels, taken = packed
        aux_weight = getattr(self, "router_aux_loss_coef", 0.0)
        if aux_weight:  # on repacked rows the balancing loss comes from the recorded router logits instead
            inputs["output_router_logits"] = taken is None
        if self.compute_loss_func is not None:
            outputs = model(**inputs)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes
            with torch.no_grad():
                _, correct, count, entropy = token_loss_sums(outputs.logits, labels)
            aux_loss = getattr(outputs, "aux_loss", None)
        else:
            forward = functools.partial(self._forward_nll, model, inputs, labels)
            # (the padded batch's balancing loss: each token weighted by the padded-batch tokens it stands for)
            result, recorded = (
                with_balancing_loss(model, forward, taken) if aux_weight and taken is not None else (forward(), None)
            )
            loss_sum, correct, count, *extra = result
            entropy, aux_loss = (extra + [None, None])[:2]
            aux_loss = aux_loss if recorded is None else recorded
            loss = self.effective_batch_mean(loss_sum, num_items_in_batch, count, model.training)
        if aux_weight and aux_loss is not None:
            # A per-micro-batch mean: averaged over the accumulation steps like the token loss is summed over them.
            steps = self.current_gradient_accumulation_steps if model.training and num_items_in_batch is not None else 1
            loss = loss + aux_weight * aux_loss / steps
        self._record_token_metrics(model.training, inputs, row_tokens, correct, count, entropy, aux_loss)
        return (loss, {}) if return_outputs else loss

    def _record_token_metrics(self, training, inputs, row_tokens, correct, count, entropy, aux_loss):
        """mean_token_accuracy and entropy over the trained tokens of all processes (a mean of per-process means
        would weight a process with few tokens like one with many), num_tokens: input tokens so far. One gather."""
        if "attention_mask" in inputs:
            input_tokens = inputs["attention_mask"].sum()
        elif row_tokens is not None:
            input_tokens = row_tokens.sum()
        else:
            input_tokens = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
        parts = [correct, count, input_tokens] + ([entropy] if entropy is not None else [])
        parts += [aux_loss.detach()] if aux_loss is not None else []
        stats = torch.stack([p.detach().float().to(self.accelerator.device) for p in parts]).reshape(1, -1)
        gathered = self.accelerator.gather(stats)
        totals = gathered.sum(0)  # kept on the device: the window's values become floats when logged (no sync here)
        metrics = self._metrics["train" if training else "eval"]
        trained = totals[1].clamp(min=1)  # (no trained token: no correct one and no entropy either, so 0)
        metrics["mean_token_accuracy"].append(totals[0] / trained)
        if entropy is not None:
            metrics["entropy"].append(totals[3] / trained)
        if aux_loss is not None:
            metrics["aux_loss"].append(gathered[:, -1].mean())
        if training:
            self._trained_tokens = totals[1].long() + self._trained_tokens
            self._input_tokens = totals[2].long() + self._input_tokens
        metrics["num_tokens"] = [torch.as_tensor(self._input_tokens, dtype=torch.float32)]
        if not training:
            as_floats(metrics)

    def checkpoint_state(self) -> dict:
        """The token counters, so that num_tokens and num_tokens_trained go on counting after a resume."""
        return {"input_tokens": int(self._input_tokens), "trained_tokens": int(self._trained_tokens)}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        self._input_tokens = state.pop("input_tokens", 0)
        self._trained_tokens = state.pop("trained_tokens", 0)
        super().load_checkpoint_state(state)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """With compute_metrics, evaluation also returns the logits and labels (one more forward pass)."""
        if prediction_loss_only:
            with segment_attention(self.model, self._segment_attention):
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with (
            torch.no_grad(),
            self.compute_loss_context_manager(),
            segment_attention(self.model, self._segment_attention),
        ):
            loss = self.compute_loss(model, inputs)
            forward = {k: v for k, v in inputs.items() if k not in ("labels", "num_input_tokens")}
            logits = model(**forward).logits
        return loss.detach(), logits, inputs["labels"]

    def log(self, logs, start_time=None):
        if "loss" in logs:
            logs["num_tokens_trained"] = float(self._trained_tokens)
        super().log(logs, start_time)
