"""Binary Classifier Optimization (Jung et al. 2024, arXiv:2404.04656), at the import path TRL had for it
(`trl.experimental.bco`, removed from TRL in 2026): alignment from unpaired thumbs-up / thumbs-down examples, in
KTO's data format (`prompt`, `completion`, boolean `label`; paired preference data is unpaired).

The implicit reward r = beta * log(pi / pi_ref) is the logit of a binary classifier of desirable vs undesirable
completions, shifted by delta, the running mean of all rewards seen in training (see `posttrain.losses.bco`).
With `embedding_func` and `embedding_tokenizer`, underlying distribution matching (UDM) reweights undesirable
examples by the density ratio of their prompts, from a logistic regression fitted once, before training, on the
embeddings of up to `prompt_sample_size` desirable and as many undesirable prompts of the training set.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from posttrain.data.batches import pad
from posttrain.data.chat import render, require_chat_template, unpair_preference_dataset
from posttrain.data.formats import DatasetFormat, validate_dataset
from posttrain.data.report import DataReport, cut_column
from posttrain.errors import ConfigError, DataError
from posttrain.experimental.bco.bco_config import BCOConfig
from posttrain.losses.bco import (
    bco_loss,
    density_ratio_weights,
    fit_density_ratio_classifier,
    prob_desirable,
    update_running_mean,
)
from posttrain.models.loading import load_causal_lm
from posttrain.models.reference import is_peft_model, reference_forward, unwrap
from posttrain.trainers.kto import KTOCollator, tokenize_kto_row
from posttrain.training.class_metrics import ClassMetricsMixin, labelled_rows
from posttrain.training.preference import sequence_logps
from posttrain.training.reference_trainer import (
    ReferenceTrainer,
    load_processing_class,
)

logger = logging.getLogger("posttrain")


TRUNCATION_FIELDS = ("max_length", "max_prompt_length", "max_completion_length", "truncation_mode")
# The data report's reasons (see `truncate_bco` for which end of each part goes).
PROMPT_CUT = "prompt cut by max_length / max_prompt_length (truncation_mode picks the end kept)"
COMPLETION_CUT = "completion cut by max_length / max_completion_length"
NO_COMPLETION_LEFT = "truncation to max_length leaves no completion token"


def truncate_bco(
    prompt: list,
    completion: list,
    max_length: int | None,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    truncation_mode: str = "keep_end",
) -> tuple[list, list]:
    """TRL's BCO rule: a sequence over max_length first loses prompt tokens beyond max_prompt_length (its start
    with keep_end, its end with keep_start), then completion tokens beyond max_length - max_prompt_length. Without
    max_prompt_length, the joined sequence is cut as truncation_mode says."""
    if max_completion_length is not None:
        completion = completion[:max_completion_length]
    limit = max_length
    if limit is None or len(prompt) + len(completion) <= limit:
        return prompt, completion
    keep_end = truncation_mode == "keep_end"
    if max_prompt_length is None:
        if keep_end:
            cut = len(prompt) + len(completion) - limit
            return prompt[cut:], completion[max(0, cut - len(prompt)) :]
        return prompt[:limit], completion[: max(0, limit - len(prompt))]
    p = max_prompt_length
    prompt = prompt[-p:] if keep_end else prompt[:p]
    if len(prompt) + len(completion) > limit:
        completion = completion[: limit - p]
    return prompt, completion


def _tokenize_bco_row(example, row, tokenizer, fmt, completion_fmt, limits, embedding_tokenizer):
    out = tokenize_kto_row(example, row, tokenizer, fmt, completion_fmt, None)
    start = out["completion_mask"].index(1)
    full_prompt, full_completion = out["input_ids"][:start], out["input_ids"][start:]
    prompt, completion = truncate_bco(full_prompt, full_completion, **limits)
    out = {
        "input_ids": prompt + completion,
        "completion_mask": [0] * len(prompt) + [1] * len(completion),
        cut_column(PROMPT_CUT): len(full_prompt) - len(prompt),
        cut_column(COMPLETION_CUT): len(full_completion) - len(completion),
    }
    if embedding_tokenizer is not None:  # UDM: the prompt as text, in the embedding model's tokens
        text = (
            render(tokenizer, list(example["prompt"]), add_generation_prompt=True)
            if fmt.conversational
            else example["prompt"]
        )
        out["embedding_input_ids"] = embedding_tokenizer(text, truncation=True, add_special_tokens=False)["input_ids"]
    return out


class BCOCollator(KTOCollator):
    """KTO's batches, plus the prompts in the embedding model's tokens (UDM), padded with its pad token."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, embedding_pad_token_id: int = 0):
        super().__init__(pad_token_id, pad_to_multiple_of)
        self.embedding_pad_token_id = embedding_pad_token_id

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().__call__(examples)
        if "embedding_input_ids" in examples[0]:
            ids = [list(e["embedding_input_ids"]) for e in examples]
            batch["embedding_input_ids"] = pad(ids, self.embedding_pad_token_id)
            batch["embedding_attention_mask"] = pad([[1] * len(i) for i in ids], 0)
        return batch


