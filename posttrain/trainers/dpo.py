"""Direct Preference Optimization (Rafailov et al. 2023) and its loss family: the policy learns to raise the
log-probability of chosen completions over rejected ones, relative to a fixed reference model.

Each step runs chosen and rejected through the policy in one forward (2B sequences, or one padding-free
row; `preference_common.sequence_logps` computes each shared prompt once and never builds the full logits).
The reference is a frozen copy, a model the user passes, the PEFT policy with its adapter disabled,
or log-probs computed once before training and cached on disk (`precompute_ref_log_probs`); otherwise each
row's reference log-probs are kept from their first forward for when the row comes back (`reference_memo.py`).
`ReferenceConfig` / `ReferenceTrainer` hold what DPO shares with KTO (reference handling, TR-DPO syncing; the
MoE auxiliary loss and the token metrics TRL logs come from `PreferenceMetricsMixin`); each sequence over
`max_length` is cut by the collator as `truncation_mode` says, exactly as TRL does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader

from ..callbacks import SyncRefModelCallback
from ..callbacks.sync_ref import load_sync_ref_checkpoint_state, sync_ref_checkpoint_state
from ..data.preference import TRUNCATION_MODES, PreferenceCollator, prepare_preference_dataset
from ..data.report import DataReport
from ..data.tokenizer_setup import configure_tokenizer, sync_model_with_tokenizer
from ..data.vision import (
    VisionPreferenceCollator,
    VisionSetup,
    freeze_vision_tower_field,
    is_vision_dataset,
    tokenizer_of,
    validate_vision_dataset,
    vision_inputs,
)
from ..errors import ConfigError
from ..losses.preference import dpo_loss, dpo_metrics, validate_dpo_loss_settings, wpo_weights
from ..models.loading import load_tokenizer
from ..models.reference import (
    add_reference_adapter,
    cached_tensors,
    checkpoint_fingerprint,
    create_reference_model,
    is_peft_model,
    reference_forward,
    weights_fingerprint,
)
from .base import BaseTrainer, PosttrainConfig, disable_dropout_in_model
from .preference_common import PreferenceMetricsMixin, SequenceLogps, sequence_index, sequence_logps
from .reference_memo import DIGESTS, DigestingCollator, ReferenceMemo

logger = logging.getLogger("posttrain")

ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def resolve_pad_to_multiple_of(value: int | str | None) -> int | None:
    """'auto' (TRL's default) pads to a multiple of 128 only on Neuron, which posttrain does not target: no extra
    padding. The command line passes numbers and 'none' as strings."""
    if isinstance(value, str):
        value = None if value.lower() in ("auto", "none", "null") else int(value)
    if value is not None and value < 1:
        raise ConfigError(f"pad_to_multiple_of={value} must be at least 1 (or None for no extra padding).")
    return value


def check_length_settings(config) -> None:
    """truncation_mode, max_prompt_length and max_completion_length of a preference config (DPO, BCO, TPO)."""
    if config.truncation_mode not in TRUNCATION_MODES:
        raise ConfigError(
            f"truncation_mode={config.truncation_mode!r} is not supported; choose from {list(TRUNCATION_MODES)}."
        )
    for name in ("max_prompt_length", "max_completion_length"):
        if getattr(config, name, None) is not None and getattr(config, name) < 1:
            raise ConfigError(f"{name}={getattr(config, name)} must be at least 1 (or None for no limit).")
    if (
        None not in (config.max_length, getattr(config, "max_prompt_length", None))
        and config.max_prompt_length >= config.max_length
    ):
        raise ConfigError(
            f"max_prompt_length={config.max_prompt_length} leaves no room for the completion within "
            f"max_length={config.max_length}; set max_prompt_length below max_length."
        )


@dataclass
class ReferenceConfig(PosttrainConfig):
    """Options shared by the trainers that compare the policy with a reference model (DPO, KTO)."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate."})
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of a Mixture-of-Experts model's load-balancing loss added to the "
            "training loss (default: the model config's value; 0 turns it off)."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Turn dropout off in the policy and the reference (log-probs of the same "
            "sequences are compared across forwards)."
        },
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad each batch to a multiple of this length ('auto': no extra padding off Neuron)."},
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs of the whole dataset once before training "
            "(cached on disk) instead of a reference forward every step."
        },
    )
    precompute_ref_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Batch size of that precomputation (default: per_device_train_batch_size "
            "for the train set, per_device_eval_batch_size for eval sets)."
        },
    )
    cache_ref_log_probs: bool = field(
        default=True,
        metadata={
            "help": "Keep each row's reference log-probs from their first forward and reuse them "
            "when the row comes back (later epochs, evaluation), skipping the reference "
            "forward of batches whose rows are all known. The reference is frozen, so "
            "only float rounding can differ; not used with sync_ref_model, "
            "precompute_ref_log_probs or a data_collator of your own."
        },
    )
    ref_cache_dir: str = field(
        default=os.path.join("~", ".cache", "posttrain", "ref_logps"),
        metadata={
            "help": "Where precomputed reference log-probs are cached, keyed by reference weights, data and "
            "tokenization."
        },
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "TR-DPO: every ref_model_sync_steps, mix the policy into the reference."}
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "TR-DPO mixing weight: ref = alpha * policy + (1 - alpha) * ref."}
    )
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO: optimizer steps between syncs."})

    def __post_init__(self):
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ConfigError(
                "sync_ref_model updates the reference during training, so its log-probs cannot be "
                "precomputed; set precompute_ref_log_probs=False or sync_ref_model=False."
            )
        if not 0 < self.ref_model_mixup_alpha <= 1:
            raise ConfigError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must lie in (0, 1].")
        if self.ref_model_sync_steps < 1:
            raise ConfigError(f"ref_model_sync_steps={self.ref_model_sync_steps} must be at least 1.")
        if self.precompute_ref_batch_size is not None and self.precompute_ref_batch_size < 1:
            raise ConfigError(
                f"precompute_ref_batch_size={self.precompute_ref_batch_size} must be at least 1 (or "
                "None for the per-device batch size)."
            )
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length} must be at least 1 (or None for no limit).")
        super().__post_init__()


