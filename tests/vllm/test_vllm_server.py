"""Server mode against a real vLLM server (`posttrain vllm-serve` on 127.0.0.1, tiny Llama with tied
embeddings): after a weight sync vLLM decodes and scores tokens exactly as the trainer's model does, PEFT
adapters reach the server merged, GRPO trains through it, a server killed and restarted mid-run is
reconnected to and gets the policy's weights again, and one that does not come back stops training with a
clear error instead of a hang."""

from __future__ import annotations

import logging
import math
import threading
import time

import pytest
import torch
from _vllm_reference import (
    EOS,
    LOGP_ATOL,
    PROMPTS,
    assert_same_episodes,
    grpo_with_vllm,
    logged_per_step,
    low_id_fraction,
    perturbed_model,
    reference_greedy,
    reference_logps,
    tool_episodes,
    transformers_tool_episodes,
)

from posttrain.generation import SamplingParams
from posttrain.generation.vllm_backend import VLLMServerBackend
from posttrain.generation.vllm_client import VLLMClient, VLLMServerError

pytestmark = pytest.mark.vllm


def assert_server_matches(backend: VLLMServerBackend, model) -> None:
    sampling = SamplingParams(max_tokens=12)
    completions = backend.generate(PROMPTS, 3, sampling, seed=11)
    assert len(completions) == 9 and [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for completion in completions:
        expected = reference_logps(model, PROMPTS[completion.prompt_index], completion.token_ids)
        torch.testing.assert_close(
            torch.tensor(completion.logprobs, dtype=torch.float64), expected, atol=LOGP_ATOL, rtol=0
        )
    for prompt in PROMPTS:
        greedy = backend.client.complete(prompt, 1, sampling, None, [], temperature=0.0)[0]
        expected, gap = reference_greedy(model, prompt, 12)
        assert gap > 1e-3, "rounding could break a tie: pick other prompts"
        assert greedy.token_ids == expected


def test_synced_server_samples_and_scores_like_the_trainer_model(vllm_server, vllm_tiny_path):
    model = perturbed_model(vllm_tiny_path, seed=1)
    backend = VLLMServerBackend(VLLMClient(vllm_server, timeout_s=120), [EOS], vocab_size=model.config.vocab_size)
    before = backend.generate(PROMPTS[:1], 1, SamplingParams(max_tokens=12), seed=3)[0]
    off = (
        (torch.tensor(before.logprobs, dtype=torch.float64) - reference_logps(model, PROMPTS[0], before.token_ids))
        .abs()
        .max()
    )
    assert off > 0.1  # not synced yet: the server still has the saved weights

    started = time.perf_counter()
    backend.sync_weights(model)
    assert time.perf_counter() - started < 30
    assert_server_matches(backend, model)

    with torch.no_grad():  # a second sync after the weights moved again
        model.model.embed_tokens.weight.mul_(1.5)  # the tied lm_head changes with it
    backend.sync_weights(model)
    assert_server_matches(backend, model)


def test_greedy_tool_episode_is_identical_on_transformers_and_the_server(vllm_server, vllm_tiny_path):
    """Multi-turn through the server: every turn continues from the episode's token ids (prompt, sampled turns
    and tool turns), as on the transformers backend (tool_episodes: a parser reads every turn as a call)."""
    model, tokenizer, stop_ids, expected = transformers_tool_episodes(vllm_tiny_path, seed=1)
    backend = VLLMServerBackend(VLLMClient(vllm_server, timeout_s=120), stop_ids, vocab_size=model.config.vocab_size)
    backend.sync_weights(model)
    assert_same_episodes(expected, tool_episodes(backend, tokenizer)[0])


def test_seeded_generation_is_reproducible_and_independent_of_the_batch(vllm_server, vllm_tiny_path):
    backend = VLLMServerBackend(VLLMClient(vllm_server, timeout_s=120), [EOS])
    sampling = SamplingParams(max_tokens=8)
    together = backend.generate(PROMPTS, 2, sampling, seed=[7, 8, 9])
    alone = backend.generate(PROMPTS[1:2], 2, sampling, seed=[8])
    assert [c.token_ids for c in together[2:4]] == [c.token_ids for c in alone]
    assert together[2].token_ids != together[3].token_ids  # a prompt's completions are different samples


def test_peft_adapter_reaches_the_server_merged(vllm_server, vllm_tiny_path):
    from peft import LoraConfig, get_peft_model

    base = perturbed_model(vllm_tiny_path, seed=2)
    torch.manual_seed(2)  # init_lora_weights=False draws from the global generator: same adapter in any test order
    model = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
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
    trainer = grpo_with_vllm(
        vllm_tiny_path, tmp_path, vllm_mode="server", vllm_server_base_url=vllm_server, vllm_sync_steps=2
    )
    trainer.train()
    diffs = logged_per_step(trainer, "sampler/logp_diff_max")
    assert len(diffs) == 3
    assert diffs[0] < LOGP_ATOL and diffs[2] < LOGP_ATOL
    assert diffs[1] > 100 * LOGP_ATOL
    ratios = logged_per_step(trainer, "sampler/ratio_mean")
    assert ratios[0] == pytest.approx(1.0, abs=1e-3) and ratios[2] == pytest.approx(1.0, abs=1e-3)


def test_server_killed_and_restarted_mid_run_is_reconnected_to_and_gets_the_last_pushed_weights(
    vllm_server, vllm_server_process, vllm_tiny_path, tmp_path, caplog
):
    """Weights are pushed every 2 steps (rounds at steps 0, 1, 2: pushes at 0 and 2). The server is killed during
    round 1's scoring and restarted on its port: round 2 has no push of its own, so only the reconnect's re-push
    of step 0's weights keeps it from sampling with the server's start-up weights. Every completion's sampler
    log-probs are checked against the weights pushed last before its round."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy_path = tmp_path / "policy"  # the policy starts far from what the server loads, so a lost push shows
    perturbed_model(vllm_tiny_path, seed=4).save_pretrained(policy_path)
    AutoTokenizer.from_pretrained(vllm_tiny_path).save_pretrained(policy_path)
    restarts = []

    def reward_and_kill_after_first_round(completion_ids, **kwargs):
        if not restarts:
            vllm_server_process.kill()
            restarts.append(threading.Thread(target=vllm_server_process.restart))
            restarts[0].start()
        return low_id_fraction(completion_ids)

    trainer = grpo_with_vllm(
        str(policy_path),
        tmp_path / "run",
        reward=reward_and_kill_after_first_round,
        vllm_mode="server",
        vllm_server_base_url=vllm_server,
        vllm_sync_steps=2,
        vllm_server_timeout=600,
    )  # a server start may take minutes here
    backend, pushed, rounds = trainer.generation_backend, [], []
    sync_weights, generate = backend.sync_weights, backend.generate

    def recording_sync_weights(model, force=False):
        before = backend.pushes
        sync_weights(model, force)
        if backend.pushes > before:
            pushed.append({name: value.detach().clone() for name, value in model.state_dict().items()})

    def recording_generate(prompt_ids, n, sampling, seed=None):
        completions = generate(prompt_ids, n, sampling, seed)
        rounds.append((len(pushed), prompt_ids, completions))
        return completions

    backend.sync_weights, backend.generate = recording_sync_weights, recording_generate
    with caplog.at_level(logging.WARNING, logger="posttrain.generation.vllm_backend"):
        trainer.train()
    restarts[0].join()
    assert trainer.state.global_step == 3 and backend.reconnects == 1
    assert sum(h.get("vllm/reconnects", 0) for h in trainer.state.log_history) == 1  # and it is in the logs
    assert [pushes for pushes, _, _ in rounds] == [1, 1, 2]
    messages = [r.getMessage() for r in caplog.records if r.name == "posttrain.generation.vllm_backend"]
    assert len(messages) == 2 and "could not reach" in messages[0] and messages[1].startswith("Reconnected")
    startup = AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    for index, (pushes, prompt_ids, completions) in enumerate(rounds):
        reference.load_state_dict(pushed[pushes - 1])
        for completion in completions:
            prompt = list(prompt_ids[completion.prompt_index])
            sampler = torch.tensor(completion.logprobs, dtype=torch.float64)
            expected = reference_logps(reference, prompt, completion.token_ids)
            torch.testing.assert_close(sampler, expected, atol=LOGP_ATOL, rtol=0, msg=f"round {index + 1}")
            if index == 1:  # the start-up weights would be far off: the check can tell a lost re-push
                assert (sampler - reference_logps(startup, prompt, completion.token_ids)).abs().max() > 0.1


def test_server_killed_mid_run_and_not_restarted_stops_training_with_a_clear_error(
    vllm_server, vllm_server_process, vllm_tiny_path, tmp_path
):
    rounds = []

    def reward_and_kill_after_first_round(completion_ids, **kwargs):
        rounds.append(len(completion_ids))
        if len(rounds) == 1:
            vllm_server_process.kill()
        return [float(len(ids)) for ids in completion_ids]

    trainer = grpo_with_vllm(
        vllm_tiny_path,
        tmp_path,
        reward=reward_and_kill_after_first_round,
        vllm_mode="server",
        vllm_server_base_url=vllm_server,
        vllm_server_timeout=20,
    )
    started = time.monotonic()
    with pytest.raises(VLLMServerError) as error:
        trainer.train()
    assert 20 <= time.monotonic() - started < 60  # waited vllm_server_timeout for it to come back, no longer
    message = str(error.value)
    assert vllm_server in message and "optimizer step 1" in message and "could not reach" in message
    assert "did not come back within 20 s" in message
    assert rounds == [16]


def test_teacher_top_k_above_vllms_default_cap_of_20_is_served(vllm_server):
    # `--max-logprobs -1` (TRL's): without it vLLM answers 400 for prompt_logprobs > 20 (distillation's top_k)
    from posttrain.generation.teacher_server import TeacherServer

    teacher = TeacherServer(vllm_server, connect_timeout_s=60)
    sequence = [3, 17, 5, 42, 9, 11]
    ((ids, logps, token_logps),) = teacher.sequence_logprobs([sequence], [2], top_k=30, temperature=1.0)
    ((ids20, logps20, _),) = teacher.sequence_logprobs([sequence], [2], top_k=20, temperature=1.0)
    assert len(ids) == len(sequence) - 2 and all(len(row) == 30 and len(set(row)) == 30 for row in ids)
    for row, row20, values, values20 in zip(ids, ids20, logps, logps20):
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-5
        assert dict(zip(row20, values20)) == pytest.approx({i: v for i, v in zip(row, values) if i in row20})
    assert all(math.isfinite(v) for v in token_logps)


def test_trls_token_route_of_vllms_scale_out_answers_like_the_completions_route(vllm_server):
    # `--enable-scale-out` (TRL's, vLLM >= 0.30): TRL's client sends multimodal prompts to /inference/v1/generate
    client = VLLMClient(vllm_server, timeout_s=120)
    client.handshake()
    prompt = PROMPTS[0]
    body = {"model": client.model_name, "token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0}}
    answer = client.request("POST", "/inference/v1/generate", body, what="scale-out generation")
    greedy = client.complete(prompt, 1, SamplingParams(max_tokens=6), None, [], temperature=0.0)[0]
    assert answer["choices"][0]["token_ids"] == greedy.token_ids and len(greedy.token_ids) == 6
