"""The helpers TRL's IW-OPD and server-distillation modules define (posttrain.losses.iw_opd's `add_tail_bucket`,
`jsd_terms`, `top_k_generalized_jsd_loss`; posttrain.data.samplers' `RepeatBatchLoader`;
`build_teacher_request_inputs`) against hand-worked float64 references, and TRL's config rules for both trainers."""

import math

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from posttrain.experimental.server_distillation import ServerDistillationConfig, build_teacher_request_inputs
from posttrain.losses.distillation import generalized_jsd_loss
from posttrain.losses.iw_opd import add_tail_bucket, jsd_terms, top_k_generalized_jsd_loss


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def _jsd(p, q, beta):
    """Generalized JSD of student p and teacher q: 0 forward KL(q||p), 1 reverse KL(p||q)."""
    if beta == 0:
        return _kl(q, p)
    if beta == 1:
        return _kl(p, q)
    m = [beta * b + (1 - beta) * a for a, b in zip(p, q)]
    return beta * _kl(q, m) + (1 - beta) * _kl(p, m)


def test_tail_bucket_holds_the_rest_of_the_mass():
    logps = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.3), -math.inf]], dtype=torch.float64)
    valid = torch.tensor([[True, True], [True, False]])
    with_tail, tail_valid = add_tail_bucket(logps, valid)
    assert with_tail[:, 2].exp().tolist() == pytest.approx([0.3, 0.7], rel=1e-12)
    assert tail_valid.tolist() == [[True, True, True], [True, False, True]]
    full = add_tail_bucket(torch.tensor([[0.0]], dtype=torch.float64), torch.tensor([[True]]))[0]
    assert torch.isfinite(full).all()  # a support holding all the mass keeps a finite (tiny) tail


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_terms_sum_to_the_generalized_jsd(beta):
    p, q = [0.6, 0.3, 0.1], [0.2, 0.5, 0.3]
    student, teacher = torch.tensor(p, dtype=torch.float64).log(), torch.tensor(q, dtype=torch.float64).log()
    assert jsd_terms(student, teacher, beta).sum().item() == pytest.approx(_jsd(p, q, beta), rel=1e-12)
    # outside the support mask an element counts 0, even at -inf
    mask = torch.tensor([True, True, False])
    student[2], teacher[2] = -math.inf, -math.inf
    got = jsd_terms(student, teacher, beta, mask)
    assert got[2].item() == 0.0 and torch.isfinite(got).all()


def test_jsd_terms_keep_gradients_finite_on_padded_positions():
    raw = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    teacher, valid = add_tail_bucket(
        torch.tensor([[[-2.3], [0.0], [0.0]], [[-1.1], [-0.4], [-3.0]]], dtype=torch.float64),
        torch.ones(2, 3, 1, dtype=torch.bool),
    )
    jsd_terms(raw.log_softmax(-1), teacher, 1.0, valid).sum().backward()
    assert torch.isfinite(raw.grad).all()


@pytest.mark.parametrize("beta,add_tail", [(0.0, True), (1.0, False), (0.5, True), (0.5, False)])
def test_top_k_generalized_jsd_loss_matches_a_float64_reference(beta, add_tail):
    g = torch.Generator().manual_seed(3)
    s_logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    t_logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    labels = torch.tensor([[5, -100, 2], [1, 4, -100]])
    got = top_k_generalized_jsd_loss(s_logits, t_logits, labels, beta, 0.7, "batchmean", top_k=2, add_tail=add_tail)
    total, count = 0.0, 0
    for b in range(2):
        for t in range(3):
            if labels[b, t] == -100:
                continue
            p = torch.softmax(s_logits[b, t] / 0.7, -1).tolist()
            q = torch.softmax(t_logits[b, t] / 0.7, -1).tolist()
            teacher_top = sorted(range(6), key=lambda i: -q[i])[:2]
            student_top = sorted(range(6), key=lambda i: -p[i])[:2]
            ids = {0.0: teacher_top, 1.0: student_top}.get(beta) or list(dict.fromkeys(teacher_top + student_top))
            ps, qs = [p[i] for i in ids], [q[i] for i in ids]
            if add_tail:
                ps, qs = ps + [1 - sum(ps)], qs + [1 - sum(qs)]
            else:
                ps, qs = [x / sum(ps) for x in ps], [x / sum(qs) for x in qs]
            total, count = total + _jsd(ps, qs, beta), count + 1
    assert got.item() == pytest.approx(total / count, rel=1e-10)


