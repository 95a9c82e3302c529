"""Images in the online trainers (GRPO, RLOO): image prompts through generation, the rollout and the log-prob forwards.

A prompt dataset with an ``images`` / ``image`` column is validated up front (one placeholder per image, every
image readable) but never materialised. Each round, its prompts are rendered (conversations: the images placed by
`prepare_multimodal_messages`, then the processor's chat template) and processed a round at a time by the processor
(left padding); each prompt's image inputs are split off (`split_vision_inputs`) and travel with every one of its
completions as `Episode.vision` -> `Rollout.vision`. A micro-batch merges them back (`vision_batch`), so the policy,
reference and old-policy forwards see the same pixels as generation did. Image tokens are never sampled (TRL
suppresses them too) and, being in the prompt, never trained.
"""

from __future__ import annotations

import copy

from posttrain.data.chat import apply_chat_template, require_chat_template
from posttrain.data.formats import is_message_list
from posttrain.data.transforms import prepare_multimodal_messages
from posttrain.data.vision import (
    TOKEN_INPUTS,
    VISION_INPUTS,
    check_vision_inputs,
    image_token_ids,
    is_processor,
    is_vision_dataset,
    is_vision_model,
    open_image,
    row_images,
    split_vision_inputs,
    tokenizer_of,
    validate_vision_dataset,
)
from posttrain.errors import ConfigError, DataError
from posttrain.models.loading import load_tokenizer
from posttrain.models.vision import adapt_vision_model, is_vision_checkpoint, load_processor, load_vision_model
from posttrain.online.rollout import PROMPT_COLUMN, Episode

__all__ = ["ImagePrompts", "forward_vision_inputs", "setup_online_vision", "tokenizer_of", "uses_own_positions"]


def setup_online_vision(
    trainer,
    model,
    args,
    train_dataset,
    eval_dataset,
    processing_class,
    tools=None,
    rollout_func=None,
    environment_factory=None,
    peft_config=None,
):
    """Returns (processing_class, ImagePrompts or None, peft_config). A vision-language model gets its processor
    by default, its tower frozen (`freeze_vision_tower`) and, with LoRA, a copy of `peft_config` that trains the
    projector in full, as in SFT and DPO (`adapt_vision_model`). Datasets with images need a trainer that takes
    them, such a model and its processor, and the transformers generation backend; anything else is refused here,
    before training."""
    name = type(trainer).__name__
    evals = list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]
    with_images = [d for d in [train_dataset, *evals] if d is not None and is_vision_dataset(d)]
    vision_model = (
        is_vision_checkpoint(model, args.trust_remote_code) if isinstance(model, str) else is_vision_model(model)
    )
    if processing_class is None:
        processing_class = (
            load_processor(model, args.trust_remote_code) if vision_model and with_images else load_tokenizer(model)
        )
    if vision_model:
        peft_config = None if peft_config is None else copy.copy(peft_config)  # completed for this model only
        freeze = args.freeze_vision_tower
        if isinstance(model, str):  # loaded as a vision-language model, not a causal LM
            trainer.load_model = lambda path, init_kwargs: adapt_vision_model(
                load_vision_model(path, init_kwargs), peft_config, freeze
            )
        else:
            adapt_vision_model(model, peft_config, freeze)
    if not with_images:
        return processing_class, None, peft_config
    if not getattr(trainer, "accepts_images", False):
        raise ConfigError(
            f"{name} does not train on image prompts (GRPOTrainer and RLOOTrainer do); drop the "
            "image column or use one of those trainers."
        )
    if isinstance(model, str) and not vision_model:
        raise ConfigError(
            f"{name}: the dataset has images, but {model!r} is a text-only model (its config has no "
            "vision_config). Train a vision-language model, or drop the image column."
        )
    check_vision_inputs(None if isinstance(model, str) else model, processing_class, with_images[0])
    refused = {
        "use_vllm": "vLLM's multimodal inputs are not wired into posttrain's vLLM backend",
        "use_transformers_continuous_batching": "continuous batching takes no image inputs",
    }
    for option, why in refused.items():
        if getattr(args, option, False):
            raise ConfigError(
                f"{name}: {option}=True cannot generate from image prompts ({why}). Set "
                f"{option}=False to generate with the transformers backend."
            )
    for option, value in (
        ("tools", tools),
        ("rollout_func", rollout_func),
        ("environment_factory", environment_factory),
    ):
        if value:
            raise ConfigError(
                f"{name}: {option} is not supported with image prompts (multi-turn episodes would "
                f"have to carry the images through every turn); drop {option} or the image column."
            )
    return (
        processing_class,
        ImagePrompts(processing_class, args.max_prompt_length, args.chat_template_kwargs),
        peft_config,
    )


