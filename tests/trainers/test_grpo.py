"""GRPOTrainer and RLOOTrainer: learning a verifiable reward, advantages and losses against float64
references written out here, the reference model (frozen copy, or the PEFT policy with its adapter off),
and RLOO differing from GRPO only in its advantages."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _paths import subprocess_pythonpath
from _trl import import_trl
from test_engine import (
    ParameterSnapshots,
    logged,
    low_id_fraction,
    make_config,
    prompt_dataset,
    stopping_model,
    target_fraction,
    train,
)
from transformers import AutoModelForCausalLM

import posttrain
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


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

    trainer = train(
        tiny_model_path,
        tmp_path,
        reward=target_tokens,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=12,
        learning_rate=3e-2,
        max_steps=30,
        data=prompt_dataset(64),
    )
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
    return [
        (
            rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist(),
            rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist(),
        )
        for i in range(len(rollout))
    ]


def _token_logps(model, sequences):
    """Per completion, the log-probs of its tokens (one unpadded forward per sequence)."""
    result = []
    for prompt, completion in sequences:
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        result.append(torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)])
    return result


def _group_advantages(rewards, n, scale):
    """Reward minus its group's mean, divided per scale by the group's or the batch's std (+ 1e-4)."""
    batch_std = torch.tensor(rewards, dtype=torch.float64).std().item()
    advantages = []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        mean = sum(group) / n
        group_std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        divisor = {"group": group_std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        advantages += [(r - mean) / divisor for r in group]
    return advantages


def _leave_one_out(rewards, n):
    return [r - (sum(rewards[s : s + n]) - r) / (n - 1) for s in range(0, len(rewards), n) for r in rewards[s : s + n]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_per_scale(tmp_path, tiny_model_path, scale):
    trainer = GRPOTrainer(
        tiny_model_path,
        target_fraction,
        args=make_config(tmp_path, scale_rewards=scale),
        train_dataset=prompt_dataset(),
    )
    rewards = [0.5, 1.0, 3.0, 0.0, 2.0, 2.0, 4.0, -1.0, 7.0, 7.0, 7.0, 7.0]
    groups_of = lambda n: SimpleNamespace(num_generations=n)  # noqa: E731 (the rollout's group size)
    advantages = trainer.compute_advantages(torch.tensor(rewards, dtype=torch.float64), groups_of(4)).advantages
    torch.testing.assert_close(advantages, torch.tensor(_group_advantages(rewards, 4, scale), dtype=torch.float64))
    # Groups follow the rollout (an evaluation round has num_generations_eval completions per prompt).
    advantages = trainer.compute_advantages(torch.tensor(rewards, dtype=torch.float64), groups_of(2)).advantages
    torch.testing.assert_close(advantages, torch.tensor(_group_advantages(rewards, 2, scale), dtype=torch.float64))
    # A completion no reward applies to is left out of its group: the others are scored as a group of 3.
    with_none = trainer.compute_advantages(
        torch.tensor([float("nan")] + rewards[1:4], dtype=torch.float64), groups_of(4)
    ).advantages
    expected = [0.0] + _group_advantages(rewards[1:4], 3, scale)
    torch.testing.assert_close(with_none, torch.tensor(expected, dtype=torch.float64))


def _reference_step(model, sequences, advantages, old, ref, beta, epsilon, bias_correction=True):
    """GRPO loss (loss_type "grpo": mean over each completion's tokens, then over completions) with the clipped
    ratio to `old` and beta * k3 KL to `ref` (times the ratio with `bias_correction`, DeepSeek-V3.2), plus the
    mean KL term and the clipped fraction of tokens."""
    logps = _token_logps(model, sequences)
    losses, kls, clipped, tokens = [], [], 0, 0
    for logp, old_logp, ref_logp, advantage in zip(logps, old, ref, advantages):
        ratio = torch.exp(logp - old_logp)
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        if bias_correction:
            kl = kl * ratio
        losses.append((-surrogate + beta * kl).mean())
        kls.append(kl.detach())
        clipped += int((((ratio < 1 - epsilon) & (advantage < 0)) | ((ratio > 1 + epsilon) & (advantage > 0))).sum())
        tokens += len(logp)
    return torch.stack(losses).mean(), torch.cat(kls).mean().item(), clipped / tokens


@pytest.mark.parametrize("bias_correction", [True, False])
def test_loss_gradient_and_kl_match_a_float64_reference(tmp_path, tiny_model_path, bias_correction):
    """Two passes over one round with a KL penalty: the first update's gradient and the second step's loss,
    KL and clipped fraction, recomputed from the rollout in float64."""
    beta, epsilon, lr = 0.2, 0.05, 2.0
    snapshots = ParameterSnapshots()
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=low_id_fraction,
        callbacks=[snapshots],
        loss_type="grpo",
        beta=beta,
        epsilon=epsilon,
        num_iterations=2,
        max_steps=2,
        optim="sgd",
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        use_bias_correction_kl=bias_correction,
    )
    rollout = trainer.rollout
    sequences = _sequences(rollout)
    assert len({len(c) for _, c in sequences}) > 1
    advantages = _group_advantages(low_id_fraction([c for _, c in sequences]), 4, "group")

    initial = _float64_model(tiny_model_path)
    with torch.no_grad():
        start_logps = _token_logps(initial, sequences)
    loss, kl, _ = _reference_step(
        initial, sequences, advantages, start_logps, start_logps, beta, epsilon, bias_correction
    )
    loss.backward()
    for name, param in initial.named_parameters():
        expected = param.detach() - lr * param.grad
        torch.testing.assert_close(snapshots.after_step[0][name].double(), expected, atol=2e-6, rtol=0)
    assert logged(trainer, "loss", 1) == pytest.approx(loss.item(), abs=1e-6) and kl == 0

    updated = _float64_model(tiny_model_path, snapshots.after_step[0])
    with torch.no_grad():
        loss, kl, clipped = _reference_step(
            updated, sequences, advantages, start_logps, start_logps, beta, epsilon, bias_correction
        )
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
        tiny_model_path,
        low_id_fraction,
        train_dataset=prompt_dataset(),
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
        torch.testing.assert_close(rollout.ref_logps[i, : len(logps)], logps, atol=1e-5, rtol=0)
    for name, param in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(param, base.state_dict()[name.replace("base_layer.", "")])


def test_a_peft_model_given_without_a_tokenizer_gets_its_base_models_tokenizer(tmp_path, tiny_model_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4))
    trainer = GRPOTrainer(model, low_id_fraction, train_dataset=prompt_dataset(), args=make_config(tmp_path))
    assert trainer.processing_class.get_vocab() == tokenizer.get_vocab()  # loaded from the name the base came from


