"""Small operations on batches of token sequences: the first True of each row, right padding to a length, cutting
completions after their first stop token; and what a ByteLevel BPE tokenizer's pieces are in bytes."""

from __future__ import annotations

import torch


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """The position of the first True along the last dim of `bools` [..., L]; L where a row has none."""
    length = bools.size(-1)
    positions = torch.arange(length, device=bools.device, dtype=dtype).expand_as(bools)
    return torch.where(bools, positions, torch.full_like(positions, length)).min(-1).values


def pad_to_length(tensor: torch.Tensor, length: int, pad_value: int | float, dim: int = -1) -> torch.Tensor:
    """`tensor` extended along `dim` to `length` with `pad_value` (unchanged when it is that long already)."""
    missing = length - tensor.size(dim)
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device)], dim=dim)


def truncate_right(
    input_ids: torch.Tensor, stop_token_ids: list[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) for completions [B, L]: everything after each row's first stop token (any of `stop_token_ids`)
    becomes `pad_token_id` with mask 0; the stop token itself is kept."""
    stops = torch.isin(input_ids, torch.as_tensor(stop_token_ids, device=input_ids.device))
    keep = torch.arange(input_ids.size(1), device=input_ids.device) <= first_true_indices(stops).unsqueeze(1)
    return input_ids.masked_fill(~keep, pad_token_id), keep.long()


def is_byte_level_tokenizer(backend) -> bool:
    """Whether the `tokenizers` backend is a ByteLevel BPE (Llama 3, Qwen, SmolLM): one piece character per byte."""
    return any("ByteLevel" in repr(getattr(backend, part, None)) for part in ("pre_tokenizer", "decoder"))


def piece_byte_len(piece: str) -> int:
    """The byte length of a ByteLevel BPE piece: each of its characters stands for one byte."""
    return len(piece)


__all__ = ["first_true_indices", "is_byte_level_tokenizer", "pad_to_length", "piece_byte_len", "truncate_right"]
