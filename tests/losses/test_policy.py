"""Policy/value losses against hand-worked numbers and plain-Python float64 references."""

import math

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.losses.policy import (
    VespoParams,
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_k3,
    policy_objective,
    vespo_weights,
)
from posttrain.losses.token_weights import high_entropy_mask, off_policy_sequence_mask, sampler_importance_weights


def as_tensor(rows, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=requires_grad)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, as_tensor(expected), rtol=1e-10, atol=1e-12)


def test_kl_k3_known_values():
    # d = ref - logp: 0 -> 0;  -ln 2 -> 0.5 + ln 2 - 1;  1 -> e - 2.
    logps = as_tensor([0.0, math.log(0.5), 0.0])
    ref_logps = as_tensor([0.0, math.log(0.25), 1.0])
    assert_close(kl_k3(logps, ref_logps), [0.0, math.log(2) - 0.5, math.e - 2])


def reference_policy_loss(logps, old, adv, mask, eps_low, eps_high, level, ref=None, beta=0.0):
    """Loops over rows and tokens; `adv` is a list per row (one number) or per token."""
    losses, kls = [], []
    for b, row_mask in enumerate(mask):
        valid = [t for t, m in enumerate(row_mask) if m]
        sequence_log_ratio = sum(logps[b][t] - old[b][t] for t in valid) / len(valid)
        row = []
        for t, m in enumerate(row_mask):
            if not m:
                row.append(0.0)
                continue
            log_ratio = sequence_log_ratio if level == "sequence" else logps[b][t] - old[b][t]
            ratio = math.exp(log_ratio)
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            a = adv[b] if not isinstance(adv[b], list) else adv[b][t]
            loss = -min(ratio * a, clipped * a)
            if ref is not None:
                d = ref[b][t] - logps[b][t]
                kls.append(math.exp(d) - d - 1)
                loss += beta * kls[-1]
            row.append(loss)
        losses.append(row)
    return losses, (sum(kls) / len(kls) if kls else None)


