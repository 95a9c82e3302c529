"""UTF-8 byte offsets of tokens, for aligning two tokenizations of the same text (GOLD's cross-tokenizer ULD).

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM, Phi, Mistral v0.3+) write each byte of the text as one
printable character of their alphabet, so a token's piece has exactly as many characters as the token has bytes;
an added (special) token counts the bytes of its written form. Offsets are `(start, end)` byte positions in the
text the tokens spell, counted from its first token.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import torch

from posttrain.errors import ConfigError

__all__ = ["encode_with_byte_offsets", "pad_byte_offsets", "piece_offsets", "token_byte_offsets"]


@lru_cache(maxsize=1)
def _byte_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE writes bytes with (GPT-2's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = set(), 0
    for b in range(256):
        if b in printable:
            chars.add(chr(b))
        else:
            chars.add(chr(256 + extra))
            extra += 1
    return frozenset(chars)


def piece_offsets(pieces: Iterable[tuple[str, bool]], owner: str = "the tokenizer") -> list[tuple[int, int]]:
    """Consecutive byte spans of token pieces `(piece, is_added_token)`; a piece outside the byte alphabet (a
    SentencePiece or WordPiece tokenizer) is refused."""
    alphabet = _byte_alphabet()
    offsets, cursor = [], 0
    for piece, added in pieces:
        if added:
            size = len(piece.encode("utf-8"))
        elif all(c in alphabet for c in piece):
            size = len(piece)
        else:
            raise ConfigError(
                f"Token {piece!r} of {owner} is not byte-level BPE: byte offsets (extended ULD) need a byte-level "
                "BPE tokenizer (Llama 3, Qwen, SmolLM, Phi, Mistral v0.3+). Set use_extended_uld=False."
            )
        offsets.append((cursor, cursor + size))
        cursor += size
    return offsets


def token_byte_offsets(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Byte offsets of `ids` in the text they decode to, for a transformers tokenizer."""
    added = set(tokenizer.added_tokens_decoder)
    pieces = zip(tokenizer.convert_ids_to_tokens(ids), (i in added for i in ids))
    return piece_offsets(pieces, type(tokenizer).__name__)


def encode_with_byte_offsets(backend, texts: list[str], add_special_tokens: bool = False):
    """`[(ids, byte_offsets), ...]` per text, from a `tokenizers.Tokenizer` (a fast tokenizer's
    `backend_tokenizer`)."""
    added = set(backend.get_added_tokens_decoder())
    return [
        (list(enc.ids), piece_offsets(zip(enc.tokens, (i in added for i in enc.ids)), "the backend tokenizer"))
        for enc in backend.encode_batch(texts, add_special_tokens=add_special_tokens)
    ]


def pad_byte_offsets(offsets: list[tuple[int, int]], target_length: int, padding_side: str) -> torch.Tensor:
    """`[target_length, 2]` long tensor of `offsets`, padded with `(0, 0)` on `padding_side` ('left' or 'right');
    longer offsets are returned whole."""
    if padding_side not in ("left", "right"):
        raise ConfigError(f"padding_side={padding_side!r} must be 'left' or 'right'.")
    rows = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)
    missing = torch.zeros(max(target_length - len(rows), 0), 2, dtype=torch.long)
    return torch.cat([missing, rows] if padding_side == "left" else [rows, missing])
