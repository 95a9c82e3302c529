"""What every posttrain trainer shares: model and tokenizer loading, PEFT wrapping, dataset
preparation with datasets' fingerprint cache, and metrics that are averaged over the logging window
and across processes. The training loop, checkpointing and logging are transformers' `Trainer`."""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments

from posttrain.data.report import DataReportCallback
from posttrain.errors import ConfigError, DataError
from posttrain.models.fused_layers import rebuilt_activations
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.runtime.distributed import (
    fsdp_on_cpu,
    refuse_unlaunched_multiprocess_config,
    save_full_model_under_fsdp,
    shard_frozen_models,
    unwrap_without_importing_deepspeed,
    use_gloo_on_cpu,
)
from posttrain.runtime.gc_freeze import freeze_import_time_objects
from posttrain.runtime.kernel_cache import bound_kernel_caches
from posttrain.training.checkpoints import CheckpointMixin
from posttrain.training.device_paths import resolve_bf16, resolve_fused_layers
from posttrain.training.fields import check_options, config_field
from posttrain.training.guards import NONFINITE_POLICIES, GuardMixin
from posttrain.training.metric_values import as_floats
from posttrain.training.model_card import method_name, tag_model, write_model_card
from posttrain.training.model_setup import prepare_model, seed_before_model
from posttrain.training.optimizer_state import allocate_adam_states_together
from posttrain.training.run_artifacts import RunArtifactsCallback
from posttrain.training.streaming import prepare_datasets

logger = logging.getLogger("posttrain")
freeze_import_time_objects()  # the imports above out of every later full collection (runtime/gc_freeze.py)
bound_kernel_caches()  # before the first oneDNN kernel is compiled (runtime/kernel_cache.py)