def test_clip_cases_by_hand():
    # eps 0.2, old logps 0, so ratio = exp(logps). Per token (ratio, A) -> loss, clipped?
    #   (1.1, +1) inside                  -> -1.1
    #   (1.5, +1) above, A > 0            -> -min(1.5, 1.2) = -1.2   high-clipped, no gradient
    #   (1.5, -1) above, A < 0            -> -min(-1.5, -1.2) = 1.5  (the clip does not bind)
    #   (0.5, +1) below, A > 0            -> -min(0.5, 0.8) = -0.5   (the clip does not bind)
    #   (0.5, -1) below, A < 0            -> -min(-0.5, -0.8) = 0.8  low-clipped, no gradient
    #   (0.9, -1) inside                  -> 0.9
    # plus one padding token holding -inf, which must not reach the loss or the gradient.
    ratios = [1.1, 1.5, 1.5, 0.5, 0.5, 0.9]
    logps = as_tensor([[math.log(r) for r in ratios] + [-math.inf]], requires_grad=True)
    advantages = as_tensor([[1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    loss, stats = clipped_policy_loss(logps, torch.zeros_like(logps), advantages, mask)
    assert_close(loss, [[-1.1, -1.2, 1.5, -0.5, 0.8, 0.9, 0.0]])
    assert_close(stats["clip_ratio_high"], 1 / 6)
    assert_close(stats["clip_ratio_low"], 1 / 6)
    assert_close(stats["clip_ratio"], 2 / 6)
    assert "kl" not in stats
    loss.sum().backward()
    # d(-r A)/d logp = -A r where the unclipped term is the minimum; 0 where the clip binds.
    assert_close(logps.grad, [[-1.1, 0.0, 1.5, -0.5, 0.0, 0.9, 0.0]])


def test_asymmetric_epsilon():
    # eps_low 0.2, eps_high 0.28: (1.25, +1) is inside (a symmetric 0.2 would clip it), (1.3, +1) clips to
    # 1.28, (0.75, -1) clips to 0.8, (0.85, -1) is inside.
    ratios = [1.25, 1.3, 0.75, 0.85]
    logps = as_tensor([[math.log(r) for r in ratios]])
    advantages = as_tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = clipped_policy_loss(
        logps, torch.zeros_like(logps), advantages, torch.ones(1, 4), epsilon_low=0.2, epsilon_high=0.28
    )
    assert_close(loss, [[-1.25, -1.28, 0.8, 0.85]])
    assert_close(stats["clip_ratio_high"], 0.25)
    assert_close(stats["clip_ratio_low"], 0.25)


def test_sequence_level_ratio_by_hand():
    # Row 0 log ratios [0.1, 0.2, 0.3]: mean 0.2, ratio e^0.2 = 1.2214 > 1.2 with A = +1 -> every token -1.2,
    # clipped. Row 1 log ratios [-0.1, 0.3] (third token padding): mean 0.1, ratio e^0.1 with A = -1 ->
    # every valid token +e^0.1, unclipped; the gradient of the row's loss sum w.r.t. each of its logps is
    # 2 tokens * (-A) * ratio * (1/2 from the mean) = e^0.1.
    logps = as_tensor([[0.1, 0.2, 0.3], [-0.1, 0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = clipped_policy_loss(
        logps,
        torch.zeros(2, 3, dtype=torch.float64),
        as_tensor([1.0, -1.0]),
        mask,
        importance_sampling_level="sequence",
    )
    ratio = math.exp(0.1)
    assert_close(loss, [[-1.2, -1.2, -1.2], [ratio, ratio, 0.0]])
    assert_close(stats["clip_ratio_high"], 1 / 2)  # at sequence level a fraction of sequences, as TRL's
    assert_close(stats["clip_ratio_low"], 0.0)
    loss.sum().backward()
    assert_close(logps.grad, [[0.0, 0.0, 0.0], [ratio, ratio, 0.0]])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("per_token_advantages", [False, True])
def test_policy_loss_matches_reference(level, per_token_advantages):
    generator = torch.Generator().manual_seed(1)
    logps = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 2
    old_logps = logps + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    ref_logps = logps + 0.5 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    shape = (3, 5) if per_token_advantages else (3,)
    advantages = torch.randn(*shape, generator=generator, dtype=torch.float64)
    mask = [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]
    loss, stats = clipped_policy_loss(
        logps,
        old_logps,
        advantages,
        torch.tensor(mask),
        epsilon_low=0.1,
        epsilon_high=0.15,
        importance_sampling_level=level,
        ref_logps=ref_logps,
        beta=0.05,
    )
    expected, expected_kl = reference_policy_loss(
        logps.tolist(), old_logps.tolist(), advantages.tolist(), mask, 0.1, 0.15, level, ref_logps.tolist(), 0.05
    )
    assert_close(loss, expected)
    assert_close(stats["kl"], expected_kl)


def test_kl_logged_but_not_added_when_beta_is_zero():
    logps = as_tensor([[math.log(1.1), 0.0]])
    ref_logps = as_tensor([[0.0, 1.0]])
    old_logps = torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = clipped_policy_loss(logps, old_logps, as_tensor([1.0]), torch.ones(1, 2), ref_logps=ref_logps)
    assert_close(loss, [[-1.1, -1.0]])
    assert_close(stats["kl"], ((1 / 1.1 + math.log(1.1) - 1) + (math.e - 2)) / 2)


def test_policy_loss_rejects_bad_settings():
    x = torch.zeros(1, 2)
    with pytest.raises(ConfigError, match="no ref_logps"):
        clipped_policy_loss(x, x, torch.zeros(1), x, beta=0.1)
    with pytest.raises(ConfigError, match="importance_sampling_level='seq'"):
        clipped_policy_loss(x, x, torch.zeros(1), x, importance_sampling_level="seq")
    with pytest.raises(ConfigError, match="epsilon_low=1.5"):
        clipped_policy_loss(x, x, torch.zeros(1), x, epsilon_low=1.5)


# Padding holds 100 so that a padding leak shows up in the result.
LOSS = [[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]]
MASK = [[1, 1, 1], [1, 0, 0]]


def test_aggregate_loss_types_by_hand():
    loss, mask = as_tensor(LOSS), torch.tensor(MASK)
    assert_close(aggregate_loss(loss, mask, "grpo"), (2.0 + 4.0) / 2)  # sequence means 2 and 4
    assert_close(aggregate_loss(loss, mask, "bnpo"), 10.0 / 4)  # 4 valid tokens
    assert_close(aggregate_loss(loss, mask, "dr_grpo", max_completion_length=3), 10.0 / (2 * 3))
    assert_close(aggregate_loss(loss, mask, "dapo", total_tokens=8), 10.0 / 8)  # global count from the caller


def reference_aggregate(loss, mask, loss_type, total_sequences, total_tokens, max_len):
    sums = [sum(x for x, m in zip(row, ms) if m) for row, ms in zip(loss, mask)]
    if loss_type == "grpo":
        return sum(s / sum(ms) for s, ms in zip(sums, mask)) / total_sequences
    if loss_type == "dr_grpo":
        return sum(sums) / (total_sequences * max_len)
    return sum(sums) / total_tokens


def random_batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    loss = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])
    return loss, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregate_loss_matches_reference(loss_type):
    loss, mask = random_batch(2)
    actual = aggregate_loss(loss, mask, loss_type, total_sequences=10, total_tokens=40, max_completion_length=6)
    expected = reference_aggregate(loss.tolist(), mask.tolist(), loss_type, 10, 40, 6)
    assert_close(actual, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_split_invariance_of_values_and_gradients(loss_type):
    """Two micro-batches with the global counts give the full batch's loss and gradient."""
    per_token, mask = random_batch(3)
    per_token.requires_grad_(True)
    totals = dict(total_sequences=4, total_tokens=mask.sum(), max_completion_length=6)
    full = aggregate_loss(per_token, mask, loss_type, **totals)
    (full_grad,) = torch.autograd.grad(full, per_token)
    parts = [aggregate_loss(per_token[rows], mask[rows], loss_type, **totals) for rows in (slice(0, 1), slice(1, 4))]
    (split_grad,) = torch.autograd.grad(sum(parts), per_token)
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-12)


def test_bnpo_with_local_counts_is_not_split_invariant():
    # Documented behaviour: without total_tokens each micro-batch is normalised by its own token count.
    loss, mask = random_batch(4)
    local = [aggregate_loss(loss[rows], mask[rows], "bnpo") for rows in (slice(0, 1), slice(1, 4))]
    first = loss[0].sum() / 6
    rest = (loss[1:] * mask[1:]).sum() / (2 + 5 + 1)
    assert_close(local[0] + local[1], (first + rest).item())


def test_aggregate_loss_rejects_missing_normalisers():
    loss, mask = as_tensor(LOSS), torch.tensor(MASK)
    with pytest.raises(ConfigError, match="pass total_tokens"):
        aggregate_loss(loss, mask, "dapo")
    with pytest.raises(ConfigError, match="max_completion_length"):
        aggregate_loss(loss, mask, "dr_grpo")
    with pytest.raises(ConfigError, match="loss_type='sum'"):
        aggregate_loss(loss, mask, "sum")


def test_clipped_value_loss_by_hand():
    # cliprange 0.2 around old value 1.0, so the clipped value lies in [0.8, 1.2]:
    #   v 1.1, R 2: inside, 0.5 * 0.9^2 = 0.405, gradient v - R = -0.9
    #   v 1.5, R 2: clip 1.2, max(0.5^2, 0.8^2) = 0.64 -> 0.32, clipped term wins, gradient 0
    #   v 0.5, R 2: clip 0.8, max(1.5^2, 1.2^2) = 2.25 -> 1.125, unclipped wins, gradient -1.5
    #   padding: 0
    values = as_tensor([[1.1, 1.5, 0.5, 9.0]], requires_grad=True)
    old_values = as_tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = as_tensor([[2.0, 2.0, 2.0, -9.0]])
    loss = clipped_value_loss(values, old_values, returns, torch.tensor([[1, 1, 1, 0]]), cliprange_value=0.2)
    assert_close(loss, [[0.405, 0.32, 1.125, 0.0]])
    loss.sum().backward()
    assert_close(values.grad, [[-0.9, 0.0, -1.5, 0.0]])


def test_entropy_matches_reference_and_is_stable():
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(2, 3, 7, generator=generator, dtype=torch.float64)
    expected = []
    for row in logits.tolist():
        expected.append([])
        for token_logits in row:
            total = sum(math.exp(x) for x in token_logits)
            expected[-1].append(-sum(math.exp(x) / total * (x - math.log(total)) for x in token_logits))
    assert_close(entropy_from_logits(logits), expected)
    assert_close(entropy_from_logits(logits + 1000.0), expected)  # a naive exp would overflow
    assert_close(entropy_from_logits(torch.zeros(5, dtype=torch.float64)), math.log(5))


def test_entropy_with_banned_tokens_has_finite_gradient():
    logits = as_tensor([0.0, 0.0, -math.inf], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert_close(entropy, math.log(2))
    entropy.backward()
    assert torch.isfinite(logits.grad).all()


# -- GRPO's loss types, against a plain-Python float64 reference ----------------------------------------------
def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def reference_objective(
    logps,
    old,
    adv,
    mask,
    loss_type,
    level="token",
    eps_low=0.2,
    eps_high=0.2,
    delta=None,
    tau_pos=1.0,
    tau_neg=1.05,
    vespo=(2.0, 3.0, 3.0, 2.0),
    keep=None,
    sampler=None,
    ref=None,
    beta=0.0,
    bias_correction=False,
):
    """Per-token losses written from the papers' formulas, one token at a time. `keep` and `sampler` are per
    token lists (a sequence-level value repeated over the row)."""
    rows = []
    for b, row_mask in enumerate(mask):
        valid = [t for t, m in enumerate(row_mask) if m]
        token_log_ratio = [logps[b][t] - old[b][t] for t in range(len(row_mask))]
        sequence_log_ratio = sum(token_log_ratio[t] for t in valid) / len(valid)
        a = adv[b]
        # VESPO: w = exp(sum of the row's log ratios + log sampler ratios), phi(w) = e^lam w^k e^(-lam w)
        log_w = sum(min(max(token_log_ratio[t], -20), 20) for t in valid)
        if sampler is not None:
            log_w += sum(min(max(math.log(sampler[b][t]), math.log(1e-8)), 20) for t in range(len(row_mask)))
        log_w = min(max(log_w, math.log(1e-8)), 20)
        k, lam = (vespo[0], vespo[1]) if a >= 0 else (vespo[2], vespo[3])
        phi = math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))
        row = []
        for t, m in enumerate(row_mask):
            if not m:
                row.append(0.0)
                continue
            r = math.exp(sequence_log_ratio if level == "sequence" else token_log_ratio[t])
            if loss_type == "cispo":
                loss = -min(r, eps_high) * a * logps[b][t]
            elif loss_type == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                loss = -4 / tau * _sigmoid(tau * (r - 1)) * a
            elif loss_type == "vespo":
                loss = -phi * a * logps[b][t]
            else:
                unclipped = r if delta is None else min(r, delta)
                loss = -min(unclipped * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            if keep is not None:
                loss *= keep[b][t]
            if sampler is not None and loss_type != "vespo":
                loss *= sampler[b][t]
            if ref is not None:
                d = ref[b][t] - logps[b][t]
                kl = math.exp(d) - d - 1
                loss += beta * kl * (r if bias_correction else 1.0)
            row.append(loss)
        rows.append(row)
    return rows


def _objective_batch(seed=7):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(3, 5, generator=generator, dtype=torch.float64) * 2 - 0.05
    old_logps = logps + 0.4 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    ref_logps = logps + 0.5 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    advantages = as_tensor([0.8, -1.3, 0.0])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    return logps, old_logps, ref_logps, advantages, mask


@pytest.mark.parametrize("loss_type", ["dapo", "luspo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_every_loss_type_matches_reference(loss_type, level):
    logps, old_logps, ref_logps, advantages, mask = _objective_batch()
    generator = torch.Generator().manual_seed(3)
    keep = (torch.rand(3, 5, generator=generator) > 0.3).double()
    sampler = 0.5 + torch.rand(3, 5, generator=generator, dtype=torch.float64)
    options = dict(epsilon_low=0.2, epsilon_high=0.3 if loss_type != "cispo" else 1.1, importance_sampling_level=level)
    loss, stats = policy_objective(
        logps,
        old_logps,
        advantages,
        mask,
        loss_type=loss_type,
        keep=keep,
        sampler_ratio=sampler,
        ref_logps=ref_logps,
        beta=0.07,
        kl_bias_correction=True,
        sapo_temperature_pos=0.9,
        sapo_temperature_neg=1.3,
        vespo=VespoParams(2.5, 3.5, 1.5, 2.2),
        **options,
    )
    expected = reference_objective(
        logps.tolist(),
        old_logps.tolist(),
        advantages.tolist(),
        mask.tolist(),
        loss_type,
        level,
        0.2,
        options["epsilon_high"],
        None,
        0.9,
        1.3,
        (2.5, 3.5, 1.5, 2.2),
        keep.tolist(),
        sampler.tolist(),
        ref_logps.tolist(),
        0.07,
        True,
    )
    assert_close(loss, expected)
    assert ("clip_ratio" in stats) == (loss_type in ("dapo", "luspo"))
    assert ("cispo_clip_ratio" in stats) == (loss_type == "cispo")


def test_delta_caps_the_unclipped_ratio_for_negative_advantages():
    # A = -1 with r = 5: plain clip gives -min(-5, -1.2) = 5; delta = 3 caps it: -min(-3, -1.2) = 3. With A = +1
    # the clip binds first (-1.2) whatever delta is. The capped token has no gradient.
    logps = as_tensor([[math.log(5.0), math.log(5.0), math.log(2.0)]], requires_grad=True)
    advantages = as_tensor([[-1.0, 1.0, -1.0]])
    loss, _ = clipped_policy_loss(
        logps, torch.zeros(1, 3, dtype=torch.float64), advantages, torch.ones(1, 3), delta=3.0
    )
    assert_close(loss, [[3.0, -1.2, 2.0]])
    loss.sum().backward()
    assert_close(logps.grad, [[0.0, 0.0, 2.0]])  # d(-r A)/dlogp = -A r = 2 where nothing binds


def test_surrogate_gradients_by_hand():
    # cispo: -sg(min(r, eps_high)) A log pi has gradient -min(r, eps_high) A; sapo: -(4/tau) sigmoid(tau (r-1)) A
    # has gradient -4 sigmoid' (tau (r - 1)) r A, which is -r A at r = 1 (the vanilla policy gradient).
    logps = as_tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    old = as_tensor([[math.log(0.25), math.log(0.25)]])  # r = 2 and 1
    advantages = as_tensor([1.5])
    loss, stats = policy_objective(logps, old, advantages, torch.ones(1, 2), loss_type="cispo", epsilon_high=1.5)
    loss.sum().backward()
    assert_close(logps.grad, [[-1.5 * 1.5, -1.0 * 1.5]])
    assert_close(stats["cispo_clip_ratio"], 0.5)
    logps.grad = None
    loss, _ = policy_objective(logps, old, advantages, torch.ones(1, 2), loss_type="sapo", sapo_temperature_pos=2.0)
    loss.sum().backward()
    s = _sigmoid(2.0 * (2 - 1))
    assert_close(logps.grad, [[-4 * s * (1 - s) * 2 * 1.5, -1.5]])


def test_vespo_weight_peaks_at_one_and_is_detached():
    logps = as_tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = policy_objective(logps, logps.detach(), as_tensor([2.0]), torch.ones(1, 2), loss_type="vespo")
    assert_close(stats["vespo_phi"], [[1.0]])  # w = 1: phi = e^lam e^-lam = 1
    loss.sum().backward()
    assert_close(logps.grad, [[-2.0, -2.0]])  # -phi A, phi carries no gradient
    far = vespo_weights(as_tensor([[1.0, 1.0]]), as_tensor([1.0]), torch.ones(1, 2))
    assert_close(far, [[math.exp(3.0 + 2 * 2.0 - 3.0 * math.exp(2.0))]])


@pytest.mark.parametrize("loss_type", ["luspo", "sapo", "cispo", "vespo"])
def test_surrogate_aggregations(loss_type):
    loss, mask = random_batch(2)
    actual = aggregate_loss(loss, mask, loss_type, total_sequences=10, total_tokens=40, max_completion_length=6)
    sums = [sum(x for x, m in zip(row, ms) if m) for row, ms in zip(loss.tolist(), mask.tolist())]
    expected = {
        "luspo": sum(sums) / 10,
        "sapo": sum(s / sum(ms) for s, ms in zip(sums, mask.tolist())) / 10,
        "cispo": sum(sums) / 40,
        "vespo": sum(sums) / 40,
    }[loss_type]
    assert_close(actual, expected)


# -- token selection and sampler weights ----------------------------------------------------------------------
def _quantile(values, q):
    values = sorted(values)
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


@pytest.mark.parametrize("top", [0.0, 0.2, 0.5, 1.0])
def test_high_entropy_mask_matches_reference(top):
    generator = torch.Generator().manual_seed(11)
    entropy = torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    selected = high_entropy_mask(entropy, mask, top)
    valid = [e for row, ms in zip(entropy.tolist(), mask.tolist()) for e, m in zip(row, ms) if m]
    threshold = _quantile(valid, 1 - top)
    expected = [
        [bool(m) and e >= threshold for e, m in zip(row, ms)] for row, ms in zip(entropy.tolist(), mask.tolist())
    ]
    assert selected.tolist() == expected
    if top in (0.0, 1.0):  # only the highest-entropy token, or every valid token
        assert sum(map(sum, expected)) == (1 if top == 0.0 else len(valid))
    with pytest.raises(ConfigError, match="top_entropy_quantile=1.5"):
        high_entropy_mask(entropy, mask, 1.5)


def test_off_policy_mask_by_hand():
    # Row means of log(pi_behaviour / pi): 0.6 (A < 0: dropped), 0.6 (A >= 0: kept), 0.2 (kept: close enough),
    # and a NaN behaviour log-prob counts as 0 (row 3: mean 0.3 over its 2 tokens, kept).
    logps = torch.zeros(4, 2, dtype=torch.float64)
    behaviour = as_tensor([[0.5, 0.7], [0.6, 0.6], [0.2, 0.2], [0.6, float("nan")]])
    keep = off_policy_sequence_mask(logps, behaviour, as_tensor([-1.0, 0.0, -1.0, -1.0]), torch.ones(4, 2), 0.5)
    assert_close(keep, [[0.0], [1.0], [1.0], [1.0]])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampler_importance_weights_modes(mode):
    trainer = as_tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    sampler = as_tensor([[math.log(4.0), -math.log(5.0), 0.0], [-math.log(2.0), float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1: padding holds 9, the sampler could not score token 1
    weights = sampler_importance_weights(trainer, sampler, mask, mode, clip_min=0.5, clip_max=3.0)
    token = [[0.25, 5.0, 1.0], [2.0, 1.0, 1.0]]
    sequence = [[0.25 * 5.0], [2.0]]
    ratios = token if mode.startswith("token") else sequence
    if mode.endswith("truncate"):
        expected = [[min(max(r, 0.5), 3.0) for r in row] for row in ratios]
    else:
        expected = [[r if 0.5 <= r <= 3.0 else 0.0 for r in row] for row in ratios]
    assert_close(weights, expected)
    open_top = (
        sampler_importance_weights(trainer, sampler, mask, mode, clip_min=None, clip_max=None)
        if mode.endswith("mask")
        else None
    )
    if open_top is not None:
        assert_close(open_top, ratios)


# -- the registry of policy loss types ----------------------------------------------------------------------
def field_rules(config_class, name: str) -> dict:
    import dataclasses

    field = next(f for f in dataclasses.fields(config_class) if f.name == name)
    return {"help": field.metadata["help"], **field.metadata["rules"]}


def test_the_registry_is_what_the_configs_offer():
    from posttrain.losses.policy import AGGREGATIONS, GRPO_LOSS_TYPES, LOSS_TYPES, POLICY_LOSSES
    from posttrain.online.config import OnlineConfig
    from posttrain.trainers.grpo_config import GRPOConfig

    grpo, online = field_rules(GRPOConfig, "loss_type"), field_rules(OnlineConfig, "loss_type")
    assert tuple(grpo["choices"]) == GRPO_LOSS_TYPES == tuple(POLICY_LOSSES)
    assert tuple(online["choices"]) == LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo")
    for name, loss in POLICY_LOSSES.items():
        assert f"{name}: {loss.summary}" in grpo["help"]
        assert loss.aggregation in AGGREGATIONS
    assert all(name in online["help"] for name in LOSS_TYPES) and "vespo" not in online["help"]
    # TRL warns about sequence-level ratios for these (they sum token terms over the step).
    assert {name for name, loss in POLICY_LOSSES.items() if loss.sums_tokens} == {"bnpo", "dr_grpo", "dapo", "cispo"}
    assert {name for name, loss in POLICY_LOSSES.items() if loss.clips} == {"grpo", "bnpo", "dr_grpo", "dapo", "luspo"}


def test_a_new_loss_type_is_one_registry_entry(monkeypatch):
    """REINFORCE, -A log pi per token with grpo's aggregation, added as one entry: the objective, its sampler
    correction and the aggregation follow, against numbers worked by hand."""
    from posttrain.losses.policy import POLICY_LOSSES, PolicyLoss, loss_type_help

    entry = PolicyLoss(lambda t: (-t.advantages * t.logps, {}), "grpo", "REINFORCE, -A log pi")
    monkeypatch.setitem(POLICY_LOSSES, "reinforce", entry)
    logps = as_tensor([[math.log(0.5), math.log(0.25), 0.0], [math.log(0.5), 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages = as_tensor([2.0, -1.0])
    sampler = as_tensor([[1.0, 0.5, 1.0], [2.0, 1.0, 1.0]])
    per_token, stats = policy_objective(
        logps, logps.detach(), advantages, mask, loss_type="reinforce", sampler_ratio=sampler
    )
    assert stats == {}
    ln2 = math.log(2)
    assert_close(per_token, [[2 * ln2, 0.5 * 2 * 2 * ln2, 0.0], [2.0 * -ln2, 0.0, 0.0]])
    loss = aggregate_loss(per_token, mask, "reinforce", total_sequences=2)
    assert_close(loss, ((2 * ln2 + 2 * ln2) / 2 + (-2 * ln2)) / 2)
    assert "reinforce: REINFORCE, -A log pi" in loss_type_help(("grpo", "reinforce"))
    with pytest.raises(ConfigError, match="loss_type='ppo' is not one of"):
        aggregate_loss(per_token, mask, "ppo")
