"""Quantized (bitsandbytes) models in training: what posttrain adjusts after loading one.

On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit layer's weights for a bf16 inference kernel the first
time the layer runs in eval mode without gradients, and keeps that layout: a reference or generation forward of a
QLoRA run would switch every later training forward to a kernel without a backward (no gradient reaches the LoRA
weights before it, silently). Trainers therefore keep the training layout on such layers
(tests/models/test_qlora.py)."""

from __future__ import annotations

from torch import nn


def keep_training_layout(model: nn.Module) -> int:
    """Turns off bitsandbytes' CPU inference repacking on every 4-bit layer of `model`; returns how many."""
    count = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count
