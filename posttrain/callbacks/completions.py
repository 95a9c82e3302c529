"""Sample completions for a trainer's eval prompts (shared by LogCompletionsCallback and WeaveCallback)."""

from __future__ import annotations

import torch
from accelerate.utils import gather_object

from posttrain.data.chat import maybe_apply_chat_template


def eval_prompts(trainer, num_prompts: int | None, who: str):
    """The trainer's eval dataset (its first `num_prompts` rows), which must have a ``prompt`` column."""
    dataset = trainer.eval_dataset
    if dataset is None:
        raise ValueError(
            f"Trainer must have an evaluation dataset to use the {who}: pass eval_dataset=... "
            "with a 'prompt' column to the trainer."
        )
    if isinstance(dataset, dict):
        raise ValueError(f"{who}: pass a single eval_dataset (not a dict of them) to the trainer.")
    if num_prompts is not None:
        dataset = dataset.select(range(min(num_prompts, len(dataset))))
    return dataset


def raw_prompts(dataset, who: str) -> list:
    """The eval dataset's raw prompts; tokenized eval sets keep no text, so say what is needed."""
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"{who} needs a 'prompt' column in the trainer's eval_dataset, which has "
            f"{dataset.column_names}. Use a prompt-only or preference eval set (the trainer keeps it "
            "as text), or give the callback a trainer whose eval_dataset has prompts."
        )
    return list(dataset["prompt"])


@torch.no_grad()
def generate_completions(trainer, prompts: list, tokenizer, generation_config, batch_size: int):
    """(prompts rendered as text, completions) for every process's share of `prompts`, gathered on all
    processes. Generation runs on the unwrapped model in eval mode, left-padded; the model's training
    mode and the tokenizer's padding side are restored afterwards."""
    accelerator = trainer.accelerator
    model = accelerator.unwrap_model(trainer.model_wrapped)
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    texts, completions = [], []
    try:
        with accelerator.split_between_processes(prompts) as shard:
            shard_texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in shard]
            for start in range(0, len(shard_texts), max(1, batch_size)):
                batch = tokenizer(
                    shard_texts[start : start + batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    add_special_tokens=False,
                ).to(model.device)
                out = model.generate(**batch, generation_config=generation_config, pad_token_id=tokenizer.pad_token_id)
                new_tokens = out[:, batch["input_ids"].shape[1] :]
                completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            texts = shard_texts
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
    return gather_object(texts), gather_object(completions)
