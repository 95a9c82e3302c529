"""Process reward models (TRL <= 0.28's `trl.experimental.prm`, dropped in 2026): a token classifier learns, at the
end of each reasoning step, whether that step is correct (Uesato et al. 2022, "Solving math word problems with
process- and outcome-based feedback"; Lightman et al. 2023, "Let's Verify Step by Step").

Data: stepwise supervision rows {"prompt": str, "completions": [step, ...], "labels": [bool, ...]}. A row becomes
prompt tokens + (step tokens + `step_separator` tokens) per step; the label of a step sits on the last token of its
separator, IGNORE_INDEX everywhere else. `prm_reward_func` turns a trained PRM into a reward function for the
online trainers (GRPO, RLOO): it scores each completion's steps and aggregates them (min by default).
"""

from __future__ import annotations

import torch
from datasets import Features, Sequence, Value
from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification, PreTrainedModel

from posttrain.data.formats import is_message_list
from posttrain.errors import ConfigError, DataError
from posttrain.experimental.prm.prm_config import PRMConfig
from posttrain.losses.prm import AGGREGATES, IGNORE_INDEX, aggregate_steps, step_label_sums, step_probabilities
from posttrain.models.layouts import repacked_tokens
from posttrain.models.loading import from_pretrained_kwargs, load_tokenizer, resolve_model_path
from posttrain.training.base import BaseTrainer

_TOKENIZED = Features({"input_ids": Sequence(Value("int64")), "labels": Sequence(Value("int64"))})


def tokenize_steps(
    example: dict,
    tokenizer,
    step_separator: str,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    train_on_last_step_only: bool = False,
    is_eval: bool = False,
    row: int = 0,
) -> dict:
    """{"input_ids", "labels"} of one stepwise-supervision row (see the module docstring)."""
    prompt, steps, labels = example.get("prompt"), example.get("completions"), example.get("labels")
    if not isinstance(prompt, str):
        kind = "a list of messages" if is_message_list(prompt) else type(prompt).__name__
        raise DataError(
            f"Row {row}, column 'prompt': expected the prompt text (a string), got {kind}. Render "
            "conversational prompts to text first (e.g. tokenizer.apply_chat_template(..., "
            "tokenize=False))."
        )
    if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps) or not steps:
        raise DataError(
            f"Row {row}, column 'completions': expected a non-empty list of step strings, got {steps!r:.80}."
        )
    if not isinstance(labels, list) or len(labels) != len(steps):
        raise DataError(f"Row {row}: {len(steps)} steps but labels {labels!r:.80}; give one label (bool) per step.")
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None:
        prompt_ids = (
            prompt_ids[len(prompt_ids) - max_prompt_length :] if len(prompt_ids) > max_prompt_length else prompt_ids
        )
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    separator = tokenizer(step_separator, add_special_tokens=False)["input_ids"]
    ids, targets = [], []
    for k, (step, label) in enumerate(zip(steps, labels)):
        step_ids = tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        trained = not train_on_last_step_only or is_eval or k == len(steps) - 1
        ids += step_ids
        targets += [IGNORE_INDEX] * (len(step_ids) - 1) + [int(label) if trained else IGNORE_INDEX]
    if max_completion_length is not None:
        ids, targets = ids[:max_completion_length], targets[:max_completion_length]
    ids, targets = prompt_ids + ids, [IGNORE_INDEX] * len(prompt_ids) + targets
    if max_length is not None:
        ids, targets = ids[:max_length], targets[:max_length]
    return {"input_ids": ids, "labels": targets}


def _load_token_classifier(model: str | PreTrainedModel, model_init_kwargs: dict | None = None):
    """A two-class token classifier; a causal LM checkpoint gets a new classification head."""
    if isinstance(model, PreTrainedModel):
        if not type(model).__name__.endswith("ForTokenClassification"):
            raise ConfigError(
                f"A {type(model).__name__} is not a token classifier; pass an "
                "AutoModelForTokenClassification (num_labels=2), or the checkpoint's name or path."
            )
        return model
    return AutoModelForTokenClassification.from_pretrained(
        resolve_model_path(model), num_labels=2, **from_pretrained_kwargs(model_init_kwargs)
    )


