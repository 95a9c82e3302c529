"""Server mode against a real vLLM server (`posttrain vllm-serve` on 127.0.0.1, tiny Llama with tied
embeddings): after a weight sync vLLM decodes and scores tokens exactly as the trainer's model does, PEFT
adapters reach the server merged, GRPO trains through it, and a server killed mid-run stops training with
a clear error instead of a hang."""

from __future__ import annotations

import time

import pytest
import torch

from posttrain.generation import SamplingParams
from posttrain.generation.vllm_backend import VLLMServerBackend
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError

from _vllm_reference import (
    EOS,
    LOGP_ATOL,
    PROMPTS,
    grpo_with_vllm,
    logged_per_step,
    perturbed_model,
    reference_greedy,
    reference_logps,
)

pytestmark = pytest.mark.vllm

def assert_server_matches(backend: VLLMServerBackend, model) -> None:
    sampling = SamplingParams(max_tokens=12)
    completions = backend.generate(PROMPTS, 3, sampling, seed=11)
    assert len(completions) == 9 and [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for completion in completions:
        expected = reference_logps(model, PROMPTS[completion.prompt_index], completion.token_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected,
                                   atol=LOGP_ATOL, rtol=0)
    for prompt in PROMPTS:
        greedy = backend.client.complete(prompt, 1, sampling, None, [], temperature=0.0)[0]
        expected, gap = reference_greedy(model, prompt, 12)
        assert gap > 1e-3, "rounding could break a tie: pick other prompts"
        assert greedy.token_ids == expected


def test_synced_server_samples_and_scores_like_the_trainer_model(vllm_server, vllm_tiny_path):
    model = perturbed_model(vllm_tiny_path, seed=1)
    backend = VLLMServerBackend(VLLMClient(vllm_server, timeout_s=120), [EOS], vocab_size=model.config.vocab_size)
    before = backend.generate(PROMPTS[:1], 1, SamplingParams(max_tokens=12), seed=3)[0]
    off = (torch.tensor(before.logprobs, dtype=torch.float64)
           - reference_logps(model, PROMPTS[0], before.token_ids)).abs().max()
    assert off > 0.1  # not synced yet: the server still has the saved weights

    started = time.perf_counter()
    backend.sync_weights(model)
    assert time.perf_counter() - started < 30
    assert_server_matches(backend, model)

    with torch.no_grad():  # a second sync after the weights moved again
        model.model.embed_tokens.weight.mul_(1.5)  # the tied lm_head changes with it
    backend.sync_weights(model)
    assert_server_matches(backend, model)


def test_seeded_generation_is_reproducible_and_independent_of_the_batch(vllm_server, vllm_tiny_path):
    backend = VLLMServerBackend(VLLMClient(vllm_server, timeout_s=120), [EOS])
    sampling = SamplingParams(max_tokens=8)
    together = backend.generate(PROMPTS, 2, sampling, seed=[7, 8, 9])
    alone = backend.generate(PROMPTS[1:2], 2, sampling, seed=[8])
    assert [c.token_ids for c in together[2:4]] == [c.token_ids for c in alone]
    assert together[2].token_ids != together[3].token_ids  # a prompt's completions are different samples


def test_peft_adapter_reaches_the_server_merged(vllm_server, vllm_tiny_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(perturbed_model(vllm_tiny_path, seed=2),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backend = VLLMServerBackend(VLLMClient(vllm_server, timeout_s=120), [EOS])
    backend.sync_weights(model)
    assert_server_matches(backend, model)  # the PEFT model's forward: base weights plus the adapter
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name


def test_a_failing_worker_call_is_reported_and_leaves_the_server_serving(vllm_server):
    """The handshake probes the worker extension with a call that fails on a server without it: the failure
    must come back as an error, not take the engine down."""
    client = VLLMClient(vllm_server, timeout_s=60)
    with pytest.raises(VLLMServerError, match="HTTP 500") as error:
        client.collective_rpc("posttrain_no_such_call", what="calling a missing worker method")
    assert vllm_server in str(error.value)
    assert len(client.complete(PROMPTS[0], 2, SamplingParams(max_tokens=3), 0, [EOS])) == 2


def test_grpo_in_server_mode_samples_from_the_current_policy(vllm_server, vllm_tiny_path, tmp_path):
    """Weights are synced every 2 steps: the sampler's log-probs agree with the trainer's at steps 1 and 3
    (just synced) and not at step 2 (generated with step 1's weights, one update behind)."""
    trainer = grpo_with_vllm(vllm_tiny_path, tmp_path, vllm_mode="server", vllm_server_base_url=vllm_server,
                             vllm_sync_steps=2)
    trainer.train()
    diffs = logged_per_step(trainer, "sampler/logp_diff_max")
    assert len(diffs) == 3
    assert diffs[0] < LOGP_ATOL and diffs[2] < LOGP_ATOL
    assert diffs[1] > 100 * LOGP_ATOL
    ratios = logged_per_step(trainer, "sampler/ratio_mean")
    assert ratios[0] == pytest.approx(1.0, abs=1e-3) and ratios[2] == pytest.approx(1.0, abs=1e-3)


def test_server_killed_mid_run_stops_training_with_a_clear_error(vllm_server, vllm_server_process, vllm_tiny_path,
                                                                  tmp_path):
    rounds = []

    def reward_and_kill_after_first_round(completion_ids, **kwargs):
        rounds.append(len(completion_ids))
        if len(rounds) == 1:
            vllm_server_process.kill()
        return [float(len(ids)) for ids in completion_ids]

    trainer = grpo_with_vllm(vllm_tiny_path, tmp_path, reward=reward_and_kill_after_first_round,
                             vllm_mode="server", vllm_server_base_url=vllm_server, vllm_server_timeout=20)
    started = time.monotonic()
    with pytest.raises(VLLMServerError) as error:
        trainer.train()
    assert time.monotonic() - started < 60
    message = str(error.value)
    assert vllm_server in message and "optimizer step 1" in message and "could not reach" in message
    assert rounds == [16]
