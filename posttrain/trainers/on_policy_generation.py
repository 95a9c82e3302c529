"""Distillation with on-policy generation through `model.generate`: the base GKD and GOLD
(posttrain.experimental.gkd, .gold) share. Per micro-batch, with probability `lmbda` the student samples the
completions; otherwise the data's completions are used, or with `seq_kd=True` the teacher's samples. Data: TRL's
`messages` rows (the last message is the completion, the rest the prompt), or prompt-completion rows."""

from __future__ import annotations

import torch

from posttrain.data.chat import require_chat_template
from posttrain.data.formats import is_message_list
from posttrain.errors import DataError
from posttrain.generation import create_generation_backend
from posttrain.losses.distillation import generalized_jsd_loss
from posttrain.losses.sft import IGNORE_INDEX
from posttrain.trainers.distillation import DistillationTrainer
from posttrain.training.streaming import PreparesEvalOnUse


def tokenize_messages(example: dict, row: int, tokenizer, max_length: int | None) -> dict:
    """TRL's GKD tokenization of a `messages` row: the whole rendered conversation, trained from the first token
    that starts at or after the end of the rendered prompt (the messages before the last, with the generation
    prompt), so everything the template appends after the last message is trained too. Longer rows keep their
    last max_length tokens."""
    messages = example["messages"]
    if not is_message_list(messages) or len(messages) < 2:
        raise DataError(
            f"Row {row}, column 'messages': GKD needs a list of at least two {{'role', 'content'}} "
            f"messages (the last is the completion), got {messages!r:.80}. Fix or drop that row."
        )
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    start = next((i for i, (begin, _) in enumerate(encoded["offset_mapping"]) if begin >= len(prompt)), len(ids))
    if max_length is not None and len(ids) > max_length:
        start, ids = max(0, start - (len(ids) - max_length)), ids[-max_length:]
    if start == 0:
        raise DataError(
            f"Row {row}: no prompt token is left after keeping the last max_length={max_length} "
            "tokens, so there is nothing to sample a completion for. Raise max_length."
        )
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * start + ids[start:]}


def generate_on_policy_outputs(model, inputs: dict, generation_config) -> tuple[torch.Tensor, ...]:
    """Completions of `inputs["prompts"]` (left-padded ids, `prompt_attention_mask`) from `model.generate`, as
    (ids, attention mask, labels) of the whole sequences: each completion is kept up to and including its first
    stop token (any of `generation_config.eos_token_id`; all of it without one), the prompt's mask is its own (a
    pad-id token inside the prompt stays attended), and labels are -100 on the prompt and after the stop."""
    sequences = model.generate(
        input_ids=inputs["prompts"],
        attention_mask=inputs["prompt_attention_mask"],
        generation_config=generation_config,
        return_dict_in_generate=True,
    ).sequences
    prompt_width = inputs["prompts"].shape[1]
    completion = sequences[:, prompt_width:]
    stop_ids = generation_config.eos_token_id
    if stop_ids is None:
        keep = torch.ones_like(completion)
    else:
        stops = torch.isin(completion, torch.as_tensor(stop_ids, device=completion.device))
        first_stop = torch.where(stops.any(1), stops.int().argmax(1), completion.shape[1])
        keep = (torch.arange(completion.shape[1], device=completion.device) <= first_stop[:, None]).to(completion)
    attention_mask = torch.cat([inputs["prompt_attention_mask"].to(completion), keep], dim=1)
    labels = sequences.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :prompt_width] = IGNORE_INDEX
    return sequences, attention_mask, labels


class OnPolicyGenerationTrainer(PreparesEvalOnUse, DistillationTrainer):
    """DistillationTrainer with TRL's GKD arguments in TRL's order (posttrain's extras after them), `messages`
    rows, the student's sampling settings as `generation_config`, and sequence-level KD (`seq_kd`)."""

    ordered_when_unshuffled = False  # batches drawn at random, as TRL (shuffle_dataset: a one-off shuffle)
    # TRL's static helpers: the loss with TRL's reductions, and one on-policy sampling step through `model.generate`
    generalized_jsd_loss = staticmethod(generalized_jsd_loss)
    generate_on_policy_outputs = staticmethod(generate_on_policy_outputs)

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
        *,
        teacher_processing_class=None,
        quantization_config=None,
        **kwargs,
    ):
        self._teacher_sampler = None
        super().__init__(
            model,
            teacher_model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            teacher_processing_class=teacher_processing_class,
            data_collator=data_collator,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            formatting_func=formatting_func,
            **kwargs,
        )
        self.generation_config = self._sampling_generation_config()

    def _sampling_generation_config(self):
        """The student's sampling settings as a transformers GenerationConfig (TRL's `trainer.generation_config`):
        max_new_tokens and temperature from the config, no top-k/top-p filter, the model's stop ids, padding with
        the tokenizer's pad token."""
        from transformers import GenerationConfig

        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        model_config = getattr(self.model, "generation_config", None)
        return GenerationConfig(
            max_new_tokens=getattr(self.args, "max_new_tokens", None) or self.args.max_completion_length,
            temperature=self.args.temperature,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=getattr(model_config, "eos_token_id", None) or tokenizer.eos_token_id,
        )

    def prepare_dataset(self, dataset, tokenizer, args, name: str):
        columns = dataset.column_names
        if "messages" in columns and not {"prompt", "completion", "input_ids"} & set(columns):
            require_chat_template(tokenizer, "GKD's messages")
            dataset = dataset.map(
                tokenize_messages,
                with_indices=True,
                remove_columns=columns,
                num_proc=args.dataset_num_proc,
                desc=f"Tokenizing {name}",
                fn_kwargs=dict(tokenizer=tokenizer, max_length=args.max_length),
            )
        return super().prepare_dataset(dataset, tokenizer, args, name)

    def loss_temperature(self) -> float:
        return 1.0

    def _off_policy_batch(self, batch: dict, seed: int) -> dict:
        if not self.args.seq_kd:
            return batch
        if self._teacher_sampler is None:
            self._teacher_sampler = create_generation_backend(self.teacher_model, self.processing_class, self.args)
        return self._student_batch(batch, seed, "train", sampler=self._teacher_sampler)


__all__ = ["OnPolicyGenerationTrainer", "generate_on_policy_outputs", "tokenize_messages"]
