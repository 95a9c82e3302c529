"""TRL's `trl.kernels` path: the chunked LM-head log-probabilities (posttrain/losses/chunked_head.py, in PyTorch on
every device)."""

from posttrain.kernels import chunked_divergence, chunked_logprob
from posttrain.losses.chunked_head import ChunkedLogProbFunction

__all__ = ["ChunkedLogProbFunction", "chunked_divergence", "chunked_logprob"]
