"""`DistillationConfig`: the settings of teacher-to-student distillation, with TRL's field names, order,
defaults and help."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import generation_config
from posttrain.online.config import GENERATION_KWARGS_FIXED
from posttrain.trainers.sft import SFTConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_completion_length_field,
    num_completions_to_print_field,
    vllm_max_model_length_field,
    vllm_mode_field,
    vllm_model_impl_field,
)

# generation_kwargs keys that override a sampling setting (TRL: they win over the config's fields), and the
# SamplingParams field each sets; other keys go to transformers' GenerationConfig.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
}


@dataclass
class DistillationConfig(SFTConfig):
    """Settings of `DistillationTrainer`: the SFT options plus the teacher, sampling and the divergence (beta, lmbda,
    alpha).

    See docs/trainers/distillation.md.
    """

    unsupported_options: ClassVar[dict[str, str]] = {
        **SFTConfig.unsupported_options,
        "use_vllm": "on-policy completions are sampled with transformers' generate on the student; vLLM sampling "
        "for distillation needs vLLM and a GPU and is not wired here.",
        "ds3_gather_for_generation": "it only applies to DeepSpeed ZeRO-3, which posttrain does not run; generation "
        "always uses the full student weights.",
        "max_tool_calling_iterations": "tool calling runs on the online engine (GRPOTrainer, RLOOTrainer, "
        "PPOTrainer); distillation samples single-turn completions; drop it",
    }
    # TRL's default here (SFTConfig's is True): the generation loop reads the prompt columns
    remove_unused_columns: bool = config_field(
        False, "Drop the dataset columns the model's forward does not accept (keep False: the trainer reads them)."
    )

    learning_rate: float = learning_rate_field(1e-6)
    # -- student and teacher
    teacher_model_name_or_path: str | None = config_field(
        None, "The teacher (hub id, path or built-in name), used when no teacher_model is passed to the trainer."
    )
    teacher_model_revision: str | None = config_field(
        None, "Revision (branch, tag or commit) of a teacher given by name."
    )
    teacher_model_init_kwargs: dict | str | None = config_field(
        None,
        "Keyword arguments for from_pretrained when the teacher is given by name or path, e.g. {'dtype': 'bfloat16'}.",
    )
    disable_dropout: bool = disable_dropout_field(False, "Switch off dropout in the student.")
    # -- data and on-policy generation
    max_completion_length: int | None = max_completion_length_field(
        512, "Most tokens the student samples per on-policy completion."
    )
    ds3_gather_for_generation: bool = config_field(
        True, "DeepSpeed ZeRO-3 only (not run by posttrain): must stay True."
    )
    shuffle_dataset: bool = config_field(True, "Shuffle the training data every epoch.")
    pad_to_multiple_of: int | str | None = config_field(
        "auto",
        "Pad batches to a multiple of this many tokens; 'auto' pads only on Neuron devices (to 128), None never.",
    )
    temperature: float = config_field(
        1.0,
        "Sampling temperature of on-policy completions, and the temperature of both distributions in the loss "
        "(softmax(logits / temperature)).",
        gt=0,
    )
    top_p: float = config_field(1.0, "Nucleus sampling of on-policy completions (1.0: off).")
    top_k: int = config_field(0, "Top-k sampling of on-policy completions (0: off).")
    min_p: float | None = config_field(
        None, "Drop tokens less likely than min_p times the most likely one (None: off)."
    )
    generation_kwargs: dict | str | None = config_field(
        None,
        "More GenerationConfig settings for on-policy sampling; its temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens override the fields.",
    )
    chat_template_kwargs: dict | str | None = config_field(
        None, "Extra keyword arguments for the chat template when rendering prompts."
    )
    repetition_penalty: float = config_field(1.0, "Repetition penalty of on-policy sampling (1.0: none).")
    cache_implementation: str | None = config_field(
        None, "KV cache implementation of transformers' generate (e.g. 'static')."
    )
    use_vllm: bool = config_field(False, "Sample with vLLM (not supported for distillation).")
    vllm_mode: str = vllm_mode_field("vLLM mode (only with use_vllm).")
    vllm_model_impl: str = vllm_model_impl_field("vLLM model implementation (only with use_vllm).")
    vllm_enable_sleep_mode: bool = config_field(False, "vLLM sleep mode (only with use_vllm).")
    vllm_structured_outputs_regex: str | None = config_field(None, "vLLM structured-output regex (only with use_vllm).")
    vllm_server_base_url: str | None = config_field(None, "vLLM server URL (only with use_vllm).")
    vllm_server_host: str = config_field("0.0.0.0", "vLLM server host (only with use_vllm).")
    vllm_server_port: int = config_field(8000, "vLLM server port (only with use_vllm).")
    vllm_server_timeout: float = config_field(240.0, "vLLM server timeout (only with use_vllm).")
    vllm_group_port: int = config_field(51216, "vLLM weight-sync port (only with use_vllm).")
    vllm_gpu_memory_utilization: float = config_field(0.3, "Colocated vLLM GPU memory share (only with use_vllm).")
    vllm_max_model_length: int | None = vllm_max_model_length_field(
        "Colocated vLLM context length (only with use_vllm)."
    )
    vllm_tensor_parallel_size: int = config_field(1, "Colocated vLLM tensor parallelism (only with use_vllm).")
    # -- the loss
    beta: float = config_field(
        1.0,
        "Generalized JSD interpolation: 0 = forward KL(teacher‖student), 0.5 = Jensen-Shannon, 1 = reverse "
        "KL(student‖teacher).",
        min=0,
        max=1,
    )
    lmbda: float = config_field(
        1.0,
        "Probability that a micro-batch's completions are sampled by the student (1: always on-policy, as "
        "TRL; 0: the data's completions only).",
        min=0,
        max=1,
    )
    alpha: float = config_field(
        1.0,
        "Weight of the distillation loss; 1 - alpha weighs the NLL of the completions (1 = pure distillation, "
        "0 = plain SFT).",
        min=0,
        max=1,
    )
    max_tool_calling_iterations: int | None = config_field(
        None, "Not used by distillation (tool calling runs on GRPO, RLOO and PPO): keep None."
    )
    # -- logging
    log_completions: bool = config_field(
        False,
        "Every logging step, save the latest on-policy (prompt, completion) pairs to output_dir/completions/ "
        "and print a sample.",
    )
    num_completions_to_print: int | None = num_completions_to_print_field(
        "How many logged completions to print (None: all)."
    )
    log_unique_prompts: bool = config_field(False, "Print each prompt's completion only once.")

    def __post_init__(self):
        for name in ("teacher_model_init_kwargs", "generation_kwargs", "chat_template_kwargs"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, json.loads(getattr(self, name)))
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.chunked_loss:
            raise ConfigError(
                "chunked_loss=True is not available for distillation: the divergence needs the full "
                "logits of student and teacher. Set chunked_loss=False."
            )
        if self.lmbda > 0 and (self.padding_free or self.packing):
            raise ConfigError(
                f"lmbda={self.lmbda}: on-policy distillation samples completions per row of a padded "
                "batch; set padding_free=False and packing=False (or lmbda=0 for offline distillation)."
            )
        fixed = sorted(set(self.generation_kwargs or {}) & set(GENERATION_KWARGS_FIXED))
        if fixed:
            raise ConfigError(
                f"generation_kwargs[{fixed[0]!r}] cannot be changed: {GENERATION_KWARGS_FIXED[fixed[0]]}. Drop it."
            )
        super().__post_init__()
        if self.pad_to_multiple_of == "auto":  # TRL pads only for Neuron, which compiles once per shape
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        generation_config(self.sampling_params(), [], 0)  # checks the sampling settings before training

    def sampling_params(self) -> SamplingParams:
        """How on-policy completions are sampled: the config's settings, overridden by generation_kwargs."""
        kwargs = self.generation_kwargs or {}
        values = dict(
            max_tokens=self.max_completion_length or 512,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            extra={k: v for k, v in kwargs.items() if k not in _SAMPLING_KEYS},
        )
        values.update({_SAMPLING_KEYS[k]: v for k, v in kwargs.items() if k in _SAMPLING_KEYS})
        return SamplingParams(**values)
