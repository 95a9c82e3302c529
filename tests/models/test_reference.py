"""Reference models: frozen copies, adapter-disabled PEFT policies, fingerprints, the disk cache, TR-DPO mixing."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState

from posttrain.callbacks import SyncRefModelCallback, mix_into_reference
from posttrain.errors import ConfigError
from posttrain.models.reference import (
    cached_tensors,
    create_reference_model,
    is_peft_model,
    reference_forward,
    weights_fingerprint,
)

IDS = torch.tensor([[1, 274, 273, 201, 85, 67]])


@pytest.fixture()
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path)


def _lora(model, seed=0):
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so the adapter changes the outputs.
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def test_default_reference_is_a_frozen_detached_copy(model):
    model.train()
    ref = create_reference_model(model)
    assert ref is not model and not ref.training
    for (name, p), (ref_name, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert name == ref_name and torch.equal(p, r) and p.data_ptr() != r.data_ptr()
        assert p.requires_grad and not r.requires_grad
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # training the policy leaves the reference alone
    assert not torch.equal(next(model.parameters()), next(ref.parameters()))


def test_user_reference_is_frozen_and_peft_policy_needs_none(model, tiny_model_path):
    user = AutoModelForCausalLM.from_pretrained(tiny_model_path).train()
    assert create_reference_model(model, user) is user
    assert not user.training and not any(p.requires_grad for p in user.parameters())
    assert create_reference_model(_lora(model), peft=True) is None


def test_adapter_disabled_forward_is_the_base_model_and_restores_training_mode(model):
    base_logits = model(IDS).logits.detach()
    policy = _lora(model).train()
    assert is_peft_model(policy) and not is_peft_model(model.model)
    assert not torch.allclose(policy(IDS).logits, base_logits, atol=1e-4)  # the adapter is live
    with reference_forward(policy, None) as ref:
        assert not ref.training and not torch.is_grad_enabled()
        ref_logits = ref(IDS).logits
    assert torch.equal(ref_logits, base_logits)
    assert policy.training and torch.is_grad_enabled()
    assert not torch.allclose(policy(IDS).logits, base_logits, atol=1e-4)  # the adapter is back on


def test_reference_forward_without_reference_or_adapter_is_an_error(model):
    with pytest.raises(TypeError, match="needs a ref_model unless the policy is a PEFT model"):
        with reference_forward(model, None):
            pass


def test_weights_fingerprint_tracks_weights_but_not_a_skipped_adapter(model, tiny_model_path):
    same = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert weights_fingerprint(model) == weights_fingerprint(same)
    with torch.no_grad():
        same.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert weights_fingerprint(model) != weights_fingerprint(same)
    # Two different random adapters on the same base: equal once trainable (adapter) weights are skipped.
    a = _lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), seed=1)
    b = _lora(AutoModelForCausalLM.from_pretrained(tiny_model_path), seed=2)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a, skip_trainable=True) == weights_fingerprint(b, skip_trainable=True)


def test_cached_tensors_computes_once_per_key(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"x": torch.tensor([1.0, 2.0])}

    first, hit1 = cached_tensors(tmp_path, {"a": 1}, compute)
    second, hit2 = cached_tensors(tmp_path, {"a": 1}, compute)
    third, hit3 = cached_tensors(tmp_path, {"a": 2}, compute)
    assert (hit1, hit2, hit3) == (False, True, False) and len(calls) == 2
    assert torch.equal(second["x"], torch.tensor([1.0, 2.0]))
    assert len(list(tmp_path.glob("*.pt"))) == 2 and not list(tmp_path.glob("*.tmp"))


def test_mix_into_reference_and_sync_callback_schedule(model):
    ref = create_reference_model(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    policy_before = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    ref_before = {n: p.detach().clone().double() for n, p in ref.named_parameters()}
    callback = SyncRefModelCallback(ref, alpha=0.25, sync_steps=3)
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control, model=model)
    state.global_step = 2
    callback.on_step_end(None, state, control, model=model)  # not a sync step
    assert all(torch.equal(p.double(), ref_before[n]) for n, p in ref.named_parameters())
    state.global_step = 3
    callback.on_step_end(None, state, control, model=model)
    for name, p in ref.named_parameters():
        expected = 0.25 * policy_before[name] + 0.75 * ref_before[name]
        torch.testing.assert_close(p.double(), expected, rtol=0, atol=1e-6)
    mix_into_reference(model, ref, 1.0)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in ref.named_parameters())


def test_policy_as_its_own_reference_is_refused(model):
    with pytest.raises(ConfigError, match="ref_model is the policy itself"):
        create_reference_model(model, model)
    assert all(p.requires_grad for p in model.parameters())
