"""Training metrics without a host sync per micro-batch: `record_metrics` keeps a training metric as a 0-dim tensor
on the device, and the values of a logging window become floats together, in one transfer, when the window is
logged (a `.item()` per metric per micro-batch would make a GPU wait for the step to finish every time; see
tests/runtime/test_host_syncs.py).
Evaluation metrics stay floats (evaluation is not the training loop's hot path)."""

from __future__ import annotations

import torch


def as_floats(window: dict[str, list]) -> None:
    """Replaces every tensor among `window`'s values (in place) by its float, with one device-to-host copy."""
    places = [(values, i) for values in window.values() for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if not places:
        return
    tensors = [values[i].detach().reshape(()).float() for values, i in places]
    devices = {t.device for t in tensors}
    floats = torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if len(devices) == 1 else None
    for k, (values, i) in enumerate(places):
        values[i] = floats[k] if floats is not None else tensors[k].item()
