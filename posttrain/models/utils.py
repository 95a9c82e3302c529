"""Model helpers at TRL's `trl.models.utils` import path: a context that turns gradient checkpointing off for a while,
the unwrapped model for generation (parameters gathered under ZeRO-3), TRL's removal of ZeRO-3's parameter hooks
around generation, and the reference-model constructor; and a fingerprint of a module's weights and a context that
switches PEFT adapters (TRL's `trl.trainer.utils` names)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from posttrain.models.frozen import prepare_deepspeed, prepare_fsdp
from posttrain.models.reference import create_reference_model, is_peft_model


@contextmanager
def disable_gradient_checkpointing(model: nn.Module, gradient_checkpointing_kwargs: dict | None = None) -> Iterator:
    """Turns gradient checkpointing off inside the block and back on after it if it was on (with
    `gradient_checkpointing_kwargs`). A model without checkpointing is left as it is."""
    was_enabled = bool(getattr(model, "is_gradient_checkpointing", False))
    if was_enabled:
        model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        if was_enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)


def get_all_parameters(sub_module: nn.Module, recurse: bool = False) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs of the module (its own, or with `recurse` its submodules' too), then those ZeRO-3
    registered as used by it from elsewhere (`ds_external_parameters`, present on a module under a ZeRO-3 engine)."""
    external = getattr(sub_module, "ds_external_parameters", None)
    return itertools.chain(sub_module.named_parameters(recurse=recurse), external() if external else ())


def iter_params(module: nn.Module, recurse: bool = False) -> list[nn.Parameter]:
    """The parameters of `get_all_parameters`, as a list."""
    return [param for _, param in get_all_parameters(module, recurse)]


def _parameter_offload(model):
    """The object that holds a ZeRO-3 engine's parameter hooks, or None before the engine has an optimizer."""
    if not hasattr(model, "optimizer"):
        return None
    if model.optimizer is None:
        raise RuntimeError("The DeepSpeed engine's optimizer is None: its ZeRO-3 hooks live on the optimizer.")
    return getattr(model.optimizer, "parameter_offload", model.optimizer)


def remove_hooks(model) -> None:
    """Takes a ZeRO-3 engine's forward/backward parameter hooks off (and clears each parameter's active-module
    set), so that a generation loop on gathered parameters does not fetch and release them per module. posttrain's
    own generation gathers the parameters instead (`unwrap_model_for_generation`); this is TRL's helper."""
    offload = _parameter_offload(model)
    if offload is None:
        return
    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def add_hooks(model) -> None:
    """Puts back the hooks `remove_hooks` took off, after invalidating the ZeRO-3 prefetch trace (generation's
    forward passes recorded another module order)."""
    offload = _parameter_offload(model)
    if offload is None:
        return
    coordinator = getattr(offload, "param_coordinator", None)  # ZeRO stage 3 only
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _zero3_engine(model) -> bool:
    config = getattr(model, "zero_optimization_stage", None)
    return callable(config) and config() == 3


@contextmanager
def unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params: bool = True) -> Iterator[nn.Module]:
    """The model inside `accelerator`'s wrapper (DDP, DeepSpeed, FSDP), ready to `generate`. Under DeepSpeed ZeRO-3
    its parameters are gathered for the duration (`gather_deepspeed3_params=False` leaves them sharded: slower
    generation, less memory)."""
    unwrapped = accelerator.unwrap_model(model)
    gather = nullcontext()
    if _zero3_engine(model) and gather_deepspeed3_params:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
    with gather:
        yield unwrapped


def hash_module(module: nn.Module) -> str:
    """A SHA-256 of the module's state: every tensor's name, dtype, shape and bytes, in name order (so the order in
    which submodules were registered does not matter)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@contextmanager
def use_adapter(model, adapter_name: str | None) -> Iterator:
    """Runs the block with the PEFT adapter `adapter_name` active, or with adapters off (None); the adapter that was
    active before is active again afterwards."""
    if adapter_name is None:
        with model.disable_adapter():
            yield
        return
    previous = model.active_adapter
    model.set_adapter(adapter_name)
    try:
        yield
    finally:
        model.set_adapter(previous)


def is_pure_lora_training(model, accelerator=None) -> bool:
    """Whether `model` is a PEFT model whose active adapter is LoRA and whose trainable parameters are all LoRA's
    (so syncing the adapter weights alone syncs everything that trains)."""
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    if not is_peft_model(model):
        return False
    config = model.peft_config.get(model.active_adapter or "default")
    if config is None or str(config.peft_type).rsplit(".", 1)[-1] != "LORA":
        return False
    return all("lora_" in name for name, param in model.named_parameters() if param.requires_grad)


__all__ = [
    "prepare_deepspeed",
    "prepare_fsdp",
    "is_pure_lora_training",
    "create_reference_model",
    "hash_module",
    "use_adapter",
    "disable_gradient_checkpointing",
    "add_hooks",
    "get_all_parameters",
    "remove_hooks",
    "iter_params",
    "unwrap_model_for_generation",
]
