"""OnlineConfig: the settings shared by the online trainers (GRPO, RLOO, PPO), with their checks.

How the batch sizes relate is described in posttrain/online/engine.py's module docstring.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, fields
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.generation import SamplingParams
from posttrain.losses.policy import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, loss_type_help
from posttrain.online.generation_batch import resolve_generation_batch
from posttrain.online.rollout_fields import RolloutBackendFields
from posttrain.rewards.scoring import FAILURE_POLICIES
from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import (
    config_field,
    disable_dropout_field,
    learning_rate_field,
    max_completion_length_field,
    max_prompt_length_field,
    num_completions_to_print_field,
    num_generations_eval_field,
    ref_model_mixup_alpha_field,
    ref_model_sync_steps_field,
    router_aux_loss_coef_field,
    sync_ref_model_field,
    vllm_max_model_length_field,
    vllm_mode_field,
    vllm_model_impl_field,
)
from posttrain.training.vision import freeze_vision_tower_field

logger = logging.getLogger("posttrain")

# generation_kwargs keys that have a config field of their own (the trainer reads the field too: the
# temperature scales the training log-probs, max_completion_length normalises dr_grpo, ...); such a key becomes the
# field's value when the field is left at its default.
GENERATION_KWARGS_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_completion_length",
    "max_tokens": "max_completion_length",
    "n": "num_generations",
    "num_return_sequences": "num_generations",
    "cache_implementation": "cache_implementation",
}
# generation_kwargs keys the engine sets itself, with the reason.
GENERATION_KWARGS_FIXED = {
    "num_beams": "beam search returns the best beams, not samples from the policy",
    "eos_token_id": "the stop tokens come from the tokenizer and the model's generation_config",
    "stop_token_ids": "the stop tokens come from the tokenizer and the model's generation_config",
    "pad_token_id": "padding is the tokenizer's pad token",
    "max_length": "the length limit is max_completion_length",
    "logprobs": "the engine asks vLLM for the sampled tokens' log-probs itself",
    "detokenize": "completions stay token ids",
    "seed": "each completion is seeded from the config's seed (per round, process and completion); set seed=...",
}


def take_generation_kwargs_fields(config, field_of: dict[str, str]) -> None:
    """A generation_kwargs key that is a config field of its own (top_k, temperature, ...) becomes that field's value
    when the field is left at its default (one info line says so); both set to different values is refused."""
    defaults = {f.name: f.default for f in fields(config)}
    config.generation_kwargs = dict(config.generation_kwargs)  # the caller's dict is left as it was
    taken = []
    for key in [k for k in config.generation_kwargs if k in field_of]:
        name, value = field_of[key], config.generation_kwargs[key]
        current = getattr(config, name)
        if current != value and current != defaults.get(name):
            raise ConfigError(
                f"generation_kwargs[{key!r}]={value!r} disagrees with {name}={current!r}; set one of them "
                f"(generation_kwargs[{key!r}] is the config's {name})."
            )
        setattr(config, name, value)
        del config.generation_kwargs[key]
        taken.append(f"{name}={value!r}")
    if taken:
        logger.info("generation_kwargs keys with a config field of their own taken as %s.", ", ".join(taken))


@dataclass
class OnlineConfig(RolloutBackendFields, PosttrainConfig):
    """Settings shared by the online trainers. See the module docstring for how the batch sizes relate."""

    min_num_generations: ClassVar[int] = 1
    unsupported_options: ClassVar[dict[str, str]] = {
        **PosttrainConfig.unsupported_options,
        "ds3_gather_for_generation": "it only applies to DeepSpeed ZeRO-3, which posttrain does not run; keep it True",
        "vllm_tensor_parallel_size": "colocated vLLM runs on the trainer's one device in posttrain (tensor "
        "parallelism needs several GPUs); keep 1, or serve a tensor-parallel model "
        "with `posttrain vllm-serve MODEL -- --tensor-parallel-size N` and "
        "vllm_mode='server'",
        "log_completions_hub_repo": "pushing completions needs the Hugging Face Hub, which posttrain does not "
        "reach; log_completions=True writes them to output_dir/completions.jsonl",
    }
    method: ClassVar[str] = "the online trainer"  # how error messages name the method
    # The option that turns generation ahead on, as errors name it (TRL's asynchronous configs: max_staleness).
    async_rounds_option: ClassVar[str] = "async_generation_rounds"

    learning_rate: float = learning_rate_field(1e-6)
    freeze_vision_tower: bool = freeze_vision_tower_field()  # as SFTConfig / DPOConfig (posttrain/data/vision.py)
    # Generation
    max_prompt_length: int | None = max_prompt_length_field(
        None,
        "Keep only the last this-many prompt tokens; the data report counts the rows cut (None, the default as "
        "in TRL: no cut, and a prompt longer than the model's context is an error naming its row).",
    )
    max_completion_length: int = max_completion_length_field(512)
    num_generations: int = config_field(8, "Completions sampled per prompt (a group).")
    num_generations_eval: int | None = num_generations_eval_field(
        "Completions sampled per eval prompt (None: num_generations)."
    )
    shuffle_dataset: bool = config_field(
        True,
        "Take the training prompts in a new random order each epoch (seeded by data_seed or seed); False "
        "keeps the dataset's order.",
    )
    pad_to_multiple_of: int | str | None = config_field(
        "auto",
        "Pad the prompt and completion widths of the training batches to a multiple of this; 'auto' is 128 on "
        "Neuron (Trainium) and no padding elsewhere, None is no padding.",
    )
    temperature: float = config_field(
        1.0,
        "Sampling temperature (> 0; 0: greedy decoding, as generation_kwargs={'do_sample': False}, with the "
        "training log-probs at temperature 1).",
    )
    top_p: float = config_field(
        1.0, "Nucleus sampling: keep the most likely tokens whose probabilities add up to top_p (1.0: off)."
    )
    top_k: int = config_field(0, "Keep only the top_k most likely tokens (0: off).")
    min_p: float | None = config_field(
        None, "Drop tokens less likely than min_p times the most likely one (None or 0: off)."
    )
    generation_kwargs: dict | str | None = config_field(
        None,
        "More sampling settings (a JSON object): GenerationConfig fields for transformers' generate (e.g. "
        "suppress_tokens, no_repeat_ngram_size), vLLM SamplingParams fields with use_vllm (e.g. "
        "presence_penalty).",
    )
    chat_template_kwargs: dict | str | None = config_field(
        None,
        "Keyword arguments for the chat template when rendering conversational prompts (a JSON object, e.g. "
        '{"enable_thinking": false}).',
    )
    repetition_penalty: float = config_field(1.0, "Penalty on tokens already in the prompt or completion (1.0: off).")
    cache_implementation: str | None = config_field(
        None,
        "KV cache of transformers' generate, e.g. 'static' or 'offloaded' (None: the model's default); not "
        "used with use_vllm.",
    )
    use_transformers_continuous_batching: bool = config_field(
        False, "Generate with transformers' continuous batching engine (generate_batch) instead of generate."
    )
    transformers_continuous_batching_config: dict | str | None = config_field(
        None, "Keyword arguments of transformers' ContinuousBatchingConfig (a JSON object)."
    )
    use_transformers_paged: bool = config_field(False, "Deprecated name of use_transformers_continuous_batching.")
    ds3_gather_for_generation: bool = config_field(True, "DeepSpeed ZeRO-3: gather the sharded weights for generation.")
    steps_per_generation: int | None = config_field(
        None,
        "Micro-batches trained on each generated batch before the next one is generated, as in TRL (default "
        "gradient_accumulation_steps: one optimizer step a round; a multiple of it), or derived from "
        "generation_batch_size.",
        min=1,
    )
    generation_batch_size: int | None = config_field(
        None,
        "Completions generated per round over all processes: per_device_train_batch_size x processes x "
        "steps_per_generation, as in TRL. Set this or steps_per_generation.",
    )
    async_generation_rounds: int | None = config_field(
        None,
        "Generate the training rounds in a background thread, up to this many rounds ahead of the one "
        "training (k: a round is sampled with weights at most k rounds old, corrected with "
        "vllm_importance_sampling_*; 0: each round with its own weights). None: generate in the training "
        "loop.",
        min=0,
    )
    num_iterations: int = config_field(
        1,
        "Passes over each generated batch (mu in the GRPO paper); > 1 reuses completions with importance "
        "ratios to the generating policy.",
        min=1,
    )
    # Rewards
    reward_weights: list[float] | None = config_field(None, "One weight per reward function (default: all 1.0).")
    reward_timeout_s: float = config_field(60.0, "Seconds an async reward function may take per batch.")
    # Loss
    loss_type: str = config_field("dapo", loss_type_help(LOSS_TYPES), choices=LOSS_TYPES)
    router_aux_loss_coef: float | None = router_aux_loss_coef_field(
        "Weight of a Mixture-of-Experts model's load-balancing loss, added to the policy loss (None: the "
        "model's own router_aux_loss_coef).",
    )
    beta: float = config_field(0.0, "KL coefficient to the reference model (0: no reference model is loaded).", min=0)
    epsilon: float = config_field(0.2, "Lower clip range of the importance ratio.")
    epsilon_high: float | None = config_field(
        None, "Upper clip range (default: epsilon; DAPO's clip-higher uses 0.28)."
    )
    importance_sampling_level: str = config_field(
        "token",
        "'token' ratios, or 'sequence' (GSPO: one length-normalised ratio per completion).",
        choices=IMPORTANCE_SAMPLING_LEVELS,
    )
    mask_truncated_completions: bool = config_field(
        False, "Leave completions cut at max_completion_length out of the loss (DAPO)."
    )
    disable_dropout: bool = disable_dropout_field(
        False,
        "Switch dropout off in the policy (and so in its reference copy): the log-probs of a completion then "
        "do not depend on the forward pass.",
    )
    sync_ref_model: bool = sync_ref_model_field(
        "TR-DPO: every ref_model_sync_steps optimizer steps, move the reference towards the policy (needs beta > 0)."
    )
    ref_model_mixup_alpha: float = ref_model_mixup_alpha_field(
        "With sync_ref_model: ref <- alpha * policy + (1 - alpha) * ref."
    )
    ref_model_sync_steps: int = ref_model_sync_steps_field(
        "With sync_ref_model: optimizer steps between two reference updates."
    )
    max_tool_calling_iterations: int | None = config_field(
        None,
        "With tools= or environment_factory=: most tool turns per completion (None: until the model stops "
        "calling tools or max_completion_length is reached).",
    )
    reward_failure_policy: str = config_field(
        "error",
        "What a reward function that raises, times out or returns a non-finite value does: 'error' stops the "
        "run naming it and the sample; 'skip' gives no reward from it for that batch and counts it in "
        "rewards/<name>/failures.",
        choices=FAILURE_POLICIES,
    )
    tool_call_parser: str = config_field(
        "auto",
        "How tool calls are read from a model turn: 'auto' (the tokenizer's response template, as TRL, else the "
        "regex parser its chat template calls for), or a regex parser: 'hermes' (Qwen/Hermes <tool_call>), "
        "'llama3', 'mistral', 'gpt-oss', or a name registered with posttrain.tools.register_parser.",
    )
    tool_timeout_s: float | None = config_field(
        30.0, "Seconds a tool call may take before the model is told it timed out (None: no limit)."
    )
    # Logging
    log_completions: bool = config_field(
        False,
        "Append {step, prompt, completion, reward} lines to output_dir/completions.jsonl at every generation "
        "round, and print the completions of the window at every log.",
    )
    log_multimodal: bool = config_field(
        True, "Log images with the completions (the online trainers take text prompts only, so there are none to log)."
    )
    num_completions_to_print: int | None = num_completions_to_print_field(
        "With log_completions: completions printed at each log, drawn at random (None: all of the window's)."
    )
    log_unique_prompts: bool = config_field(
        False, "With log_completions: print each prompt once (its first completion)."
    )
    log_completions_hub_repo: str | None = config_field(
        None, "Hub dataset repository to push the completions to (not supported: no Hub access)."
    )
    # vLLM generation (docs/vllm.md)
    use_vllm: bool = config_field(False, "Generate with vLLM instead of transformers' generate.")
    vllm_mode: str = vllm_mode_field(
        "'colocate': vLLM inside the training process; 'server': a vLLM server started with `posttrain vllm-serve`."
    )
    vllm_model_impl: str = vllm_model_impl_field(
        "Colocate mode: vLLM's own model code ('vllm') or transformers' ('transformers')."
    )
    vllm_structured_outputs_regex: str | None = config_field(
        None, "Constrain every completion to match this regex (vLLM structured outputs; None: off)."
    )
    vllm_server_base_url: str | None = config_field(
        None,
        "Server mode: the server's URL, e.g. http://10.0.0.2:8000 (default http://vllm_server_host:vllm_server_port).",
    )
    vllm_server_host: str = config_field("0.0.0.0", "Server mode: the server's host.")
    vllm_server_port: int = config_field(8000, "Server mode: the server's port.")
    vllm_server_timeout: float = config_field(
        240.0,
        "Server mode: seconds to wait for the server to come up, or to come back after it went away mid-run, "
        "and for any one request (a generation round included).",
    )
    vllm_group_port: int = config_field(
        51216,
        "Server mode: the port of the NCCL group that sends weights to a server started with `--weight-transfer "
        "nccl` (the trainer's rank 0 listens on it; the server must reach it). Unused when weights go through files.",
    )
    vllm_max_model_length: int | None = vllm_max_model_length_field(
        "Colocate mode: vLLM's context length (None: max_prompt_length + max_completion_length, at most the model's)."
    )
    vllm_tensor_parallel_size: int = config_field(
        1, "Colocate mode: GPUs vLLM splits the model over (only 1 is supported)."
    )
    vllm_sync_dir: str | None = config_field(
        None,
        "Server mode: directory for the weights synced to the server, readable by it under the same path "
        "(default: a temporary directory, right when both run on one machine).",
    )
    vllm_sync_steps: int = config_field(
        1,
        "Push the policy's weights to vLLM every this many optimizer steps (with async_generation_rounds: "
        "refresh the background sampler's weights, with either backend).",
        min=1,
    )
    vllm_importance_sampling_correction: bool = config_field(
        True,
        "Weight each token's loss by min(exp(trainer - vLLM log-prob), cap): corrects for vLLM sampling from "
        "slightly different probabilities (and, with async_generation_rounds, for sampling with older "
        "weights).",
    )
    vllm_importance_sampling_cap: float = config_field(2.0, "Cap of the truncated importance weight (> 0).", gt=0)
    vllm_gpu_memory_utilization: float = config_field(
        0.3,
        "Colocate mode on a GPU: fraction of GPU memory vLLM may take, as in TRL (on a CPU, changing it is an "
        "error: set vllm_kv_cache_gb).",
    )
    vllm_kv_cache_gb: float | None = config_field(
        None,
        "Colocate mode: vLLM's KV cache in GiB instead of vllm_gpu_memory_utilization (None: the fraction on a "
        "GPU, 1 GiB on a CPU; setting both is an error).",
    )
    vllm_enable_sleep_mode: bool = config_field(
        False, "Colocate mode on a GPU: move vLLM's weights and KV cache off the GPU between generation rounds."
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("generation_kwargs", "chat_template_kwargs", "transformers_continuous_batching_config"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, json.loads(getattr(self, name)))
        if self.use_transformers_paged:
            warnings.warn(
                "use_transformers_paged is deprecated; use use_transformers_continuous_batching.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        self._check_generation_options()
        self.sampling_params()  # validates the sampling settings
        if self.greedy and self.vllm_importance_sampling_correction:
            logger.info(
                "Greedy generation: vllm_importance_sampling_correction is switched off (a greedy sampler gives "
                "its tokens probability 1, which is no sampling distribution to correct towards)."
            )
            self.vllm_importance_sampling_correction = False
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 1:
            raise ConfigError(
                f"max_tool_calling_iterations={self.max_tool_calling_iterations}: must be at least 1, "
                "or None for no limit."
            )
        in_trainer = self.use_vllm and self.vllm_mode == "colocate" and self.rollout_backend != "ray"
        if self.async_generation_rounds is not None and in_trainer:  # with "ray", vLLM runs in each rollout actor
            raise ConfigError(
                f"async_generation_rounds={self.async_generation_rounds} generates beside training, but colocated "
                "vLLM runs inside the training process on its device; use vllm_mode='server' (`posttrain "
                "vllm-serve MODEL`), or the transformers backend (use_vllm=False)."
            )
        if self.num_generations < self.min_num_generations:
            reason = (
                "; its advantages compare each completion with the others of the same prompt"
                if self.min_num_generations > 1
                else ""
            )
            raise ConfigError(
                f"num_generations={self.num_generations}, but {self.method} needs at least "
                f"{self.min_num_generations} completions per prompt{reason}. Set num_generations >= "
                f"{self.min_num_generations} (typical: 4 to 16)."
            )
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError(
                "sync_ref_model=True updates the reference model, but beta=0 loads none (no KL term); "
                "set beta > 0 or sync_ref_model=False."
            )
        self._resolve_generation_batch()

    def _check_generation_options(self) -> None:
        """Options that only mean something with one generation backend, and generation_kwargs' keys."""
        if not (
            self.pad_to_multiple_of in (None, "auto")
            or (isinstance(self.pad_to_multiple_of, int) and self.pad_to_multiple_of >= 1)
        ):
            raise ConfigError(
                f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive int, 'auto' or None (no padding)."
            )
        if self.use_vllm:
            for name in ("cache_implementation", "use_transformers_continuous_batching"):
                if getattr(self, name):
                    raise ConfigError(
                        f"{name}={getattr(self, name)!r} sets up transformers' generation, but "
                        "use_vllm=True generates with vLLM; drop one of them."
                    )
            if self.vllm_mode == "server":
                for name, flag in (("vllm_model_impl", "--model-impl"), ("vllm_max_model_length", "--max-model-len")):
                    if getattr(self, name) != _DEFAULTS[name]:
                        raise ConfigError(
                            f"{name}={getattr(self, name)!r} applies to colocated vLLM; a vLLM server "
                            f"has its own: start it with `posttrain vllm-serve MODEL -- {flag} ...` "
                            f"and drop {name}."
                        )
        elif self.vllm_structured_outputs_regex is not None:
            raise ConfigError(
                "vllm_structured_outputs_regex constrains vLLM's sampling, but use_vllm=False; set "
                "use_vllm=True or drop the regex."
            )
        if self.transformers_continuous_batching_config and not self.use_transformers_continuous_batching:
            raise ConfigError(
                "transformers_continuous_batching_config is set but use_transformers_continuous_"
                "batching=False; set it to True or drop the config."
            )
        if self.generation_kwargs is None:
            return
        if not isinstance(self.generation_kwargs, dict):
            raise ConfigError(f"generation_kwargs={self.generation_kwargs!r} must be a dict (a JSON object).")
        for key in self.generation_kwargs:
            if key in GENERATION_KWARGS_FIXED:
                raise ConfigError(
                    f"generation_kwargs[{key!r}] cannot be changed: {GENERATION_KWARGS_FIXED[key]}. Drop it."
                )
        take_generation_kwargs_fields(self, GENERATION_KWARGS_FIELDS)

    def _resolve_generation_batch(self) -> None:
        """steps_per_generation and generation_batch_size in TRL's units (online/generation_batch.py)."""
        resolve_generation_batch(self)

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps trained on one generation round (steps_per_generation counts micro-batches)."""
        return self.steps_per_generation // self.gradient_accumulation_steps

    @property
    def greedy(self) -> bool:
        """Greedy decoding: generation_kwargs={'do_sample': False} or temperature=0 (as in TRL)."""
        return self.temperature == 0 or (self.generation_kwargs or {}).get("do_sample") is False

    @property
    def logps_temperature(self) -> float:
        """The temperature of the training log-probs: the sampling temperature, 1 for temperature=0 (greedy)."""
        return self.temperature if self.temperature != 0 else 1.0

    def sampling_params(self) -> SamplingParams:
        """The sampler's settings; greedy decoding is the arg-max (top_k=1, the other filters cannot change it)."""
        extra = {k: v for k, v in (self.generation_kwargs or {}).items() if k != "do_sample"}
        greedy = self.greedy
        return SamplingParams(
            max_tokens=self.max_completion_length,
            temperature=1.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=1 if greedy else self.top_k,
            min_p=0.0 if greedy else self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            extra=extra,
            regex=self.vllm_structured_outputs_regex,
        )

    # Asynchronous generation in a process of its own (online/producers/process.py)
    async_generation_process: bool | None = config_field(
        None,
        "With async_generation_rounds: sample in a generation process pinned to its own cores (None: for rounds "
        ">= 1 on a CPU machine with at least 2 free cores and the transformers backend, else in a thread; True: "
        "always, or an error saying why not; False: a thread of the training process).",
    )
    async_generation_cores: int | None = config_field(
        None,
        "Physical cores of the generation process (None: half the free cores, rounded down); training keeps the "
        "rest. `posttrain env` shows the split.",
        min=1,
    )
    async_inflight_weight_updates: bool = config_field(
        True,
        "Generation process: take the newest weights before every decode step, without draining the batch (each "
        "token records the version that sampled it). False: each round is sampled with the weights it was "
        "submitted with, which makes runs reproducible.",
    )
    max_staleness: int | None = config_field(
        None,
        "With async_generation_rounds: leave out of the loss the episodes whose oldest token was sampled more than "
        "this many optimizer steps before the step their round starts training at (logged as "
        "sample/dropped_stale). None: no limit.",
        min=0,
    )


_DEFAULTS = {f.name: f.default for f in fields(OnlineConfig)}
