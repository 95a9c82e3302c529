"""How much memory colocated vLLM takes: vllm_gpu_memory_utilization (TRL's setting) on a GPU, or a KV cache of
vllm_kv_cache_gb GiB; never both silently."""

from __future__ import annotations

import dataclasses

from posttrain.errors import ConfigError

__all__ = ["CPU_KV_CACHE_GB", "colocate_memory"]

CPU_KV_CACHE_GB = 1.0  # colocated vLLM's KV cache on a CPU when vllm_kv_cache_gb is None


def colocate_memory(args, device_type: str) -> tuple[float | None, float]:
    """(kv_cache_gb, gpu_memory_utilization) for colocated vLLM on `device_type`. On a GPU,
    vllm_gpu_memory_utilization sizes vLLM's memory as in TRL unless vllm_kv_cache_gb is set, and both changed is
    refused (vLLM would take the KV cache size and drop the fraction). On a CPU there is no GPU memory to share:
    the KV cache is vllm_kv_cache_gb (default 1 GiB), and a changed vllm_gpu_memory_utilization is refused."""
    default = next(f.default for f in dataclasses.fields(args) if f.name == "vllm_gpu_memory_utilization")
    fraction, kv_cache_gb = args.vllm_gpu_memory_utilization, args.vllm_kv_cache_gb
    changed = fraction != default
    if device_type == "cuda":
        if changed and kv_cache_gb is not None:
            raise ConfigError(
                f"vllm_gpu_memory_utilization={fraction} and vllm_kv_cache_gb={kv_cache_gb} both size colocated "
                "vLLM's memory; set one: the fraction of GPU memory (TRL's setting), or vllm_kv_cache_gb=None."
            )
        return kv_cache_gb, fraction
    if changed:
        raise ConfigError(
            f"vllm_gpu_memory_utilization={fraction} sizes vLLM's share of GPU memory, but colocated vLLM runs on "
            f"the {device_type.upper()} here, where its KV cache is vllm_kv_cache_gb (default {CPU_KV_CACHE_GB} "
            "GiB); set vllm_kv_cache_gb=... instead and leave vllm_gpu_memory_utilization at its default."
        )
    return (CPU_KV_CACHE_GB if kv_cache_gb is None else kv_cache_gb), fraction
