"""The helpers of TRL's former experimental trainers that `trl.experimental.utils` still exports: DPO-style padding of
`*_input_ids` / `*_attention_mask` / `*_labels` rows, BOS/EOS insertion into tokenized preference pairs, a reward
model's last-token score, and the PEFT / k-bit preparation of a model. posttrain's own trainers do these in
data/preference.py and training/base.py; these faces keep user code that imports them from TRL working, with
TRL's arguments and results, over posttrain's padding routine (data/batches.pad)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.batches import pad
from posttrain.data.sequence_tensors import first_true_indices
from posttrain.errors import ConfigError
from posttrain.models.reference import is_peft_model

_PADDED_SUFFIXES = ("_input_ids", "_attention_mask", "_labels", "_pixel_values")


def _no_pad_token() -> ConfigError:
    return ConfigError(
        "Padding *_input_ids needs a pad token id, and pad_token_id is None: set tokenizer.pad_token (e.g. to "
        "tokenizer.eos_token) and pass its id."
    )


def _encoder_decoder_value(key: str, pad_token_id: int | None) -> int:
    if key.startswith("prompt") and key.endswith("input_ids"):
        if pad_token_id is None:
            raise _no_pad_token()
        return pad_token_id
    if key.endswith("_attention_mask"):
        return 0
    if key.startswith(("chosen", "rejected", "completion")) or "decoder" in key:
        return -100
    raise ValueError(f"Unexpected key in batch '{key}'")


def _decoder_value(key: str, pad_token_id: int | None) -> int:
    if key.endswith("_input_ids"):
        if pad_token_id is None:
            raise _no_pad_token()
        return pad_token_id
    return -100 if key.endswith("_labels") else 0  # masks and pixel values pad with 0


@dataclass
class DPODataCollatorWithPadding:
    """Pads each `*_input_ids` / `*_attention_mask` / `*_labels` / `*_pixel_values` key to the batch's longest row
    (the prompt's ids and mask on the left, the rest on the right; labels with -100), stacks `*_logps` (cached
    reference log-probs) and keeps any other key as a list."""

    pad_token_id: int = 0
    is_encoder_decoder: bool | None = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for key in features[0]:
            values = [example[key] for example in features]
            if key.endswith(_PADDED_SUFFIXES):
                if self.is_encoder_decoder:
                    value = _encoder_decoder_value(key, self.pad_token_id)
                    batch[key] = pad([torch.as_tensor(v, dtype=torch.long) for v in values], value)
                    continue
                value = _decoder_value(key, self.pad_token_id)
                side = "left" if key in ("prompt_input_ids", "prompt_attention_mask") else "right"
                dtype = torch.float32 if key.endswith("_pixel_values") else torch.int64
                batch[key] = pad([torch.as_tensor(v, dtype=dtype) for v in values], value, side)
            elif key.endswith("_logps"):
                batch[key] = torch.tensor(values)
            else:
                batch[key] = values
        return batch


def _prepend(tokens: dict[str, list[int]], bos_token_id: int, length: int) -> None:
    if length == 0 or tokens["prompt_input_ids"][0] != bos_token_id:
        tokens["prompt_input_ids"] = [bos_token_id, *tokens["prompt_input_ids"]]
        tokens["prompt_attention_mask"] = [1, *tokens["prompt_attention_mask"]]


def add_bos_token_if_needed(
    bos_token_id: int | None,
    prompt_len_input_ids: int,
    prompt_tokens: dict[str, list[int]],
    chosen_prompt_len_input_ids: int,
    chosen_tokens: dict[str, list[int]],
    rejected_prompt_len_input_ids: int,
    rejected_tokens: dict[str, list[int]],
):
    """Puts `bos_token_id` (when not None) in front of each of the three prompts that does not start with it yet."""
    if bos_token_id is not None:
        _prepend(prompt_tokens, bos_token_id, prompt_len_input_ids)
        _prepend(chosen_tokens, bos_token_id, chosen_prompt_len_input_ids)
        _prepend(rejected_tokens, bos_token_id, rejected_prompt_len_input_ids)
    return prompt_tokens, chosen_tokens, rejected_tokens


def add_eos_token_if_needed(eos_token_id: int, chosen_tokens: dict, rejected_tokens: dict):
    """Appends `eos_token_id` (attended) to the chosen and the rejected ids that do not end with it yet (in place)."""
    for tokens in (chosen_tokens, rejected_tokens):
        if not tokens["input_ids"] or tokens["input_ids"][-1] != eos_token_id:
            tokens["input_ids"].append(eos_token_id)
            tokens["attention_mask"].append(1)
    return chosen_tokens, rejected_tokens


def get_reward(model: torch.nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    """A sequence-classification model's scores of right-padded query+response rows: (the score head's output at
    every position, the score at each row's last response token before its first pad after `context_length`, that
    position). Pads are attended as 0 and the positions count real tokens only."""
    mask = query_responses != pad_token_id
    positions = mask.cumsum(1) - mask.long()
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=query_responses.masked_fill(~mask, 0),
        attention_mask=mask,
        position_ids=positions,
        return_dict=True,
        output_hidden_states=False,
        use_cache=False,
    ).last_hidden_state
    scores = model.score(hidden)
    lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rows = torch.arange(scores.size(0), device=scores.device)
    return scores, scores[rows, lengths].squeeze(-1), lengths


def _inputs_require_grad(model) -> None:
    """Gradient checkpointing with reentrant checkpoints needs an input that requires grad."""
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    else:
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_(True))


def prepare_model_for_kbit_training(model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs=None):
    """Freezes every parameter and, for a quantized model (8/4-bit, GPTQ, AQLM, EETQ, torchao, HQQ) with
    `use_gradient_checkpointing`, switches gradient checkpointing on with an input that requires grad."""
    quantized = (
        getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "quantization_method", None) in ("gptq", "aqlm", "eetq", "torchao", "hqq")
        or getattr(model, "hqq_quantized", False)
    )
    for param in model.parameters():
        param.requires_grad = False
    if quantized and use_gradient_checkpointing:
        _inputs_require_grad(model)
        enable = model.gradient_checkpointing_enable
        takes_kwargs = "gradient_checkpointing_kwargs" in inspect.signature(enable).parameters
        kwargs = {"gradient_checkpointing_kwargs": gradient_checkpointing_kwargs or {}} if takes_kwargs else {}
        enable(**kwargs)
    return model


def enable_gradient_checkpointing(model, gradient_checkpointing_kwargs: dict | None):
    """Gradient checkpointing on the model (a PEFT model's base model), with an input that requires grad unless
    `use_reentrant=False` is asked for."""
    (model.base_model if is_peft_model(model) else model).gradient_checkpointing_enable()
    if (gradient_checkpointing_kwargs or {}).get("use_reentrant", True):
        _inputs_require_grad(model)
    return model


def _sharded_qlora(model) -> bool:
    """A 4-bit model whose quantized weights still sit on the CPU or the meta device (FSDP / ZeRO-3 loading)."""
    if not getattr(model, "is_loaded_in_4bit", False):
        return False
    for param in model.parameters():
        if type(param).__name__ == "Params4bit":
            return param.data.device.type in ("cpu", "meta")
    return False


def prepare_peft_model(model, peft_config, args):
    """A model ready for PEFT training: a quantized model prepared for k-bit training (which takes over gradient
    checkpointing: `args.gradient_checkpointing` is set to False), else gradient checkpointing as `args` asks;
    then the adapter from `peft_config`, and with `args.bf16` a 4-bit model's float32 parameters cast to bf16."""
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel) and peft_config is not None:
        raise ConfigError(
            "A PeftModel was passed together with a peft_config: merge and unload the existing adapter, save the "
            "base model, and pass that with the new peft_config."
        )
    sharded = _sharded_qlora(model)
    qlora = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if qlora and not sharded and not isinstance(model, PeftModel):
        model = prepare_model_for_kbit_training(
            model, args.gradient_checkpointing, args.gradient_checkpointing_kwargs or {}
        )
        args.gradient_checkpointing = False
    elif args.gradient_checkpointing:
        model = enable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs)
    if peft_config is not None:
        extra = {"autocast_adapter_dtype": False} if getattr(model, "is_loaded_in_4bit", False) and sharded else {}
        model = get_peft_model(model, peft_config, **extra)
    if args.bf16 and getattr(model, "is_loaded_in_4bit", False) and not sharded:
        for param in model.parameters():
            if param.dtype == torch.float32:
                param.data = param.data.to(torch.bfloat16)
    return model


def peft_module_casting_to_bf16(model) -> None:
    """Norms in float32; the output head and embeddings (lm_head, embed_tokens, wte, wpe) from float32 to bf16."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
            module.to(torch.float32)
        elif any(part in name for part in ("lm_head", "embed_tokens", "wte", "wpe")):
            weight = getattr(module, "weight", None)
            if weight is not None and weight.dtype == torch.float32:
                module.to(torch.bfloat16)


__all__ = [
    "DPODataCollatorWithPadding",
    "add_bos_token_if_needed",
    "add_eos_token_if_needed",
    "enable_gradient_checkpointing",
    "get_reward",
    "peft_module_casting_to_bf16",
    "prepare_model_for_kbit_training",
    "prepare_peft_model",
]
