"""Reductions that skip NaN entries (a NaN marks "no value", e.g. a reward function that did not apply)."""

from __future__ import annotations

import torch


def nanstd(tensor: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation of the non-NaN entries (over `dim`, or all); NaN where fewer than two remain."""
    dims = tuple(range(tensor.dim())) if dim is None else (dim if isinstance(dim, tuple) else (dim,))
    present = ~torch.isnan(tensor)
    count = present.sum(dim=dims, keepdim=True)
    mean = torch.nansum(tensor, dim=dims, keepdim=True) / count
    squares = torch.where(present, (tensor - mean) ** 2, torch.zeros_like(tensor))
    std = torch.sqrt(squares.sum(dim=dims, keepdim=True) / (count - 1))
    std = torch.where(count > 1, std, torch.full_like(std, float("nan")))
    return std if keepdim else std.squeeze(dims) if dims else std


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """The smallest non-NaN entry; NaN when every entry is NaN."""
    present = tensor[~torch.isnan(tensor)]
    return present.min() if present.numel() else torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """The largest non-NaN entry; NaN when every entry is NaN."""
    present = tensor[~torch.isnan(tensor)]
    return present.max() if present.numel() else torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
