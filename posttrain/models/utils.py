"""Model helpers at TRL's `trl.models.utils` import path: a context that turns gradient checkpointing off for a while,
the unwrapped model for generation (parameters gathered under ZeRO-3), and the reference-model constructor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from torch import nn

from posttrain.models.reference import create_reference_model


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


__all__ = [
    "create_reference_model",
    "disable_gradient_checkpointing",
    "get_all_parameters",
    "iter_params",
    "unwrap_model_for_generation",
]
