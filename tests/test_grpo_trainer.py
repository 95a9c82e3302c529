"""GRPOTrainer and RLOOTrainer: learning a verifiable reward, advantages and losses against float64
references written out here, the reference model (frozen copy, or the PEFT policy with its adapter off),
and RLOO differing from GRPO only in its advantages."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import posttrain
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer
from test_online_engine import (
    ParameterSnapshots,
    logged,
    low_id_fraction,
    make_config,
    prompt_dataset,
    stopping_model,
    target_fraction,
    train,
)


def test_public_names_and_method_defaults(tmp_path):
    assert posttrain.GRPOTrainer is GRPOTrainer and posttrain.RLOOTrainer is RLOOTrainer
    assert posttrain.GRPOConfig is GRPOConfig and posttrain.RLOOConfig is RLOOConfig
    grpo = GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (grpo.num_generations, grpo.beta, grpo.loss_type, grpo.scale_rewards) == (8, 0.0, "dapo", "group")
    rloo = RLOOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (rloo.num_generations, rloo.beta, rloo.loss_type, rloo.normalize_advantages) == (2, 0.05, "dr_grpo", False)


def test_reward_rises_on_a_verifiable_task(tmp_path, tiny_model_path):
    """The tiny random model learns to emit four chosen tokens (about 1 in 96 of its tokens at the start)."""
    targets = {298, 299, 300, 301}

    def target_tokens(completion_ids, **kwargs):
        return [sum(t in targets for t in ids) / len(ids) for ids in completion_ids]

    trainer = train(tiny_model_path, tmp_path, reward=target_tokens, per_device_train_batch_size=16,
                    num_generations=8, max_completion_length=12, learning_rate=3e-2, max_steps=30,
                    data=prompt_dataset(64))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 30
    assert sum(rewards[:3]) / 3 < 0.05
    assert sum(rewards[-5:]) / 5 > 0.9


# -- float64 references ------------------------------------------------------------------------------------
def _float64_model(model_path, parameters=None):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    if parameters is not None:
        own = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in parameters.items():
                own[name].copy_(value.double())
    return model


def _sequences(rollout):
    """(prompt ids, completion ids) of every completion of a rollout, without padding."""
    return [(rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist(),
             rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()) for i in range(len(rollout))]


def _token_logps(model, sequences):
    """Per completion, the log-probs of its tokens (one unpadded forward per sequence)."""
    result = []
    for prompt, completion in sequences:
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        result.append(torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)])
    return result


def _group_advantages(rewards, n, scale):
    """Reward minus its group's mean, divided per scale by the group's or the batch's std (+ 1e-4)."""
    batch_std = torch.tensor(rewards, dtype=torch.float64).std().item()
    advantages = []
    for start in range(0, len(rewards), n):
        group = rewards[start:start + n]
        mean = sum(group) / n
        group_std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        divisor = {"group": group_std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        advantages += [(r - mean) / divisor for r in group]
    return advantages


def _leave_one_out(rewards, n):
    return [r - (sum(rewards[s:s + n]) - r) / (n - 1) for s in range(0, len(rewards), n) for r in rewards[s:s + n]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_per_scale(tmp_path, tiny_model_path, scale):
    trainer = GRPOTrainer(tiny_model_path, target_fraction, args=make_config(tmp_path, scale_rewards=scale),
                          train_dataset=prompt_dataset())
    rewards = [0.5, 1.0, 3.0, 0.0, 2.0, 2.0, 4.0, -1.0, 7.0, 7.0, 7.0, 7.0]
    advantages = trainer.compute_advantages(torch.tensor(rewards, dtype=torch.float64), rollout=None)
    torch.testing.assert_close(advantages, torch.tensor(_group_advantages(rewards, 4, scale), dtype=torch.float64))
    # A completion no reward applies to is left out of its group: the others are scored as a group of 3.
    with_none = trainer.compute_advantages(torch.tensor([float("nan")] + rewards[1:4], dtype=torch.float64), None)
    expected = [0.0] + _group_advantages(rewards[1:4], 3, scale)
    torch.testing.assert_close(with_none, torch.tensor(expected, dtype=torch.float64))


def _reference_step(model, sequences, advantages, old, ref, beta, epsilon):
    """GRPO loss (loss_type "grpo": mean over each completion's tokens, then over completions) with the clipped
    ratio to `old` and beta * k3 KL to `ref`, plus mean k3 and the clipped fraction of tokens."""
    logps = _token_logps(model, sequences)
    losses, kls, clipped, tokens = [], [], 0, 0
    for logp, old_logp, ref_logp, advantage in zip(logps, old, ref, advantages):
        ratio = torch.exp(logp - old_logp)
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        losses.append((-surrogate + beta * kl).mean())
        kls.append(kl.detach())
        clipped += int((((ratio < 1 - epsilon) & (advantage < 0)) | ((ratio > 1 + epsilon) & (advantage > 0))).sum())
        tokens += len(logp)
    return torch.stack(losses).mean(), torch.cat(kls).mean().item(), clipped / tokens


def test_loss_gradient_and_kl_match_a_float64_reference(tmp_path, tiny_model_path):
    """Two passes over one round with a KL penalty: the first update's gradient and the second step's loss,
    KL and clipped fraction, recomputed from the rollout in float64."""
    beta, epsilon, lr = 0.2, 0.05, 2.0
    snapshots = ParameterSnapshots()
    trainer = train(stopping_model(tiny_model_path), tmp_path, reward=low_id_fraction, callbacks=[snapshots],
                    loss_type="grpo", beta=beta, epsilon=epsilon, num_iterations=2, max_steps=2, optim="sgd",
                    learning_rate=lr, lr_scheduler_type="constant", max_grad_norm=0.0)
    rollout = trainer.rollout
    sequences = _sequences(rollout)
    assert len({len(c) for _, c in sequences}) > 1
    advantages = _group_advantages(low_id_fraction([c for _, c in sequences]), 4, "group")

    initial = _float64_model(tiny_model_path)
    with torch.no_grad():
        start_logps = _token_logps(initial, sequences)
    loss, kl, _ = _reference_step(initial, sequences, advantages, start_logps, start_logps, beta, epsilon)
    loss.backward()
    for name, param in initial.named_parameters():
        expected = param.detach() - lr * param.grad
        torch.testing.assert_close(snapshots.after_step[0][name].double(), expected, atol=2e-6, rtol=0)
    assert logged(trainer, "loss", 1) == pytest.approx(loss.item(), abs=1e-6) and kl == 0

    updated = _float64_model(tiny_model_path, snapshots.after_step[0])
    with torch.no_grad():
        loss, kl, clipped = _reference_step(updated, sequences, advantages, start_logps, start_logps, beta, epsilon)
    assert kl > 1e-3 and clipped > 0.05  # the KL term and the clip are both exercised
    assert logged(trainer, "loss", 2) == pytest.approx(loss.item(), abs=1e-5)
    assert logged(trainer, "kl", 2) == pytest.approx(kl, abs=1e-6)
    assert logged(trainer, "clip_ratio/region_mean", 2) == pytest.approx(clipped, abs=1e-6)

    # The reference is a separate frozen copy that training does not move.
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    for name, param in trainer.ref_model.named_parameters():
        torch.testing.assert_close(param.double(), dict(_float64_model(tiny_model_path).named_parameters())[name])


def test_peft_reference_is_the_policy_with_its_adapter_off(tmp_path, tiny_model_path):
    from peft import LoraConfig

    trainer = GRPOTrainer(
        tiny_model_path, low_id_fraction, train_dataset=prompt_dataset(),
        args=make_config(tmp_path, beta=0.5, max_steps=3, learning_rate=0.1),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.ref_model is None  # no second model
    trainer.train()
    kls = [logged(trainer, "kl", step) for step in (1, 2, 3)]
    assert kls[0] == pytest.approx(0.0, abs=1e-7) and kls[2] > 1e-4  # LoRA starts as a no-op, then moves
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        expected = _token_logps(base, _sequences(trainer.rollout))
    rollout = trainer.rollout
    for i, logps in enumerate(expected):
        torch.testing.assert_close(rollout.tensors["ref_logps"][i, : len(logps)], logps, atol=1e-5, rtol=0)
    for name, param in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(param, base.state_dict()[name.replace("base_layer.", "")])


def test_rloo_differs_from_grpo_only_in_its_advantages(tmp_path, tiny_model_path):
    settings = dict(reward=low_id_fraction, loss_type="dr_grpo", beta=0.0, optim="sgd", learning_rate=1.0,
                    max_grad_norm=0.0)
    grpo = train(stopping_model(tiny_model_path), tmp_path / "grpo", scale_rewards="none", **settings)
    rloo = train(stopping_model(tiny_model_path), tmp_path / "rloo", trainer_class=RLOOTrainer,
                 config_class=RLOOConfig, num_generations=4, **settings)
    assert torch.equal(grpo.rollout.completion_ids, rloo.rollout.completion_ids)
    rewards = low_id_fraction([c for _, c in _sequences(rloo.rollout)])
    assert len(set(rewards)) > 2
    expected = torch.tensor(_leave_one_out(rewards, 4))
    torch.testing.assert_close(rloo.rollout.tensors["advantages"], expected.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(grpo.rollout.tensors["advantages"], expected.float() * 3 / 4, atol=1e-6, rtol=0)
    # The leave-one-out advantage is n / (n - 1) times the centred one, and so is the loss.
    assert abs(logged(grpo, "loss", 1)) > 1e-4
    assert logged(rloo, "loss", 1) == pytest.approx(logged(grpo, "loss", 1) * 4 / 3, abs=1e-6)


def test_rloo_puts_the_kl_to_the_reference_into_the_reward(tmp_path, tiny_model_path):
    beta = 0.5
    snapshots = ParameterSnapshots()
    trainer = train(stopping_model(tiny_model_path), tmp_path, reward=low_id_fraction, trainer_class=RLOOTrainer,
                    config_class=RLOOConfig, num_generations=4, beta=beta, max_steps=2, learning_rate=0.05,
                    callbacks=[snapshots])
    rollout = trainer.rollout  # generated after the first update, so the policy differs from the reference
    sequences = _sequences(rollout)
    with torch.no_grad():
        policy = _token_logps(_float64_model(tiny_model_path, snapshots.after_step[0]), sequences)
        reference = _token_logps(_float64_model(tiny_model_path), sequences)
    rewards = low_id_fraction([c for _, c in sequences])
    kl = [(p - r).sum().item() for p, r in zip(policy, reference)]
    assert max(abs(k) for k in kl) > 1e-2
    expected = _leave_one_out([r - beta * k for r, k in zip(rewards, kl)], 4)
    torch.testing.assert_close(rollout.tensors["advantages"].double(), torch.tensor(expected, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    assert logged(trainer, "reward", 2) == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)  # raw rewards
