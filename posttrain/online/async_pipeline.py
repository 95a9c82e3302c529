"""What TRL's two asynchronous trainers (async_grpo, async_distillation) share, mapped onto the online engine's
asynchronous producer (posttrain/online/producers/thread.py): the rollout-pipeline and vLLM-server fields, their
checks, the model's `dtype`, and the refusal of TRL's worker objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.errors import ConfigError
from posttrain.training.fields import config_field, max_completion_length_field

DTYPES = ("auto", "bfloat16", "float16", "float32")

# Pipeline fields of TRL's that have no counterpart here: only their defaults are accepted.
PIPELINE_UNSUPPORTED = {
    "request_timeout": "posttrain's vLLM client bounds every request by vllm_server_timeout; set that instead.",
    "weight_sync_timeout": "weights reach posttrain's vLLM server as files, a request bounded by "
    "vllm_server_timeout; set that instead.",
    "max_inflight_tasks": "the producer generates whole rounds, at most max_staleness of them ahead; bound the work in "
    "flight with max_staleness.",
    "queue_maxsize": "the queue holds at most max_staleness rounds of samples; bound it with max_staleness.",
    "heartbeat_stale_after_s": "the generation thread lives in the training process and its failure is raised in "
    "the training loop at once; there is no separate worker to watch.",
}


@dataclass
class AsyncPipelineFields:
    """TRL's fields of the asynchronous rollout pipeline (a mixin of the configs)."""

    async_rounds_option: ClassVar[str] = "max_staleness"  # errors name TRL's option (OnlineConfig's attribute)

    dtype: str = config_field(
        "float32",
        f"Precision the model is loaded in when given by name, one of {DTYPES} (a dtype in model_init_kwargs wins); "
        "serve the vLLM server in the same one.",
        choices=DTYPES,
    )
    max_completion_length: int = max_completion_length_field(2048)
    # TRL's default (its async configs keep TrainingArguments' True, which trims each rollout sample to the keys its
    # collator reads). posttrain's engine builds its batches from the rollout and reads each dataset row itself: the
    # loss is the same either way, and every column reaches the reward functions, as TRL's rollout worker passes them.
    remove_unused_columns: bool = config_field(
        True,
        "TRL: drop rollout fields the collator does not read. The loss is the same either way, and every dataset "
        "column reaches the reward functions (as in TRL).",
    )
    logging_steps: float = config_field(1, "Log every N optimizer steps.")
    use_vllm: bool = config_field(
        True,
        "Sample with the vLLM server at vllm_server_base_url (as TRL's trainer does); False samples with a "
        "copy of the policy through transformers.",
    )
    vllm_mode: str = config_field("server", "'server' (asynchronous generation needs it).")
    vllm_server_base_url: str | None = config_field(
        "http://localhost:8000", "URL of the vLLM server that samples the completions (`posttrain vllm-serve MODEL`)."
    )
    request_timeout: int = config_field(
        600, "TRL: seconds per HTTP request (posttrain: vllm_server_timeout bounds them; only the default)."
    )
    weight_sync_timeout: int = config_field(
        1800, "TRL: seconds a weight transfer may take (posttrain: vllm_server_timeout; only the default)."
    )
    token_budget: int | None = config_field(
        None,
        "TRL: tokens per packed micro-batch row. posttrain always trains per_device_train_batch_size "
        "completions per micro-batch (TRL's token_budget <= 0); a positive budget is refused.",
    )
    max_inflight_tasks: int = config_field(
        -1, "TRL: concurrent generation requests (posttrain generates whole rounds; only -1, auto)."
    )
    max_staleness: int = config_field(
        4,
        "Rounds generated ahead of the one training: a rollout is sampled with weights at most this many "
        "rounds (optimizer steps, with steps_per_generation=1) old. 0: each round with its own weights.",
        min=0,
    )
    queue_maxsize: int = config_field(
        1024, "TRL: samples buffered (posttrain holds at most max_staleness rounds; only the default)."
    )
    weight_sync_steps: int = config_field(
        1, "Optimizer steps between two refreshes of the sampler's weights (pushes to the vLLM server).", min=1
    )
    heartbeat_stale_after_s: float = config_field(
        300.0,
        "TRL: seconds without a worker heartbeat before aborting (posttrain: no separate worker; only the default).",
    )

    def resolve_async_pipeline(self) -> None:
        """Checks the pipeline fields and maps them onto the engine's (before OnlineConfig's own checks)."""
        if self.token_budget is not None and self.token_budget > 0:
            raise ConfigError(
                f"token_budget={self.token_budget}: posttrain does not pack micro-batches by a token "
                "budget; it trains per_device_train_batch_size completions per micro-batch (TRL's "
                "token_budget <= 0). Leave token_budget at None or set it <= 0."
            )
        for own, trl_name, default in (
            ("async_generation_rounds", "max_staleness", None),
            ("vllm_sync_steps", "weight_sync_steps", 1),
        ):
            if getattr(self, own) not in (default, getattr(self, trl_name)):
                raise ConfigError(
                    f"{own}={getattr(self, own)} and {trl_name}={getattr(self, trl_name)} set the same "
                    f"thing here; set only {trl_name}."
                )
        self.async_generation_rounds, self.vllm_sync_steps = self.max_staleness, self.weight_sync_steps


def refuse_trl_workers(trainer: str, rollout_worker, weight_transfer) -> None:
    """TRL's asynchronous trainers take a worker process and a weight-transfer object; posttrain has neither."""
    for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
        if value is not None:
            raise ConfigError(
                f"{trainer}({name}=...) plugs a TRL worker process into TRL's trainer; posttrain "
                "generates in its own thread (on a vLLM server with use_vllm=True). Drop "
                f"{name}."
            )


def apply_dtype(model, args) -> None:
    """TRL's `dtype` field: the precision of a model loaded by name (a dtype in model_init_kwargs wins)."""
    if isinstance(model, str):
        args.model_init_kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
    elif args.dtype != "float32":
        raise ConfigError(
            f"dtype={args.dtype!r} applies when the model is given by name; the model passed is loaded "
            "already. Convert it (model.to(dtype)) or pass its name."
        )