def _check_models(model, model_init, peft_config, args, embedding_func, embedding_tokenizer, model_adapter_name):
    """The model, UDM's embedding pair and the adapter to train: what BCOTrainer can use."""
    if model_init is not None:
        raise ConfigError(
            "model_init is not supported by posttrain's BCOTrainer (the reference model and the "
            "data are prepared from the model when the trainer is built); pass `model` instead."
        )
    if model is None:
        raise ConfigError("BCOTrainer needs `model` (a causal LM, or its name or path).")
    if (embedding_func is None) != (embedding_tokenizer is None):
        raise ConfigError(
            "UDM needs both embedding_func and embedding_tokenizer (the prompts are tokenized with "
            "the one and embedded with the other); pass both, or neither to train without UDM."
        )
    if model_adapter_name is not None:
        _check_adapter_name("model_adapter_name", model_adapter_name, model, peft_config)


def _check_adapter_name(option: str, name: str, model, peft_config) -> None:
    if isinstance(model, str) or not is_peft_model(model) or peft_config is not None:
        raise ConfigError(
            f"{option}={name!r} names an adapter of a PEFT model passed as `model` (without "
            f"peft_config); pass such a model, or drop {option}."
        )


class BCOTrainer(ClassMetricsMixin, ReferenceTrainer):
    """`BCOTrainer(model, ref_model=None, args=BCOConfig(...), train_dataset=..., processing_class=...,
    embedding_func=..., embedding_tokenizer=...)`, the keyword arguments of TRL's BCOTrainer in its order.

    The reference is `ref_model`, else a frozen copy of the policy, else (PEFT) the policy with its adapter
    disabled, or the adapter `ref_adapter_name`, or log-probs precomputed once (`precompute_ref_log_probs`).
    `embedding_func(input_ids=..., attention_mask=...)` returns one embedding per prompt ([B, D]) for UDM.
    """

    _name = "BCO"

    REF_COLUMNS = ("ref_logps",)
    ID_COLUMNS = ("input_ids", "completion_mask", "label")
    PREPARED_COLUMN = "input_ids"

    def __init__(
        self,
        model=None,
        ref_model=None,
        args: BCOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        data_collator=None,
        model_init=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        compute_metrics=None,
        model_adapter_name: str | None = None,
        ref_adapter_name: str | None = None,
        embedding_func=None,
        embedding_tokenizer=None,
        quantization_config=None,
        **kwargs,
    ):
        args = args or BCOConfig(output_dir="outputs/bco")
        _check_models(model, model_init, peft_config, args, embedding_func, embedding_tokenizer, model_adapter_name)
        if ref_adapter_name is not None:
            _check_adapter_name("ref_adapter_name", ref_adapter_name, model, peft_config)
            if args.precompute_ref_log_probs:
                raise ConfigError(
                    "ref_adapter_name with precompute_ref_log_probs=True is not supported; set "
                    "precompute_ref_log_probs=False."
                )
        if isinstance(ref_model, str) and args.ref_model_init_kwargs:
            ref_model = load_causal_lm(ref_model, dict(args.ref_model_init_kwargs))
        elif args.ref_model_init_kwargs and ref_model is not None:
            raise ConfigError(
                "ref_model_init_kwargs only applies when `ref_model` is a name or path; the ref_model "
                "you passed is already loaded. Drop ref_model_init_kwargs."
            )
        self.embedding_func, self.embedding_tokenizer = embedding_func, embedding_tokenizer
        self._adapters = (model_adapter_name or "default", ref_adapter_name)
        self._delta = (0.0, 0)  # running mean of the implicit rewards, and how many it averages
        self._udm = None  # (weight, bias) of the density-ratio classifier
        self._total_train_tokens = 0
        processing_class = load_processing_class(model, processing_class, args)
        if model_adapter_name is not None:
            unwrap(model).set_adapter(model_adapter_name)
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
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **kwargs,
        )
        # A PEFT policy's reference: its adapter as it starts (posttrain's rule), or the named adapter; with a named
        # adapter to train and none for the reference, the policy with adapters disabled (TRL's rule).
        pretrained = peft_config is None and is_peft_model(model) and ref_adapter_name is model_adapter_name is None
        self.setup_reference(ref_model, pretrained_adapter=pretrained)
        if embedding_func is not None:
            self._udm = self._fit_udm_classifier()

    # -- data ------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: BCOConfig, name: str):
        fmt = validate_dataset(dataset, ("unpaired_preference", "preference"), "BCOTrainer", name)
        paired = fmt.kind == "preference"
        if paired:
            dataset = unpair_preference_dataset(dataset, num_proc=args.dataset_num_proc)
            fmt = validate_dataset(dataset, ("unpaired_preference",), "BCOTrainer", name)
        if fmt.conversational:
            require_chat_template(tokenizer)
        completion_fmt = DatasetFormat("prompt_completion", fmt.conversational, ("prompt", "completion"))
        dataset = dataset.map(
            _tokenize_bco_row,
            with_indices=True,
            num_proc=args.dataset_num_proc,
            remove_columns=[c for c in dataset.column_names if c not in ("label", *self.REF_COLUMNS)],
            fn_kwargs=dict(
                tokenizer=tokenizer,
                fmt=fmt,
                completion_fmt=completion_fmt,
                limits={k: getattr(args, k) for k in TRUNCATION_FIELDS},
                embedding_tokenizer=self.embedding_tokenizer,
            ),
            desc=f"Tokenizing {name}",
        )
        report = DataReport.of(self).start(name, len(dataset))
        report.note(len(dataset) // 2 if paired else 0, "pairs unpaired into two rows each (counted as rows)")
        empty = [i for i, mask in enumerate(dataset["completion_mask"]) if 1 not in mask]
        report.dropped(len(empty), NO_COMPLETION_LEFT)
        if empty:
            if len(empty) == len(dataset):
                raise DataError(
                    f"Every row of {name} loses its whole completion to max_length={args.max_length}; "
                    "raise max_length or lower max_prompt_length."
                )
            logger.warning(
                "Dropping %d of %d rows of %s: truncation to max_length=%s leaves no completion token.",
                len(empty),
                len(dataset),
                name,
                args.max_length,
            )
            dataset = dataset.select(sorted(set(range(len(dataset))) - set(empty)))
        return report.take_cuts(dataset)  # the truncation of the rows kept

    def _set_signature_columns_if_needed(self):
        """With remove_unused_columns=True (TRL's default) the columns the collator reads stay, the others go."""
        if self._signature_columns is None:
            self._signature_columns = [*self.ID_COLUMNS, "embedding_input_ids", *self.REF_COLUMNS]

    def default_collator(self, tokenizer, args: BCOConfig):
        pad_id = tokenizer.pad_token_id if args.padding_value is None else args.padding_value
        embedding_pad = getattr(self.embedding_tokenizer, "pad_token_id", None) or 0
        return BCOCollator(pad_id, pad_to_multiple_of=args.pad_to_multiple_of, embedding_pad_token_id=embedding_pad)

    # -- reference -------------------------------------------------------------------------------
    @contextmanager
    def reference_module(self, model):
        """The module that gives reference log-probs: the named reference adapter if there is one."""
        train_adapter, ref_adapter = self._adapters
        if ref_adapter is None:
            with reference_forward(model, self.ref_model) as reference:
                yield reference
            return
        peft_model = unwrap(model)
        was_training = peft_model.training
        peft_model.eval()
        peft_model.set_adapter(ref_adapter)
        try:
            with torch.no_grad():
                yield peft_model
        finally:
            peft_model.set_adapter(train_adapter)  # which also makes only that adapter trainable again
            peft_model.train(was_training)

    def reference_columns(self, reference, batch):
        return {"ref_logps": sequence_logps(reference, labelled_rows(batch, slice(None))).logps}

    # -- UDM -------------------------------------------------------------------------------------
    def _embed(self, batch: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.embedding_func(
                input_ids=batch["embedding_input_ids"], attention_mask=batch["embedding_attention_mask"]
            ).float()

    def _fit_udm_classifier(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeds up to prompt_sample_size prompts of each class (drawn with the run's seed) and fits the
        classifier whose odds are the density ratio."""
        labels = self.train_dataset["label"]
        generator = torch.Generator().manual_seed(self.args.seed)
        picked = []
        for wanted in (True, False):
            rows = [i for i, label in enumerate(labels) if label == wanted]
            if not rows:
                raise DataError(
                    "UDM compares the prompts of desirable and undesirable examples, but train_dataset "
                    f"has no {'desirable' if wanted else 'undesirable'} rows."
                )
            order = torch.randperm(len(rows), generator=generator)[: self.args.prompt_sample_size]
            picked += [rows[i] for i in sorted(order.tolist())]
        sample = self.train_dataset.select(picked).select_columns(
            ["input_ids", "completion_mask", "label", "embedding_input_ids"]
        )
        size = self.args.per_device_train_batch_size
        embeddings, classes = [], []
        for start in range(0, len(sample), size):
            batch = self._prepare_inputs(
                self.data_collator([sample[i] for i in range(start, min(start + size, len(sample)))])
            )
            embeddings.append(self._embed(batch).cpu())
            classes.append(batch["label"].cpu())
        desirable = torch.cat(classes)
        weight, bias = fit_density_ratio_classifier(torch.cat(embeddings), desirable)
        accuracy = ((prob_desirable(torch.cat(embeddings), weight, bias) > 0.5) == desirable).double().mean()
        logger.info("UDM density-ratio classifier: training accuracy %.3f on %d prompts.", accuracy, len(desirable))
        return weight, bias

    def _udm_weights(self, batch: dict) -> torch.Tensor | None:
        if self._udm is None:
            return None
        prob = prob_desirable(self._embed(batch), *self._udm).to(self.accelerator.device)
        return density_ratio_weights(prob, self.args.min_density_ratio, self.args.max_density_ratio)

    # -- loss ------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["label"]
        n = len(labels)
        policy = sequence_logps(model, labelled_rows(inputs, slice(None)), router_logits=self.aux_loss_enabled)
        ref_logps = self.reference_logps(model, inputs)["ref_logps"]
        if model.training:  # delta takes in this batch's rewards (of all processes) before it shifts them
            rewards = self.args.beta * (policy.logps.detach() - ref_logps)
            self._delta = update_running_mean(*self._delta, self.accelerator.gather(rewards.float()))
        delta = self._delta[0]
        losses, rewards = bco_loss(
            policy.logps, ref_logps, labels, delta, beta=self.args.beta, undesirable_weights=self._udm_weights(inputs)
        )
        loss = self.effective_batch_mean(losses.sum(), num_items_in_batch, n, model.training)
        loss = self.add_aux_loss(loss, policy.aux_loss)
        self.record_token_metrics(
            policy.stats, policy.token_counts, inputs["attention_mask"].sum(), {"chosen": labels, "rejected": ~labels}
        )
        self.record_class_metrics(labels, rewards, policy.logps.detach())  # BCO has no KL reference point
        self.record_metrics({"delta": delta})
        return (loss, {"rewards": rewards}) if return_outputs else loss

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """delta's running mean and the UDM classifier, so that a resumed run goes on with them (as TRL saves)."""
        state = {**super().checkpoint_state(), "bco_delta": list(self._delta)}
        if self._udm is not None:
            state["bco_udm"] = [t.cpu() for t in self._udm]
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        mean, count = state.pop("bco_delta", (0.0, 0))
        self._delta = (float(mean), int(count))
        if "bco_udm" in state:
            self._udm = tuple(state.pop("bco_udm"))
        super().load_checkpoint_state(state)


__all__ = ["BCOConfig", "BCOTrainer", "BCOCollator"]