class ImagePrompts:
    """Renders, processes and generates from a round's image prompts."""

    def __init__(self, processor, max_prompt_length: int | None, chat_template_kwargs: dict | None = None) -> None:
        self.processor, self.max_prompt_length = processor, max_prompt_length
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.image_ids = sorted(image_token_ids(processor)) if is_processor(processor) else []

    def prepare(self, dataset, name: str, trainer: str):
        """Validates the rows (prompt-only format, placeholders, images); nothing is tokenized ahead."""
        fmt = validate_vision_dataset(dataset, self.processor, ("prompt_only",), trainer, name)
        if fmt.conversational:
            require_chat_template(self.processor, "conversational prompts")
        return dataset

    def render(self, row: dict) -> str:
        prompt = row[PROMPT_COLUMN]
        if not is_message_list(prompt):
            return prompt
        messages = prepare_multimodal_messages(prompt, row_images(row))
        rendered = apply_chat_template({PROMPT_COLUMN: messages}, self.processor, **self.chat_template_kwargs)
        return rendered[PROMPT_COLUMN]

    def process(self, rows: list[dict]) -> tuple[list[list[int]], list[dict]]:
        """Each row's prompt ids (image tokens expanded) and its image inputs (`split_vision_inputs`, plus the
        unpadded per-token inputs such as token_type_ids)."""
        images = [[open_image(image) for image in row_images(row)] for row in rows]
        conversational = is_message_list(rows[0][PROMPT_COLUMN])
        out = self.processor(
            text=[self.render(row) for row in rows],
            images=images if any(images) else None,
            padding=True,
            padding_side="left",
            add_special_tokens=not conversational,
            return_tensors="pt",
        )
        parts = split_vision_inputs(out, [len(i) for i in images])
        prompt_ids = []
        for r, part in enumerate(parts):
            keep = out["attention_mask"][r].bool()
            ids = out["input_ids"][r][keep].tolist()
            tokens = {k: out[k][r][keep] for k in TOKEN_INPUTS if k in out}
            if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
                cut = len(ids) - self.max_prompt_length
                if set(ids[:cut]) & set(self.image_ids):
                    raise DataError(
                        f"max_prompt_length={self.max_prompt_length} would cut image tokens off a prompt "
                        f"of {len(ids)} tokens while its image stays; raise max_prompt_length or set it "
                        "to None."
                    )
                ids, tokens = ids[cut:], {k: v[cut:] for k, v in tokens.items()}
            if not ids:
                raise DataError("A prompt is empty after processing; generation needs at least one prompt token.")
            prompt_ids.append(ids)
            part.update(tokens)
        return prompt_ids, parts

    def generate(self, backend, rows: list[dict], n: int, sampling, seeds) -> list[Episode]:
        """`n` single-turn episodes per row, prompt-major, each carrying its prompt's ids and image inputs."""
        prompt_ids, parts = self.process(rows)
        completions = backend.generate(prompt_ids, n, sampling, seeds, vision=parts, suppress_tokens=self.image_ids)
        episodes = []
        for i, completion in enumerate(completions):
            episode = Episode.single_turn(completion)
            episode.prompt_ids, episode.vision = prompt_ids[i // n], parts[i // n]
            episodes.append(episode)
        return episodes


def forward_vision_inputs(batch: dict, model) -> dict:
    """The image inputs of a rollout batch for `model`'s forward: on its device, pixels in its dtype."""
    parameter = next(model.parameters())
    out = {}
    for key in VISION_INPUTS:
        if key in batch:
            value = batch[key].to(parameter.device)
            out[key] = value.to(parameter.dtype) if key.startswith("pixel_values") else value
    return out


def uses_own_positions(inputs: dict) -> bool:
    """Qwen2-VL-style models compute their multimodal rope positions themselves: no position_ids for them."""
    return "image_grid_thw" in inputs or "video_grid_thw" in inputs
