"""A frozen model (a reference, teacher or reward model) placed beside a policy that DeepSpeed or FSDP trains, the
way posttrain's trainers place their own: sharded like the policy under ZeRO-3 and FSDP2, whole in each process
otherwise (runtime/distributed.py). TRL's `prepare_deepspeed` / `prepare_fsdp` names."""

from __future__ import annotations

from posttrain.errors import ConfigError
from posttrain.runtime.distributed import shard_frozen_models


def _prepare_frozen(model, accelerator, plugin: str, name: str):
    if getattr(accelerator.state, plugin, None) is None:
        raise ConfigError(
            f"{name} places a model beside a policy that {plugin.split('_')[0].replace('deepspeed', 'DeepSpeed')} "
            f"trains, but this Accelerator has no {plugin}: launch with that accelerate config, or pass the model "
            "to accelerator.prepare_model(model, evaluation_mode=True) instead."
        )
    if not getattr(accelerator, "posttrain_frozen_sharding", False):
        shard_frozen_models(accelerator)
        accelerator.posttrain_frozen_sharding = True
    return accelerator.prepare_model(model.eval().requires_grad_(False), evaluation_mode=True)


def prepare_deepspeed(model, accelerator):
    """`model`, frozen and placed for inference under the DeepSpeed config of `accelerator` (a ZeRO-3 inference
    engine sharded like the policy under stage 3)."""
    return _prepare_frozen(model, accelerator, "deepspeed_plugin", "prepare_deepspeed")


def prepare_fsdp(model, accelerator):
    """`model`, frozen and placed for inference under the FSDP config of `accelerator` (each decoder layer its own
    unit, resharded after its forward, under FSDP2)."""
    return _prepare_frozen(model, accelerator, "fsdp_plugin", "prepare_fsdp")


__all__ = ["prepare_deepspeed", "prepare_fsdp"]
