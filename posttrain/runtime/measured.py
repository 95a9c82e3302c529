"""Where each of posttrain's own fast paths has been measured: the devices on which it was timed against the
plain transformers computation and found faster (and equal to rounding). A path runs only on these devices unless
the user turns it on (`POSTTRAIN_FAST_PATHS`, or `fused_layers=True` in a config); elsewhere the ecosystem's own
kernels run (`posttrain/runtime/paths.py`). Add a device here only with a measurement on the results pages."""

from __future__ import annotations

# path -> device types (torch.device.type) it has been measured on, and where the figures are
MEASURED: dict[str, frozenset[str]] = {
    "fused_layers": frozenset({"cpu"}),  # docs/results.md: fused RMSNorm/MLP activations and step time
    "segment_attention": frozenset({"cpu"}),  # padding-free rows attended one sequence at a time
    "fast_forward": frozenset({"cpu"}),  # the no-grad forward without transformers' per-module wrappers
    "adam_layout": frozenset({"cpu"}),  # Adam's moment buffers from one allocation
}

WHAT = {
    "fused_layers": "fused RMSNorm and gated-MLP autograd functions",
    "segment_attention": "padding-free rows attended one sequence at a time",
    "fast_forward": "no-grad forward without per-module wrappers",
    "adam_layout": "Adam moment buffers in one allocation",
}