@dataclass
class DPOConfig(ReferenceConfig):
    beta: float = field(
        default=0.1,
        metadata={"help": "Strength of the pull towards the reference: rewards are beta * log(pi / pi_ref)."},
    )
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={
            "help": "DPO loss, or several to sum (a list, or comma-separated names): sigmoid, hinge, ipo, "
            "robust, exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, "
            "discopop, sft, sigmoid_norm."
        },
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss_type entry (default: 1 each)."}
    )
    ld_alpha: float | None = field(
        default=None,
        metadata={
            "help": "LD-DPO: weight in [0, 1] of the completion tokens past the shorter "
            "completion's length (None or 1: plain sums)."
        },
    )
    use_weighting: bool = field(
        default=False,
        metadata={
            "help": "WPO: weight each pair by the policy's length-normalised probabilities of its two completions."
        },
    )
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Assumed rate of flipped preference labels (cDPO / robust / EXO), in [0, 0.5]."}
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={
            "help": "Divergence to the reference: reverse_kl (DPO), forward_kl, js_divergence or alpha_divergence."
        },
    )
    f_alpha_divergence_coef: float = field(
        default=0.5, metadata={"help": "alpha of the alpha divergence, f'(u) = (u^(alpha-1) - 1) / (alpha - 1)."}
    )
    discopop_tau: float = field(default=0.05, metadata={"help": "Temperature of the discopop loss."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Bound on each prompt + completion sequence, cut as truncation_mode says."}
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "help": "How a sequence over max_length is cut: keep_start (drop its end) "
            "or keep_end (drop the start of the prompt).",
            "choices": ["keep_start", "keep_end"],
        },
    )
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "posttrain extra: keep at most the last this-many prompt tokens."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "posttrain extra: keep at most the first this-many tokens of each completion."}
    )
    padding_free: bool = field(
        default=False, metadata={"help": "Concatenate each batch's 2B sequences into one row without padding."}
    )
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated in TRL: the padding token (default: the tokenizer's, else EOS)."}
    )
    freeze_vision_tower: bool = freeze_vision_tower_field()

    def __post_init__(self):
        # Comma-separated names (the command line's form) -> a list.
        entries = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        self.loss_type = [name.strip() for entry in entries for name in entry.split(",")]
        validate_dpo_loss_settings(
            self.loss_type,
            self.loss_weights,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            discopop_tau=self.discopop_tau,
            use_weighting=self.use_weighting,
            ld_alpha=self.ld_alpha,
        )
        check_length_settings(self)
        super().__post_init__()


