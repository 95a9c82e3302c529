"""Self-distillation at TRL's module paths (`posttrain.experimental.sdft.loss_utils`, `.teacher_sync`): the per-mode
losses and the importance-sampling clip against float64 formulas, the averaged-adapter teacher callback by hand,
and the teacher each `teacher_model_kind` gives (a live teacher is the student; a PEFT student's 'base' teacher is
the student with its adapter merged in)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState, TrainingArguments

from posttrain.errors import ConfigError
from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer
from posttrain.experimental.sdft.loss_utils import (
    apply_importance_sampling_clipping,
    compute_full_logit_self_distillation_loss,
    compute_sampled_token_self_distillation_loss,
    compute_topk_self_distillation_loss,
)
from posttrain.experimental.sdft.teacher_sync import PEFTAdapterEMACallback


def _probs(row: list[float]) -> list[float]:
    z = [math.exp(x) for x in row]
    return [x / sum(z) for x in z]


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def _jsd(p_s: list[float], p_t: list[float], alpha: float) -> float:
    if alpha == 0:
        return _kl(p_t, p_s)
    if alpha == 1:
        return _kl(p_s, p_t)
    m = [alpha * t + (1 - alpha) * s for s, t in zip(p_s, p_t)]
    return alpha * _kl(p_t, m) + (1 - alpha) * _kl(p_s, m)


@pytest.fixture()
def logits():
    g = torch.Generator().manual_seed(4)
    return torch.randn(2, 3, 6, generator=g, dtype=torch.float64), torch.randn(
        2, 3, 6, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("alpha", [0.0, 0.4, 1.0])
def test_full_logit_loss_is_the_generalized_jsd(logits, alpha):
    s, t = logits
    got = compute_full_logit_self_distillation_loss(s, t, distillation_alpha=alpha)
    assert got.shape == (2, 3)
    for b in range(2):
        for i in range(3):
            ref = _jsd(_probs(s[b, i].tolist()), _probs(t[b, i].tolist()), alpha)
            assert got[b, i].item() == pytest.approx(ref, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("add_tail", [False, True])
def test_topk_loss_on_the_students_support(logits, add_tail):
    s, t = logits
    got = compute_topk_self_distillation_loss(
        s, t, distillation_topk=3, distillation_alpha=0.0, distillation_add_tail=add_tail
    )
    for b in range(2):
        for i in range(3):
            p_s, p_t = _probs(s[b, i].tolist()), _probs(t[b, i].tolist())
            top = sorted(range(6), key=lambda v: -p_s[v])[:3]
            q_s, q_t = [p_s[v] for v in top], [p_t[v] for v in top]
            if add_tail:
                q_s, q_t = q_s + [1 - sum(q_s)], q_t + [1 - sum(q_t)]
            else:
                q_s, q_t = [x / sum(q_s) for x in q_s], [x / sum(q_t) for x in q_t]
            assert got[b, i].item() == pytest.approx(_kl(q_t, q_s), rel=1e-9, abs=1e-12)


def test_sampled_token_loss_and_its_gradient(logits):
    s, t = logits
    s = s.clone().requires_grad_(True)
    ids = torch.tensor([[0, 5, 2], [3, 3, 1]])
    got = compute_sampled_token_self_distillation_loss(s, t, ids, distillation_alpha=1.0)
    for b in range(2):
        for i in range(3):
            log_s = math.log(_probs(s[b, i].tolist())[ids[b, i]])
            log_t = math.log(_probs(t[b, i].tolist())[ids[b, i]])
            assert got[b, i].item() == pytest.approx((log_s - log_t) * log_s, rel=1e-9)
    # the log-ratio is a constant: d loss / d logits = (log p_S - log p_T)(x) * (onehot(x) - p_S), the score estimator
    got.sum().backward()
    p_s = s.detach().softmax(-1)
    log_ratio = s.detach().log_softmax(-1).gather(-1, ids[..., None]) - t.log_softmax(-1).gather(-1, ids[..., None])
    expected = log_ratio * (torch.nn.functional.one_hot(ids, 6).double() - p_s)
    torch.testing.assert_close(s.grad, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="reverse KL only"):
        compute_sampled_token_self_distillation_loss(s, t, ids, distillation_alpha=0.5)


def test_importance_sampling_clip_caps_the_ratio_without_a_gradient_through_it():
    per_token = torch.tensor([[1.0, 2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    student = torch.tensor([[0.4, 0.3, 0.1]], dtype=torch.float64).log().requires_grad_(True)
    old = torch.tensor([[0.1, 0.2, 0.2]], dtype=torch.float64).log()
    got = apply_importance_sampling_clipping(per_token, student, old, clip_coeff=2.0)
    ratios = [min(0.4 / 0.1, 2.0), min(0.3 / 0.2, 2.0), min(0.1 / 0.2, 2.0)]  # 2 (capped), 1.5, 0.5
    assert got[0].tolist() == pytest.approx([1.0 * ratios[0], 2.0 * ratios[1], -3.0 * ratios[2]], rel=1e-12)
    got.sum().backward()
    assert student.grad is None or torch.count_nonzero(student.grad) == 0
    assert per_token.grad[0].tolist() == pytest.approx(ratios, rel=1e-12)
    # a log-ratio past 20 is clamped before exp: no overflow
    huge = apply_importance_sampling_clipping(torch.ones(1), torch.tensor([500.0]), torch.tensor([0.0]), 1e30)
    assert huge.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def _lora_model(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def test_adapter_ema_callback_averages_the_student_adapter(tmp_path, tiny_model_path):
    model = _lora_model(tiny_model_path)
    callback = PEFTAdapterEMACallback(model, teacher_adapter_name="teacher", update_rate=0.25, sync_steps=2)
    args, state, control = TrainingArguments(str(tmp_path), report_to="none"), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control)
    assert "teacher" in model.peft_config and model.active_adapter == "default"
    teacher = get_peft_model_state_dict(model, adapter_name="teacher")
    assert teacher.keys() == callback.shadow_weights.keys() and all(not v.any() for v in teacher.values())
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".teacher." in n)
    assert any(p.requires_grad for n, p in model.named_parameters() if ".default." in n)

    first = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    state.global_step = 1  # not a sync step
    callback.on_step_end(args, state, control)
    assert all(not v.any() for v in callback.shadow_weights.values())
    state.global_step = 2
    callback.on_step_end(args, state, control)
    with torch.no_grad():
        for p in (p for n, p in model.named_parameters() if ".default." in n):
            p.add_(1.0)
    second = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    state.global_step = 4
    callback.on_step_end(args, state, control)
    teacher = get_peft_model_state_dict(model, adapter_name="teacher")
    for key in first:  # shadow = 0.75 * (0.25 * first) + 0.25 * second
        expected = 0.75 * 0.25 * first[key] + 0.25 * second[key]
        torch.testing.assert_close(callback.shadow_weights[key], expected)
        torch.testing.assert_close(teacher[key], expected)
    with pytest.raises(ConfigError, match="update_rate"):
        PEFTAdapterEMACallback(model, update_rate=0.0)


def _sdft(tmp_path, model, kind):
    data = Dataset.from_list([{"prompt": "Name red.", "privileged_context": "The answer is red."}] * 2)
    args = SDFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        num_generations=1,
        max_completion_length=4,
        max_steps=1,
        teacher_model_kind=kind,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    return SDFTTrainer(model, args=args, train_dataset=data)


def test_live_teacher_is_the_student(tmp_path, tiny_model_path):
    trainer = _sdft(tmp_path, tiny_model_path, "live")
    assert trainer.teacher_model is trainer.model


def test_a_peft_students_base_teacher_has_the_adapter_merged_in(tmp_path, tiny_model_path, caplog):
    model = _lora_model(tiny_model_path)  # random (non-zero) LoRA weights: merging changes the outputs
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with caplog.at_level(logging.WARNING):
        trainer = _sdft(tmp_path, model, "base")
    assert "already contains a PEFT adapter" in caplog.text
    teacher = trainer.teacher_model
    assert not hasattr(teacher, "peft_config") and not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    with torch.no_grad():
        torch.testing.assert_close(teacher(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
