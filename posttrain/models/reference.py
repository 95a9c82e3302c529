"""The reference model of DPO-style and KL-regularised trainers.

Three ways to have one, from most to least memory:

- a frozen copy of the policy as it was before training (the default);
- a model the user passes (`ref_model`);
- none at all when the policy is a PEFT model: the reference is the policy with its adapter disabled,
  which is exactly the starting point when the adapter starts as a no-op (LoRA's B = 0); or, for a policy
  that arrives with a trained adapter, a frozen copy of that adapter named "ref" (`add_reference_adapter`).

Use `create_reference_model` once at set-up and `reference_forward` around every reference forward:

    ref_model = create_reference_model(policy, user_ref_model, peft=is_peft_model(policy))
    with reference_forward(policy, ref_model) as ref:
        ref_logits = ref(input_ids=...).logits

Reference outputs that are computed once before training can be kept on disk with `cached_tensors`,
keyed by `weights_fingerprint` / `checkpoint_fingerprint` of the reference and a fingerprint of the data.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from posttrain.errors import ConfigError
from posttrain.models.loading import load_causal_lm, resolve_model_path


def is_peft_model(model: nn.Module) -> bool:
    """True for a model wrapped by peft (it can switch its adapter off)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(unwrap(model), PeftModel)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel wrappers (whose `.module` holds it)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode (no dropout) and no gradients: a reference is only ever read."""
    model.eval()
    model.requires_grad_(False)
    return model


def create_reference_model(
    model: nn.Module,
    ref_model: nn.Module | str | None = None,
    *,
    peft: bool = False,
    model_init_kwargs: dict | None = None,
) -> nn.Module | None:
    """Builds the frozen reference model that DPO, KTO and the KL-regularised online trainers compare the policy
    against.

    The reference to use with `model`: `ref_model` (loaded with `model_init_kwargs` if a path or id) frozen;
    else None when `peft` (the adapter-disabled policy serves); else a frozen deep copy of `model`.

    See docs/trainers/dpo.md.
    """
    if ref_model is model:
        raise ConfigError(
            "ref_model is the policy itself, so freezing it would stop training. Omit ref_model "
            "to get a frozen copy of the policy, or pass a separately loaded model."
        )
    if ref_model is not None:
        return freeze(load_causal_lm(ref_model, model_init_kwargs) if isinstance(ref_model, str) else ref_model)
    if peft:
        return None
    return freeze(copy_model(unwrap(model)))


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy; of a model sharded by DeepSpeed ZeRO-3 or FSDP2 (a frozen reward model placed by the trainer), a
    fresh model of its class holding the gathered full weights (a collective: every process calls it), since a deep
    copy would hold only this process's shards and the engine's hooks. Under ZeRO-3 it is built outside zero.Init
    (the trainer partitions it again)."""
    from torch.distributed.tensor import DTensor

    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if not (partitioned or sharded) or not hasattr(model, "config"):
        return copy.deepcopy(model)
    if sharded:
        state = {
            name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in model.state_dict().items()
        }
        return _fresh_copy(model, _unsharded_class(model), state)
    import deepspeed
    from transformers.integrations import deepspeed as hf_deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    saved, hf_deepspeed._hf_deepspeed_config_weak_ref = hf_deepspeed._hf_deepspeed_config_weak_ref, None
    try:
        return _fresh_copy(model, type(model), state)
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _unsharded_class(model: nn.Module) -> type:
    """The model's own class: `fully_shard` swaps it for a subclass that mixes in FSDPModule."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _fresh_copy(model: nn.Module, cls: type, state: dict) -> nn.Module:
    fresh = cls._from_config(model.config, dtype=next(iter(state.values())).dtype)
    fresh.load_state_dict(state)
    if getattr(model, "generation_config", None) is not None:  # a sequence classifier has none
        fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh


# -- a model's weights, whatever engine holds them -----------------------------------------------------
def named_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by their names in the model itself (inside DDP and DeepSpeed engines, which prefix
    them with "module."). They may be ZeRO-3 partitions or FSDP2 DTensor shards: read or change them through
    `gathered_weights`, `full_state_dict` and `load_full_state_dict`."""
    model = unwrap(model)
    if any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__):
        model = model.module
    return dict(model.named_parameters())


