"""Preference losses against float64 references written from the papers' formulas in plain `math`."""

import math

import pytest
import torch
from torch.testing import assert_close

from posttrain.errors import ConfigError, DataError
from posttrain.losses.preference import (
    DPO_LOSS_TYPES,
    bradley_terry_loss,
    dpo_loss,
    dpo_metrics,
    kto_loss,
    validate_dpo_loss_settings,
)

# Three pairs. Policy-minus-reference log-ratios: chosen [0.3, 0.2, -0.4], rejected [-0.3, 2.3, -2.5];
# their sorted orders differ from the example order, and the policy and reference margins sort differently,
# so the AOT tests notice a missing or misplaced sort.
CHOSEN = [-5.2, -3.1, -7.4]
REJECTED = [-6.0, -2.5, -9.1]
REF_CHOSEN = [-5.5, -3.3, -7.0]
REF_REJECTED = [-5.7, -4.8, -6.6]
NLL = [1.3, 0.4, 2.2]
CHOSEN_LEN = [3, 7, 2]
REJECTED_LEN = [5, 1, 4]
BETA = 0.7


def tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected: list[float] | float) -> None:
    assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def pairs() -> list[tuple[float, float]]:
    """(chosen log-ratio, rejected log-ratio) per example."""
    return [(pc - rc, pr - rr) for pc, pr, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)]


def smoothed_logistic(z: float, eps: float) -> float:
    return -(1 - eps) * logsig(z) - eps * logsig(-z)


def reference(loss_type: str, eps: float = 0.0, delta: float = 0.0, tau: float = 0.05) -> list[float]:
    """The loss per example, from each paper's formula; h = chosen log-ratio - rejected log-ratio."""
    b = BETA
    if loss_type == "aot":
        policy = sorted(c - r for c, r in zip(CHOSEN, REJECTED))
        ref = sorted(c - r for c, r in zip(REF_CHOSEN, REF_REJECTED))
        return [smoothed_logistic(b * (p - q), eps) for p, q in zip(policy, ref)]
    if loss_type == "aot_unpaired":
        chosen, rejected = sorted(c for c, _ in pairs()), sorted(r for _, r in pairs())
        return [smoothed_logistic(b * (c - r), eps) for c, r in zip(chosen, rejected)]
    if loss_type == "sft":
        return list(NLL)
    if loss_type == "sigmoid_norm":  # DPO on per-token log-ratios
        return [-logsig(b * (c / lc - r / lr)) for (c, r), lc, lr in zip(pairs(), CHOSEN_LEN, REJECTED_LEN)]
    out = []
    for c, r in pairs():
        h = c - r
        if loss_type == "sigmoid":
            out.append(-(1 - eps) * logsig(b * h) - eps * logsig(-b * h))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - b * h))
        elif loss_type == "ipo":
            out.append((h - 1 / (2 * b)) ** 2)
        elif loss_type == "robust":
            out.append(((1 - eps) * -logsig(b * h) - eps * -logsig(-b * h)) / (1 - 2 * eps))
        elif loss_type == "exo_pair":
            p = math.exp(b * h) / (math.exp(b * h) + 1)  # softmax over (b*c, b*r) at the chosen answer
            out.append(p * math.log(p / (1 - eps)) + (1 - p) * math.log((1 - p) / eps))
        elif loss_type == "nca_pair":
            out.append(-logsig(b * c) - 0.5 * logsig(-b * c) - 0.5 * logsig(-b * r))
        elif loss_type == "bco_pair":
            out.append(-logsig(b * c - delta) - logsig(-(b * r - delta)))
        elif loss_type == "sppo_hard":
            out.append((c - (1 - 0.5) / b) ** 2 + (r - (0 - 0.5) / b) ** 2)
        elif loss_type == "apo_zero":
            out.append((1 - sig(b * c)) + sig(b * r))
        elif loss_type == "apo_down":
            out.append(sig(b * c) + (1 - sig(b * (c - r))))
        elif loss_type == "discopop":
            m = sig(b * h / tau)
            out.append((1 - m) * -logsig(b * h) + m * math.exp(-b * h))
        else:
            raise AssertionError(loss_type)
    return out


def run_dpo(loss_type, **kwargs):
    if loss_type == "sigmoid_norm":
        kwargs.update(chosen_lengths=tensor(CHOSEN_LEN), rejected_lengths=tensor(REJECTED_LEN))
    return dpo_loss(
        tensor(CHOSEN),
        tensor(REJECTED),
        tensor(REF_CHOSEN),
        tensor(REF_REJECTED),
        loss_type=loss_type,
        beta=BETA,
        chosen_nll=tensor(NLL),
        **kwargs,
    )


