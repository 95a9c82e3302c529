"""PPOTrainer with the last TRL PPOTrainer's signature and PPOConfig fields (trl.experimental.ppo): an old-TRL
script trains and saves; each mapped field changes what it should (float64 references where it is a formula)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_engine import logged, low_id_fraction, prompt_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
)

from posttrain import PPOConfig, PPOTrainer
from posttrain.errors import ConfigError
from posttrain.losses.policy import kl_estimate


def _config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_ppo_epochs=1,
        response_length=6,
        learning_rate=1e-2,
        logging_steps=1,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        num_sample_generations=0,
        max_steps=1,
    )
    base.update(kw)
    return PPOConfig(**base)


def _tokenized(tokenizer, n):
    """TRL's PPO dataset format: the prompts as token ids in 'input_ids'."""
    return prompt_dataset(n).map(lambda row: tokenizer(row["prompt"]), remove_columns=["prompt", "answer"])


@pytest.fixture(scope="module")
def scorer_path(tiny_model_path, tmp_path_factory):
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    path = tmp_path_factory.mktemp("scorer") / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


def test_old_trl_script_trains_and_saves(tmp_path, tiny_model_path, scorer_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    value_model = AutoModelForSequenceClassification.from_pretrained(scorer_path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(scorer_path, num_labels=1)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref_policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    train_dataset, eval_dataset = _tokenized(tokenizer, 16), _tokenized(tokenizer, 4)
    args = _config(
        tmp_path,
        max_steps=-1,
        total_episodes=8,
        num_ppo_epochs=2,
        stop_token="eos",
        missing_eos_penalty=1.0,
        kl_estimator="k3",
        local_rollout_forward_batch_size=3,
        num_sample_generations=10,
        per_device_eval_batch_size=2,
        exp_name="old_script",
    )
    value_before = value_model.score.weight.detach().clone()
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    assert args.max_steps == 4 and args.max_completion_length == 6 and args.run_name.startswith("old_script__0__")
    assert trainer.train_dataset[3]["prompt_ids"] == train_dataset[3]["input_ids"]  # the given ids, as they are
    trainer.train()
    assert trainer.state.global_step == 4
    assert not torch.equal(trainer.model.value_model.score.weight, value_before)
    for name, param in ref_policy.named_parameters():  # the given reference is used, frozen
        assert not param.requires_grad and torch.equal(
            param, dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())[name]
        )
    samples = [json.loads(line) for line in open(tmp_path / "sample_generations.jsonl")]
    assert len(samples) == 2 * 2 and {s["step"] for s in samples} == {0, 2}  # one eval batch per rollout
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.lm_head.weight, trainer.model.pretrained_model.lm_head.weight)