def _accelerator_available() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class PosttrainConfig(TrainingArguments):
    """Settings shared by every posttrain config (on top of `transformers.TrainingArguments`).

    `unsupported_options` maps a field that cannot work on this stack to the reason: a value other than the
    field's default stops the run when the config is built (a TRL option is never silently ignored).
    """

    unsupported_options: ClassVar[dict[str, str]] = {}

    model_init_kwargs: dict | str | None = config_field(
        None,
        "Keyword arguments for from_pretrained when `model` is a string, e.g. {'dtype': 'bfloat16', "
        "'attn_implementation': 'sdpa'}.",
    )
    trust_remote_code: bool = config_field(
        False,
        "Run the model's and tokenizer's own code from the hub or a local folder when it is given by name "
        "(only for sources you trust).",
    )
    dataset_num_proc: int | None = config_field(None, "Processes for dataset preprocessing.")
    logging_steps: float = config_field(10, "Log every N optimizer steps.")
    # TRL turns it on; posttrain only with an accelerator: on a CPU it only costs time (docs/trl_parity.md).
    gradient_checkpointing: bool | None = config_field(
        None,
        "Recompute activations in the backward pass to save memory (default: on with an accelerator, off on a CPU).",
    )
    bf16: bool | None = config_field(
        None,
        "bfloat16 mixed precision (autocast over float32 weights). Default: on unless fp16 is set, on every device "
        "as in TRL, a CPU included; set bf16=False to train in float32 (docs/trl_parity.md has CPU timings).",
    )
    fused_layers: bool | None = config_field(
        None,
        "Run RMSNorms and gated MLPs (SwiGLU, GeGLU) of any family that computes these formulas as single autograd "
        "functions that keep fewer activations for the backward pass (about 40% fewer; same numbers to rounding), "
        "rebuild norm outputs (and a LoRA MLP's elementwise outputs) in the backward instead of keeping them, and "
        "let a tied input embedding add its gradient into the output layer's in place. Off with use_liger_kernel, "
        "which replaces these layers itself. Default: on where measured (runtime/measured.py: the CPU).",
    )
    activation_offloading: bool = config_field(
        False, "Keep the activations saved for the backward pass in CPU memory (needs an accelerator)."
    )
    nonfinite_policy: str = config_field(
        "error",
        "When a step's loss or gradient norm is NaN or infinite: 'error' stops before applying it, naming the "
        "step and the last checkpoint; 'skip' drops that step's update and counts it.",
        choices=NONFINITE_POLICIES,
    )
    max_nonfinite_steps: int = config_field(
        3, "With nonfinite_policy='skip': stop after this many non-finite steps in a row.", min=1
    )
    checkpoint_on_signal: bool = config_field(
        True,
        "On SIGTERM/SIGINT, finish the current step, save a checkpoint and exit 0 (a second signal exits at once).",
    )
    # Our datasets carry columns the model's forward does not take (masks, sequence lengths): the configs whose
    # trainers name their collator's columns (`_set_signature_columns_if_needed`) default to True, as TRL's.
    remove_unused_columns: bool = config_field(
        False,
        "Drop dataset columns the model's forward does not accept (posttrain's collators need theirs: keep False).",
    )
    write_report: bool = config_field(
        True,
        "At the end of train(), write output_dir/report.html with SVG plots of the logged metrics "
        "(metrics.jsonl is written either way).",
    )

    def __post_init__(self):
        self.reject_unsupported_options()
        check_options(self)  # every field's declared choices and bounds (posttrain/training/fields.py)
        if not math.isfinite(self.learning_rate) or self.learning_rate < 0:  # torch takes inf, and steps once with it
            raise ConfigError(f"learning_rate={self.learning_rate} must be a finite number >= 0 (e.g. 2e-5).")
        if isinstance(self.model_init_kwargs, str):
            import json

            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        on_accelerator = _accelerator_available() and not self.use_cpu
        if self.gradient_checkpointing is None and getattr(self, "activation_checkpointing", None) is None:
            # transformers >= 5.20 calls it activation_checkpointing and mirrors the old name from it
            renamed = any(f.name == "activation_checkpointing" for f in fields(self))
            setattr(self, "activation_checkpointing" if renamed else "gradient_checkpointing", on_accelerator)
        resolve_bf16(self)
        resolve_fused_layers(self)  # and the run's kernel choices checked (training/device_paths.py)
        if self.activation_offloading and not on_accelerator:
            raise ConfigError(
                "activation_offloading=True moves activations from accelerator memory to CPU memory, "
                "but this run trains on the CPU already; set activation_offloading=False."
            )
        check_trackers_installed(self.report_to)
        if self.push_to_hub:
            check_hub_reachable()
        if self.ddp_backend is not None and not _launched_distributed():
            # accelerate fails ("Default process group has not been initialized") when a backend is
            # named in a single process; one config file should serve one and several processes.
            self.ddp_backend = None
        if _launched_distributed():
            use_gloo_on_cpu(self)
        else:
            refuse_unlaunched_multiprocess_config()
        if not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # pinning needs an accelerator; on a CPU it only warns
        super().__post_init__()

    def reject_unsupported_options(self) -> None:
        """Raises ConfigError for the first field of `unsupported_options` set to other than its default."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        for name, reason in self.unsupported_options.items():
            value = getattr(self, name)
            if name in defaults and value != defaults[name]:
                raise ConfigError(
                    f"{type(self).__name__}.{name}={value!r} is not supported by posttrain: {reason} "
                    f"Leave {name} at its default ({defaults[name]!r})."
                )


# report_to name -> (package to import, what to pip install)
TRACKERS = {
    "tensorboard": ("tensorboard", "'posttrain[tensorboard]'"),
    "wandb": ("wandb", "'posttrain[wandb]'"),
    "mlflow": ("mlflow", "'posttrain[mlflow]'"),
    "trackio": ("trackio", "'posttrain[trackio]'"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "neptune": ("neptune", "neptune"),
    "swanlab": ("swanlab", "swanlab"),
    "codecarbon": ("codecarbon", "codecarbon"),
    "azure_ml": ("azureml.core", "azureml-core"),
    "dagshub": ("dagshub", "dagshub"),
    "flyte": ("flytekit", "flytekit"),
}


def check_trackers_installed(report_to) -> None:
    """A tracker named in report_to must be importable: transformers would fail with a traceback mid-set-up."""
    import importlib.util

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in ("none", "all") or name not in TRACKERS:
            continue
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ConfigError(
                f"report_to includes {name!r}, but {module} is not installed: pip install {package} "
                f"(or drop {name!r} from report_to)."
            )


def check_hub_reachable() -> None:
    """push_to_hub needs the hub: refused before training when the hub is switched off or no token is set."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            "push_to_hub=True, but the Hugging Face Hub is switched off here (HF_HUB_OFFLINE=1). "
            "Set push_to_hub=False and upload the saved output_dir later."
        )
    if get_token() is None:
        raise ConfigError(
            "push_to_hub=True needs a Hugging Face token: run `hf auth login` or set HF_TOKEN; or set "
            "push_to_hub=False."
        )


def _launched_distributed() -> bool:
    """Whether this process was started by a distributed launcher (torchrun, accelerate, mpirun)."""
    from accelerate.utils import get_int_from_env

    sizes = ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]
    return get_int_from_env(["LOCAL_RANK"], -1) != -1 or get_int_from_env(sizes, 1) > 1


