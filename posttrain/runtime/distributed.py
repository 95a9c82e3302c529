"""Running under a distributed launcher on a machine without an accelerator: DDP, FSDP2 and DeepSpeed ZeRO all
work on CPUs over gloo, but accelerate only selects them when it sees GPUs. These hooks make an
`accelerate launch --config_file <ddp|fsdp2|zero2|zero3>.yaml` behave on a CPU as it does on GPUs."""

from __future__ import annotations

import contextlib
import os
import sys

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
        from posttrain.errors import ConfigError

        raise ConfigError(
            f"accelerate's default config ({default_config_file}) asks for {processes} processes, but this process "
            "was not started by a launcher, so it would train alone. Start it with `accelerate launch your_script.py "
            "...` (or `accelerate launch --config_file examples/accelerate_configs/ddp.yaml ...`, or `posttrain "
            f"<method> --num_processes {processes} ...`); to train in one process anyway, set {SINGLE_PROCESS_ENV}=1."
        )


def frozen_model_sharding(accelerator) -> str | None:
    """How this run shards frozen models (reference, teacher, reward models): 'zero3' or 'fsdp2' where the engine
    shards the policy's parameters, None where each process holds the policy whole (DDP, ZeRO-1/2), and a full
    copy of a frozen model is what the policy costs too."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        return "zero3"
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp is not None and getattr(fsdp, "fsdp_version", 1) == 2:
        return "fsdp2"
    return None


def shard_frozen_models(accelerator) -> None:
    """Makes `accelerator.prepare_model(model, evaluation_mode=True)` (how posttrain places its reference, teacher
    and reward models) shard the frozen model like the policy under ZeRO-3 and FSDP2; accelerate alone leaves a full
    replica in every process there (FSDP2), or a model created partitioned by zero.Init that is never gathered and
    whose forward fails (ZeRO-3). A model an engine already holds (DTensor parameters, a DeepSpeed engine) and
    every training-mode call keep accelerate's own path."""
    sharding = frozen_model_sharding(accelerator)
    if sharding is None:
        return
    prepare = accelerator.prepare_model

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        if not evaluation_mode or _engine_held(model):
            return prepare(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if sharding == "zero3":
            return _zero3_inference_engine(
                model, accelerator.state.deepspeed_plugin.deepspeed_config, accelerator.num_processes
            )
        return _fsdp2_frozen(model, accelerator)

    accelerator.prepare_model = prepare_model


def unwrap_without_importing_deepspeed() -> None:
    """accelerate's `extract_model_from_parallel` (behind every `unwrap_model`) imports DeepSpeed whenever it is
    installed, to test whether the model is a `DeepSpeedEngine`: 137 MB resident and seconds of import in a run that
    never uses it. No model can be an engine before DeepSpeed is imported, so the test is made only once it is."""
    import accelerate.utils.other as other

    installed = getattr(other, "is_deepspeed_available", None)
    if installed is None or getattr(installed, "imported_first", False):
        return

    def imported_and_installed() -> bool:
        return "deepspeed" in sys.modules and installed()

    imported_and_installed.imported_first = True
    other.is_deepspeed_available = imported_and_installed


def _engine_held(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDPModule) or any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def _zero3_inference_engine(model, training_config: dict, num_processes: int):
    """An inference-only ZeRO-3 engine (no optimizer). Parameters below `stage3_param_persistence_threshold`
    elements stay gathered in every process after their first use; DeepSpeed's default (1e5) would keep whole
    matrices of small models gathered, so the threshold is tied to the model's width as TRL does (10 x hidden
    size: norms and biases stay, weight matrices are gathered only while their layer runs)."""
    import deepspeed

    zero = {"stage": 3}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden:
        zero.update(
            stage3_param_persistence_threshold=10 * hidden,  # and prefetch about one weight matrix ahead
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
        )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": num_processes,
        "zero_optimization": zero,
    }
    for precision in ("bf16", "fp16"):  # compute in the policy's precision ("auto" was resolved by the Trainer)
        section = training_config.get(precision) or {}
        if section.get("enabled") is True:
            config[precision] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def _fsdp2_frozen(model, accelerator):
    """`fully_shard` for a model that only runs forward: each decoder layer (the model's `_no_split_modules`, or the
    config's `fsdp_transformer_layer_cls_to_wrap`) is its own unit and the root holds the rest (embeddings, final
    norm, head). Unlike the policy's units, every unit reshards after its forward: without a backward to free
    them, units that stay gathered (accelerate's choice for the policy's root and head) would keep a full copy of
    those weights in every process between steps. Precision, offloading and mesh follow the policy's plugin."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {
        "reshard_after_forward": True,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    if plugin.transformer_cls_names_to_wrap:
        named = set(plugin.transformer_cls_names_to_wrap)
        if any(type(m).__name__ in named for m in model.modules()):  # the policy's layer class, if this has it
            layer_names = named
    for module in list(model.modules())[1:]:
        if type(module).__name__ in layer_names:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    model.eval()
    return model


@contextlib.contextmanager
def root_gathered(model):
    """Keeps an FSDP2 root's own parameters (embeddings, final norm, head: those outside its decoder-layer units)
    gathered for the duration, then frees them; the decoder layers gather and free themselves as usual. Needed
    where code reaches them outside the root's forward: generation that calls a model nested inside the root (PPO's
    policy inside the policy+value wrapper), and log-probs computed from the hidden states with the head's weight
    after the forward (a frozen model's root reshards after its forward). A no-op for other engines."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    state = model._get_fsdp_state()
    # FSDP2 picks its root as the first module to run forward; this must not make a decoder layer the root, so
    # the real root is initialised first (a no-op once it has run a forward).
    state._lazy_init()
    resharding = [g for g in state._fsdp_param_groups if g._reshard_after_forward]
    if resharding:  # its own forward would free them again
        model.set_reshard_after_forward(False, recurse=False)
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
        if resharding:
            model.set_reshard_after_forward(True, recurse=False)


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


def held_parameter_count(model) -> tuple[int, int]:
    """(parameter elements this process holds, elements of the whole model), to check how an engine placed a model:
    a ZeRO-3 partition plus any parameter left gathered (below the persistence threshold), FSDP2's local DTensor
    shards (a unit left unsharded after its forward holds plain full tensors), or everything for a replica."""
    held = full = 0
    for param in model.parameters():
        if hasattr(param, "ds_id"):
            held += param.ds_tensor.numel() + param.data.numel()
            full += param.ds_numel
        else:
            held += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
            full += param.numel()
    return held, full