def test_kl_estimators_match_their_formulas():
    logps = torch.tensor([[-1.2, -0.3, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.7, -0.9, -2.0]], dtype=torch.float64)
    k1 = [lp - r for lp, r in zip(logps[0].tolist(), ref[0].tolist())]
    k3 = [math.exp(r - lp) - 1 - (r - lp) for lp, r in zip(logps[0].tolist(), ref[0].tolist())]
    torch.testing.assert_close(kl_estimate(logps, ref, "k1")[0], torch.tensor(k1, dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(logps, ref, "k3")[0], torch.tensor(k3, dtype=torch.float64))
    assert (kl_estimate(logps, ref, "k3") >= 0).all()


def _rollout_reference(trainer, kl_coef, whiten_rewards, estimator):
    """Sequence KL (objective/kl) and GAE returns recomputed in float64 from the rollout's tensors."""
    r = trainer.rollout
    mask = r.completion_mask.bool()
    old, ref, values = (getattr(r, k).double() for k in ("old_logps", "ref_logps", "old_values"))
    kl = torch.where(mask, (old - ref) if estimator == "k1" else torch.expm1(ref - old) - (ref - old), 0.0)
    rewards = -kl_coef * kl
    last = mask.sum(1) - 1
    rewards[torch.arange(len(r)), last] += r.rewards.double()
    if whiten_rewards:
        valid = rewards[mask]
        rewards = torch.where(mask, (rewards - valid.mean()) / (valid.var() + 1e-8).sqrt() + valid.mean(), 0.0)
    returns = torch.zeros_like(rewards)
    for row in range(len(r)):
        advantage, n = 0.0, int(mask[row].sum())
        for t in reversed(range(n)):
            next_value = values[row, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[row, t].item() + next_value - values[row, t].item()
            advantage = delta + 0.95 * advantage
            returns[row, t] = advantage + values[row, t].item()
    return kl.sum(1).mean().item(), returns


@pytest.mark.parametrize("estimator,whiten_rewards", [("k1", False), ("k3", True)])
def test_kl_estimator_and_whiten_rewards_shape_the_rewards(tmp_path, tiny_model_path, estimator, whiten_rewards):
    other = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        other.lm_head.weight.mul_(3.0)  # a reference that differs from the policy: KL > 0 at the first rollout
    trainer = PPOTrainer(
        model=tiny_model_path,
        ref_model=other,
        reward_model=low_id_fraction,
        train_dataset=prompt_dataset(8),
        args=_config(tmp_path, kl_coef=0.2, kl_estimator=estimator, whiten_rewards=whiten_rewards, use_value_head=True),
    )
    trainer.train()
    kl, returns = _rollout_reference(trainer, 0.2, whiten_rewards, estimator)
    assert kl > 0.01 and logged(trainer, "objective/kl", 1) == pytest.approx(kl, rel=1e-5)
    mask = trainer.rollout.completion_mask.bool()
    torch.testing.assert_close(trainer.rollout.returns.double()[mask], returns[mask], rtol=1e-5, atol=1e-5)


def test_total_episodes_response_length_and_stop_token_id(tmp_path, tiny_model_path):
    args = _config(tmp_path, max_steps=-1, total_episodes=10, num_ppo_epochs=3)
    assert args.max_steps == math.ceil(10 / 4) * 3
    with pytest.raises(ConfigError, match="total_episodes=10 and max_steps=5 both"):
        _config(tmp_path, total_episodes=10, max_steps=5)
    assert PPOConfig(output_dir=str(tmp_path), use_cpu=True, max_completion_length=9).response_length == 9
    with pytest.raises(ConfigError, match="response_length=7 and max_completion_length=9"):
        _config(tmp_path, response_length=7, max_completion_length=9)
    assert (
        PPOConfig(output_dir=str(tmp_path), use_cpu=True).temperature,
        PPOConfig(output_dir=str(tmp_path), use_cpu=True).max_completion_length,
    ) == (0.7, 53)
    stop = 150
    trainer = PPOTrainer(
        model=tiny_model_path,
        reward_model=low_id_fraction,
        train_dataset=prompt_dataset(8),
        args=_config(tmp_path, stop_token_id=stop, response_length=64, use_value_head=True),
    )
    completions = trainer.generation_backend.generate([[5, 6, 7]] * 64, 1, trainer.sampling, seed=0)
    ended = [c for c in completions if c.token_ids[-1] == stop]
    assert ended and all(c.finished_with_eos for c in ended)
    assert all(stop not in c.token_ids[:-1] for c in completions)


def test_named_adapters_train_one_and_reference_the_other(tmp_path, tiny_model_path):
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    lora = dict(r=4, target_modules=["q_proj", "v_proj"])
    policy = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="policy_adapter")
    policy.add_adapter("ref_adapter", peft.LoraConfig(**lora, init_lora_weights=False))
    ref_before = {n: p.detach().clone() for n, p in policy.named_parameters() if ".ref_adapter." in n}
    train_before = {n: p.detach().clone() for n, p in policy.named_parameters() if ".policy_adapter." in n}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trainer = PPOTrainer(
        model=policy,
        reward_model=low_id_fraction,
        train_dataset=prompt_dataset(8),
        processing_class=tokenizer,
        args=_config(
            tmp_path,
            use_value_head=True,
            kl_coef=0.1,
            model_adapter_name="policy_adapter",
            ref_adapter_name="ref_adapter",
        ),
    )
    trainer.train()
    assert logged(trainer, "objective/kl", 1) != 0  # the new policy adapter is the base, the reference's is not
    params = dict(policy.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in ref_before.items())
    assert any(not torch.equal(params[n], p) for n, p in train_before.items())
    with pytest.raises(ConfigError, match=r"Adapters \['nope'\]"):
        PPOTrainer(
            model=policy,
            reward_model=low_id_fraction,
            train_dataset=prompt_dataset(8),
            processing_class=tokenizer,
            args=_config(tmp_path, use_value_head=True, ref_adapter_name="nope"),
        )


def test_old_signature_errors(tmp_path, tiny_model_path):
    args = _config(tmp_path, use_value_head=True)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cases = [
        (dict(model=policy, ref_model=policy, reward_model=low_id_fraction), "ref_model is the policy itself"),
        (dict(model=policy, reward_model=low_id_fraction, reward_funcs=low_id_fraction), "pass only one"),
        (dict(model=policy, reward_model=low_id_fraction, data_collator=lambda rows: rows), "drop data_collator"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            PPOTrainer(args=args, train_dataset=prompt_dataset(8), **kwargs)
    with pytest.raises(ConfigError, match="Pass the TRL arguments by keyword"):
        PPOTrainer(args, None, policy)
    for setting, message in [
        ({"kl_estimator": "k2"}, "kl_estimator='k2'"),
        ({"stop_token": "eot"}, "'eos'"),
        ({"stop_token": "eos", "stop_token_id": 3}, "set only one"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _config(tmp_path, **setting)
