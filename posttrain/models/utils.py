"""Model helpers at TRL's `trl.models.utils` import path: a context that turns gradient checkpointing off for a while,
the unwrapped model for generation (parameters gathered under ZeRO-3), and the reference-model constructor; and a
fingerprint of a module's weights and a context that switches PEFT adapters (TRL's `trl.trainer.utils` names)."""

from __future__ import annotations

import hashlib
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


def iter_params(module: nn.Module, recurse: bool = False) -> list[nn.Parameter]:
    """The module's parameters (its own, or with `recurse` its submodules' too) as a list."""
    return list(module.parameters(recurse=recurse))


def get_all_parameters(sub_module: nn.Module, recurse: bool = False) -> list[nn.Parameter]:
    """`iter_params`, the name DeepSpeed's hook helpers use."""
    return iter_params(sub_module, recurse)


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
    "get_all_parameters",
    "iter_params",
    "unwrap_model_for_generation",
]