class PRMTrainer(BaseTrainer):
    """`PRMTrainer(model, args=PRMConfig(...), train_dataset=..., processing_class=...)`, TRL's keyword arguments in
    TRL's order; posttrain's extra `quantization_config` after them.

    `model` is a token classifier (AutoModelForTokenClassification, usually num_labels=2), or a checkpoint name
    or path (loaded with a new two-class head). Logged: loss and accuracy (of the step labels, train and eval,
    TRL's eval key), num_steps (labelled steps so far).
    """

    _name = "PRM"
    load_model = staticmethod(_load_token_classifier)

    def __init__(
        self,
        model=None,
        args: PRMConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        model_init=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        *,
        quantization_config=None,
        **kwargs,
    ):
        args = args or PRMConfig(output_dir="outputs/prm")
        if model_init is not None:
            raise ConfigError(
                "model_init (transformers' hyperparameter search) is not supported by posttrain's "
                "PRMTrainer: pass the model itself as `model` and drop model_init."
            )
        if model is None:
            raise ConfigError("PRMTrainer needs `model`: a token classifier or a checkpoint name or path.")
        if train_dataset is None:
            raise ConfigError(
                "PRMTrainer needs a train_dataset of stepwise supervision rows (prompt, completions, labels)."
            )
        self._steps_seen = 0
        super().__init__(
            _load_token_classifier(model) if not isinstance(model, str) else model,
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

    def prepare_dataset(self, dataset, tokenizer, args: PRMConfig, name: str):
        if "input_ids" in dataset.column_names:
            return dataset
        missing = [c for c in ("prompt", "completions", "labels") if c not in dataset.column_names]
        if missing:
            raise DataError(
                f"{name} lacks the column(s) {missing}: PRMTrainer reads stepwise supervision rows "
                "{'prompt': str, 'completions': [step, ...], 'labels': [bool, ...]}."
            )
        settings = dict(
            tokenizer=tokenizer,
            step_separator=args.step_separator,
            max_length=args.max_length,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            train_on_last_step_only=args.train_on_last_step_only,
            is_eval=name != "train_dataset",
        )
        return dataset.map(
            lambda example, row: tokenize_steps(example, row=row, **settings),
            with_indices=True,
            remove_columns=dataset.column_names,
            num_proc=args.dataset_num_proc,
            desc=f"Tokenizing {name}",
            features=_TOKENIZED,
        )  # else labels stay typed as bools

    def default_collator(self, tokenizer, args):
        return DataCollatorForTokenClassification(tokenizer, label_pad_token_id=IGNORE_INDEX)

    def count_loss_items(self, batch):
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The step labels' cross-entropy. A right-padded batch runs on fewer, fuller rows where that saves enough
        (`repacked_tokens`: each token's logits as in the padded batch), except when the logits are returned."""
        forward = {k: v for k, v in inputs.items() if k != "labels"}
        packed = (
            None
            if return_outputs or self.is_fsdp_enabled or self.is_deepspeed_enabled
            else repacked_tokens(model, forward)
        )
        if packed is None:
            logits, labels = model(**forward, use_cache=False).logits, inputs["labels"]
        else:
            packed_inputs, index = packed
            logits = model(**packed_inputs, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[index][None]
            labels = inputs["labels"][inputs["attention_mask"].bool()][None]
        loss_sum, correct, count = step_label_sums(logits, labels)
        loss = self.effective_batch_mean(loss_sum, num_items_in_batch, count, model.training)
        totals = self.accelerator.gather(torch.stack([correct.float(), count.float()]).reshape(1, 2)).sum(0)
        mode = "train" if model.training else "eval"
        self._metrics[mode]["accuracy"].append(totals[0].item() / max(totals[1].item(), 1))
        if model.training:
            self._steps_seen += int(totals[1].item())
            self._metrics[mode]["num_steps"] = [float(self._steps_seen)]
        return (loss, {"logits": logits}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss; with compute_metrics also the logits [B, T, C] and labels, as TRL hands them over."""
        if prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        return loss.detach(), outputs["logits"], inputs["labels"]

    def checkpoint_state(self) -> dict:
        return {**super().checkpoint_state(), "num_steps": self._steps_seen}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        self._steps_seen = state.pop("num_steps", 0)
        super().load_checkpoint_state(state)


def _text(value) -> str:
    """A prompt or completion as text: a string as it is, a conversation as its last message's content."""
    if isinstance(value, str):
        return value
    if is_message_list(value):
        content = value[-1]["content"]
        if isinstance(content, list):  # content parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content
    raise DataError(f"prm_reward_func scores text or conversations; got a {type(value).__name__}.")


def prm_reward_func(
    model,
    tokenizer=None,
    step_separator: str = "\n",
    aggregate: str = "min",
    positive_label: int = 1,
    batch_size: int = 8,
    max_length: int | None = None,
):
    """A reward function `f(prompts, completions, **kwargs) -> list[float]` for GRPO/RLOO from a process reward
    model (a token classifier, or its name or path).

    Each completion is split into steps at `step_separator` (empty steps dropped), tokenized as PRMTrainer
    tokenizes training rows, and scored in batches of `batch_size`; each step's P(correct) (class
    `positive_label`) at its end is aggregated with `aggregate` ('min', 'prod', 'mean' or 'last'). Conversational
    prompts and completions are scored by their last message's text. A completion without steps scores 0.0.
    """
    if aggregate not in AGGREGATES:
        raise ConfigError(f"aggregate={aggregate!r} is not one of {AGGREGATES}.")
    if not step_separator:
        raise ConfigError("step_separator='' cannot split completions into steps; use e.g. '\\n'.")
    if tokenizer is None:
        if not isinstance(model, str):
            tokenizer = load_tokenizer(model.name_or_path)
        else:
            tokenizer = load_tokenizer(model)
    model = _load_token_classifier(model)
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.no_grad()
    def prm_reward(prompts, completions, **kwargs) -> list[float]:
        rows = []
        for prompt, completion in zip(prompts, completions):
            steps = [s for s in _text(completion).split(step_separator) if s.strip()]
            if not steps:
                rows.append(None)
                continue
            rows.append(
                tokenize_steps(
                    {"prompt": _text(prompt), "completions": steps, "labels": [1] * len(steps)},
                    tokenizer,
                    step_separator,
                    max_length=max_length,
                    is_eval=True,
                )
            )
        rewards = [0.0] * len(rows)
        scored = [i for i, r in enumerate(rows) if r is not None]
        device = next(model.parameters()).device
        for start in range(0, len(scored), batch_size):
            chunk = scored[start : start + batch_size]
            width = max(len(rows[i]["input_ids"]) for i in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, i in enumerate(chunk):
                ids[j, : len(rows[i]["input_ids"])] = torch.tensor(rows[i]["input_ids"])
                mask[j, : len(rows[i]["input_ids"])] = 1
            probabilities = step_probabilities(
                model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits, positive_label
            ).cpu()
            for j, i in enumerate(chunk):
                ends = [t for t, label in enumerate(rows[i]["labels"]) if label != IGNORE_INDEX]
                rewards[i] = aggregate_steps(probabilities[j, ends].tolist(), aggregate)
        return rewards

    return prm_reward


__all__ = ["PRMConfig", "PRMTrainer", "prm_reward_func", "tokenize_steps"]
