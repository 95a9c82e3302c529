"""Colocate mode: `vllm.LLM` inside the test process (tiny Llama with untied embeddings; the tied case is
covered in server mode). After an in-process weight sync vLLM scores tokens as the trainer's model does,
and GRPO trains with it."""

from __future__ import annotations

import pytest
import torch
from _vllm_reference import LOGP_ATOL, PROMPTS, grpo_with_vllm, logged_per_step, perturbed_model

from posttrain.generation import SamplingParams

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def colocated(vllm_tiny_untied_path):
    """One engine for the module (start-up costs seconds; an LLM is not freed reliably within a process)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from posttrain.generation.vllm_backend import VLLMColocateBackend

    model = perturbed_model(vllm_tiny_untied_path, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(vllm_tiny_untied_path)
    backend = VLLMColocateBackend(model, tokenizer, [tokenizer.eos_token_id], max_model_len=128, kv_cache_gb=0.25)
    return backend, model


def assert_engine_matches(backend, model) -> None:
    completions = backend.generate(PROMPTS, 2, SamplingParams(max_tokens=10, temperature=0.7), seed=5)
    assert len(completions) == 6
    for completion in completions:
        # The engine samples from softmax(logits / T) and reports that distribution's log-probs.
        logits = model(torch.tensor([PROMPTS[completion.prompt_index] + completion.token_ids])).logits.detach()
        start = len(PROMPTS[completion.prompt_index]) - 1
        scaled = torch.log_softmax(logits[0, start:-1].double() / 0.7, -1)
        expected = scaled.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(completion.logprobs, dtype=torch.float64), expected, atol=LOGP_ATOL, rtol=0
        )


def test_colocated_engine_starts_from_the_policy_and_follows_its_updates(colocated):
    backend, model = colocated
    assert_engine_matches(backend, model)  # built from the policy's weights, not the checkpoint on disk
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.2)
    backend.sync_weights(model)
    assert_engine_matches(backend, model)


def test_grpo_in_colocate_mode_samples_from_the_current_policy(colocated, vllm_tiny_untied_path, tmp_path):
    """Synced before every step: the sampler's log-probs agree with the trainer's at every step while the
    weights move, and the importance weights are ~1."""
    trainer = grpo_with_vllm(vllm_tiny_untied_path, tmp_path, vllm_mode="colocate", vllm_kv_cache_gb=0.25)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert max((p - start[n]).abs().max() for n, p in trainer.model.named_parameters()) > 1e-2
    diffs = logged_per_step(trainer, "sampler/logp_diff_max")
    assert len(diffs) == 3 and max(diffs) < LOGP_ATOL
    assert all(r == pytest.approx(1.0, abs=1e-3) for r in logged_per_step(trainer, "sampler/ratio_mean"))
