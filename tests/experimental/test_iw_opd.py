"""IW-OPD (posttrain.experimental.iw_opd): its losses against float64 references, the step-0 loss of every objective
equal to TRL 1.16's IWOPDTrainer on the same tiny student, teacher and batch, TRL's defaults and signature, and
on-policy learning."""

import dataclasses
import inspect
import math

import pytest
import torch
from _trl import import_trl_experimental
from test_gkd import _messages

from posttrain.errors import ConfigError
from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from posttrain.losses.iw_opd import iw_opd_token_losses, support_divergence, top1_mixed_support, top_k_support
from posttrain.models.tiny import build_tiny_model


def _trl_iw_opd():
    return import_trl_experimental("iw_opd")


# -- float64 references ------------------------------------------------------------------------------------------
def test_iw_opd_token_losses_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    student = -torch.rand(2, 5, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(2, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    losses, advantages, weights = iw_opd_token_losses(student, teacher, mask, gamma=0.7, eps=1e-8)
    for b in range(2):
        ratios = [float(teacher[b, t] - student[b, t]) if mask[b, t] else 0.0 for t in range(5)]
        total = max(sum(abs(r) for r in ratios), 1e-8)
        for t in range(5):
            if not mask[b, t]:
                assert losses[b, t].item() == 0.0
                continue
            w = 1 + 0.7 * (1 - sum(abs(r) for r in ratios[:t]) / total)
            assert weights[b, t].item() == pytest.approx(w, rel=1e-12)
            assert advantages[b, t].item() == pytest.approx(w * ratios[t], rel=1e-12)
            assert losses[b, t].item() == pytest.approx(-float(student[b, t]) * w * ratios[t], rel=1e-12)
    # the advantage is a constant: the gradient is -w_t * a_t on the student's log-probability
    student.requires_grad_(True)
    iw_opd_token_losses(student, teacher, mask, gamma=0.7)[0].sum().backward()
    assert torch.allclose(student.grad, torch.where(mask, -advantages, 0.0))


def _softmax(row, temperature=1.0):
    z = [math.exp(x / temperature) for x in row]
    return [x / sum(z) for x in z]


def test_mixed_top1_reverse_kl_with_tail():
    """beta=1 on the sampled token alone: KL between the Bernoulli (token, rest) of student and teacher."""
    g = torch.Generator().manual_seed(1)
    s_logits, t_logits = (
        torch.randn(3, 6, generator=g, dtype=torch.float64),
        torch.randn(3, 6, generator=g, dtype=torch.float64),
    )
    sampled = torch.tensor([2, 0, 5])
    support, valid = top1_mixed_support(t_logits, sampled, beta=1.0)
    got = support_divergence(s_logits, t_logits, support, valid, beta=1.0, add_tail=True, temperature=0.5)
    for n in range(3):
        p, q = _softmax(s_logits[n].tolist(), 0.5)[sampled[n]], _softmax(t_logits[n].tolist(), 0.5)[sampled[n]]
        ref = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
        assert got[n].item() == pytest.approx(ref, rel=1e-9)


def test_top_k_jsd_renormalised_on_the_union_of_supports():
    g = torch.Generator().manual_seed(2)
    s_logits, t_logits = (
        torch.randn(4, 7, generator=g, dtype=torch.float64),
        torch.randn(4, 7, generator=g, dtype=torch.float64),
    )
    support, valid = top_k_support(s_logits, t_logits, 2, beta=0.3)
    got = support_divergence(s_logits, t_logits, support, valid, beta=0.3, add_tail=False)
    for n in range(4):
        ids = list(dict.fromkeys(t_logits[n].topk(2).indices.tolist() + s_logits[n].topk(2).indices.tolist()))
        p, q = _softmax(s_logits[n].tolist()), _softmax(t_logits[n].tolist())
        p, q = [p[i] / sum(p[j] for j in ids) for i in ids], [q[i] / sum(q[j] for j in ids) for i in ids]
        m = [0.3 * b + 0.7 * a for a, b in zip(p, q)]
        ref = 0.3 * sum(b * math.log(b / c) for b, c in zip(q, m)) + 0.7 * sum(
            a * math.log(a / c) for a, c in zip(p, m)
        )
        assert got[n].item() == pytest.approx(ref, rel=1e-9)


# -- against TRL ----------------------------------------------------------------------------------------------------
def _teacher(tokenizer, path):
    teacher = build_tiny_model(tokenizer, seed=1, hidden_size=64, tie=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5.0)
    teacher.config._name_or_path = path  # TRL loads the teacher's tokenizer from here
    return teacher


def _kw(tmp_path, **kw):
    return {
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=2,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            seed=0,
            max_completion_length=8,
        ),
        **kw,
    }


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(distillation_objective="jsd"),
        dict(distillation_objective="jsd", beta=0.5, lmbda=0.5, reverse_kl_top_1_mode="argmax"),
        dict(distillation_objective="jsd", beta=0.5, loss_top_k=3, loss_add_tail=False, temperature=0.7),
        dict(distillation_objective="jsd", beta=0.0, loss_top_k=0),
        dict(distillation_objective="jsd", beta=0.0, loss_top_k=2),
    ],
)
def test_step0_loss_equals_trls(tmp_path, tokenizer, tiny_model_path, settings):
    iw_opd = _trl_iw_opd()
    data = _messages(4, tokenizer)
    theirs = iw_opd.IWOPDTrainer(
        model=build_tiny_model(tokenizer),
        teacher_model=_teacher(tokenizer, tiny_model_path),
        train_dataset=data,
        processing_class=tokenizer,
        args=iw_opd.IWOPDConfig(**_kw(tmp_path / "trl", bf16=False, gradient_checkpointing=False, **settings)),
    )
    batch = theirs.data_collator([data[i] for i in range(4)])
    assert bool((batch["attention_mask"] == 1).all())
    theirs.model.eval()
    with torch.no_grad():
        trl_loss = theirs.compute_loss(
            theirs.model, {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        ).item()
    ours = IWOPDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer, tiny_model_path),
        train_dataset=data,
        processing_class=tokenizer,
        args=IWOPDConfig(**_kw(tmp_path / "ours", **settings)),
    )
    rows = [
        {"input_ids": batch["input_ids"][i].tolist(), "completion_mask": (batch["labels"][i] != -100).long().tolist()}
        for i in range(4)
    ]
    ours.model.eval()
    with torch.no_grad():
        our_loss = ours.compute_loss(ours.model, ours.data_collator(rows)).item()
    assert abs(our_loss) > 1e-4
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)


