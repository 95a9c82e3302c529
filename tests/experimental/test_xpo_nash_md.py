"""XPO and Nash-MD (posttrain.experimental.xpo / nash_md): their losses and the geometric mixture against float64
references from the papers, where their second completion comes from, the judge path, and learning on a task
with a known answer."""

from __future__ import annotations

import pytest
import torch
from test_engine import low_id_fraction, prompt_dataset
from test_online_dpo import LowIdJudge, config, learning_run

from posttrain.errors import ConfigError
from posttrain.experimental.nash_md import NashMDConfig, NashMDTrainer, sample_completions
from posttrain.experimental.xpo import XPOConfig, XPOTrainer
from posttrain.generation.base import SamplingParams
from posttrain.losses.online_preference import geometric_mixture_logps, nash_md_loss, xpo_loss


# -- losses ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_xpo_loss_is_dpo_plus_alpha_log_pi_of_the_reference_sample(loss_type):
    torch.manual_seed(1)
    c, r, rc, rr, explore = (torch.randn(6, dtype=torch.float64) * 4 for _ in range(5))
    beta, alpha = 0.2, 0.7
    total, dpo, exploration, margin = xpo_loss(c, r, rc, rr, explore, beta, alpha, loss_type)
    for i in range(6):
        h = (c[i] - rc[i]) - (r[i] - rr[i])
        sigmoid = -torch.nn.functional.logsigmoid(beta * h)
        expected_dpo = sigmoid if loss_type == "sigmoid" else (h - 1 / (2 * beta)) ** 2
        assert dpo[i].item() == pytest.approx(expected_dpo.item(), abs=1e-9)
        assert exploration[i].item() == pytest.approx(alpha * explore[i].item(), abs=1e-12)
        assert total[i].item() == pytest.approx(expected_dpo.item() + alpha * explore[i].item(), abs=1e-9)
        assert margin[i].item() == pytest.approx(beta * h.item(), abs=1e-9)


def test_nash_md_loss_value_and_gradient_follow_the_mirror_descent_step():
    """Value beta * sum_t sg(log pi - log pi_ref) log pi - (P - 1/2) sum_t log pi; gradient
    beta * sum_t (log pi - log pi_ref) grad log pi - (P - 1/2) sum_t grad log pi, checked per token."""
    torch.manual_seed(2)
    logps = (torch.rand(3, 5, dtype=torch.float64) * -3).requires_grad_()
    ref = torch.rand(3, 5, dtype=torch.float64) * -3
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    p = torch.tensor([0.9, 0.2, 0.5], dtype=torch.float64)
    beta = 0.3
    losses, score, kl = nash_md_loss(logps, ref, mask, p, beta)
    losses.sum().backward()
    for i in range(3):
        total_logp = sum(logps[i, t].item() for t in range(5) if mask[i, t])
        kl_i = sum(logps[i, t].item() - ref[i, t].item() for t in range(5) if mask[i, t])
        surrogate = sum((logps[i, t].item() - ref[i, t].item()) * logps[i, t].item() for t in range(5) if mask[i, t])
        assert losses[i].item() == pytest.approx(beta * surrogate - (p[i].item() - 0.5) * total_logp, abs=1e-9)
        assert kl[i].item() == pytest.approx(kl_i, abs=1e-9)
        assert score[i].item() == pytest.approx((p[i].item() - 0.5) * total_logp, abs=1e-9)
        for t in range(5):
            expected = (beta * (logps[i, t].item() - ref[i, t].item()) - (p[i].item() - 0.5)) * mask[i, t].item()
            assert logps.grad[i, t].item() == pytest.approx(expected, abs=1e-9)


def test_geometric_mixture_is_the_normalised_product_of_powers():
    torch.manual_seed(3)
    policy, ref = torch.randn(2, 7, dtype=torch.float64), torch.randn(2, 7, dtype=torch.float64)
    c = 0.3
    mixture = geometric_mixture_logps(policy, ref, c)
    for row in range(2):
        p, q = torch.softmax(policy[row], 0), torch.softmax(ref[row], 0)
        unnormalised = [p[v].item() ** (1 - c) * q[v].item() ** c for v in range(7)]
        for v in range(7):
            assert mixture[row, v].exp().item() == pytest.approx(unnormalised[v] / sum(unnormalised), abs=1e-12)


