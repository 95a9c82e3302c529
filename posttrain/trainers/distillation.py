"""Knowledge distillation: the student learns to match a frozen teacher's next-token distributions (Hinton et
al. 2015) under GKD's generalized JSD (Agarwal et al. 2024), on completions it samples itself (on-policy, as
TRL's DistillationTrainer does), on the data's own completions (offline), or on a mix of both.

Per micro-batch the trainer draws whether its completions are the student's (probability `lmbda`, default 1:
always, like TRL) or the data's. Either way the loss sum over the completion tokens is

    alpha * sum_t JSD_beta(p_T(. | x_<t) ‖ p_S(. | x_<t)) + (1 - alpha) * sum_t -log p_S(x_t | x_<t),

divided by the completion tokens of the whole effective batch (TRL's normalisation). The teacher sees the same
token ids as the student, so the two must share a tokenizer (checked before training). Data: prompt-only rows
(on-policy only), prompt-completion or conversations (prepared as for SFT); with lmbda=1 only the prompts are
read, as in TRL.
"""

from __future__ import annotations

import logging
import os
import random
from collections import deque

import torch
from torch.utils.data import SequentialSampler
from transformers import PreTrainedModel

from posttrain.data.chat import apply_chat_template, require_chat_template
from posttrain.data.formats import detect_format, is_message_list
from posttrain.errors import ConfigError, DataError
from posttrain.generation import create_generation_backend, derive_seed, stop_token_ids
from posttrain.losses.distillation import check_vocab_sizes, generalized_jsd, shared_vocab
from posttrain.losses.policy import entropy_from_logits
from posttrain.losses.sft import IGNORE_INDEX, nll_sum, shift_for_next_token
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.reference import freeze
from posttrain.trainers.distillation_config import DistillationConfig
from posttrain.trainers.sft import SFTTrainer, uses_flash_attention

logger = logging.getLogger("posttrain")


def _name(model: str | PreTrainedModel) -> str:
    return model if isinstance(model, str) else (model.name_or_path or type(model).__name__)


def _teacher_tokenizer(teacher: str | PreTrainedModel, given):
    """The teacher's tokenizer: the one passed, else the one saved with the teacher, else None (unknown)."""
    if given is not None:
        return given
    if isinstance(teacher, str) or os.path.isdir(teacher.name_or_path):
        return load_tokenizer(teacher if isinstance(teacher, str) else teacher.name_or_path)
    return None


def check_teacher_compatible(
    student: PreTrainedModel, student_tokenizer, teacher: PreTrainedModel, teacher_tokenizer
) -> None:
    """Raises ConfigError unless every student id means the same token to the teacher and has a teacher logit.

    The tokenizers must agree on the ids the student can predict (the teacher may have more ids beyond the
    student's vocabulary, e.g. padding of its output layer: they are cut off). Without the teacher's
    tokenizer only the vocabulary sizes can be checked.
    """
    student_vocab = student.config.get_text_config().vocab_size
    teacher_vocab = teacher.config.get_text_config().vocab_size
    check_vocab_sizes(student_vocab, teacher_vocab)
    if teacher_tokenizer is None:
        logger.warning(
            "The teacher %r comes without a tokenizer (pass teacher_processing_class): only its "
            "vocabulary size was checked against the student's.",
            _name(teacher),
        )
        return
    student_ids = student_tokenizer.get_vocab()
    teacher_ids = {token: i for token, i in teacher_tokenizer.get_vocab().items() if i < student_vocab}
    if student_ids != teacher_ids:
        differing = sorted(set(student_ids.items()) ^ set(teacher_ids.items()), key=lambda pair: pair[1])[:3]
        raise ConfigError(
            f"The student's tokenizer ({_name(student)}, {len(student_tokenizer)} tokens, vocabulary size "
            f"{student_vocab}) and the teacher's ({_name(teacher)}, {len(teacher_tokenizer)} tokens, vocabulary "
            f"size {teacher_vocab}) give different tokens for the same ids (e.g. token/id pairs in one but not the "
            f"other: {differing}), so their next-token distributions cannot be compared. Distil from a teacher "
            "that shares the student's tokenizer."
        )