def test_top_k_zero_is_the_full_vocabulary_loss():
    g = torch.Generator().manual_seed(4)
    s, t = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    for reduction in ("batchmean", "sum", "mean"):
        ours = IWOPDTrainer.generalized_jsd_loss(s, t, beta=0.4, reduction=reduction)
        assert torch.equal(ours, generalized_jsd_loss(s, t, beta=0.4, reduction=reduction))
    assert torch.equal(top_k_generalized_jsd_loss(s, t, top_k=5), generalized_jsd_loss(s, t))


def test_repeat_batch_loader_repeats_each_batch_and_forwards_the_rest():
    from posttrain.data.samplers import RepeatBatchLoader

    class Loader:
        batch_size, epoch = 4, None

        def __iter__(self):
            yield from ({"x": 1}, {"x": 2})

        def __len__(self):
            return 2

        def set_epoch(self, epoch):
            self.epoch = epoch

    inner = Loader()
    loader = RepeatBatchLoader(inner, repeat_count=3)
    batches = list(loader)
    assert [b["x"] for b in batches] == [1, 1, 1, 2, 2, 2] and batches[0] is batches[1]
    assert len(loader) == 6 and loader.batch_size == 4
    loader.set_epoch(5)
    assert inner.epoch == 5
    with pytest.raises(ValueError, match="repeat_count"):
        RepeatBatchLoader(inner, 0)


def test_build_teacher_request_inputs_trims_padding():
    ids = torch.tensor([[0, 7, 8, 9, 0], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, 8, 9, -100], [-100, -100, -100, 8, 9]])
    assert build_teacher_request_inputs(ids, mask, labels=labels) == ([[7, 8, 9], [5, 6, 7, 8, 9]], [1, 3], [2, 2])
    prompt_mask = torch.tensor([[1, 1], [1, 0]])
    assert build_teacher_request_inputs(ids, mask, prompt_mask) == ([[7, 8, 9], [5, 6, 7, 8, 9]], [2, 1], [1, 4])
    with pytest.raises(ValueError, match="labels are required"):
        build_teacher_request_inputs(ids, mask)
    with pytest.raises(ValueError, match="same shape"):
        build_teacher_request_inputs(ids, mask[:, :3], labels=labels)
    with pytest.raises(ValueError, match="Invalid prompt length"):
        build_teacher_request_inputs(ids, mask, torch.ones(2, 4, dtype=torch.long))


def _kw(tmp_path, **settings):
    return dict(output_dir=str(tmp_path), report_to="none", **settings)


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(use_liger_kernel=True), "use_liger_kernel=True is not supported with distillation_objective='iw_opd'"),
        (dict(iw_opd_gamma=-0.1), "iw_opd_gamma must be non-negative"),
        (dict(iw_opd_epsilon=0.0), "iw_opd_epsilon must be positive"),
        (dict(reverse_kl_top_1_mode="x"), "reverse_kl_top_1_mode must be one of"),
        (dict(reverse_kl_top_1_mode="argmax"), "requires reverse_kl_top_1_mode='sampled'"),
        (dict(use_teacher_server=True, teacher_model_server_url="http://h", beta=0.5, loss_top_k=2), "loss_top_k"),
    ],
)
def test_iw_opd_config_rules(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        IWOPDConfig(**_kw(tmp_path, **settings))


def test_server_config_refuses_liger(tmp_path):
    with pytest.raises(ConfigError, match="use_liger_kernel=True is not supported by ServerDistillationTrainer"):
        ServerDistillationConfig(**_kw(tmp_path, teacher_model_server_url="http://h", use_liger_kernel=True))
