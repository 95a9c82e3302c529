"""Model FLOPs utilisation (MFU): the training FLOPs a model needs per token, and the share of the accelerators'
peak that a measured throughput represents (TRL's `trl.trainer.utils` names).

FLOPs per token follow PaLM's estimate (Chowdhery et al., 2022, appendix B): 6 N for the matrix products of the
forward and backward passes over the N parameters a token goes through (a mixture-of-experts layer counts only its
active experts, an input embedding is a lookup and not counted, a tied output layer shares its matrix with it), plus
12 L H Q T for attention scores and their weighted sum over a T-token sequence (L layers, H heads of size Q).
"""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets), matched against torch's device name.
PEAK_BF16_FLOPS = {
    "B200": 2250e12,
    "H200": 989.5e12,
    "H100": 989.5e12,
    "H800": 989.5e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _moe_layer(config, layer: int) -> bool:
    experts = _get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    if not experts:
        return False
    if layer in (_get(config, "mlp_only_layers", default=[]) or []):
        return False
    if layer < _get(config, "first_k_dense_replace", default=0):
        return False
    return layer % _get(config, "decoder_sparse_step", "moe_layer_freq", default=1) == 0


def active_parameters_per_token(config) -> int:
    """Parameters of the matrix products one token goes through: attention projections, the MLP (the active experts,
    the router and any shared expert of an MoE layer) and an untied output layer."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = _get(config, "head_dim", default=hidden // heads)
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    dense_mlp = 3 * hidden * _get(config, "intermediate_size", default=4 * hidden)
    moe_size = _get(config, "moe_intermediate_size", default=_get(config, "intermediate_size", default=0))
    active = _get(config, "num_experts_per_tok", default=1)
    experts = _get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    shared = _get(config, "shared_expert_intermediate_size", default=0)
    shared += _get(config, "n_shared_experts", default=0) * moe_size
    moe_mlp = active * 3 * hidden * moe_size + hidden * experts + 3 * hidden * shared
    total = 0
    for layer in range(config.num_hidden_layers):
        total += attention + (moe_mlp if _moe_layer(config, layer) else dense_mlp)
    if not getattr(config, "tie_word_embeddings", False):
        total += config.vocab_size * hidden
    return total


def _attention_flops(config, seq_len: int) -> int:
    """Forward and backward FLOPs per token of the attention scores and their weighted sum: 12 L H Q T."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = _get(config, "head_dim", default=config.hidden_size // heads)
    return 12 * config.num_hidden_layers * heads * head_dim * seq_len


def compute_flops_per_token(config, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token of a `seq_len`-token sequence, for a transformers config."""
    return 6 * active_parameters_per_token(config) + _attention_flops(config, seq_len)


def get_peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """The dense peak FLOP/s of the accelerator called `device_name` in half precision ("bf16"/"fp16"), or None when
    the accelerator or the dtype is not listed."""
    if dtype not in ("bf16", "fp16", "bfloat16", "float16"):
        return None
    name = device_name.upper()
    for model, flops in PEAK_BF16_FLOPS.items():  # longer names first where one contains another (L40S before L4)
        if model in name:
            return flops
    return None


def get_peak_flops_per_device(accelerator=None, dtype: str = "bf16") -> float | None:
    """`get_peak_flops` of the CUDA device this process trains on (`accelerator.device`, else the current one); None
    on a CPU."""
    if not torch.cuda.is_available():
        return None
    device = getattr(accelerator, "device", None)
    return get_peak_flops(torch.cuda.get_device_name(device), dtype)


def compute_mfu(
    flops_per_token: float,
    tokens_per_second: float,
    world_size: int = 1,
    peak_flops_per_device: float | None = None,
) -> float | None:
    """MFU in percent: the FLOP/s the throughput (all processes' tokens per second) represents, over the peak of
    `world_size` accelerators. None when the peak is unknown."""
    peak = peak_flops_per_device if peak_flops_per_device is not None else get_peak_flops_per_device()
    if not peak:
        return None
    return 100.0 * flops_per_token * tokens_per_second / (peak * world_size)


def adjusted_mfu(mfu: float, config, seq_len: int) -> float:
    """MFU counting the causal half of the attention scores only: a causal mask leaves half of them unused, which
    `compute_flops_per_token` (like PaLM's formula) counts."""
    full = compute_flops_per_token(config, seq_len)
    return mfu * (full - _attention_flops(config, seq_len) / 2) / full