def setup_router_aux_loss(model, coef: float | None) -> float:
    """The weight of a Mixture-of-Experts model's load-balancing loss (0.0: off), written into its config so that
    its forward returns the loss as `outputs.aux_loss`. `coef` None takes the model's own coefficient."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    is_moe = hasattr(config, "output_router_logits")
    if coef and not is_moe:
        raise ConfigError(
            f"router_aux_loss_coef={coef} weights the load-balancing loss of a Mixture-of-Experts "
            f"model, but {type(model).__name__} has no experts (no router logits). Leave "
            "router_aux_loss_coef unset (None) or at 0."
        )
    weight = float(getattr(config, "router_aux_loss_coef", 0.0) if coef is None else coef) if is_moe else 0.0
    if hasattr(config, "router_aux_loss_coef"):
        config.output_router_logits = weight != 0.0
        config.router_aux_loss_coef = weight
    return weight


def ensure_pad_token(tokenizer) -> None:
    """Batching needs a pad token; without one, use EOS (padding is never trained or attended)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning("The tokenizer has no pad token; using its EOS token %r for padding.", tokenizer.eos_token)


class BaseTrainer(GuardMixin, CheckpointMixin, Trainer):
    """A `transformers.Trainer` with posttrain's model loading, data preparation and metric bookkeeping.

    A subclass says how to turn its datasets into tokenized rows (`prepare_dataset`), which collator
    batches them (`default_collator`), and how the loss is computed (`compute_loss`).
    """

    # How a model given by name or path is loaded; the reward trainer loads a sequence classifier instead.
    load_model = staticmethod(load_causal_lm)
    # True: `eval_dataset` is kept as given (TRL's online trainers do) and prepared when evaluate() reads it.
    prepares_eval_on_use: ClassVar[bool] = False
    # True: construction without a train_dataset stops (TRL's stable trainers require one).
    requires_train_dataset: ClassVar[bool] = False

    def __init__(
        self,
        model: str | PreTrainedModel,
        args: PosttrainConfig,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        data_collator=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        **kwargs: Any,
    ):
        if train_dataset is None and self.requires_train_dataset:
            raise DataError(f"`train_dataset` is required: {type(self).__name__} trains on it.")
        strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
        if eval_dataset is None and (args.eval_on_start or strategy != "no"):
            # transformers would only fail at the first evaluation, possibly after hours of training.
            raise ConfigError(
                f"eval_strategy={strategy!r}, eval_on_start={args.eval_on_start}: evaluation needs an "
                "eval_dataset, and none was given. "
                "Pass eval_dataset=..., or set eval_strategy='no' and eval_on_start=False."
            )
        unwrap_without_importing_deepspeed()
        model_id = model if isinstance(model, str) else model.config._name_or_path
        processing_class = processing_class or load_tokenizer(model_id, trust_remote_code=args.trust_remote_code)
        ensure_pad_token(getattr(processing_class, "tokenizer", processing_class))  # a processor's tokenizer
        seed_before_model(args)
        model = prepare_model(model, args, peft_config, load=self.load_model, quantization_config=quantization_config)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._last_train_window: dict[str, float] = {}
        # map-style datasets prepared whole, streams chunk by chunk as they are read (training/streaming.py)
        train_dataset, eval_dataset = prepare_datasets(self, train_dataset, eval_dataset, processing_class, args)
        self.uses_default_collator = data_collator is None
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or self.default_collator(processing_class, args),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        # Our trainers compute and normalise their own losses (see `effective_batch_mean`): transformers
        # must neither divide by the accumulation steps again nor skip counting the effective batch.
        self.model_accepts_loss_kwargs = True
        self._init_guards()
        self.add_callback(DataReportCallback(self))  # what data preparation cut or dropped, before training
        self.add_callback(RunArtifactsCallback(self))  # metrics.jsonl, report.html, README.md model card
        tags = getattr(self, "_tag_names", None) or ["trl", method_name(self).lower().replace(" ", "-")]
        tag_model(self.model, ["posttrain", *tags])

    def create_accelerator_and_postprocess(self):
        with fsdp_on_cpu():  # an FSDP launch config shards on a CPU too (posttrain/runtime/distributed.py)
            super().create_accelerator_and_postprocess()
        shard_frozen_models(self.accelerator)

    def compute_loss_context_manager(self):
        """transformers' context of every forward that computes a loss; here fused norms' outputs are also saved as
        recipes for the backward (`models/fused_layers.py`), except where the norm weight is sharded (FSDP,
        DeepSpeed) or activations are offloaded (other saved-tensor hooks)."""
        stack = contextlib.ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        recompute = (
            self.args.fused_layers
            and not self.args.activation_offloading
            and not self.is_fsdp_enabled
            and not self.is_deepspeed_enabled
        )
        stack.enter_context(rebuilt_activations(recompute))
        return stack

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.args.activation_offloading:
            return super().training_step(model, inputs, num_items_in_batch)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return super().training_step(model, inputs, num_items_in_batch)

    def prepare_dataset(self, dataset, tokenizer, args, name: str):
        """Validates and tokenizes a dataset (runs before `Trainer.__init__`)."""
        return dataset

    def default_collator(self, tokenizer, args):
        raise NotImplementedError

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation computes the trainer's own loss (and records its metrics); no logits are kept."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # -- loss normalisation ------------------------------------------------------------------------
    # Each trainer averages its loss over some unit (trained tokens, pairs, examples). Dividing every
    # micro-batch's *sum* by the count over the whole effective batch (all accumulation steps and
    # processes) makes batch 8 x accumulation 1 and batch 1 x accumulation 8 give the same gradient.
    def count_loss_items(self, batch: dict) -> int | None:
        """How many units the loss averages over in one micro-batch; None leaves it to transformers."""
        return None

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        counts = [self.count_loss_items(b) for b in batch_samples]
        if not counts or counts[0] is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        total = torch.tensor(sum(int(c) for c in counts), device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            total = self.accelerator.gather(total).sum()
        return total

    def effective_batch_mean(self, loss_sum: torch.Tensor, num_items_in_batch, local_count, training: bool):
        """This micro-batch's share of the effective batch's mean loss; the micro-batch mean in evaluation."""
        if training and num_items_in_batch is not None:
            loss = loss_sum / num_items_in_batch
            # DDP averages gradients over processes; the count above already covers all of them.
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes
            return loss
        return loss_sum / max(int(local_count), 1)

    def create_optimizer(self, model=None):
        """transformers' optimizer; Adam's moment buffers then come from one allocation (`optimizer_state.py`),
        except where DeepSpeed or FSDP own the parameters' layout."""
        optimizer = super().create_optimizer(model)
        if not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            allocate_adam_states_together(optimizer)
        return optimizer

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self.last_complete_checkpoint()
            if resume_from_checkpoint is None:
                logger.warning(
                    "resume_from_checkpoint=True but %s holds no complete checkpoint: starting fresh.",
                    self.args.output_dir,
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # -- saving ----------------------------------------------------------------------------------
    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """TRL's method: writes the README.md model card (posttrain/training/model_card.py) into output_dir."""
        if self.is_world_process_zero():
            write_model_card(self, self.args.output_dir, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer.save_model, plus the model card beside the weights when called by the user (checkpoints get
        theirs from RunArtifactsCallback)."""
        if _internal_call or not save_full_model_under_fsdp(self, output_dir or self.args.output_dir):
            super().save_model(output_dir, _internal_call)  # (under sharded FSDP, transformers writes no weights)
        if not _internal_call and self.is_world_process_zero():
            write_model_card(self, output_dir or self.args.output_dir)

    # -- metrics ---------------------------------------------------------------------------------
    def record_metrics(self, values: dict[str, torch.Tensor | float], reduce: str = "mean") -> None:
        """Stores this micro-batch's metrics, averaged (or summed) over all processes."""
        mode = "train" if self.model.training else "eval"
        for key, value in values.items():
            tensor = torch.as_tensor(value, dtype=torch.float32, device=self.accelerator.device).detach().reshape(1)
            gathered = self.accelerator.gather(tensor)
            reduced = gathered.sum() if reduce == "sum" else gathered.mean()
            # training: a device tensor, made a float with the whole window when logged (training/metric_values.py)
            self._metrics[mode][key].append(reduced if mode == "train" else reduced.item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if "loss" in logs or not any(k.startswith("eval_") for k in logs) else "eval"
        prefix = "eval_" if mode == "eval" else ""
        as_floats(self._metrics[mode])  # one host sync per logging window
        window = {prefix + key: sum(values) / len(values) for key, values in self._metrics[mode].items() if values}
        off_schedule = RunArtifactsCallback.logged_final_window_off_schedule(self.args, self.state)
        if "train_runtime" in logs and not window and off_schedule:
            # RunArtifactsCallback logged the final partial window, which TRL's logging schedule skips and its
            # end-of-training summary carries instead: the summary repeats it, so log_history[-1] reads as in TRL
            window = dict(self._last_train_window)
        elif mode == "train" and window:
            self._last_train_window = window
        logs.update({key: value for key, value in window.items() if key not in logs})
        self._metrics[mode].clear()
        super().log(logs, start_time)
