"""The policy's weights as the vLLM backends send them: under the base model's parameter names (a PEFT adapter
merged for the sync, the trainer's weights left bit-identical), each tensor once, and as one safetensors file for a
server to reload."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import extract_model_from_parallel

from posttrain.models.reference import is_peft_model, unwrap

WEIGHTS_FILE = "model.safetensors"


@contextmanager
def policy_weights(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's current weights as (name, tensor) pairs under the base model's names, valid inside the
    `with` block.

    A PEFT model has its adapter merged into the base weights for the block; afterwards it is unmerged and
    the base weights are restored from a copy, so they are bit-identical (merge-then-unmerge alone leaves
    rounding errors that would accumulate over thousands of syncs). A weight shared by two names (tied
    embeddings) is sent once, under its first name, as in a saved checkpoint.
    """
    model = policy_module(model)
    if not is_peft_model(model):
        yield _unique_tensors(model)
        return
    base = model.get_base_model()
    adapters = set(model.peft_config)
    originals = {name: p.detach().clone() for name, p in base.named_parameters() if ".base_layer." in name}
    with torch.no_grad():
        model.merge_adapter()
        try:
            named = ((_base_name(name, adapters), tensor) for name, tensor in _unique_tensors(base))
            yield [(name, tensor) for name, tensor in named if name is not None]
        finally:
            model.unmerge_adapter()
            parameters = dict(base.named_parameters())
            for name, original in originals.items():
                parameters[name].copy_(original)


def policy_module(model: torch.nn.Module) -> torch.nn.Module:
    """The language model to send: without DDP/accelerate wrappers, and without the critic of a PPO
    policy-and-value model (which keeps the policy as `pretrained_model`)."""
    model = unwrap(extract_model_from_parallel(model))
    return getattr(model, "pretrained_model", model)


def _base_name(name: str, adapters: set[str]) -> str | None:
    """A PEFT state-dict name as the base model calls it, or None for the adapter's own weights."""
    parts = name.split(".")
    if "original_module" in parts:  # modules_to_save keeps the untouched original beside the trained copy
        return None
    if "modules_to_save" in parts:
        index = parts.index("modules_to_save")
        del parts[index : index + 2]  # "modules_to_save.<adapter>": the trained copy is the weight
    elif adapters.intersection(parts):  # lora_A.<adapter>, lora_B.<adapter>, lora_magnitude_vector.<adapter>...
        return None
    return ".".join(part for part in parts if part != "base_layer")


def _unique_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`module`'s state dict with each parameter once, under its first name (tied weights share one). Told apart
    by the parameter object, not the data pointer: an FSDP2 shard (a DTensor) has none, and the choice must be
    the same on every rank."""
    owners = {name: id(p) for name, p in module.named_parameters(remove_duplicate=False)}
    seen: set[int] = set()
    unique = []
    for name, tensor in module.state_dict().items():
        owner = owners.get(name)
        if owner is None or owner not in seen:
            seen.add(owner)
            unique.append((name, tensor.detach()))
    return unique


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole: an FSDP2 shard (a DTensor) is gathered, a collective every rank of the training group must
    call in the same order; any other tensor is itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the policy's parameters are FSDP2 shards (DTensors): then every rank takes part in a sync."""
    return any(hasattr(param, "full_tensor") for param in policy_module(model).parameters())


@torch.no_grad()
def gathered_params(model) -> list[torch.Tensor]:
    """`model`'s parameters in `named_parameters` order (a tied one once), each whole (`full_tensor`): every rank
    of the training group calls it, before any send."""
    return [full_tensor(param) for _, param in model.named_parameters()]


def save_weights(
    weights: Sequence[tuple[str, torch.Tensor]], directory: str | os.PathLike, dtype: torch.dtype | None = None
) -> Path:
    """Writes the weights as one safetensors file into `directory` (floating tensors cast to `dtype`), via a
    temporary name and a rename so that a reader never sees a half-written file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
        for name, t in weights
    }
    staging = directory / (WEIGHTS_FILE + ".partial")
    save_file(tensors, str(staging), metadata={"format": "pt"})
    os.replace(staging, directory / WEIGHTS_FILE)
    return directory / WEIGHTS_FILE