def _token_fingerprint(dataset, columns) -> str:
    """A hash of the tokenized rows: it changes with the data and with every tokenization setting."""
    digest = hashlib.sha256()
    for batch in dataset.iter(batch_size=1024):
        digest.update(json.dumps([batch[c] for c in columns]).encode())
    return digest.hexdigest()


def load_processing_class(model, processing_class, args):
    """The tokenizer: the one given, else loaded from `model` (before the model itself, which its options change)."""
    if processing_class is None:
        model_id = model if isinstance(model, str) else model.config._name_or_path
        processing_class = load_tokenizer(model_id, trust_remote_code=args.trust_remote_code)
    return processing_class


class PreparesEvalDatasets:
    """`evaluate(raw_dataset)` tokenizes the dataset first, as TRL does (a dataset already prepared, i.e. holding
    `PREPARED_COLUMN`, or a name of an eval split, passes through)."""

    PREPARED_COLUMN = "prompt_ids"

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self.prepare_eval_dataset(v, f"eval_dataset[{k!r}]") for k, v in eval_dataset.items()}
        elif eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self.prepare_eval_dataset(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def prepare_eval_dataset(self, dataset, name: str):
        if self.PREPARED_COLUMN in dataset.column_names:
            return dataset
        return self.prepare_dataset(dataset, self.processing_class, self.args, name)


class ReferenceTrainer(PreferenceMetricsMixin, PreparesEvalDatasets, BaseTrainer):
    """What DPO and KTO share: the reference model (a frozen copy, the user's, the PEFT policy with its adapter
    off, or log-probs precomputed once and cached on disk), TR-DPO syncing, dropout off, and the MoE aux loss.

    A subclass names the columns the precomputation adds (`REF_COLUMNS`), the id columns that identify a row
    (`ID_COLUMNS`) and how a batch's reference log-probs are computed (`reference_columns`).
    """

    REF_COLUMNS: tuple[str, ...] = ()
    ID_COLUMNS: tuple[str, ...] = ()
    ref_memo: ReferenceMemo | None = None

    def setup_reference(self, ref_model, pretrained_adapter: bool = False) -> None:
        """`pretrained_adapter`: the policy arrived as a PEFT model (its adapter may be trained already), so the
        reference is a frozen copy of that adapter, as in TRL."""
        args = self.args
        if pretrained_adapter and ref_model is None:
            add_reference_adapter(self.model)
        if args.disable_dropout and isinstance(ref_model, torch.nn.Module):
            disable_dropout_in_model(ref_model)
        self._setup_router_aux_loss()
        peft = is_peft_model(self.model)
        if args.precompute_ref_log_probs:
            self.ref_model = None
            self._precompute(ref_model, peft)
            return
        if args.cache_ref_log_probs and not args.sync_ref_model and self.uses_default_collator:
            self.ref_memo = ReferenceMemo(self.REF_COLUMNS)
            self.data_collator = DigestingCollator(self.data_collator, self.ID_COLUMNS)
        reference = create_reference_model(self.model, ref_model, peft=peft, model_init_kwargs=args.model_init_kwargs)
        self.ref_model = None if reference is None else self.accelerator.prepare_model(reference, evaluation_mode=True)
        if args.sync_ref_model:
            if self.ref_model is None:
                raise ConfigError(
                    "sync_ref_model needs a separate reference model, but with a PEFT policy the "
                    "reference is the adapter-disabled base; pass ref_model or set sync_ref_model=False."
                )
            self.add_callback(
                SyncRefModelCallback(self.ref_model, args.ref_model_mixup_alpha, args.ref_model_sync_steps)
            )

    def _setup_router_aux_loss(self) -> None:
        """A Mixture-of-Experts model's load-balancing loss joins the loss with router_aux_loss_coef (default: the
        model config's own coefficient)."""
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        coef = self.args.router_aux_loss_coef
        if coef and not hasattr(config, "output_router_logits"):
            raise ConfigError(
                f"router_aux_loss_coef={coef} weights a Mixture-of-Experts load-balancing loss, but "
                f"{config.model_type} models return no router logits; leave router_aux_loss_coef unset."
            )
        self.router_aux_loss_coef = getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef
        self.aux_loss_enabled = hasattr(config, "output_router_logits") and bool(self.router_aux_loss_coef)

    def reference_columns(self, reference, batch: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @contextmanager
    def reference_module(self, model):
        """What `reference_columns` runs (the reference model, or the policy with its adapter off)."""
        with reference_forward(model, self.ref_model) as reference:
            yield reference

    def reference_logps(self, model, inputs: dict) -> dict[str, torch.Tensor]:
        """The batch's REF_COLUMNS: precomputed in the dataset, known from an earlier forward of the same rows
        (`cache_ref_log_probs`), or from a reference forward now."""
        if all(c in inputs for c in self.REF_COLUMNS):
            return {c: inputs[c] for c in self.REF_COLUMNS}
        digests = inputs.get(DIGESTS) if self.ref_memo is not None else None
        if self.ref_memo is not None:
            known = None if digests is None else self.ref_memo.lookup(digests, self.args.device)
            if self.accelerator.num_processes > 1:  # a sharded reference's forward is collective: all or none
                everywhere = self.accelerator.gather(torch.tensor([int(known is not None)], device=self.args.device))
                known = known if bool(everywhere.all()) else None
            if known is not None:
                return known
        with self.reference_module(model) as reference:
            values = self.reference_columns(reference, inputs)
        if digests is not None:
            self.ref_memo.store(digests, values)
        return values

    def metric_inputs(self, inputs: dict) -> dict:
        """The sequences whose logits `compute_metrics` receives (with their input_ids as labels), as in TRL."""
        return {
            **{k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs},
            **vision_inputs(inputs),
        }

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The trainer's own loss; with `compute_metrics`, also the policy's logits (an extra forward)."""
        loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        batch = self.metric_inputs(self._prepare_inputs(inputs))
        with torch.no_grad(), self.compute_loss_context_manager():
            logits = model(**batch, use_cache=False).logits
        return loss, logits, batch["input_ids"]

    def checkpoint_state(self) -> dict:
        """The num_tokens counter and TR-DPO's synced reference, so that a resumed run goes on from them."""
        return {"num_tokens": self._total_train_tokens, **sync_ref_checkpoint_state(self)}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        load_sync_ref_checkpoint_state(self, state)
        self._total_train_tokens = state.pop("num_tokens", 0)
        super().load_checkpoint_state(state)

    def precompute_settings(self) -> dict:
        """Settings besides the token ids that change the precomputed values (part of the cache key)."""
        return {}

    def _precompute(self, ref_model, peft: bool) -> None:
        """Adds REF_COLUMNS to the train and eval datasets, from the disk cache when it has them."""
        if isinstance(ref_model, str):
            identity = {"checkpoint": checkpoint_fingerprint(ref_model), "init": self.args.model_init_kwargs}
        else:
            source = self.model if ref_model is None else ref_model
            identity = {
                "name": source.config._name_or_path,
                "weights": weights_fingerprint(source, skip_trainable=peft and ref_model is None),
            }
        identity["precision"] = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"
        identity["settings"] = self.precompute_settings()
        loaded = {}

        def reference():  # loaded only on a cache miss, once
            if "module" not in loaded:
                if ref_model is None:
                    loaded["module"] = None if peft else self.model
                else:
                    loaded["module"] = create_reference_model(
                        self.model, ref_model, model_init_kwargs=self.args.model_init_kwargs
                    ).to(self.accelerator.device)
            return loaded["module"]

        self._precompute_source = (identity, reference, ref_model is not None or peft)
        size = self.args.precompute_ref_batch_size
        self.train_dataset = self._with_ref_logps(
            self.train_dataset, identity, reference, size or self.args.per_device_train_batch_size
        )
        size = size or self.args.per_device_eval_batch_size
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {
                k: self._with_ref_logps(v, identity, reference, size) for k, v in self.eval_dataset.items()
            }
        else:
            self.eval_dataset = self._with_ref_logps(self.eval_dataset, identity, reference, size)

    def prepare_eval_dataset(self, dataset, name: str):
        dataset = super().prepare_eval_dataset(dataset, name)
        if not self.args.precompute_ref_log_probs or set(self.REF_COLUMNS) <= set(dataset.column_names):
            return dataset
        identity, reference, reference_kept = self._precompute_source
        if not reference_kept and self.state.global_step > 0:
            raise ConfigError(
                f"evaluate() got a new {name} after training began, but with precompute_ref_log_probs=True and no "
                "ref_model the reference (the untrained policy) is no longer in memory. Pass it as eval_dataset when "
                "creating the trainer, pass ref_model, or set precompute_ref_log_probs=False."
            )
        size = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
        return self._with_ref_logps(dataset, identity, reference, size)

    def _with_ref_logps(self, dataset, identity: dict, reference, batch_size: int):
        if dataset is None or set(self.REF_COLUMNS) <= set(dataset.column_names):
            return dataset
        key = {
            "reference": identity,
            "data": _token_fingerprint(dataset.select_columns(list(self.ID_COLUMNS)), self.ID_COLUMNS),
        }

        def compute() -> dict[str, torch.Tensor]:
            loader = DataLoader(
                dataset.select_columns(list(self.ID_COLUMNS)), collate_fn=self.data_collator, batch_size=batch_size
            )
            parts = {c: [] for c in self.REF_COLUMNS}
            with reference_forward(self.model, reference()) as ref, self.accelerator.autocast():
                for batch in loader:
                    for column, values in self.reference_columns(ref, self._prepare_inputs(batch)).items():
                        parts[column].append(values.float())
            return {c: torch.cat(v) for c, v in parts.items()}

        with self.accelerator.main_process_first():
            logps, from_cache = cached_tensors(self.args.ref_cache_dir, key, compute)
        logger.info(
            "Reference log-probs for %d rows %s.",
            len(dataset),
            "loaded from the cache" if from_cache else "computed and cached",
        )
        for column in self.REF_COLUMNS:
            dataset = dataset.add_column(column, logps[column].tolist())
        return dataset


class DPOTrainer(VisionSetup, ReferenceTrainer):
    """`DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=..., processing_class=...,
    peft_config=...)`, TRL's keyword arguments in TRL's order.

    `ref_model` (a model, name or path) is the reference; without one it is a frozen copy of `model`, or the
    PEFT policy with its adapter disabled. The loss is summed over pairs and divided by the number of pairs
    in the whole effective batch (all accumulation steps and processes). A dataset with an `images` / `image`
    column (and an explicit prompt) trains a vision-language model: see `posttrain/data/vision.py`.
    """

    _name = "DPO"  # the method the model card names and cites (posttrain/model_card.py)

    REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
    ID_COLUMNS = ID_COLUMNS

    def __init__(
        self,
        model,
        ref_model=None,
        args: DPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        **kwargs,
    ):
        args = args or DPOConfig(output_dir="outputs/dpo")
        processing_class, peft_config = self.setup_vision(
            model, args, train_dataset, eval_dataset, processing_class, peft_config, load_tokenizer
        )
        configure_tokenizer(tokenizer_of(processing_class), args)  # pad_token
        freeze = args.freeze_vision_tower
        if isinstance(model, str) and self._vision_model:
            load = self.vision_loader(model, args)
            self.load_model = lambda name, kw: self._adapted(load(name, kw), peft_config, freeze)
        elif not isinstance(model, str):
            self.adapt_vision_model(model, peft_config, freeze)
        if isinstance(ref_model, str) and self._vision_model:  # a vision-language reference by name
            ref_model = self.vision_loader(model, args)(ref_model, args.model_init_kwargs)
        self._loss_types, self._loss_weights = validate_dpo_loss_settings(
            args.loss_type,
            args.loss_weights,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
            use_weighting=args.use_weighting,
            ld_alpha=args.ld_alpha,
        )
        self._total_train_tokens = 0
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
                compute_metrics=compute_metrics,
                **kwargs,
            )
        self.finish_vision_setup(freeze)
        sync_model_with_tokenizer(
            self.accelerator.unwrap_model(self.model), tokenizer_of(self.processing_class), eos_changed=False
        )
        self.setup_reference(ref_model, pretrained_adapter=peft_config is None and is_peft_model(model))

    def _adapted(self, loaded, peft_config, freeze: bool):
        self.adapt_vision_model(loaded, peft_config, freeze)
        return loaded

    # -- data ------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: DPOConfig, name: str):
        if is_vision_dataset(dataset):  # validated here; images are processed in the collator
            if "prompt" not in dataset.column_names:
                raise ConfigError(
                    f"{name} has images but no 'prompt' column: with images, give the prompt (with its "
                    "image placeholders) explicitly, e.g. with posttrain.data_utils.extract_prompt."
                )
            validate_vision_dataset(dataset, tokenizer, ("preference",), "DPOTrainer", name)
            return dataset
        return prepare_preference_dataset(
            dataset,
            tokenizer_of(tokenizer),
            trainer="DPOTrainer",
            name=name,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            num_proc=args.dataset_num_proc,
            report=DataReport.of(self).start(name, len(dataset)),
        )

    def default_collator(self, tokenizer, args: DPOConfig):
        if self._vision:
            return VisionPreferenceCollator(tokenizer, args.max_length, args.pad_to_multiple_of)
        tokenizer = tokenizer_of(tokenizer)
        return PreferenceCollator(
            tokenizer.pad_token_id,
            padding_free=args.padding_free,
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )

    def precompute_settings(self) -> dict:
        return {
            "ld_alpha": self.args.ld_alpha,
            "max_length": self.args.max_length,
            "truncation_mode": self.args.truncation_mode,
        }

    def reference_columns(self, reference, batch):
        logps = sequence_logps(reference, batch, self.args.ld_alpha, stats=False).logps
        return dict(zip(self.REF_COLUMNS, logps.chunk(2)))

    # -- loss ------------------------------------------------------------------------------------
    def count_loss_items(self, batch):
        return (int(sequence_index(batch).max()) + 1) // 2

    def _reference_logps(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.reference_logps(model, inputs)
        return tuple(values[c] for c in self.REF_COLUMNS)

    def _losses(self, policy: SequenceLogps, ref_chosen, ref_rejected):
        """Per-pair losses, chosen rewards and rejected rewards."""
        args = self.args
        half = policy.logps.shape[0] // 2
        counts = policy.token_counts
        extra = {}
        if "sft" in self._loss_types:  # the chosen completions' token-mean NLL over the micro-batch, as in TRL
            nll = -policy.token_logps[:half].sum() / counts[:half].sum().clamp(min=1)
            extra["chosen_nll"] = nll.expand(half)
        if args.use_weighting:
            weights = wpo_weights(policy.token_logps.detach(), policy.stats["log_sum_sq"], policy.mask)
            extra["pair_weights"] = weights[:half] * weights[half:]
        return dpo_loss(
            policy.logps[:half],
            policy.logps[half:],
            ref_chosen,
            ref_rejected,
            loss_type=list(self._loss_types),
            loss_weights=list(self._loss_weights),
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
            chosen_lengths=counts[:half],
            rejected_lengths=counts[half:],
            **extra,
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        policy = sequence_logps(
            model, inputs, self.args.ld_alpha, wpo=self.args.use_weighting, router_logits=self.aux_loss_enabled
        )
        ref_chosen, ref_rejected = self._reference_logps(model, inputs)
        losses, chosen_rewards, rejected_rewards = self._losses(policy, ref_chosen, ref_rejected)
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, len(losses), model.training)
        loss = self.add_aux_loss(loss, policy.aux_loss)
        self._record(policy, chosen_rewards, rejected_rewards, inputs)
        return (loss, None) if return_outputs else loss

    def _record(self, policy: SequenceLogps, chosen_rewards, rejected_rewards, inputs) -> None:
        half = policy.logps.shape[0] // 2
        counts = policy.token_counts
        parts = {"chosen": slice(None, half), "rejected": slice(half, None)}
        attention = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel()
        self.record_token_metrics(policy.stats, counts, torch.as_tensor(attention, device=counts.device), parts)
        metrics = dpo_metrics(chosen_rewards, rejected_rewards)
        # Over all chosen completion tokens of all processes (a token-weighted ratio, as TRL computes it).
        top1 = self.accelerator.gather(torch.stack([policy.stats["top1"][:half].sum(), counts[:half].sum()])[None])
        metrics["mean_token_accuracy"] = top1[:, 0].sum() / top1[:, 1].sum().clamp(min=1)
        for name, part in parts.items():
            metrics[f"logps/{name}"] = policy.logps[part].detach().mean()
        self.record_metrics(metrics)
