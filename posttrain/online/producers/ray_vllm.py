"""A rollout actor's server with a vLLM engine (use_vllm=True with rollout_backend="ray"): the generation server of
generation_worker.py, sampling with an in-process `vllm.LLM` (the colocate backend, generation/vllm_backend.py)
instead of the transformers loop.

The actor's torch model stays what it is in the transformers case: its parameters point at the weight slot of the
request's version (received over the actor's weight pair), so a request names its weights exactly as before.
Before sampling, vLLM's weights are replaced by that model's when the version differs from the one vLLM holds
(posttrain's worker extension: an in-process reload, the tied output layer repacked on CPU). Every token of a
request records that one version: vLLM samples a request whole, so in-flight updates between decode steps are not
possible here (the producer refuses them). The sampler's log-probs are vLLM's, or at k = 0 the trainer's own
forward on the torch model (exact_logps), as with the transformers server.

Precision. vLLM samples in the dtype of the policy's parameters (float32 master weights also under bf16=True),
as the trainer's own colocated engine does, so the tokens are that engine's. The exact_logps forward runs under
the trainer's bf16 / fp16 autocast (`WorkerSettings.autocast_dtype`), so at k = 0 the log-probs equal the
trainer's; vLLM's own log-probs (k >= 1) are float32 and differ from the trainer's bf16 ones by a few 1e-3 at
the tiny model (tests/vllm/test_vllm_ray.py).
"""

from __future__ import annotations

from posttrain.online.producers.generation_worker import GenerationServer, WorkerSettings
from posttrain.online.weights.shared_memory import SharedWeights

__all__ = ["VLLMGenerationServer", "vllm_engine_options"]


class _LoadedVersion:
    """The backend the server calls: the vLLM engine, given the server model's weights first when the version the
    server took differs from the one the engine holds."""

    def __init__(self, server: GenerationServer, engine) -> None:
        self.server, self.engine, self.loaded = server, engine, None

    def generate(self, prompt_ids, n, sampling, seed=None):
        if self.server.version != self.loaded:
            self.engine.sync_weights(self.server.model, force=True)
            self.loaded = self.server.version
        return self.engine.generate(prompt_ids, n, sampling, seed)


class VLLMGenerationServer(GenerationServer):
    """The generation server sampling with vLLM; `engine_options` are `VLLMColocateBackend`'s (tokenizer,
    max_model_len, kv_cache_gb, seed, model_impl)."""

    def __init__(self, model, weights: SharedWeights, settings: WorkerSettings, engine_options: dict) -> None:
        if settings.in_flight:
            raise ValueError("A vLLM rollout actor samples each request with one version (no in-flight updates).")
        super().__init__(model, weights, settings)
        from posttrain.generation.vllm_backend import VLLMColocateBackend

        options = dict(engine_options)
        tokenizer = options.pop("tokenizer")
        engine = VLLMColocateBackend(model, tokenizer, settings.stop_ids, **options)
        self.backend = _LoadedVersion(self, engine)


def vllm_engine_options(args, model, tokenizer) -> dict:
    """The vLLM engine an actor builds, from the run's settings (those of vllm_mode='colocate' on CPU)."""
    from posttrain.generation.vllm_backend import check_cpu_head_dim
    from posttrain.generation.vllm_memory import colocate_memory

    check_cpu_head_dim(model.config)
    context = model.config.max_position_embeddings
    kv_cache_gb, _ = colocate_memory(args, "cpu")
    max_model_len = args.vllm_max_model_length or min(
        context, (args.max_prompt_length or context) + args.max_completion_length
    )
    return {
        "tokenizer": tokenizer,
        "max_model_len": max_model_len,
        "kv_cache_gb": kv_cache_gb,
        "seed": args.seed,
        "model_impl": args.vllm_model_impl,
    }
