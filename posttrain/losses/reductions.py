"""Reductions that skip entries: NaN entries (a NaN marks "no value", e.g. a reward function that did not apply),
and masked-out positions (`masked_mean`)."""

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


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values x mask) / sum(mask), over `dim` or all positions; 0 where the mask is empty (the sum of the mask
    is clamped to at least 1, so a mask of fractional weights summing below 1 is not scaled up). The mask may be
    bool, integer or float; the result has the promoted dtype of values x mask."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)
