"""TRL's `trl.experimental.async_grpo.vllm_client` path: the vLLM server's client
(posttrain.generation.vllm_client)."""

from posttrain.generation.vllm_client import VLLMClient

__all__ = ["VLLMClient"]
