"""Running under a distributed launcher on a machine without an accelerator: DDP, FSDP2 and DeepSpeed ZeRO all
work on CPUs over gloo, but accelerate only selects them when it sees GPUs. These hooks make an
`accelerate launch --config_file <ddp|fsdp2|zero2|zero3>.yaml` behave on a CPU as it does on GPUs."""

from __future__ import annotations

import contextlib
import os

import torch


def _accelerator_available() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def use_gloo_on_cpu(args) -> None:
    """Under a launcher on a CPU-only machine, train on the CPU over gloo. Without this accelerate finds no GPU
    backend and every process silently trains alone on its own copy of the data."""
    if not _accelerator_available():
        args.use_cpu = True
        args.ddp_backend = args.ddp_backend or "gloo"


@contextlib.contextmanager
def fsdp_on_cpu():
    """While the Accelerator is built: present a multi-CPU run that `accelerate launch` configured for FSDP as a
    multi-device one, so that accelerate shards the model (torch's `fully_shard` runs on CPUs over gloo) instead
    of silently falling back to plain data parallelism."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState._shared_state
    forced = _env_flag("ACCELERATE_USE_FSDP") and state.get("distributed_type") == DistributedType.MULTI_CPU
    if forced:
        state["distributed_type"] = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        if forced and state.get("distributed_type") == DistributedType.MULTI_GPU:
            state["distributed_type"] = DistributedType.MULTI_CPU


SINGLE_PROCESS_ENV = "POSTTRAIN_SINGLE_PROCESS"


def refuse_unlaunched_multiprocess_config() -> None:
    """Stops a run that accelerate's default config (written by `accelerate config`) sets up for several processes
    but that was started without a launcher: it would otherwise train in one process, silently. Setting
    POSTTRAIN_SINGLE_PROCESS=1 allows it (a notebook on a machine configured for multi-GPU runs)."""
    if _env_flag(SINGLE_PROCESS_ENV):
        return
    from accelerate.commands.config.config_args import default_config_file

    if not os.path.isfile(default_config_file):
        return
    import yaml

    try:
        with open(default_config_file, encoding="utf-8") as handle:
            settings = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError):
        return  # not ours to validate; accelerate reports a broken file when it is launched with it
    processes = settings.get("num_processes") if isinstance(settings, dict) else None
    if isinstance(processes, int) and processes > 1:
        from ..errors import ConfigError

        raise ConfigError(
            f"accelerate's default config ({default_config_file}) asks for {processes} processes, but this process "
            "was not started by a launcher, so it would train alone. Start it with `accelerate launch your_script.py "
            "...` (or `accelerate launch --config_file examples/accelerate_configs/ddp.yaml ...`, or `posttrain "
            f"<method> --num_processes {processes} ...`); to train in one process anyway, set {SINGLE_PROCESS_ENV}=1.")


def shard_frozen_models_under_zero3(accelerator) -> None:
    """Under DeepSpeed ZeRO-3, `accelerator.prepare_model(model, evaluation_mode=True)` (how posttrain places
    reference and teacher models) wraps the frozen model in an inference-only ZeRO-3 engine: its parameters stay
    partitioned like the policy's and are gathered layer by layer in the forward. Without it a model loaded while
    ZeRO-3 is configured is created partitioned (zero.Init) but never gathered, and its forward fails."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        return
    prepare = accelerator.prepare_model

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        if not evaluation_mode:
            return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        return _zero3_inference_engine(model, plugin.deepspeed_config, accelerator.num_processes)

    accelerator.prepare_model = prepare_model


def _zero3_inference_engine(model, training_config: dict, num_processes: int):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": num_processes, "zero_optimization": {"stage": 3}}
    for precision in ("bf16", "fp16"):  # compute in the policy's precision ("auto" was resolved by the Trainer)
        section = training_config.get(precision) or {}
        if section.get("enabled") is True:
            config[precision] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


@contextlib.contextmanager
def gathered_for_generation(model):
    """Around generation: FSDP2 gathers a module's parameters in that module's own forward, but generation may
    call a model nested inside the sharded root (PPO's policy inside the policy+value wrapper) and never run the
    root's forward, so the root's parameters (embeddings, final norm, head) would stay sharded. This gathers them
    before and frees them after; the decoder layers gather themselves as usual. A no-op for other engines
    (ZeRO-3 gathers in each submodule's forward hooks)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    # FSDP2 picks its root as the first module to run forward; generation must not make a decoder layer the
    # root, so the real root is initialised first (a no-op once it has run a forward).
    model._get_fsdp_state()._lazy_init()
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def save_full_model_under_fsdp(trainer, output_dir: str) -> bool:
    """`trainer.save_model` under FSDP with a sharded state dict (the shipped fsdp2.yaml): transformers writes no
    weights there, so an export would be silently empty. This gathers the full state dict (a collective: every
    process calls it) and writes a plain Hugging Face checkpoint that `from_pretrained` loads. Returns whether it
    applied (False for other engines and FULL_STATE_DICT, where transformers already writes full weights)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not trainer.is_fsdp_enabled or plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        return False
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    trainer._save(output_dir, state_dict=state_dict)
    return True