# -- the second sampler ----------------------------------------------------------------------------------------
def test_sample_completions_stops_at_eos_and_is_seeded():
    vocab = 6

    def next_logits(ids, mask, position_ids):  # token 5 (EOS) once three tokens were sampled, else 1..4
        logits = torch.full((ids.shape[0], vocab), -1e9)
        if ids.shape[1] - 3 >= 3:  # the prompts are left-padded to 3 columns
            logits[:, 5] = 0.0
        else:
            logits[:, 1:5] = 0.0
        return logits

    sampling = SamplingParams(max_tokens=10)
    first = sample_completions(next_logits, [[1, 2], [3, 3, 3]], sampling, [7, 8], {5}, 0, "cpu")
    again = sample_completions(next_logits, [[1, 2], [3, 3, 3]], sampling, [7, 8], {5}, 0, "cpu")
    assert [e.token_ids for e in first] == [e.token_ids for e in again]
    for episode in first:
        assert len(episode.token_ids) == 4 and episode.token_ids[-1] == 5 and episode.finished
        assert all(1 <= t <= 4 for t in episode.token_ids[:3])
    cut = sample_completions(next_logits, [[1, 1, 2]], SamplingParams(max_tokens=2), [7], {5}, 0, "cpu")
    assert len(cut[0].token_ids) == 2 and not cut[0].finished


# -- configs ---------------------------------------------------------------------------------------------------
def test_configs_have_the_former_trl_defaults_and_schedules(tmp_path):
    assert XPOConfig(output_dir=str(tmp_path), use_cpu=True).alpha == 1e-5
    assert NashMDConfig(output_dir=str(tmp_path), use_cpu=True).mixture_coef == 0.5
    assert XPOConfig(output_dir=str(tmp_path), use_cpu=True, alpha=[1e-3, 1e-4]).alpha == [1e-3, 1e-4]
    with pytest.raises(ConfigError, match="mixture_coef"):
        NashMDConfig(output_dir=str(tmp_path), use_cpu=True, mixture_coef=1.5)
    with pytest.raises(ConfigError, match="alpha"):
        XPOConfig(output_dir=str(tmp_path), use_cpu=True, alpha=-0.1)


# -- training --------------------------------------------------------------------------------------------------
def test_xpo_pairs_a_policy_sample_with_a_reference_sample(tmp_path, tiny_model_path):
    """With mixture_coef=1 Nash-MD's opponent is the reference; XPO's second completion is the reference's:
    the same seeds give the same reference completions before any update."""
    xpo = XPOTrainer(
        tiny_model_path,
        reward_funcs=low_id_fraction,
        train_dataset=prompt_dataset(4),
        args=config(tmp_path / "x", XPOConfig, temperature=1.0),
    )
    nash = NashMDTrainer(
        tiny_model_path,
        reward_funcs=low_id_fraction,
        train_dataset=prompt_dataset(4),
        args=config(tmp_path / "n", NashMDConfig, temperature=1.0, mixture_coef=1.0),
    )
    rows = [dict(r) for r in xpo.train_dataset.select(range(2))]
    a, b = xpo.generate_episodes(rows, 2, [3, 4]), nash.generate_episodes(rows, 2, [3, 4])
    assert [e.token_ids for e in a[1::2]] == [e.token_ids for e in b[1::2]]
    xpo.train()
    logs = xpo.state.log_history[0]
    assert {"loss/dpo", "loss/xpo", "alpha", "objective/model_scores", "val/ref_contain_eos_token"} <= set(logs)


def test_nash_md_judge_path_uses_soft_probabilities(tmp_path, tiny_model_path):
    class SoftJudge(LowIdJudge):
        def judge(self, prompts, completions, shuffle_order=True, return_scores=False):
            assert return_scores
            self.calls += 1
            return [0.8 for _ in completions]

    judge = SoftJudge()
    trainer = NashMDTrainer(
        tiny_model_path,
        judge=judge,
        train_dataset=prompt_dataset(4),
        args=config(tmp_path, NashMDConfig, temperature=1.0),
    )
    trainer.train()
    assert judge.calls >= 1
    assert trainer.rollout.advantages.tolist() == pytest.approx([0.8] * len(trainer.rollout))
    assert trainer.state.log_history[0]["rewards/probabilities"] == pytest.approx(0.8)


def scaled_low_id_fraction(completion_ids, **kwargs):
    """Ten times the fraction of tokens below id 192, so that P(y beats y') = sigmoid(difference) is far from 1/2."""
    return [10 * r for r in low_id_fraction(completion_ids)]


@pytest.mark.parametrize(
    "trainer_class, config_class, extra",
    [
        (XPOTrainer, XPOConfig, dict(beta=0.1, learning_rate=3e-2)),
        (NashMDTrainer, NashMDConfig, dict(beta=0.01)),
    ],
)
def test_method_learns_a_known_preference(tmp_path, tiny_model_path, trainer_class, config_class, extra):
    """The reward of the policy's own completions (the other completion comes from the reference or the mixture)."""
    trainer, _ = learning_run(
        trainer_class, config_class, tmp_path, tiny_model_path, reward=scaled_low_id_fraction, max_steps=20, **extra
    )
    rewards = [h["objective/model_scores"] / 10 for h in trainer.state.log_history if "objective/model_scores" in h]
    print(trainer_class.__name__, "policy reward", rewards[:3], "->", rewards[-3:])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2
