"""Which of posttrain's fast paths a loaded model gets, in one line: logged when a trainer prepares its model, and
shown by `posttrain env --model M`. Each path is decided by what the model computes (`computes.py`), so a model of
an unknown family simply gets fewer of them; this line says which."""

from __future__ import annotations

import torch
from torch import nn

from posttrain.models.fast_forward import fast_forward_name
from posttrain.models.fused_layers import FUSED_FORWARDS
from posttrain.models.segment_attention import supports_segment_attention
from posttrain.runtime.measured import MEASURED
from posttrain.runtime.paths import fast_path_on


def _off_here(path: str, device: str) -> str | None:
    """'off (...)' when fast path `path` does not run on `device` (the meta device of `posttrain env --model` stands
    for the CPU)."""
    if fast_path_on(path, "cpu" if device == "meta" else device):
        return None
    where = ", ".join(sorted(MEASURED[path]))
    return f"off on {device} (measured on {where}; POSTTRAIN_FAST_PATHS={path} turns it on)"


def fast_paths(model: nn.Module) -> dict[str, str]:
    """{fast path: what it does for `model`, or "off" and why}."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    fused = sum(getattr(vars(m).get("forward"), "__func__", None) in FUSED_FORWARDS for m in base.modules())
    weight = next(base.parameters(), None)
    device = "cpu" if weight is None else weight.device.type
    forward = _off_here("fast_forward", device) or fast_forward_name(model)
    if forward is None:
        reason = "a PEFT model" if base is not model else "not a recognised causal LM, or hooks, or not sdpa"
        forward = f"off ({reason})"
    segments = _off_here("segment_attention", device) or "off"
    if segments == "off" and supports_segment_attention(model):
        window = getattr(base.config.get_text_config(), "sliding_window", None)
        segments = "on for padding-free rows" + (" (sliding-window layers keep their masks)" if window else "")
    paths = {
        "no-grad forward": forward,
        "fused layers": f"{fused} norms and MLPs" if fused else "off",
        "segment attention": segments,
    }
    experts = getattr(base.config, "_experts_implementation", None)
    if any("experts" in name.rsplit(".", 1)[-1] for name, _ in base.named_modules()) and experts:
        paths["experts"] = experts
    return paths


def describe_fast_paths(model: nn.Module) -> str:
    """'Fast paths for <class>: no-grad forward: ...; fused layers: ...; segment attention: ...'."""
    with torch.no_grad():  # (the no-grad forward is asked as the trainers ask for it)
        paths = fast_paths(model)
    return f"Fast paths for {type(model).__name__}: " + "; ".join(f"{k}: {v}" for k, v in paths.items())