def test_config_defaults_and_signature_are_trls():
    iw_opd = _trl_iw_opd()

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    ours = {f.name: default(f) for f in dataclasses.fields(IWOPDConfig)}
    for f in dataclasses.fields(iw_opd.IWOPDConfig):
        if f.name not in {"gradient_checkpointing", "remove_unused_columns"}:  # posttrain-wide differences
            assert f.name in ours, f.name
            assert ours[f.name] == default(f), f.name
    params = list(inspect.signature(IWOPDTrainer.__init__).parameters)[1:]
    theirs = list(inspect.signature(iw_opd.IWOPDTrainer.__init__).parameters)[1:]
    assert params[: len(theirs)] == theirs


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(lmbda=0.5), "lmbda=1.0"),
        (dict(num_generations=2), "num_gen"),
        (dict(distillation_objective="kl"), "distillation_objective"),
        (dict(use_teacher_server=True), "use_teacher_server"),
        (dict(max_completion_length=2048), "max_completion_length"),
    ],
)
def test_bad_settings_stop_before_training(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        IWOPDConfig(**_kw(tmp_path, **settings))


def test_prompts_are_cut_on_the_tokenizers_truncation_side(tmp_path, fresh_tokenizer, tiny_model_path):
    data = _messages(2, fresh_tokenizer)
    full = IWOPDTrainer(
        build_tiny_model(fresh_tokenizer),
        _teacher(fresh_tokenizer, tiny_model_path),
        train_dataset=data,
        processing_class=fresh_tokenizer,
        args=IWOPDConfig(**_kw(tmp_path, max_prompt_length=None, max_length=None)),
    )
    ids = full.train_dataset[0]["input_ids"]
    assert len(ids) > 5
    cut = IWOPDTrainer(
        build_tiny_model(fresh_tokenizer),
        _teacher(fresh_tokenizer, tiny_model_path),
        train_dataset=data,
        processing_class=fresh_tokenizer,
        args=IWOPDConfig(**_kw(tmp_path, max_prompt_length=5)),
    )
    assert cut.train_dataset[0]["input_ids"] == ids[:5]
    fresh_tokenizer.truncation_side = "left"
    left = IWOPDTrainer(
        build_tiny_model(fresh_tokenizer),
        _teacher(fresh_tokenizer, tiny_model_path),
        train_dataset=data,
        processing_class=fresh_tokenizer,
        args=IWOPDConfig(**_kw(tmp_path, max_prompt_length=5)),
    )
    assert left.train_dataset[0]["input_ids"] == ids[-5:]


def test_on_policy_student_moves_towards_the_teacher(tmp_path, tokenizer, tiny_model_path):
    """IW-OPD's expected gradient is that of -KL(student || teacher): the reverse KL on held text falls."""
    from posttrain.losses.distillation import reverse_kl

    data = _messages(16, tokenizer)
    trainer = IWOPDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer, tiny_model_path),
        processing_class=tokenizer,
        train_dataset=data,
        args=IWOPDConfig(
            **_kw(
                tmp_path,
                max_steps=20,
                learning_rate=3e-3,
                lr_scheduler_type="constant",
                per_device_train_batch_size=16,
                max_completion_length=16,
                logging_steps=1,
            )
        ),
    )
    ids = torch.tensor(
        [tokenizer.apply_chat_template(data[i]["messages"], tokenize=True, return_dict=False) for i in range(8)]
    )

    def gap():
        trainer.model.eval()
        with torch.no_grad():
            return reverse_kl(trainer.model(ids).logits, trainer.teacher_model(ids).logits).mean().item()

    before = gap()
    trainer.train()
    after = gap()
    assert len([h for h in trainer.state.log_history if "iw_opd/mean_weight" in h]) == 20
    assert after < 0.9 * before, (before, after)