def test_rloo_differs_from_grpo_only_in_its_advantages(tmp_path, tiny_model_path):
    settings = dict(
        reward=low_id_fraction, loss_type="dr_grpo", beta=0.0, optim="sgd", learning_rate=1.0, max_grad_norm=0.0
    )
    grpo = train(stopping_model(tiny_model_path), tmp_path / "grpo", scale_rewards="none", **settings)
    rloo = train(
        stopping_model(tiny_model_path),
        tmp_path / "rloo",
        trainer_class=RLOOTrainer,
        config_class=RLOOConfig,
        num_generations=4,
        **settings,
    )
    assert torch.equal(grpo.rollout.completion_ids, rloo.rollout.completion_ids)
    rewards = low_id_fraction([c for _, c in _sequences(rloo.rollout)])
    assert len(set(rewards)) > 2
    expected = torch.tensor(_leave_one_out(rewards, 4))
    torch.testing.assert_close(rloo.rollout.advantages, expected.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(grpo.rollout.advantages, expected.float() * 3 / 4, atol=1e-6, rtol=0)
    # The leave-one-out advantage is n / (n - 1) times the centred one, and so is the loss.
    assert abs(logged(grpo, "loss", 1)) > 1e-4
    assert logged(rloo, "loss", 1) == pytest.approx(logged(grpo, "loss", 1) * 4 / 3, abs=1e-6)


def test_rloo_puts_the_kl_to_the_reference_into_the_reward(tmp_path, tiny_model_path):
    beta = 0.5
    snapshots = ParameterSnapshots()
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=low_id_fraction,
        trainer_class=RLOOTrainer,
        config_class=RLOOConfig,
        num_generations=4,
        beta=beta,
        max_steps=2,
        learning_rate=0.05,
        callbacks=[snapshots],
    )
    rollout = trainer.rollout  # generated after the first update, so the policy differs from the reference
    sequences = _sequences(rollout)
    with torch.no_grad():
        policy = _token_logps(_float64_model(tiny_model_path, snapshots.after_step[0]), sequences)
        reference = _token_logps(_float64_model(tiny_model_path), sequences)
    rewards = low_id_fraction([c for _, c in sequences])
    kl = [(p - r).sum().item() for p, r in zip(policy, reference)]
    assert max(abs(k) for k in kl) > 1e-2
    expected = _leave_one_out([r - beta * k for r, k in zip(rewards, kl)], 4)
    torch.testing.assert_close(
        rollout.advantages.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0
    )
    assert logged(trainer, "reward", 2) == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)  # raw rewards