def tokenize_prompt(example: dict, row: int, tokenizer, conversational: bool, template_kwargs: dict) -> dict:
    """A prompt-only row: the prompt's ids (rendered with the generation prompt if conversational), nothing
    trained; the student's sample supplies the completion."""
    prompt = example["prompt"]
    if conversational != is_message_list(prompt) or not (conversational or isinstance(prompt, str)):
        expected = "a non-empty list of {'role', 'content'} messages" if conversational else "a string"
        raise DataError(
            f"Row {row}, column 'prompt': expected {expected} like row 0, got {prompt!r:.80}. Fix or drop that row."
        )
    if conversational:
        text = apply_chat_template({"prompt": prompt}, tokenizer, **template_kwargs)["prompt"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise DataError(
            f"Row {row}: the prompt is empty after tokenization; sampling needs at least one prompt "
            "token. Remove the row or give it a prompt."
        )
    return {"input_ids": ids, "completion_mask": [0] * len(ids)}


def _completion_stats(completions) -> list[float]:
    """[completions, summed length, min, max, cut at the length limit, ended, summed/min/max ended length]."""
    lengths = [len(c.token_ids) for c in completions]
    ended = [len(c.token_ids) for c in completions if c.finished_with_eos]
    inf = float("inf")
    return [
        float(len(lengths)),
        float(sum(lengths)),
        float(min(lengths, default=inf)),
        float(max(lengths, default=-inf)),
        float(len(lengths) - len(ended)),
        float(len(ended)),
        float(sum(ended)),
        float(min(ended, default=inf)),
        float(max(ended, default=-inf)),
    ]


class DistillationTrainer(SFTTrainer):
    """On-policy distillation: a student samples completions and learns to match a teacher's next-token distributions
    on them (generalized JSD).

    `DistillationTrainer(model, teacher_model, args=DistillationConfig(...), train_dataset=...)`, TRL's
    signature; posttrain's extras `teacher_processing_class` (checks the tokenizers agree) and `data_collator`.

    `teacher_model` is a model, hub id, path or built-in name (default: args.teacher_model_name_or_path); it
    is loaded with `teacher_model_init_kwargs` (+ `teacher_model_revision`), frozen and kept in eval mode.
    On-policy completions come from the generation backend (posttrain/generation), one seeded sample per
    prompt. Evaluation batches without completions (prompt-only data) are sampled too. Logged as means over
    completion tokens: TRL's entropy and completions/* keys, and posttrain's distill_loss, nll,
    teacher_agreement (student and teacher top-1 tokens equal), on_policy, mean_token_accuracy.

    See docs/trainers/distillation.md.
    """

    _name = "Distillation"  # the method the model card names and cites (posttrain/training/model_card.py)
    sample_offset = 0  # added to the micro-batch index of a step's sampling seeds (several rounds in one step)
    # shuffle_dataset=False also reads the batches in order here; TRL's GKD and IW-OPD draw them at random
    # whatever it says (for them it is SFT's one-off shuffle of the data), so they set this to False.
    ordered_when_unshuffled = True

    def __init__(
        self,
        model,
        teacher_model=None,
        args: DistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        *,
        teacher_processing_class=None,
        data_collator=None,
        **kwargs,
    ):
        args = args or DistillationConfig(output_dir="outputs/distillation")
        if tools:
            raise ConfigError(
                f"tools={[getattr(t, '__name__', t) for t in tools]}: tool-calling rollouts run on "
                "GRPOTrainer, RLOOTrainer and PPOTrainer; DistillationTrainer samples single-turn "
                "completions. Pass tools=None."
            )
        teacher_model = self._resolve_teacher(model, teacher_model, args)
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            data_collator=data_collator,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            **kwargs,
        )
        init_kwargs = None
        if isinstance(teacher_model, str):
            init_kwargs = {"trust_remote_code": args.trust_remote_code, **(args.teacher_model_init_kwargs or {})}
            if args.teacher_model_revision is not None:
                init_kwargs.setdefault("revision", args.teacher_model_revision)
        teacher = None  # `_resolve_teacher` gives None when no teacher is held locally (server distillation)
        if teacher_model is not None:
            teacher = load_causal_lm(teacher_model, init_kwargs)
            self._check_teacher(teacher, _teacher_tokenizer(teacher_model, teacher_processing_class))
        self.teacher_model = (
            None if teacher is None else self.accelerator.prepare_model(freeze(teacher), evaluation_mode=True)
        )
        if self.data_collator is self._own_collator:
            # The teacher reads the same batches: a flash-attention teacher needs them in one row too.
            self.data_collator.one_row = uses_flash_attention(self.model) or (
                teacher is not None and uses_flash_attention(teacher)
            )
            self.data_collator.pad_to_multiple_of = args.pad_to_multiple_of
        self._sampler = create_generation_backend(self.model, self.processing_class, args)
        self._sampling = args.sampling_params()
        self._stop_ids = set(stop_token_ids(self.processing_class, self.model))
        self._coin = random.Random(args.seed)
        self._eval_samples = 0
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        self._completion_log: deque = deque(maxlen=batch)

    def _check_teacher(self, teacher, teacher_tokenizer) -> None:
        """Hook: refuses a teacher whose token ids mean something else (cross-tokenizer methods override it)."""
        check_teacher_compatible(self.model, self.processing_class, teacher, teacher_tokenizer)

    @staticmethod
    def _resolve_teacher(model, teacher_model, args: DistillationConfig):
        named = args.teacher_model_name_or_path
        if teacher_model is not None and named is not None and teacher_model != named:  # TRL's script passes both
            raise ConfigError(
                f"Two teachers: teacher_model={_name(teacher_model)!r} and "
                f"teacher_model_name_or_path={args.teacher_model_name_or_path!r}; give only one."
            )
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher_model is None:
            raise ConfigError(
                "DistillationTrainer needs a teacher: pass teacher_model (a model, hub id or path) or "
                "set teacher_model_name_or_path in the config."
            )
        if teacher_model is model and not isinstance(model, str):  # a name loads a separate copy
            raise ConfigError(
                "teacher_model is the student itself, so freezing it would stop training. Pass a "
                "separately loaded teacher."
            )
        if not isinstance(teacher_model, str):
            for name in ("teacher_model_init_kwargs", "teacher_model_revision"):
                if getattr(args, name):
                    raise ConfigError(
                        f"{name} only applies when the teacher is given by name or path; the teacher "
                        f"you passed is already loaded. Drop {name}."
                    )
        return teacher_model

    # -- data --------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: DistillationConfig, name: str):
        """Prompt-only rows when only prompts are read (prompt-only data, or lmbda=1: TRL reads only the
        prompt column); otherwise SFT's preparation of the completions, or of rows already tokenized (GKD tokenizes
        its 'messages' rows its own way first)."""
        if "input_ids" in dataset.column_names:
            return super().prepare_dataset(dataset, tokenizer, args, name)
        fmt = detect_format(dataset.column_names, dataset[0] if len(dataset) else None)
        if fmt.kind == "prompt_only" or (args.lmbda == 1 and fmt.kind == "prompt_completion"):
            if fmt.kind == "prompt_only" and args.lmbda < 1 and name == "train_dataset":
                raise ConfigError(
                    f"lmbda={args.lmbda}: some micro-batches train on the data's completions, but "
                    f"{name} has only prompts. Set lmbda=1.0 (always on-policy) or give completions."
                )
            if fmt.conversational:
                require_chat_template(tokenizer, "conversational prompts")
            return dataset.map(
                tokenize_prompt,
                with_indices=True,
                remove_columns=dataset.column_names,
                num_proc=args.dataset_num_proc,
                fn_kwargs=dict(
                    tokenizer=tokenizer,
                    conversational=fmt.conversational,
                    template_kwargs=args.chat_template_kwargs or {},
                ),
                desc=f"Tokenizing the prompts of {name}",
            )
        if fmt.kind == "language_modeling" and args.lmbda > 0:
            raise ConfigError(
                f"lmbda={args.lmbda}: on-policy distillation samples completions for prompts, but "
                f"{name} is language-modeling data ({', '.join(fmt.columns)}) without prompts. Give "
                "'prompt' (+ 'completion') columns, or set lmbda=0 to distil on the text as it is."
            )
        if args.chat_template_kwargs and fmt.conversational:
            raise ConfigError(
                "chat_template_kwargs is only applied to prompts that the student completes; with "
                f"lmbda={args.lmbda} {name}'s conversations are rendered as for SFT. Set lmbda=1 or drop "
                "chat_template_kwargs."
            )
        return super().prepare_dataset(dataset, tokenizer, args, name)

    def _get_train_sampler(self, train_dataset=None):
        if not self.args.shuffle_dataset and self.ordered_when_unshuffled:
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
        return super()._get_train_sampler(train_dataset)

    # -- on-policy completions ---------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Draws which micro-batches of the effective batch are on-policy and samples them before the batch's
        completion tokens are counted, so the loss is normalised by the tokens actually trained."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        flags = [self._coin.random() < self.args.lmbda for _ in batches]
        seeds = [
            derive_seed(self.args.seed, self.state.global_step, i + self.sample_offset, self.accelerator.process_index)
            for i in range(len(batches))
        ]
        batches = [
            self._student_batch(b, seed, "train") if on else self._off_policy_batch(b, seed)
            for b, on, seed in zip(batches, flags, seeds)
        ]
        self._metrics["train"]["on_policy"].extend(float(on) for on in flags)
        return batches, self._get_num_items_in_batch(batches, device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if "labels" in inputs and bool((inputs["labels"] == IGNORE_INDEX).all()):  # prompts only: sample
            self._eval_samples += 1
            seed = derive_seed(
                self.args.seed, self.state.global_step, self._eval_samples, 1 << 20, self.accelerator.process_index
            )
            inputs = self._student_batch(inputs, seed, "eval")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def _off_policy_batch(self, batch: dict, seed: int) -> dict:
        """Hook: the training batch of a micro-batch that is not on-policy (here the data's completions)."""
        return batch

    def loss_temperature(self) -> float:
        """Hook: the softmax temperature of both distributions in the loss (here the sampling temperature)."""
        return self.args.temperature

    def _student_batch(self, batch: dict, seed: int, mode: str, sampler=None) -> dict:
        """The batch with each row's completion replaced by one the student (or `sampler`) samples for the row's
        prompt: the tokens before its first trained token, or the whole row when nothing in it is trained."""
        prompts = []
        for row, labels in enumerate(batch["labels"]):
            trained = (labels != IGNORE_INDEX).nonzero()
            if len(trained) and int(trained[0]) == 0:
                raise DataError(
                    f"A row of the batch (number {row}) is trained from its first token, so it has no "
                    "prompt to sample a completion for. On-policy distillation needs prompt-completion "
                    "or conversational data."
                )
            start = int(trained[0]) if len(trained) else int(batch["attention_mask"][row].sum())
            prompts.append(batch["input_ids"][row, :start].tolist())
        completions = (sampler or self._sampler).generate(prompts, 1, self._sampling, seed=seed)
        self._record_completions(prompts, completions, mode)
        collated = self.data_collator(
            [
                {"input_ids": prompt + c.token_ids, "completion_mask": [0] * len(prompt) + [1] * len(c.token_ids)}
                for prompt, c in zip(prompts, completions)
            ]
        )
        return {k: v.to(batch["input_ids"].device) for k, v in collated.items()}

    def _record_completions(self, prompts, completions, mode: str) -> None:
        """TRL's completions/* metrics over all processes, and the texts for log_completions."""
        stats = torch.tensor(_completion_stats(completions), device=self.accelerator.device)
        s = self.accelerator.gather(stats.reshape(1, -1)).cpu()
        count, ended = s[:, 0].sum().item(), s[:, 5].sum().item()
        metrics = self._metrics[mode]
        metrics["completions/mean_length"].append(s[:, 1].sum().item() / max(count, 1))
        metrics["completions/min_length"].append(s[:, 2].min().item())
        metrics["completions/max_length"].append(s[:, 3].max().item())
        metrics["completions/clipped_ratio"].append(s[:, 4].sum().item() / max(count, 1))
        # TRL reports 0 when no completion ended with a stop token.
        metrics["completions/mean_terminated_length"].append(s[:, 6].sum().item() / ended if ended else 0.0)
        metrics["completions/min_terminated_length"].append(s[:, 7].min().item() if ended else 0.0)
        metrics["completions/max_terminated_length"].append(s[:, 8].max().item() if ended else 0.0)
        if self.args.log_completions and mode == "train":
            decode = self.processing_class.decode
            self._completion_log.extend(
                (decode(p, skip_special_tokens=True), decode(c.token_ids, skip_special_tokens=True))
                for p, c in zip(prompts, completions)
            )

    # -- the loss ----------------------------------------------------------------------------------
    def _forward_nll(self, model, inputs, labels):
        """SFT's hook for the loss sum over trained tokens: here the alpha-mix of divergence and NLL."""
        student_logits = model(**inputs).logits
        mask = shift_for_next_token(labels) != IGNORE_INDEX
        temperature = self.loss_temperature()
        divergence, teacher_top1 = self._divergence(inputs, student_logits, mask, temperature)
        nll, correct, count = nll_sum(student_logits, labels)
        with torch.no_grad():
            entropy = entropy_from_logits(student_logits[mask].float() / temperature).sum()
            agree = (student_logits[mask].argmax(-1) == teacher_top1).sum()
        totals = self.accelerator.gather(
            torch.stack([divergence.detach(), nll.detach(), agree.float(), entropy, count.float()]).reshape(1, 5)
        ).sum(0)
        means = (totals[:4] / totals[4].clamp(min=1)).tolist()
        metrics = self._metrics["train" if model.training else "eval"]
        for key, value in zip(("distill_loss", "nll", "teacher_agreement", "entropy"), means):
            metrics[key].append(value)
        return self.args.alpha * divergence + (1 - self.args.alpha) * nll, correct, count

    def _divergence(self, inputs, student_logits, mask, temperature: float):
        """Hook: the divergence summed over the `mask`ed positions, and the teacher's most likely token at each of
        them (here from the local teacher's logits on the same inputs)."""
        with torch.no_grad():
            teacher_logits = shared_vocab(student_logits, self.teacher_model(**inputs).logits)
        divergence = generalized_jsd(student_logits, teacher_logits, self.args.beta, mask, temperature).sum()
        return divergence, teacher_logits[mask].argmax(-1)

    # -- resuming --------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """SFT's counters and the lmbda coin, so that the same micro-batches are on-policy after a resume."""
        return {**super().checkpoint_state(), "lmbda_coin": self._coin.getstate()}

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        if "lmbda_coin" in state:
            self._coin.setstate(state.pop("lmbda_coin"))
        super().load_checkpoint_state(state)

    # -- logging -----------------------------------------------------------------------------------
    def log(self, logs, start_time=None):
        super().log(logs, start_time)
        if "loss" in logs and self.args.log_completions and self._completion_log and self.is_world_process_zero():
            self._write_completions()

    def _write_completions(self) -> None:
        """Saves the latest on-policy pairs as output_dir/completions/completions_<step>.parquet (TRL's file) and
        prints a sample."""
        import pandas as pd

        rows = list(self._completion_log)
        table = pd.DataFrame(
            {
                "step": [self.state.global_step] * len(rows),
                "prompt": [p for p, _ in rows],
                "completion": [c for _, c in rows],
            }
        )
        folder = os.path.join(self.args.output_dir, "completions")
        os.makedirs(folder, exist_ok=True)
        table.to_parquet(os.path.join(folder, f"completions_{self.state.global_step:05d}.parquet"))
        shown = table.drop_duplicates(subset=["prompt"]) if self.args.log_unique_prompts else table
        if self.args.num_completions_to_print is not None:
            shown = shown.head(self.args.num_completions_to_print)
        for prompt, completion in zip(shown["prompt"], shown["completion"]):
            logger.info("step %d | prompt: %r | completion: %r", self.state.global_step, prompt, completion)
