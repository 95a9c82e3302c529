"""The public base of the trainers that learn against a frozen reference model (DPO, KTO, BCO, TPO, ...):
`ReferenceConfig` (the reference-model fields they share) and `ReferenceTrainer` (the reference model set up,
its log-probs computed, precomputed or remembered per row, and synced; eval datasets prepared like the train set).
A method subclasses both and adds its data format, collator and loss."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from posttrain.data.vision import (
    vision_inputs,
)
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer
from posttrain.models.reference import (
    add_reference_adapter,
    cached_tensors,
    checkpoint_fingerprint,
    create_reference_model,
    is_peft_model,
    reference_forward,
    weights_fingerprint,
)
from posttrain.training.base import BaseTrainer, PosttrainConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    pad_to_multiple_of_field,
    parse_pad_to_multiple_of,
    ref_model_mixup_alpha_field,
    ref_model_sync_steps_field,
    router_aux_loss_coef_field,
    sync_ref_model_field,
)
from posttrain.training.model_setup import disable_dropout_in_model
from posttrain.training.preference import PreferenceMetricsMixin
from posttrain.training.reference_memo import DIGESTS, DigestingCollator, ReferenceMemo
from posttrain.training.streaming import is_prepared, is_streaming, prepare_any
from posttrain.training.sync_ref import SyncRefModelCallback, load_sync_ref_checkpoint_state, sync_ref_checkpoint_state

logger = logging.getLogger("posttrain")


def check_length_settings(config) -> None:
    """A preference config's (DPO, BCO, TPO) max_prompt_length must leave room for a completion in max_length."""
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

    learning_rate: float = learning_rate_field(1e-6)
    router_aux_loss_coef: float | None = router_aux_loss_coef_field(
        "Weight of a Mixture-of-Experts model's load-balancing loss added to the training loss (default: the "
        "model config's value; 0 turns it off).",
    )
    disable_dropout: bool = disable_dropout_field(
        True,
        "Turn dropout off in the policy and the reference (log-probs of the same sequences are compared "
        "across forwards).",
    )
    pad_to_multiple_of: int | str | None = pad_to_multiple_of_field()
    precompute_ref_log_probs: bool = config_field(
        False,
        "Compute the reference log-probs of the whole dataset once before training (cached on disk) instead "
        "of a reference forward every step.",
    )
    precompute_ref_batch_size: int | None = config_field(
        None,
        "Batch size of that precomputation (default: per_device_train_batch_size for the train set, "
        "per_device_eval_batch_size for eval sets).",
        min=1,
    )
    cache_ref_log_probs: bool = config_field(
        True,
        "Keep each row's reference log-probs from their first forward and reuse them when the row comes back "
        "(later epochs, evaluation), skipping the reference forward of batches whose rows are all known. The "
        "reference is frozen, so only float rounding can differ; not used with sync_ref_model, "
        "precompute_ref_log_probs or a data_collator of your own.",
    )
    ref_cache_dir: str = config_field(
        os.path.join("~", ".cache", "posttrain", "ref_logps"),
        "Where precomputed reference log-probs are cached, keyed by reference weights, data and tokenization.",
    )
    sync_ref_model: bool = sync_ref_model_field(
        "TR-DPO: every ref_model_sync_steps, mix the policy into the reference."
    )
    ref_model_mixup_alpha: float = ref_model_mixup_alpha_field(
        "TR-DPO mixing weight: ref = alpha * policy + (1 - alpha) * ref."
    )
    ref_model_sync_steps: int = ref_model_sync_steps_field("TR-DPO: optimizer steps between syncs.")

    def __post_init__(self):
        self.pad_to_multiple_of = parse_pad_to_multiple_of(self.pad_to_multiple_of)
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ConfigError(
                "sync_ref_model updates the reference during training, so its log-probs cannot be "
                "precomputed; set precompute_ref_log_probs=False or sync_ref_model=False."
            )
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


def _named_eval_sets(eval_dataset) -> list[tuple[str, object]]:
    if isinstance(eval_dataset, dict):
        return [(f"eval_dataset[{k!r}]", v) for k, v in eval_dataset.items()]
    return [] if eval_dataset is None else [("eval_dataset", eval_dataset)]


def refuse_streaming_precompute(dataset, name: str) -> None:
    """precompute_ref_log_probs stores one value per row index, which a stream does not have."""
    if is_streaming(dataset):
        raise ConfigError(
            f"precompute_ref_log_probs=True is not supported with IterableDataset ({name} is a stream): the "
            "reference log-probs are stored per row index. Set precompute_ref_log_probs=False (the reference model "
            "then scores each batch), or load the dataset without streaming."
        )


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
        if is_prepared(dataset, self.PREPARED_COLUMN):
            return dataset
        return prepare_any(self, dataset, self.processing_class, self.args, name)


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
            refuse_streaming_precompute(self.train_dataset, "train_dataset")
            for name, dataset in _named_eval_sets(self.eval_dataset):
                refuse_streaming_precompute(dataset, name)
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
        """The num_tokens counter, TR-DPO's synced reference and the memo of reference values, so that a resumed
        run goes on from them (a row missing from the memo would be scored afresh in another batch, which under
        bf16 autocast rounds differently from the value the uninterrupted run reuses)."""
        state = {"num_tokens": self._total_train_tokens, **sync_ref_checkpoint_state(self)}
        if self.ref_memo is not None:
            state["ref_memo"] = self.ref_memo.state_dict()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        load_sync_ref_checkpoint_state(self, state)
        memo = state.pop("ref_memo", None)
        if memo is not None and self.ref_memo is not None:  # a run resumed without the memo only drops it
            self.ref_memo.load_state_dict(memo)
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
        if self.args.precompute_ref_log_probs:
            refuse_streaming_precompute(dataset, name)
        if not self.args.precompute_ref_log_probs or set(self.REF_COLUMNS) <= set(dataset.column_names):
            return dataset
        identity, reference, reference_kept = self._precompute_source
        if not reference_kept and self.state.global_step > 0:
            raise ConfigError(
                f"Cannot compute reference log-probs for a dataset passed to evaluate() ({name}) after training "
                "began: with precompute_ref_log_probs=True and no ref_model the reference (the untrained policy) is no "
                "longer in memory. Pass it as eval_dataset when creating the trainer, pass ref_model, or set "
                "precompute_ref_log_probs=False."
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
