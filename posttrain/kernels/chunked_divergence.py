"""TRL's `trl.kernels.chunked_divergence` path (posttrain/losses/chunked_head.py)."""

from posttrain.losses.chunked_head import ChunkedDivergenceFunction

__all__ = ["ChunkedDivergenceFunction"]