CASES = [
    ("sigmoid", {}),
    ("sigmoid", {"label_smoothing": 0.1}),
    ("hinge", {}),
    ("ipo", {}),
    ("robust", {"label_smoothing": 0.2}),
    ("exo_pair", {"label_smoothing": 1e-3}),
    ("exo_pair", {"label_smoothing": 0.25}),
    ("nca_pair", {}),
    ("bco_pair", {}),
    ("bco_pair", {"bco_delta": 0.35}),
    ("sppo_hard", {}),
    ("aot", {}),
    ("aot", {"label_smoothing": 0.1}),
    ("aot_unpaired", {}),
    ("aot_unpaired", {"label_smoothing": 0.1}),
    ("apo_zero", {}),
    ("apo_down", {}),
    ("discopop", {}),
    ("discopop", {"discopop_tau": 0.5}),
    ("sft", {}),
    ("sigmoid_norm", {}),
]


def test_cases_cover_every_loss_type():
    assert {name for name, _ in CASES} == set(DPO_LOSS_TYPES)


@pytest.mark.parametrize(("loss_type", "kwargs"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_dpo_loss_matches_paper_formula(loss_type, kwargs):
    losses, chosen_rewards, rejected_rewards = run_dpo(loss_type, **kwargs)
    expected = reference(
        loss_type,
        eps=kwargs.get("label_smoothing", 0.0),
        delta=kwargs.get("bco_delta", 0.0),
        tau=kwargs.get("discopop_tau", 0.05),
    )
    close(losses, expected)
    close(chosen_rewards, [BETA * c for c, _ in pairs()])
    close(rejected_rewards, [BETA * r for _, r in pairs()])


def test_label_smoothing_changes_sigmoid_loss_and_half_is_symmetric():
    plain, _, _ = run_dpo("sigmoid")
    smoothed, _, _ = run_dpo("sigmoid", label_smoothing=0.5)
    assert not torch.allclose(plain, smoothed)
    # With half the labels flipped, the loss cannot tell chosen from rejected.
    close(smoothed, [-0.5 * (logsig(BETA * (c - r)) + logsig(-BETA * (c - r))) for c, r in pairs()])


def f_prime(u: float, kind: str, alpha: float) -> float:
    """f'(u) from Wang et al. 2023, Table 1. TRL's (and posttrain's) alpha is 1 - the paper's alpha: the paper's
    alpha divergence f'(u) = (1 - u^-a) / a with a = 1 - alpha (reverse KL, log u + 1, at a = 0)."""
    if kind == "reverse_kl":
        return math.log(u) + 1
    if kind == "forward_kl":
        return -1 / u
    if kind == "js_divergence":
        return math.log(2 * u / (1 + u))
    a = 1 - alpha
    return math.log(u) if a == 0 else (1 - u ** (-a)) / a


@pytest.mark.parametrize(
    ("kind", "alpha"),
    [
        ("reverse_kl", 1.0),
        ("forward_kl", 1.0),
        ("js_divergence", 1.0),
        ("alpha_divergence", 0.5),
        ("alpha_divergence", 0.3),
        ("alpha_divergence", 1.0),
        ("alpha_divergence", 1.7),
    ],
)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_f_divergence_sigmoid_loss(kind, alpha, eps):
    losses, _, _ = run_dpo("sigmoid", f_divergence_type=kind, f_alpha_divergence_coef=alpha, label_smoothing=eps)
    expected = []
    for c, r in pairs():
        logit = BETA * (f_prime(math.exp(c), kind, alpha) - f_prime(math.exp(r), kind, alpha))
        expected.append(smoothed_logistic(logit, eps))
    close(losses, expected)


def test_alpha_divergence_at_zero_equals_forward_kl_and_at_one_reverse_kl():
    forward, _, _ = run_dpo("sigmoid", f_divergence_type="forward_kl")
    alpha_zero, _, _ = run_dpo("sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.0)
    close(alpha_zero, forward.tolist())
    plain, _, _ = run_dpo("sigmoid")
    alpha_one, _, _ = run_dpo("sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0)
    close(alpha_one, plain.tolist())


def test_alpha_divergence_default_half_matches_trl_formula():
    # TRL 1.16: score = (exp((alpha - 1) * log-ratio) - 1) / (alpha - 1); the DPO logit is the scores' difference.
    losses, _, _ = run_dpo("sigmoid", f_divergence_type="alpha_divergence")  # default alpha 0.5
    expected = []
    for c, r in pairs():
        score_c, score_r = (math.exp(-0.5 * c) - 1) / -0.5, (math.exp(-0.5 * r) - 1) / -0.5
        expected.append(-logsig(BETA * (score_c - score_r)))
    close(losses, expected)


@pytest.mark.parametrize("kind", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_f_divergence_with_length_normalised_losses_keeps_trl_score_constants(kind):
    # ipo / sigmoid_norm divide each score by its length, so f' constants matter; TRL's scores are
    # forward_kl 1 - 1/u, js log 2 + log sigmoid(log u), alpha (u^(alpha-1) - 1)/(alpha-1).
    def score(x):
        if kind == "forward_kl":
            return 1 - math.exp(-x)
        if kind == "js_divergence":
            return math.log(2) + logsig(x)
        return (math.exp(-0.7 * x) - 1) / -0.7

    lengths = dict(chosen_lengths=tensor(CHOSEN_LEN), rejected_lengths=tensor(REJECTED_LEN))
    for loss_type in ("ipo", "sigmoid_norm"):
        losses, _, _ = run_dpo(loss_type, f_divergence_type=kind, f_alpha_divergence_coef=0.3, **lengths)
        expected = []
        for (c, r), lc, lr in zip(pairs(), CHOSEN_LEN, REJECTED_LEN):
            d = score(c) / lc - score(r) / lr
            expected.append((d - 1 / (2 * BETA)) ** 2 if loss_type == "ipo" else -logsig(BETA * d))
        close(losses, expected)


def test_wpo_weights_and_pair_weighting():
    from posttrain.losses.preference import wpo_weights

    # two sequences of 3 positions; mask picks the completion tokens
    token_logps = tensor([[0.0, -1.2, -0.4], [0.0, -2.0, 0.0]])
    lss = tensor([[0.0, -0.9, -0.2], [0.0, -1.5, 0.0]])  # log sum_v p_v^2
    mask = tensor([[0, 1, 1], [0, 1, 0]])
    weights = wpo_weights(token_logps, lss, mask)
    close(weights, [math.exp(((-1.2 + 0.9) + (-0.4 + 0.2)) / 2), math.exp(-2.0 + 1.5)])
    w = tensor([0.5, 0.2, 0.9])
    losses, _, _ = run_dpo("sigmoid", pair_weights=w)
    close(losses, [x * wi for x, wi in zip(reference("sigmoid"), [0.5, 0.2, 0.9])])


def test_length_desensitized_logps():
    from posttrain.losses.preference import length_desensitized_logps

    token_logps = tensor([[0.0, -1.0, -2.0, -3.0, -4.0], [0.0, -0.5, -0.25, 0.0, 0.0]])
    mask = tensor([[0, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    shared = tensor([1, 1])  # min(4, 1): only the first completion token of each counts fully
    out = length_desensitized_logps(token_logps * mask, mask, shared, 0.3)
    close(out, [-1.0 + 0.3 * (-2.0 - 3.0 - 4.0), -0.25])


def test_combined_loss_types_are_weighted_per_example():
    losses, _, _ = run_dpo(["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.5], label_smoothing=0.1)
    parts = [reference("sigmoid", eps=0.1), reference("bco_pair"), reference("sft")]
    close(losses, [0.8 * a + 0.2 * b + 1.5 * s for a, b, s in zip(*parts)])


def test_combined_loss_types_default_to_unit_weights():
    losses, _, _ = run_dpo(["apo_zero", "ipo"])
    close(losses, [a + i for a, i in zip(reference("apo_zero"), reference("ipo"))])


def test_sigmoid_hand_worked_two_examples():
    # beta = 0.5. Example 1: h = (-1 - -3) - (-2 - -2) = 2, beta*h = 1, loss = log(1 + e^-1) = 0.3132616875182228;
    # rewards: chosen 0.5 * (-1 - -2) = 0.5, rejected 0.5 * (-3 - -2) = -0.5.
    # Example 2: h = (-4 - -2) - (-3 - -3) = -2, beta*h = -1, loss = log(1 + e) = 1.3132616875182228;
    # rewards: chosen 0.5 * (-4 - -3) = -0.5, rejected 0.5 * (-2 - -3) = 0.5.
    # Metrics: chosen mean 0, rejected mean 0, accuracy 1/2, margin mean (1 + -1) / 2 = 0.
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        tensor([-1.0, -4.0]), tensor([-3.0, -2.0]), tensor([-2.0, -3.0]), tensor([-2.0, -3.0]), beta=0.5
    )
    close(losses, [0.3132616875182228, 1.3132616875182228])
    close(chosen_rewards, [0.5, -0.5])
    close(rejected_rewards, [-0.5, 0.5])
    assert dpo_metrics(chosen_rewards, rejected_rewards) == pytest.approx(
        {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/accuracies": 0.5, "rewards/margins": 0.0}
    )


def test_dpo_metrics_means():
    metrics = dpo_metrics(tensor([1.0, 0.5, -0.2]), tensor([0.0, 0.7, -1.0]))
    assert metrics == pytest.approx(
        {
            "rewards/chosen": 1.3 / 3,
            "rewards/rejected": -0.3 / 3,
            "rewards/accuracies": 2 / 3,
            "rewards/margins": 1.6 / 3,
        }
    )


def test_sigmoid_gradient_matches_analytic_and_rewards_are_detached():
    chosen = tensor(CHOSEN).requires_grad_()
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        chosen, tensor(REJECTED), tensor(REF_CHOSEN), tensor(REF_REJECTED), beta=BETA
    )
    losses.sum().backward()
    assert torch.isfinite(chosen.grad).all() and (chosen.grad != 0).all()
    # d/d chosen of -logsigmoid(beta * h) = -beta * sigmoid(-beta * h).
    close(chosen.grad, [-BETA * sig(-BETA * (c - r)) for c, r in pairs()])
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "error", "phrase"),
    [
        ({"loss_type": "dpo"}, ConfigError, "not supported"),
        ({"loss_type": []}, ConfigError, "not supported"),
        ({"loss_type": ["sigmoid", "sigmoid"]}, ConfigError, "twice"),
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, ConfigError, "one weight per loss type"),
        ({"beta": 0.0}, ConfigError, "beta"),
        ({"label_smoothing": 0.6}, ConfigError, "label_smoothing"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, ConfigError, "no effect"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, ConfigError, "below 0.5"),
        ({"loss_type": "exo_pair"}, ConfigError, "label_smoothing > 0"),
        ({"f_divergence_type": "tv"}, ConfigError, "f_divergence_type"),
        ({"loss_type": "nca_pair", "f_divergence_type": "js_divergence"}, ConfigError, "only applies to loss types"),
        ({"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": math.inf}, ConfigError, "finite"),
        ({"loss_type": "aot", "use_weighting": True}, ConfigError, "sorts the batch"),
        ({"ld_alpha": 1.5}, ConfigError, r"ld_alpha=1.5 must lie in \[0, 1\]"),
        ({"loss_type": "discopop", "discopop_tau": 0.0}, ConfigError, "discopop_tau"),
    ],
)
def test_dpo_settings_errors(kwargs, error, phrase):
    with pytest.raises(error, match=phrase):
        validate_dpo_loss_settings(**kwargs)


def test_sft_needs_per_example_nll():
    args = (tensor(CHOSEN), tensor(REJECTED), tensor(REF_CHOSEN), tensor(REF_REJECTED))
    with pytest.raises(ConfigError, match="chosen_nll"):
        dpo_loss(*args, loss_type=["sigmoid", "sft"])
    with pytest.raises(DataError, match="one NLL per example"):
        dpo_loss(*args, loss_type="sft", chosen_nll=torch.tensor(1.0, dtype=torch.float64))


# KTO: five examples, labels mixed; KL pairs give mean log-ratio 0.15.
KTO_POLICY = [-4.0, -6.5, -2.2, -8.0, -3.3]
KTO_REF = [-4.4, -6.0, -2.5, -7.1, -3.2]
KTO_LABELS = [True, False, True, False, False]
KL_POLICY = [-5.0, -7.0, -3.0, -6.0]
KL_REF = [-5.3, -6.9, -3.4, -5.8]


def kto_reference(idx: list[int], z0: float, kind: str = "kto", w_d: float = 1.0, w_u: float = 1.0) -> list[float]:
    out = []
    for i in idx:
        r = KTO_POLICY[i] - KTO_REF[i]
        if kind == "kto":
            out.append(w_d * (1 - sig(BETA * (r - z0))) if KTO_LABELS[i] else w_u * (1 - sig(BETA * (z0 - r))))
        else:
            out.append(w_d * (1 - sig(BETA * r)) if KTO_LABELS[i] else w_u * sig(BETA * r))
    return out


def run_kto(idx: list[int], kl_policy=KL_POLICY, kl_ref=KL_REF, **kwargs):
    def pick(values):
        return tensor([values[i] for i in idx])

    kl = (tensor(kl_policy), tensor(kl_ref)) if kl_policy is not None else (None, None)
    labels = torch.tensor([KTO_LABELS[i] for i in idx])
    return kto_loss(pick(KTO_POLICY), pick(KTO_REF), labels, *kl, beta=BETA, **kwargs)


def test_kto_both_classes_with_weights():
    idx = [0, 1, 2, 3, 4]
    z0 = sum(p - r for p, r in zip(KL_POLICY, KL_REF)) / len(KL_POLICY)
    losses, rewards, kl = run_kto(idx, desirable_weight=1.3, undesirable_weight=0.6)
    close(losses, kto_reference(idx, z0, w_d=1.3, w_u=0.6))
    close(rewards, [BETA * (KTO_POLICY[i] - KTO_REF[i]) for i in idx])
    close(kl, z0)
    assert not kl.requires_grad and not rewards.requires_grad


@pytest.mark.parametrize("idx", [[0, 2], [1, 3, 4]], ids=["desirable-only", "undesirable-only"])
def test_kto_one_class(idx):
    z0 = sum(p - r for p, r in zip(KL_POLICY, KL_REF)) / len(KL_POLICY)
    losses, _, _ = run_kto(idx, undesirable_weight=2.0)
    close(losses, kto_reference(idx, z0, w_u=2.0))


def test_kto_kl_point_is_clamped_at_zero_and_detached():
    kl_policy = tensor([-5.0, -7.0]).requires_grad_()
    losses, _, kl = kto_loss(
        tensor(KTO_POLICY), tensor(KTO_REF), torch.tensor(KTO_LABELS), kl_policy, tensor([-4.0, -6.5]), beta=BETA
    )
    close(kl, 0.0)
    close(losses, kto_reference([0, 1, 2, 3, 4], 0.0))
    assert not kl.requires_grad


def test_kto_gradient_flows_to_policy_only():
    policy = tensor(KTO_POLICY).requires_grad_()
    kl_policy = tensor(KL_POLICY).requires_grad_()
    losses, _, _ = kto_loss(policy, tensor(KTO_REF), torch.tensor(KTO_LABELS), kl_policy, tensor(KL_REF), beta=BETA)
    losses.sum().backward()
    assert torch.isfinite(policy.grad).all() and (policy.grad != 0).all()
    assert kl_policy.grad is None


def test_kto_apo_zero_unpaired_needs_no_kl():
    idx = [0, 1, 2, 3, 4]
    losses, _, kl = run_kto(idx, kl_policy=None, loss_type="apo_zero_unpaired", desirable_weight=0.5)
    close(losses, kto_reference(idx, 0.0, kind="apo_zero_unpaired", w_d=0.5))
    close(kl, 0.0)


def test_kto_errors():
    with pytest.raises(ConfigError, match="needs policy_kl_logps"):
        run_kto([0, 1], kl_policy=None)
    with pytest.raises(ConfigError, match="not supported for KTO"):
        run_kto([0, 1], loss_type="sigmoid")
    with pytest.raises(DataError, match="bool"):
        kto_loss(tensor([-1.0]), tensor([-1.0]), torch.tensor([1]), tensor([-1.0]), tensor([-1.0]))


# Bradley-Terry reward model.
R_CHOSEN = [1.2, -0.3, 0.8]
R_REJECTED = [0.4, 0.5, -1.1]


def test_bradley_terry_plain():
    expected = sum(-logsig(c - r) for c, r in zip(R_CHOSEN, R_REJECTED)) / 3
    close(bradley_terry_loss(tensor(R_CHOSEN), tensor(R_REJECTED)), expected)


def test_bradley_terry_margin_per_example_and_scalar():
    margins = [0.5, 0.0, 2.0]
    expected = sum(-logsig(c - r - m) for c, r, m in zip(R_CHOSEN, R_REJECTED, margins)) / 3
    close(bradley_terry_loss(tensor(R_CHOSEN), tensor(R_REJECTED), margin=tensor(margins)), expected)
    expected_scalar = sum(-logsig(c - r - 0.3) for c, r in zip(R_CHOSEN, R_REJECTED)) / 3
    close(bradley_terry_loss(tensor(R_CHOSEN), tensor(R_REJECTED), margin=0.3), expected_scalar)


def test_bradley_terry_centering_term():
    bt = sum(-logsig(c - r) for c, r in zip(R_CHOSEN, R_REJECTED)) / 3
    centering = sum((c + r) ** 2 for c, r in zip(R_CHOSEN, R_REJECTED)) / 3  # (1.6^2 + 0.2^2 + 0.3^2) / 3
    loss = bradley_terry_loss(tensor(R_CHOSEN), tensor(R_REJECTED), center_rewards_coefficient=0.01)
    close(loss, bt + 0.01 * centering)
    assert centering == pytest.approx((1.6**2 + 0.2**2 + 0.3**2) / 3)
