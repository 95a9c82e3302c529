"""GRPO's relatives in posttrain.experimental: GMPO and A*-PO. Their objectives against float64 references written
here from the papers, TRL 1.16's trainers side by side on the same tensors, and tiny-model learning tests."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
from _trl import import_trl, import_trl_experimental
from test_engine import make_config, prompt_dataset, train
from test_grpo import _side_by_side_batch, _stub

import posttrain
from posttrain.experimental.gmpo import GMPOConfig, GMPOTrainer
from posttrain.losses.grpo_family import a2po_loss, a2po_optimal_values, gmpo_objective


# -- GMPO ----------------------------------------------------------------------------------------------------
def _gmpo_reference(logps, old, adv, mask, eps_low, eps_high, beta=0.0, ref=None):
    """Per completion, in float64 and plain loops: -A * exp(mean over tokens of the sign-aware clipped log ratio)
    + beta * mean k3 KL (GMPO paper, eq. 5 with the token clip of its Algorithm 1)."""
    out = []
    for i in range(logps.shape[0]):
        clipped, kls = [], []
        for t in range(logps.shape[1]):
            if not mask[i, t]:
                continue
            lr = float(logps[i, t]) - float(old[i, t])
            bound = min(max(lr, -eps_low), eps_high)
            clipped.append(min(lr, bound) if adv[i] > 0 else max(lr, bound))
            if ref is not None:
                d = float(ref[i, t]) - float(logps[i, t])
                kls.append(math.exp(d) - d - 1)
        value = -float(adv[i]) * math.exp(sum(clipped) / len(clipped))
        if beta:
            value += beta * sum(kls) / len(kls)
        out.append(value)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("eps_low, eps_high, beta", [(0.4, 0.4, 0.0), (0.1, 0.25, 0.05)])
def test_gmpo_objective_matches_a_float64_reference(eps_low, eps_high, beta):
    data = _side_by_side_batch(seed=3)
    logps = (data["logps"].detach().double() + 0.0).requires_grad_(True)
    old, ref, adv = data["old"].double(), data["ref"].double(), data["advantages"].double()
    mask = data["mask"]
    loss, stats = gmpo_objective(
        logps, old, adv, mask, epsilon_low=eps_low, epsilon_high=eps_high, ref_logps=ref, beta=beta
    )
    expected = _gmpo_reference(logps.detach(), old, adv, mask, eps_low, eps_high, beta, ref)
    torch.testing.assert_close(loss.detach(), expected, atol=1e-12, rtol=1e-10)
    # Some tokens are clipped on each side, so the clip really is exercised.
    assert 0 < float(stats["clip_ratio"]) < 1
    # Clipped tokens get no gradient; the others carry -A * w / n.
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    lr = logps.detach() - old
    for i in range(6):
        n = int(mask[i].sum())
        for t in range(n):
            outside = (lr[i, t] > eps_high) if adv[i] > 0 else (lr[i, t] < -eps_low)
            kl_grad = beta * (1 - math.exp(float(ref[i, t] - logps.detach()[i, t]))) / n
            if outside:
                assert float(grad[i, t]) == pytest.approx(kl_grad, abs=1e-12)
        assert float(grad[i, n:].abs().sum()) == 0.0


def test_gmpo_keep_selects_the_tokens_of_the_geometric_mean():
    data = _side_by_side_batch(seed=1)
    keep = torch.rand(data["mask"].shape, generator=torch.Generator().manual_seed(0)) > 0.5
    keep[:, 0] = True
    loss, _ = gmpo_objective(data["logps"].detach(), data["old"], data["advantages"], data["mask"], keep=keep)
    expected = _gmpo_reference(data["logps"].detach(), data["old"], data["advantages"], data["mask"] * keep, 0.4, 0.4)
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)


def _import_trl_experimental(name: str):
    trl = import_trl("grpo_config", "grpo_trainer")
    return trl, import_trl_experimental(name)


@pytest.mark.parametrize(
    "options", [dict(beta=0.0), dict(beta=0.04, epsilon=0.2, epsilon_high=0.3), dict(top_entropy_quantile=0.5)]
)
def test_gmpo_loss_matches_trl_on_the_same_tensors(options, tmp_path):
    """TRL's GMPOTrainer._compute_loss and posttrain's GMPOTrainer.policy_loss on one batch: equal loss, gradient
    and clip metrics."""
    trl, gmpo = _import_trl_experimental("gmpo")
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
    trl_args = gmpo.GMPOConfig(**common)
    theirs = _stub(
        gmpo.GMPOTrainer,
        args=trl_args,
        beta=trl_args.beta,
        epsilon_low=trl_args.epsilon,
        epsilon_high=trl_args.epsilon_high or trl_args.epsilon,
        top_entropy_quantile=trl_args.top_entropy_quantile,
        current_gradient_accumulation_steps=1,
        _metrics={"train": defaultdict(list)},
    )
    theirs._get_per_token_logps_and_entropies = lambda *args, **kwargs: (data["logps"], data["entropy"], None)
    trl_loss = theirs._compute_loss(
        None,
        {
            "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
            "prompt_mask": torch.ones(n, 1),
            "completion_ids": torch.zeros(n, mask.shape[1], dtype=torch.long),
            "completion_mask": mask,
            "advantages": data["advantages"],
            "old_per_token_logps": data["old"],
            "ref_per_token_logps": data["ref"],
        },
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, data["logps"])

    ours = _stub(GMPOTrainer, args=GMPOConfig(**common), _metrics={"train": defaultdict(list)})
    our_loss, metrics = ours.policy_loss(
        {
            "loss_mask": mask,
            "advantages": data["advantages"],
            "old_logps": data["old"],
            "ref_logps": data["ref"],
            "total_sequences": n,
            "total_tokens": mask.sum(),
        },
        data["logps"],
        data["entropy"],
    )
    (our_grad,) = torch.autograd.grad(our_loss, data["logps"])
    assert abs(trl_loss.item()) > 1e-3
    torch.testing.assert_close(our_loss, trl_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(our_grad, trl_grad, atol=1e-6, rtol=1e-5)
    trl_metrics = {k: v[-1] for k, v in theirs._metrics["train"].items() if k != "entropy"}
    assert "clip_ratio/region_mean" in trl_metrics
    for key, value in trl_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-5), key


def test_gmpo_defaults_and_refused_options(tmp_path):
    config = GMPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (config.epsilon, config.epsilon_high, config.num_generations) == (0.4, None, 8)
    for option in (
        dict(loss_type="grpo"),
        dict(delta=2.0),
        dict(importance_sampling_level="sequence"),
        dict(entropy_coef=0.01),
        dict(off_policy_mask_threshold=0.5),
    ):
        name = next(iter(option))
        with pytest.raises(posttrain.errors.ConfigError, match=f"GMPOConfig.{name}="):
            GMPOConfig(output_dir=str(tmp_path), use_cpu=True, **option)


def test_gmpo_learns_a_verifiable_reward(tmp_path, tiny_model_path):
    """The tiny model learns to emit four chosen tokens (about 1 in 96 of its tokens at the start)."""
    targets = {298, 299, 300, 301}

    def target_tokens(completion_ids, **kwargs):
        return [sum(t in targets for t in ids) / len(ids) for ids in completion_ids]

    trainer = train(
        tiny_model_path,
        tmp_path,
        reward=target_tokens,
        trainer_class=GMPOTrainer,
        config_class=GMPOConfig,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=12,
        learning_rate=3e-2,
        max_steps=20,
        data=prompt_dataset(64),
    )
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print("GMPO reward", rewards[0], "->", rewards[-1])
    assert sum(rewards[:3]) / 3 < 0.05
    assert sum(rewards[-3:]) / 3 > 0.5


# -- A*-PO ---------------------------------------------------------------------------------------------------
from posttrain.experimental.a2po import A2POConfig, A2POTrainer  # noqa: E402


def test_a2po_optimal_values_and_loss_match_float64_references():
    rewards = torch.tensor(
        [[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64
    )
    for beta1 in (0.5, 0.05, 3.0):
        expected = [beta1 * math.log(sum(math.exp(r / beta1) for r in row) / 4) for row in rewards.tolist()]
        torch.testing.assert_close(a2po_optimal_values(rewards, beta1), torch.tensor(expected, dtype=torch.float64))
    # A soft maximum: between the mean and the best reward.
    values = a2po_optimal_values(rewards, 0.5)
    assert bool((values >= rewards.mean(1) - 1e-12).all() and (values <= rewards.max(1).values + 1e-12).all())

    logp = torch.tensor([-12.0, -3.5, -7.25], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-11.0, -4.0, -7.0], dtype=torch.float64)
    r, v = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64), torch.tensor([0.6, 0.2, 0.9], dtype=torch.float64)
    loss, stats = a2po_loss(logp, ref, r, v, beta2=0.1)
    want = [(0.1 * (a - b) - (c - d)) ** 2 for a, b, c, d in zip(logp.tolist(), ref.tolist(), r.tolist(), v.tolist())]
    torch.testing.assert_close(loss.detach(), torch.tensor(want, dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    want_grad = [
        2 * 0.1 * (0.1 * (a - b) - (c - d)) for a, b, c, d in zip(logp.tolist(), ref.tolist(), r.tolist(), v.tolist())
    ]
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64))
    assert float(stats["advantage"]) == pytest.approx((0.4 - 0.2 + 0.1) / 3)


def test_a2po_loss_matches_trl_on_the_same_model_and_completions(tmp_path, tiny_model_path):
    """TRL's A2POTrainer.compute_loss and posttrain's on the same tiny model, prompts, completions, rewards and V*."""
    import_trl("grpo_config")
    a2po = import_trl_experimental("a2po")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    generator = torch.Generator().manual_seed(0)
    b, p, t = 4, 5, 6
    prompt_ids = torch.randint(3, 200, (b, p), generator=generator)
    completion_ids = torch.randint(3, 200, (b, t), generator=generator)
    completion_mask = torch.tensor([[1] * k + [0] * (t - k) for k in (6, 3, 5, 1)])
    ref_per_token = -torch.rand(b, t, generator=generator) * 6
    rewards, v_star = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.7, 0.3, 0.2, 0.05])
    common = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, beta2=0.05, per_device_train_batch_size=b
    )

    theirs = _stub(
        a2po.A2POTrainer,
        args=a2po.A2POConfig(**common),
        _metrics={"train": defaultdict(list)},
        model_kwarg_keys={"input_ids", "attention_mask", "logits_to_keep"},
    )
    trl_loss = theirs.compute_loss(
        model,
        {
            "input_ids": torch.cat([prompt_ids, completion_ids], 1),
            "attention_mask": torch.cat([torch.ones(b, p, dtype=torch.long), completion_mask], 1),
            "logits_to_keep": t,
            "ref_logps": (ref_per_token * completion_mask).sum(1),
            "rewards": rewards,
            "v_star": v_star,
        },
    )

    ours = _stub(A2POTrainer, args=A2POConfig(**common), _metrics={"train": defaultdict(list)})
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    logps, _ = ours.completion_logps(model, batch)
    our_loss, stats = ours.policy_loss(
        {
            **batch,
            "loss_mask": completion_mask,
            "ref_logps": ref_per_token,
            "advantages": rewards - v_star,
            "total_sequences": b,
        },
        logps,
    )
    assert trl_loss.item() > 1e-3
    torch.testing.assert_close(our_loss, trl_loss, atol=1e-6, rtol=1e-5)
    for key in ("implicit_reward", "advantage"):
        assert float(stats[key]) == pytest.approx(theirs._metrics["train"][key][-1], abs=1e-6), key


def test_a2po_config_matches_trl_fields_and_refuses_grpo_only_options(tmp_path):
    config = A2POConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (
        config.num_value_samples,
        config.beta1,
        config.filter_all_incorrect,
        config.beta2,
        config.num_generations,
        config.max_completion_length,
        config.max_prompt_length,
        config.learning_rate,
    ) == (8, 0.5, True, 1e-3, 1, 256, 512, 5e-5)
    for option in (dict(beta=0.04), dict(loss_type="grpo"), dict(dynamic_sampling=True, num_generations=2)):
        with pytest.raises(posttrain.errors.ConfigError, match=f"A2POConfig.{next(iter(option))}="):
            A2POConfig(output_dir=str(tmp_path), use_cpu=True, **option)
    with pytest.raises(posttrain.errors.ConfigError, match="beta2 > 0"):
        A2POConfig(output_dir=str(tmp_path), use_cpu=True, beta2=0.0)
    import inspect

    names = list(inspect.signature(A2POTrainer.__init__).parameters)[1:9]
    assert names == [
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "callbacks",
        "optimizers",
    ]


@pytest.mark.parametrize("name", ["tools", "rollout_func", "environment_factory"])
def test_a2po_refuses_the_online_trainers_episode_arguments_by_name(tmp_path, name):
    """A2PO's V*(x) is estimated from plain samples of the dataset's prompts and regressed on one plain completion
    per prompt; tools, a custom rollout or environments would break that, so each is refused by name before any
    model is loaded (the model argument here is not even a model)."""
    args = A2POConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(posttrain.errors.ConfigError, match=f"A2POTrainer does not take {name}=: .*Leave {name} out"):
        A2POTrainer("not-a-model", [lambda **kw: [0.0]], args=args, **{name: lambda *a, **k: None})


TARGETS = {298, 299, 300, 301}


def any_target(completion_ids, **kwargs):
    """Binary: 1 when the completion holds one of four chosen tokens."""
    return [float(any(t in TARGETS for t in ids)) for ids in completion_ids]


def test_a2po_stage1_estimates_v_star_and_drops_unsolvable_prompts(tmp_path, tiny_model_path):
    trainer = A2POTrainer(
        tiny_model_path,
        any_target,
        args=make_config(
            tmp_path,
            A2POConfig,
            per_device_train_batch_size=4,
            num_generations=1,
            max_completion_length=8,
            num_value_samples=4,
        ),
        train_dataset=prompt_dataset(32),
    )
    trainer.estimate_optimal_values()
    assert len(trainer.optimal_values) == 32
    values = torch.tensor(list(trainer.optimal_values.values()))
    assert bool((values >= 0).all() and (values <= 1).all())
    solved = int((values > 0).sum())
    assert 0 < solved < 32 and len(trainer.train_dataset) == solved  # all-zero prompts have V* = 0 and are gone


def test_a2po_learns_a_binary_reward(tmp_path, tiny_model_path):
    trainer = train(
        tiny_model_path,
        tmp_path,
        reward=any_target,
        trainer_class=A2POTrainer,
        config_class=A2POConfig,
        per_device_train_batch_size=16,
        num_generations=1,
        max_completion_length=12,
        num_value_samples=4,
        beta2=0.1,
        learning_rate=3e-2,
        max_steps=20,
        data=prompt_dataset(64),
        filter_all_incorrect=False,
    )
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print("A2PO reward", rewards[:3], "->", rewards[-3:])
    assert "v_star" in trainer.state.log_history[0] and "implicit_reward" in trainer.state.log_history[0]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3


# -- GSPO-token --------------------------------------------------------------------------------------------
def test_gspo_token_has_the_sequence_ratio_and_per_token_gradients():
    """GSPO paper, eq. for GSPO-token: s_t = sg(s) * pi(y_t) / sg(pi(y_t)), s = exp(mean_t log(pi / pi_old)); the
    clipped surrogate -min(s_t A_t, clip(s_t) A_t) then has the value of GSPO's and, per token, the gradient -A_t s
    where not clipped (0 where clipped)."""
    from posttrain.losses.policy import policy_objective

    data = _side_by_side_batch(seed=5)
    mask = data["mask"]
    logps = data["logps"].detach().double().requires_grad_(True)
    old = data["old"].double()
    token_adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    loss, _ = policy_objective(
        logps, old, token_adv, mask, importance_sampling_level="sequence_token", epsilon_low=0.2, epsilon_high=0.28
    )
    (grad,) = torch.autograd.grad(loss.sum(), logps)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        s = math.exp(sum(float(logps.detach()[i, t] - old[i, t]) for t in range(n)) / n)
        for t in range(mask.shape[1]):
            if t >= n:
                assert float(loss[i, t]) == 0.0 and float(grad[i, t]) == 0.0
                continue
            a = float(token_adv[i, t])
            clipped = min(max(s, 0.8), 1.28)
            assert float(loss[i, t]) == pytest.approx(-min(s * a, clipped * a), abs=1e-12)
            active = s * a <= clipped * a
            assert float(grad[i, t]) == pytest.approx(-a * s if active else 0.0, abs=1e-12)
    # With one advantage per completion the value equals GSPO's (sequence level).
    seq_loss, _ = policy_objective(
        logps.detach(), old, data["advantages"].double(), mask, importance_sampling_level="sequence"
    )
    tok_loss, _ = policy_objective(
        logps.detach(), old, data["advantages"].double(), mask, importance_sampling_level="sequence_token"
    )
    torch.testing.assert_close(tok_loss, seq_loss)


def test_gspo_token_is_a_grpo_config_choice(tmp_path):
    assert (
        make_config(tmp_path, importance_sampling_level="sequence_token").importance_sampling_level == "sequence_token"
    )


# -- GRPO with a replay buffer ---------------------------------------------------------------------------------
from posttrain.experimental.grpo_with_replay_buffer import (  # noqa: E402
    GRPOWithReplayBufferConfig,
    GRPOWithReplayBufferTrainer,
    ReplayBuffer,
)


def test_replay_buffer_keeps_the_highest_scores_and_samples_in_proportion():
    buffer = ReplayBuffer(3)
    for score in (0.5, 2.0, 0.1, 1.0, 0.3, 4.0):
        buffer.add(score, {"score": score})
    assert sorted(entry[0] for entry in buffer.heap) == [1.0, 2.0, 4.0]
    draws = buffer.sample(7000, torch.Generator().manual_seed(0))
    for score in (1.0, 2.0, 4.0):
        share = sum(d["score"] == score for d in draws) / len(draws)
        assert share == pytest.approx(score / 7.0, abs=0.02)
    restored = ReplayBuffer(3)
    restored.load_state(buffer.state())
    restored.add(1.5, {"score": 1.5})
    assert sorted(entry[0] for entry in restored.heap) == [1.5, 2.0, 4.0]


def _replay_trainer(model_path, out, reward, callbacks=None, **overrides):
    from test_dynamic_sampling import Recorder

    recorder = Recorder(reward)
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=6, replay_buffer_size=4
    )
    args = make_config(out, GRPOWithReplayBufferConfig, **{**settings, **overrides})
    trainer = GRPOWithReplayBufferTrainer(
        model_path, recorder, args=args, train_dataset=prompt_dataset(16), callbacks=callbacks
    )
    return recorder.watch(trainer), recorder


def test_replay_buffer_replaces_zero_variance_groups(tmp_path, tiny_model_path):
    from test_dynamic_sampling import half_constant

    generated = []
    trainer, recorder = _replay_trainer(tiny_model_path, tmp_path, half_constant)
    replay = trainer.replay

    def watched(rollout, round_index):
        n = rollout.num_generations
        before = [
            (
                rollout.completion_ids[g * n : (g + 1) * n].clone(),
                rollout.completion_mask[g * n : (g + 1) * n],
                rollout.rewards[g * n : (g + 1) * n].clone(),
                rollout.advantages[g * n : (g + 1) * n].clone(),
            )
            for g in range(len(rollout) // n)
        ]
        # float64 reference of each group's buffer score: unbiased std of its rewards times sum |advantages|.
        scores = [float(r.double().std() * a.double().abs().sum()) for _, _, r, a in before if (r != r[0]).any()]
        had = {entry[1] for entry in trainer.replay_buffer.heap}
        result = replay(rollout, round_index)
        added = sorted(entry[0] for entry in trainer.replay_buffer.heap if entry[1] not in had)
        assert all(any(abs(a - s) < 1e-6 for s in scores) for a in added)
        generated.extend(before)
        return result

    trainer.replay = watched
    trainer.train()
    rounds = recorder.trained
    assert len(rounds) == 6
    replayed = _series_of(trainer, "replay_buffer/frac_replayed")
    assert len(replayed) == 6 and sum(replayed) > 0
    for groups in rounds[1:]:  # once the buffer holds a group, no zero-variance group is trained
        assert all(bool((g != g[0]).any()) for g in groups)
    # A replayed group is one generated earlier, with the rewards and advantages it had then.
    final = trainer.rollout
    n = final.num_generations
    for g in range(len(final) // n):
        ids = final.completion_ids[g * n : (g + 1) * n]
        width = int(final.completion_mask[g * n : (g + 1) * n].sum(1).max())
        assert any(
            torch.equal(ids[:, :width], c[:, :width]) and not bool(m[:, width:].any()) for c, m, _, _ in generated
        )


def _series_of(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_replay_buffer_size_zero_is_plain_grpo(tmp_path, tiny_model_path):
    from test_dynamic_sampling import half_constant

    trainer, recorder = _replay_trainer(
        tiny_model_path, tmp_path / "a", half_constant, replay_buffer_size=0, max_steps=2
    )
    trainer.train()
    plain = train(
        tiny_model_path,
        tmp_path / "b",
        reward=half_constant,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
    )
    for (name, ours), (_, theirs) in zip(trainer.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(ours, theirs, msg=name)
    with pytest.raises(posttrain.errors.ConfigError, match="replay_buffer_size=-1"):
        make_config(tmp_path, GRPOWithReplayBufferConfig, replay_buffer_size=-1)


def test_replay_buffer_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_model_path):
    from test_dynamic_sampling import half_constant
    from test_resume import _logged, _StopAfter

    def make(out, callbacks):
        return _replay_trainer(
            tiny_model_path,
            out,
            half_constant,
            callbacks=callbacks,
            save_strategy="steps",
            save_steps=3,
            logging_steps=1,
        )[0]

    straight = make(tmp_path / "straight", None)
    straight.train()
    make(tmp_path / "run", [_StopAfter(3)]).train()
    resumed = make(tmp_path / "run", None)
    resumed.train(resume_from_checkpoint=True)
    expected = dict(straight.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)
    want, got = _logged(straight, range(4, 7)), _logged(resumed, range(4, 7))
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)


def test_grpo_with_replay_buffer_learns(tmp_path, tiny_model_path):
    def sparse_target(completion_ids, **kwargs):
        """Often the same for a whole group: 1 if a chosen token appears in the completion, else 0."""
        return [float(any(t in TARGETS for t in ids)) for ids in completion_ids]

    trainer = train(
        tiny_model_path,
        tmp_path,
        reward=sparse_target,
        trainer_class=GRPOWithReplayBufferTrainer,
        config_class=GRPOWithReplayBufferConfig,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        learning_rate=3e-2,
        max_steps=20,
        data=prompt_dataset(64),
        replay_buffer_size=8,
    )
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print("replay-buffer GRPO reward", rewards[:3], "->", rewards[-3:])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3