# -- side by side with TRL 1.16's GRPOTrainer loss on the same tensors ------------------------------------------
def _stub(cls, **attributes):
    """An instance of `cls` without running its __init__, holding just what the loss reads."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    obj = cls.__new__(cls)
    obj.__dict__.update(accelerator=Accelerator(cpu=True), model=SimpleNamespace(training=True), **attributes)
    return obj


def _side_by_side_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    lengths = [7, 3, 5, 7, 1, 6]
    mask = torch.tensor([[1] * n + [0] * (t - n) for n in lengths], dtype=torch.float32)
    logps = (-torch.rand(b, t, generator=generator) * 3 - 0.05).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(b, t, generator=generator)
    ref = logps.detach() + 0.4 * torch.randn(b, t, generator=generator)
    sampler = old + 0.2 * torch.randn(b, t, generator=generator)
    entropy = torch.rand(b, t, generator=generator) * 4
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2])
    return dict(mask=mask, logps=logps, old=old, ref=ref, sampler=sampler, entropy=entropy, advantages=advantages)


TRL_CASES = {
    "dapo": dict(loss_type="dapo", beta=0.04),
    "grpo-delta": dict(loss_type="grpo", beta=0.04, delta=1.5, epsilon_high=0.28),
    "bnpo-nocorr": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False),
    "dr_grpo-seq": dict(loss_type="dr_grpo", importance_sampling_level="sequence", beta=0.04),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3, beta=0.04),
    "sapo": dict(loss_type="sapo", beta=0.04),
    "vespo": dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate"),
    "entropy-select": dict(loss_type="dapo", top_entropy_quantile=0.3, entropy_coef=0.05),
    "off-policy": dict(loss_type="dapo", off_policy_mask_threshold=0.05, beta=0.04),
    "vllm-token-mask": dict(
        loss_type="dapo", vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.2
    ),
    "vllm-seq-truncate": dict(
        loss_type="grpo",
        vllm_importance_sampling_mode="sequence_truncate",
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=1.5,
    ),
}


@pytest.mark.parametrize("case", sorted(TRL_CASES))
def test_loss_matches_trl_on_the_same_tensors(case, tmp_path):
    """TRL's GRPOTrainer._compute_loss and posttrain's GRPOTrainer.policy_loss on one batch of log-probs,
    entropies and advantages (the forward pass stubbed out): equal loss, gradient and metrics."""
    trl = import_trl("grpo_config", "grpo_trainer")
    options = dict(TRL_CASES[case])
    uses_sampler = "vllm_importance_sampling_mode" in options or "off_policy_mask_threshold" in options
    data = _side_by_side_batch()
    mask, n = data["mask"], data["mask"].shape[0]
    common = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=n,
        num_generations=2,
        use_cpu=True,
        report_to="none",
        bf16=False,
        max_completion_length=9,
        **options,
    )

    ours_args = GRPOConfig(**common)
    ratio = None
    if uses_sampler:
        ratio = _stub(GRPOTrainer, args=ours_args).sampler_ratio(data["old"], data["sampler"], mask)
    trl_args = trl.GRPOConfig(**common)
    copied = (
        "top_entropy_quantile",
        "off_policy_mask_threshold",
        "importance_sampling_level",
        "beta",
        "loss_type",
        "max_completion_length",
        "entropy_coef",
        "use_adaptive_entropy",
        "vllm_importance_sampling_correction",
    )
    theirs = _stub(
        trl.GRPOTrainer,
        args=trl_args,
        **{k: getattr(trl_args, k) for k in copied},
        epsilon_low=trl_args.epsilon,
        epsilon_high=trl_args.epsilon_high or trl_args.epsilon,
        use_vllm=uses_sampler,
        current_gradient_accumulation_steps=1,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=trl_args.entropy_coef != 0.0,
        _metrics={"train": defaultdict(list)},
    )
    theirs._get_per_token_logps_and_entropies = lambda *args, **kwargs: (data["logps"], data["entropy"], None)
    trl_inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1),
        "completion_ids": torch.zeros(n, mask.shape[1], dtype=torch.long),
        "completion_mask": mask,
        "advantages": data["advantages"],
        "old_per_token_logps": data["old"],
        "ref_per_token_logps": data["ref"],
        "num_items_in_batch": mask.sum(),
    }
    if uses_sampler:
        trl_inputs.update(sampling_per_token_logps=data["sampler"], importance_sampling_ratio=ratio)
    trl_loss = theirs._compute_loss(None, trl_inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, data["logps"])

    ours = _stub(GRPOTrainer, args=ours_args, _metrics={"train": defaultdict(list)})
    our_inputs = {
        "loss_mask": mask,
        "advantages": data["advantages"],
        "old_logps": data["old"],
        "ref_logps": data["ref"],
        "total_sequences": n,
        "total_tokens": mask.sum(),
    }
    if uses_sampler:
        our_inputs["sampler_logps"] = data["sampler"]
    our_loss, metrics = ours.policy_loss(our_inputs, data["logps"], data["entropy"])
    (our_grad,) = torch.autograd.grad(our_loss, data["logps"])

    assert abs(trl_loss.item()) > 1e-3
    torch.testing.assert_close(our_loss, trl_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(our_grad, trl_grad, atol=1e-6, rtol=1e-5)
    trl_metrics = {k: v[-1] for k, v in theirs._metrics["train"].items() if k != "entropy"}
    assert trl_metrics, "TRL logged no metric for this case"
    for key, value in trl_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-5), key


# -- GRPO's options, wired through the trainer ---------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(loss_type="ppo"), r"loss_type='ppo' is not one of"),
        (dict(delta=1.1), r"delta=1.1 .* must exceed 1 \+ epsilon"),
        (dict(top_entropy_quantile=1.5), r"top_entropy_quantile=1.5"),
        (dict(off_policy_mask_threshold=0.0), r"off_policy_mask_threshold=0.0"),
        (dict(vllm_importance_sampling_clip_min=3.0), r"clip_min=3.0 must be below"),
        (
            dict(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=None),
            r"both are None",
        ),
        (dict(vllm_importance_sampling_mode="token"), r"vllm_importance_sampling_mode='token' is not one of"),
        (dict(loss_type="vespo", use_vllm=True), r"loss_type='vespo' folds the vLLM correction"),
        (dict(multi_objective_aggregation="mean"), r"multi_objective_aggregation='mean' is not one of"),
        (dict(sapo_temperature_neg=0.0), r"sapo_temperature_neg=0.0 must be > 0"),
        (dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1), r"entropy_coef_min \(0.5\)"),
    ],
)
def test_bad_grpo_options_fail_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(posttrain.errors.ConfigError, match=message):
        make_config(tmp_path, **overrides)


def test_trl_spellings_of_grpo_options(tmp_path):
    assert make_config(tmp_path, scale_rewards=True).scale_rewards == "group"
    assert make_config(tmp_path, scale_rewards=False).scale_rewards == "none"
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        config = make_config(tmp_path, vllm_importance_sampling_cap=2.5)
    assert config.vllm_importance_sampling_clip_max == 2.5 and config.vllm_importance_sampling_cap == 2.5
    for loss_type in ("cispo", "sapo", "luspo", "vespo"):
        assert make_config(tmp_path, loss_type=loss_type).loss_type == loss_type
    with pytest.raises(posttrain.errors.ConfigError, match="loss_type='cispo' is not one of"):
        make_config(tmp_path, config_class=RLOOConfig, num_generations=4, loss_type="cispo")  # GRPO's only


def _first_of_each(completion_ids, **kwargs):
    return [float(ids[0] % 7) for ids in completion_ids]


def _is_short(completion_ids, **kwargs):
    return [None if len(ids) == 8 and ids[-1] % 5 == 0 else float(len(ids) < 5) for ids in completion_ids]


def test_normalize_then_sum_advantages(tmp_path, tiny_model_path):
    """GDPO: each reward function is normalised within its group, the weighted sum over the batch."""
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=[_first_of_each, _is_short],
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 3.0],
        learning_rate=0.0,
    )
    completions = [c for _, c in _sequences(trainer.rollout)]
    columns = [_first_of_each(completions), _is_short(completions)]
    per_function = [
        [math.nan if columns[j][i] is None else columns[j][i] for j in range(2)] for i in range(len(completions))
    ]

    def mean_std(values):
        values = [v for v in values if not math.isnan(v)]
        mean = sum(values) / len(values)
        return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))

    summed = [0.0] * len(completions)
    for start in range(0, len(completions), 4):
        for j, weight in enumerate([1.0, 3.0]):
            mean, std = mean_std([per_function[i][j] for i in range(start, start + 4)])
            for i in range(start, start + 4):
                if not math.isnan(per_function[i][j]):
                    summed[i] += weight * (per_function[i][j] - mean) / (std + 1e-4)
    mean, std = mean_std(summed)
    expected = torch.tensor([(s - mean) / (std + 1e-4) for s in summed])
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(trainer.rollout.advantages, expected, atol=1e-5, rtol=1e-5)


def _step0_reference(trainer, model_path, keep_fraction=1.0):
    """Step 0's dapo loss recomputed in float64 (ratio 1, so each kept token contributes -A / tokens), and
    the mean entropy over all completion tokens and over the kept ones."""
    rollout = trainer.rollout
    sequences = _sequences(rollout)
    model = _float64_model(model_path)
    entropies = []
    with torch.no_grad():
        for prompt, completion in sequences:
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            logps = torch.log_softmax(logits, -1)
            entropies.append(-(logps.exp() * logps).sum(-1))
    flat = torch.cat(entropies)
    threshold = torch.quantile(flat, 1 - keep_fraction)
    advantages = rollout.advantages.double()
    kept = [e >= threshold for e in entropies]
    loss = -sum(a * k.sum() for a, k in zip(advantages, kept)) / flat.numel()
    return loss.item(), flat.mean().item(), flat[flat >= threshold].mean().item(), sum(int(k.sum()) for k in kept)


def test_top_entropy_quantile_trains_only_the_high_entropy_tokens(tmp_path, tiny_model_path):
    trainer = train(stopping_model(tiny_model_path), tmp_path, reward=low_id_fraction, top_entropy_quantile=0.25)
    loss, _, _, kept = _step0_reference(trainer, tiny_model_path, 0.25)
    tokens = int(trainer.rollout.loss_mask.sum())
    assert 0 < kept < tokens / 2 and abs(loss) > 1e-3  # with every token kept the step-0 loss would be ~0
    assert logged(trainer, "loss", 1) == pytest.approx(loss, abs=1e-5)


def test_entropy_bonus_is_subtracted_from_the_loss(tmp_path, tiny_model_path):
    coef = 0.3
    trainer = train(
        stopping_model(tiny_model_path), tmp_path, reward=low_id_fraction, entropy_coef=coef, top_entropy_quantile=0.5
    )
    loss, _, kept_entropy, _ = _step0_reference(trainer, tiny_model_path, 0.5)
    assert logged(trainer, "policy_loss", 1) == pytest.approx(loss, abs=1e-5)
    assert logged(trainer, "loss", 1) == pytest.approx(loss - coef * kept_entropy, abs=1e-4)
    assert logged(trainer, "entropy_coef", 1) == pytest.approx(coef)


@pytest.mark.parametrize("target, direction", [(100.0, 1), (0.0, -1)])
def test_adaptive_entropy_coefficient_moves_and_survives_a_checkpoint(tmp_path, tiny_model_path, target, direction):
    settings = dict(
        reward=low_id_fraction,
        use_adaptive_entropy=True,
        entropy_coef=0.1,
        entropy_coef_delta=0.02,
        entropy_target=target,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=2,
    )
    first = train(tiny_model_path, tmp_path, max_steps=2, **settings)
    coefs = [logged(first, "entropy_coef", step) for step in (1, 2)]
    assert coefs == pytest.approx([0.1 + direction * 0.02, 0.1 + direction * 0.04])
    assert first.entropy_coef == pytest.approx(coefs[-1])  # TRL's attribute: the coefficient now
    # Before the first measurement no bonus applies; at step 2 (entropy ~6 nats) only below a target of 100.
    assert logged(first, "loss", 1) == pytest.approx(logged(first, "policy_loss", 1), abs=1e-6)
    bonus = logged(first, "policy_loss", 2) - logged(first, "loss", 2)
    assert (bonus > 0.05) if direction == 1 else bonus == pytest.approx(0.0, abs=1e-6)

    resumed = GRPOTrainer(
        tiny_model_path,
        low_id_fraction,
        train_dataset=prompt_dataset(),
        args=make_config(tmp_path, max_steps=3, **{k: v for k, v in settings.items() if k != "reward"}),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert logged(resumed, "entropy_coef", 3) == pytest.approx(0.1 + direction * 0.06)


def test_cast_lm_head_to_fp32(tmp_path, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    trainer = train(model, tmp_path, reward=low_id_fraction, cast_lm_head_to_fp32=True, beta=0.1)
    for module in (trainer.model, trainer.ref_model):
        assert module.lm_head.weight.dtype == torch.float32
        assert module.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
        ids = torch.tensor([[5, 6, 7]])
        assert module.get_input_embeddings()(ids).dtype == torch.bfloat16  # tied: outputs keep the model's dtype
        hidden = module.model(input_ids=ids).last_hidden_state
        assert hidden.dtype == torch.bfloat16
        logits = module(input_ids=ids).logits
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, hidden.float() @ module.lm_head.weight.T)
    assert math.isfinite(logged(trainer, "loss", 1))


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_step0_loss_of_each_surrogate_through_the_engine(tmp_path, tiny_model_path, loss_type):
    """On-policy (ratio 1) each surrogate reduces to a closed form, computed here from the rollout in float64:
    cispo -min(1, eps_high) A log pi and vespo -phi(1) A log pi = -A log pi (token mean over the step), sapo
    -(4 / tau) sigmoid(0) A = -(2 / tau) A (mean per completion), luspo -A (token sum / completions)."""
    trainer = train(
        stopping_model(tiny_model_path),
        tmp_path,
        reward=low_id_fraction,
        loss_type=loss_type,
        epsilon_high=0.9,
        sapo_temperature_pos=0.5,
        sapo_temperature_neg=2.0,
        learning_rate=0.0,
    )
    sequences = _sequences(trainer.rollout)
    advantages = trainer.rollout.advantages.double().tolist()
    with torch.no_grad():
        logps = _token_logps(_float64_model(tiny_model_path), sequences)
    tokens = sum(len(c) for _, c in sequences)
    if loss_type in ("cispo", "vespo"):
        weight = 0.9 if loss_type == "cispo" else 1.0
        expected = -sum(weight * a * lp.sum().item() for a, lp in zip(advantages, logps)) / tokens
    elif loss_type == "sapo":
        expected = sum(-(2 / (0.5 if a > 0 else 2.0)) * a for a in advantages) / len(advantages)
    else:
        expected = -sum(a * len(c) for a, (_, c) in zip(advantages, sequences)) / len(sequences)
    assert abs(expected) > 1e-3
    assert logged(trainer, "loss", 1) == pytest.approx(expected, abs=1e-5)


# -- two processes ---------------------------------------------------------------------------------------------
def _two_objective_rewards(completion_ids, **kwargs):
    return [float(len(ids) % 3) for ids in completion_ids]


def grpo_options_record(model_path: str, out_dir: str, per_device: int) -> dict:
    """One SGD step with the options whose statistics span every process: the entropy quantile, GDPO's batch
    normalisation and the adaptive entropy controller (whose bonus is still off at step 1)."""
    snapshots = ParameterSnapshots()
    trainer = train(
        stopping_model(model_path),
        out_dir,
        reward=[low_id_fraction, _two_objective_rewards],
        callbacks=[snapshots],
        optim="sgd",
        learning_rate=1.0,
        max_grad_norm=0.0,
        per_device_train_batch_size=per_device,
        ddp_backend="gloo",
        top_entropy_quantile=0.3,
        multi_objective_aggregation="normalize_then_sum",
        use_adaptive_entropy=True,
        entropy_target=100.0,
        off_policy_mask_threshold=0.5,
    )
    params = snapshots.after_step[0]
    return {
        "world_size": trainer.accelerator.num_processes,
        "params": params,
        "advantages": trainer.rollout.advantages,
        "loss": logged(trainer, "loss", 1),
        "entropy_coef": logged(trainer, "entropy_coef", 1),
        "coef": trainer.entropy_controller.coef,
        "last_entropy": trainer.entropy_controller.last_entropy,
    }


@pytest.mark.slow
def test_grpo_options_on_two_processes_match_one_process(tmp_path, tiny_model_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=subprocess_pythonpath())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        tiny_model_path,
        str(tmp_path / "ddp"),
        "4",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in range(2)]
    single = grpo_options_record(tiny_model_path, str(tmp_path / "single"), 8)
    assert [r["world_size"] for r in ranks] == [2, 2] and single["world_size"] == 1
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), single["advantages"], atol=1e-6, rtol=0)
    for rank in ranks:
        assert rank["loss"] == pytest.approx(single["loss"], abs=1e-6)
        for key in ("entropy_coef", "coef", "last_entropy"):
            assert rank[key] == pytest.approx(single[key], abs=1e-6), key
        for name, value in single["params"].items():
            torch.testing.assert_close(rank["params"][name], value, atol=1e-6, rtol=0)


if __name__ == "__main__":
    model_path, out_dir, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    record = grpo_options_record(model_path, out_dir, per_device)
    assert record["world_size"] == int(os.environ.get("WORLD_SIZE", "1")) == 2, record["world_size"]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(record, Path(out_dir) / f"rank{int(os.environ['RANK'])}.pt")


@pytest.mark.parametrize(
    "trainer_class,config_class,family",
    [
        (GRPOTrainer, GRPOConfig, "qwen3_moe"),
        (RLOOTrainer, RLOOConfig, "qwen3_moe"),
        (GRPOTrainer, GRPOConfig, "mixtral"),
    ],
)
def test_router_aux_loss_joins_the_online_loss(tmp_path, tiny_model_path, trainer_class, config_class, family):
    from posttrain.errors import ConfigError
    from posttrain.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / "moe", family=family, router_aux_loss_coef=0.01)
    for coef in (None, 0.5):
        args = make_config(
            tmp_path / str(coef),
            config_class=config_class,
            router_aux_loss_coef=coef,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
        )
        trainer = trainer_class(path, target_fraction, args=args, train_dataset=prompt_dataset())
        trainer.train()
        assert trainer.state.log_history[0]["aux_loss"] > 0
        batch = trainer.rollout.batch(0, 4)
        batch.update(total_sequences=8, total_tokens=trainer.rollout.step_tokens[0])
        model = trainer.model.eval()
        with torch.no_grad():
            with_aux = trainer.compute_loss(model, dict(batch))
            weight, trainer.router_aux_loss_coef = trainer.router_aux_loss_coef, 0.0
            without = trainer.compute_loss(model, dict(batch))
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            aux = model(
                input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                attention_mask=mask,
                position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                output_router_logits=True,
            ).aux_loss
        assert weight == (0.01 if coef is None else 0.5)
        torch.testing.assert_close(with_aux - without, weight * aux / 2, rtol=1e-4, atol=1e-7)
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.5 weights the load-balancing loss"):
        trainer_class(
            tiny_model_path,
            target_fraction,
            train_dataset=prompt_dataset(),
            args=make_config(tmp_path / "dense", config_class=config_class, router_aux_loss_coef=0.5),
        )
