"""Asynchronous generation against a real vLLM server (`posttrain vllm-serve` on 127.0.0.1): with one round ahead,
the server samples the round trained at step t with the weights of step t - 1 (its log-probs are those weights',
not the policy's at step t), and AsyncGRPOTrainer trains through it with TRL's defaults."""

from __future__ import annotations

import pytest
import torch
from _vllm_reference import LOGP_ATOL, grpo_with_vllm, logged_per_step, low_id_fraction, reference_logps
from transformers import AutoModelForCausalLM, TrainerCallback

pytestmark = pytest.mark.vllm


class WeightsAtStepBegin(TrainerCallback):
    def __init__(self):
        self.weights = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {n: v.detach().clone() for n, v in model.state_dict().items()}


def test_one_round_ahead_on_the_server_samples_with_the_previous_steps_weights(vllm_server, vllm_tiny_path, tmp_path):
    trainer = grpo_with_vllm(
        vllm_tiny_path, tmp_path, vllm_mode="server", vllm_server_base_url=vllm_server, async_generation_rounds=1
    )
    weights = WeightsAtStepBegin()
    trainer.add_callback(weights)
    rollouts, make = [], trainer.make_rollout
    trainer.make_rollout = lambda *args: rollouts.append(make(*args)) or rollouts[-1]
    trainer.train()
    assert logged_per_step(trainer, "sample/staleness_mean") == [0.0, 1.0, 1.0]
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_path, dtype=torch.float32)
    for round_index, rollout in enumerate(rollouts):
        version = max(round_index - 1, 0)
        assert rollout.policy_version == version
        for i in range(0, len(rollout), 5):  # a few completions of each round
            prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
            completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
            sampled = rollout.sampler_logps[i][: len(completion)].double()
            model.load_state_dict(weights.weights[version])
            torch.testing.assert_close(sampled, reference_logps(model, prompt, completion), atol=LOGP_ATOL, rtol=0)
            if round_index >= 2:
                model.load_state_dict(weights.weights[round_index])
                assert (sampled - reference_logps(model, prompt, completion)).abs().max() > 100 * LOGP_ATOL


def test_async_grpo_trains_through_the_server_with_trls_defaults(vllm_server, vllm_tiny_path, tmp_path):
    from datasets import Dataset

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        vllm_server_base_url=vllm_server,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=3e-2,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    assert args.use_vllm and args.vllm_mode == "server" and args.max_staleness == 4
    dataset = Dataset.from_list([{"prompt": f"cat {i} and dog {2 * i}"} for i in range(16)])
    trainer = AsyncGRPOTrainer(vllm_tiny_path, low_id_fraction, args=args, train_dataset=dataset)
    trainer.train()
    # max_steps=3 leaves 2 rounds ahead of the first: staleness 0, 1, 2 steps.
    assert logged_per_step(trainer, "sample/staleness_mean") == [0.0, 1.0, 2.0]
    initial = AutoModelForCausalLM.from_pretrained(vllm_tiny_path).state_dict()
    assert max((v - initial[n]).abs().max() for n, v in trainer.model.state_dict().items()) > 1e-3