@contextmanager
def gathered_weights(params, modify: bool = False) -> Iterator[None]:
    """Makes ZeRO-3 partitioned parameters among `params` whole for the duration (a collective: every process
    enters it); with `modify`, changes made to them are kept (every process must make the same ones). FSDP2
    DTensor shards need no gathering for elementwise updates between models sharded alike, and plain tensors none."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0 if modify else None):
        yield


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full, on the CPU (a collective under ZeRO-3 and FSDP2), by `named_weights`' names."""
    weights = named_weights(model)
    with gathered_weights(weights.values()):
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for name, p in weights.items()
        }


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads full tensors (as `full_state_dict` gives them) into the model, each process keeping its shard."""
    weights = named_weights(model)
    missing = sorted(set(weights) - set(state))
    if missing:
        raise ConfigError(f"The saved weights lack {missing[:3]}: they belong to a different model.")
    with torch.no_grad(), gathered_weights(weights.values(), modify=True):
        for name, param in weights.items():
            value = state[name].to(param.dtype)
            if hasattr(param, "full_tensor"):
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            param.copy_(value)


REFERENCE_ADAPTER = "ref"


def add_reference_adapter(model: nn.Module) -> None:
    """Adds a frozen copy of a PEFT model's "default" adapter under the name "ref": the reference of a policy that
    starts from a trained adapter is that adapter as it was, not the bare base model."""
    peft_model = unwrap(model)
    peft_model.add_adapter(REFERENCE_ADAPTER, peft_model.peft_config["default"])
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".default." in name:
                ref_param = peft_model.get_parameter(name.replace(".default.", f".{REFERENCE_ADAPTER}."))
                ref_param.copy_(param)
                ref_param.requires_grad_(False)


@contextmanager
def _reference_adapter(peft_model):
    """The PEFT model with its "ref" adapter active (if it has one), else with every adapter disabled."""
    if REFERENCE_ADAPTER not in getattr(peft_model, "peft_config", {}):
        with peft_model.disable_adapter():
            yield
        return
    previous = peft_model.active_adapter
    peft_model.set_adapter(REFERENCE_ADAPTER)
    try:
        yield
    finally:
        peft_model.set_adapter(previous)
        for name, param in peft_model.named_parameters():  # set_adapter changes which adapter trains
            if f".{REFERENCE_ADAPTER}." in name:
                param.requires_grad_(False)


@contextmanager
def reference_forward(model: nn.Module, ref_model: nn.Module | None) -> Iterator[nn.Module]:
    """Yields the module that computes reference outputs, in eval mode (no dropout) and under `torch.no_grad`.

    That is `ref_model` (which may be the policy itself, e.g. to precompute reference log-probs before
    training) or, when it is None, the PEFT policy `model` with its "ref" adapter (see `add_reference_adapter`)
    or else with its adapter disabled. The module's training mode is restored afterwards.
    """
    from posttrain.runtime.distributed import root_gathered  # lazily: the trainers import this module

    module = unwrap(model) if ref_model is None else ref_model
    if ref_model is None and not hasattr(module, "disable_adapter"):
        raise TypeError(
            "reference_forward needs a ref_model unless the policy is a PEFT model "
            "(whose adapter can be disabled); create one with create_reference_model."
        )
    was_training = module.training
    module.eval()
    try:
        # an FSDP2-sharded reference keeps its head gathered: log-probs may be computed from it after the forward
        with torch.no_grad(), _reference_adapter(module) if ref_model is None else root_gathered(ref_model):
            yield module
    finally:
        module.train(was_training)


# -- reference log-probs cached on disk ------------------------------------------------------------------
def weights_fingerprint(model: nn.Module, skip_trainable: bool = False, samples_per_tensor: int = 4096) -> str:
    """A hash of the model's parameter names, shapes, dtypes and an evenly spaced sample of each tensor's values.

    Sampling keeps this fast for large models while any training or different checkpoint still changes it.
    `skip_trainable` leaves out trainable parameters (a PEFT adapter, which the adapter-disabled reference
    does not use and whose random initialisation would otherwise change the hash on every run).
    """
    digest = hashlib.sha256()
    for name, param in unwrap(model).named_parameters():
        if skip_trainable and param.requires_grad:
            continue
        flat = param.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // samples_per_tensor)].float().cpu()
        digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}|".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def checkpoint_fingerprint(name_or_path: str) -> str:
    """A model given by name or path, identified without loading it: its resolved path plus the size and
    modification time of its weight files (a name that is not a local directory stands for itself)."""
    path = Path(resolve_model_path(name_or_path))
    if not path.is_dir():
        return name_or_path
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    return f"{path.resolve()}|" + "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def cached_tensors(
    cache_dir: str | os.PathLike, key_parts: dict, compute: Callable[[], dict[str, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], bool]:
    """`compute()`'s tensors, stored in `cache_dir` under a hash of `key_parts` and loaded from there when
    present; returns (tensors, loaded_from_cache). `key_parts` must hold everything the result depends on."""
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
    path = Path(cache_dir).expanduser() / f"{key}.pt"
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True), True
    tensors = {name: t.detach().cpu() for name, t in compute().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(tensors, partial)
    partial.replace(path)  # atomic: a concurrent reader never sees half a file
    return tensors, False
