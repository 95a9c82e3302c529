"""TRL's `trl.kernels.chunked_logprob` path (posttrain/losses/chunked_head.py)."""

from posttrain.losses.chunked_head import OPTIONAL_OUTPUTS, TOKEN_CHUNK_SIZE, ChunkedLogProbFunction

__all__ = ["OPTIONAL_OUTPUTS", "TOKEN_CHUNK_SIZE", "ChunkedLogProbFunction"]
