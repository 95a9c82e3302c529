"""Tensor and batch helpers with TRL's names (`trl.trainer.utils`): padding a list of tensors, moving each row's
tokens to the left, splitting and shuffling dicts of per-sample values, and the per-sample slices of a VLM's
flattened image features."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def pad(
    tensors: Sequence[torch.Tensor | Sequence[int | float]],
    padding_value: int | float = 0,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Stacks rows of the same rank into one [len(tensors), *max_shape] tensor, filling with `padding_value` on
    `padding_side` ("right": each row at the start of every dimension; "left": at the end). With
    `pad_to_multiple_of`, the first dimension is rounded up to a multiple of it.

    Rows are tensors or plain lists of numbers (token ids, masks); lists become tensors of `dtype`, by default
    `torch.long`, so an empty row or an empty batch stays integer. Tensors keep the first one's dtype unless `dtype`
    is given. This is the one padding routine of the package: every collator and the rollout pad through it."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    rows = [t if isinstance(t, torch.Tensor) else torch.as_tensor(t, dtype=dtype or torch.long) for t in tensors]
    if not rows:
        return torch.full((0, 0), padding_value, dtype=dtype or torch.long)
    shape = [max(sizes) for sizes in zip(*(t.shape for t in rows))]
    if pad_to_multiple_of and shape:
        shape[0] = math.ceil(shape[0] / pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(rows), *shape), padding_value, dtype=dtype or rows[0].dtype, device=rows[0].device)
    for i, t in enumerate(rows):
        if padding_side == "right":
            where = tuple(slice(0, size) for size in t.shape)
        else:
            where = tuple(slice(full - size, full) for full, size in zip(shape, t.shape))
        out[(i, *where)] = t
    return out


def pad_rows(
    rows: Sequence[Sequence[int | float]], value: int | float, left: bool, multiple: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths as one [len(rows), width] long tensor (`pad`) and its 0/1 mask of the real
    positions, padded on the left or the right with `value`; the width is rounded up to `multiple`."""
    side = "left" if left else "right"
    return pad(rows, value, side, multiple), pad([[1] * len(r) for r in rows], 0, side, multiple)


def flush_left(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Moves each row's kept positions (`mask` 1) to the left, in order, and drops the columns left empty in every
    row. `tensors` ([B, T], like `mask`) move with the mask; positions that were 0 become 0. Returns the new mask
    alone when no tensor is given, else (mask, *tensors)."""
    keep = mask.bool()
    width = int(keep.sum(dim=1).max()) if mask.numel() else 0
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    new_keep = torch.gather(keep, 1, order)
    moved = [torch.gather(mask, 1, order) * new_keep]
    moved += [torch.gather(t, 1, order) * new_keep.to(t.dtype) for t in tensors]
    return moved[0] if not tensors else tuple(moved)


def split_tensor_dict(tensor_dict: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """`num_chunks` dicts, each with the matching chunk of every tensor along dim 0 (`torch.chunk` sizes). None and
    0-dim tensors (scalars) are given to every chunk as they are; lists are split like tensors."""
    rows = next((len(v) for v in tensor_dict.values() if _is_per_sample(v)), 0)
    size = math.ceil(rows / num_chunks) if rows else 0
    chunks = []
    for i in range(num_chunks):
        chunk = {}
        for key, value in tensor_dict.items():
            chunk[key] = value[i * size : (i + 1) * size] if _is_per_sample(value) else value
        chunks.append(chunk)
    return chunks


def _is_per_sample(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() > 0) or isinstance(value, list)


def shuffle_sequence_dict(seq_dict: dict[str, Any], generator: torch.Generator | None = None) -> dict[str, Any]:
    """The same random permutation applied to every per-sample value (tensors along dim 0, lists); None and scalars
    are kept as they are."""
    rows = next((len(v) for v in seq_dict.values() if _is_per_sample(v)), 0)
    order = torch.randperm(rows, generator=generator)
    out = {}
    for key, value in seq_dict.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = value[order.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in order.tolist()]
        else:
            out[key] = value
    return out


# Keys holding one row per image patch (or tile), split like pixel_values.
_PER_PATCH_KEYS = ("pixel_values", "image_position_ids", "pixel_attention_mask", "spatial_shapes")


def split_pixel_values_by_grid(batch: dict[str, Any]) -> dict[str, Any]:
    """A VLM batch with `pixel_values` (all images' patches concatenated) split into one tensor per sample, so that
    samples can be regrouped. The split follows `image_grid_thw` (Qwen-VL: t*h*w patches per image, `num_images` per
    sample), else `num_tiles` (rows per sample), else one row per image (`num_images`). Per-patch companions
    (`image_position_ids`, `pixel_attention_mask`, `spatial_shapes`) are split the same way, `image_grid_thw` per
    sample. A batch without `num_images` is returned unchanged; ValueError when the rows do not add up."""
    if "pixel_values" not in batch or "num_images" not in batch:
        return batch
    num_images = [int(n) for n in batch["num_images"]]
    grid = batch.get("image_grid_thw")
    if batch.get("num_tiles") is not None and grid is None:  # rows (tiles) per sample, all its images together
        bounds = [int(n) for n in batch["num_tiles"]]
    else:
        rows_per_image = grid.prod(dim=-1).tolist() if grid is not None else [1] * sum(num_images)
        if len(rows_per_image) != sum(num_images):
            raise ValueError(f"{len(rows_per_image)} images described, but num_images adds up to {sum(num_images)}.")
        bounds, start = [], 0
        for count in num_images:
            bounds.append(sum(rows_per_image[start : start + count]))
            start += count
    if sum(bounds) != len(batch["pixel_values"]):
        raise ValueError(
            f"pixel_values has {len(batch['pixel_values'])} rows, but the images' grids add up to {sum(bounds)}."
        )
    out = dict(batch)
    for key in _PER_PATCH_KEYS:
        if isinstance(batch.get(key), torch.Tensor):
            out[key] = list(torch.split(batch[key], bounds, dim=0))
    if grid is not None:
        out["image_grid_thw"] = list(torch.split(grid, num_images, dim=0))
    return out


def unsplit_pixel_values_by_grid(batch: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `split_pixel_values_by_grid`: per-sample lists concatenated back into tensors."""
    out = dict(batch)
    for key in (*_PER_PATCH_KEYS, "image_grid_thw"):
        if isinstance(batch.get(key), list):
            out[key] = torch.cat(batch[key], dim=0)
    return out


def identity(x: Any) -> Any:
    """Returns its argument (a collate function that keeps a batch as the list of its examples)."""
    return x
