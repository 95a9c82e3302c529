"""posttrain's extension of vLLM's worker: the weight-sync calls that the trainer makes through
`collective_rpc`, in server mode (`POST /collective_rpc`) and in colocate mode (in process).

vLLM mixes this class into its worker (`--worker-extension-cls` / `worker_extension_cls=`), so `self`
is a vLLM worker here. This module must stay importable without posttrain's training stack: it runs in
the vLLM server process.

Why it exists: vLLM's own `reload_weights` loads new weights in place, but on CPU it leaves a stale
copy behind when the output layer shares its weight with the input embedding (tied embeddings, as in
SmolLM2): the lm_head's matmul runs on a repacked (oneDNN) copy of the embedding made at start-up, and
reloading the embedding does not repack it. Log-probs then differ from the trainer's by nats, with no
error. `_refresh_output_layer` repacks it from the reloaded weight.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

PROTOCOL_VERSION = 2  # bumped when the calls below change; the client refuses a server that differs


class PosttrainWorkerExtension:
    """Weight-sync calls for vLLM's worker (mixed in by vLLM; `self` is the worker)."""

    def posttrain_handshake(self) -> dict:
        """What the client checks before the first request: that this extension is loaded, its protocol
        version, and the engine settings that decide whether log-probs are comparable."""
        import vllm

        model_config = self.vllm_config.model_config
        transfer = getattr(self.vllm_config, "weight_transfer_config", None)  # --weight-transfer-config
        return {
            "protocol": PROTOCOL_VERSION,
            "vllm_version": vllm.__version__,
            "logprobs_mode": str(model_config.logprobs_mode),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "max_model_len": int(model_config.max_model_len),
            "vocab_size": int(model_config.get_vocab_size()),
            # "nccl" when started with `posttrain vllm-serve --weight-transfer nccl`: the trainer syncs over NCCL
            "weight_transfer": None if transfer is None else str(transfer.backend),
        }

    def posttrain_reload_from_path(self, weights_path: str, version: str | None = None) -> dict:
        """Loads every `*.safetensors` file in `weights_path` (names as in the Hugging Face checkpoint) and
        remembers `version`, the trainer's name for these weights."""
        self._posttrain_version = None  # a reload that fails half-way leaves no version: the trainer pushes again
        result = self._posttrain_reload(weights_path=weights_path)
        self._posttrain_version = version
        return result

    def posttrain_weights_version(self) -> dict:
        """Which weights this worker holds: the `version` of the last reload (None: the start-up weights, as
        after a restart) and how many reloads it has done. The trainer compares the version with the one it
        pushed last, so a server restarted between two requests is noticed, not silently sampled from."""
        return {"version": getattr(self, "_posttrain_version", None), "reloads": getattr(self, "_posttrain_reloads", 0)}

    def posttrain_reload_from_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Loads `(name, tensor)` pairs handed over in process (colocate mode, no multiprocessing)."""
        return self._posttrain_reload(weights_iterator=weights)

    def _posttrain_reload(self, **source) -> dict:
        start = time.perf_counter()
        self.reload_weights(**source)
        _refresh_output_layer(self.model_runner.get_model())
        self._posttrain_reloads = getattr(self, "_posttrain_reloads", 0) + 1
        return {"seconds": time.perf_counter() - start}


def _refresh_output_layer(model: torch.nn.Module) -> None:
    """Re-derives the lm_head's packed CPU matmul weight from its (reloaded) weight; nothing to do on GPU,
    where the matmul reads the weight itself."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "cpu_linear"):
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
