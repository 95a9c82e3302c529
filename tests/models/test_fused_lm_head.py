"""posttrain.models.fused_lm_head (TRL's `trl.trainer.utils.add_fused_lm_head` path) against TRL 1.16's
add_fused_lm_head, side by side on copies of the same tiny model and batch: every output field and every parameter's
gradient, on Llama, Qwen2, Gemma 3 (soft-capped logits) and Qwen3-MoE (load-balancing loss); the loss against the
model's own loss, and the unpatched path against the original forward."""

import copy
import importlib

import pytest
import torch
from _trl import import_trl

from posttrain.models.tiny import build_tiny_model
from posttrain.trainer import add_fused_lm_head as face_add_fused_lm_head
from posttrain.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask", "aux_loss")
ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class _Vocab:
    """What tiny_config reads from a tokenizer: its length and the special token ids."""

    eos_token_id, pad_token_id = 1, 0

    def __len__(self):
        return 97


@pytest.fixture(scope="module")
def trl_utils():
    import_trl()
    return importlib.import_module("trl.trainer.utils")


def _batch(seed=0, rows=3, length=11):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, 97, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0  # a right-padded row
    labels = input_ids.clone()
    labels[:, :4] = -100  # a prompt
    labels[attention_mask == 0] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _run(model, patch, batch, loss_weights=(1.0, 0.3), **patch_kwargs):
    """The patched forward's output and every parameter's gradient of loss + 0.3 * sum(entropy)."""
    patch(model, **patch_kwargs)
    out = model(**batch, fused_lm_head=True)
    total = loss_weights[0] * out.loss
    if out.entropy is not None:
        total = total + loss_weights[1] * out.entropy.sum()
    total.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def _compare(ours, theirs, tol=1e-5):
    (out, grads), (expected, expected_grads) = ours, theirs
    for field in FIELDS:
        mine, reference = getattr(out, field), getattr(expected, field)
        if reference is None:
            assert mine is None, field
        elif reference.dtype == torch.bool:
            assert torch.equal(mine, reference), field
        else:
            torch.testing.assert_close(mine.detach(), reference.detach(), rtol=tol, atol=tol, msg=field)
    assert grads.keys() == expected_grads.keys()
    for name, reference in expected_grads.items():
        assert (grads[name] is None) == (reference is None), name
        if reference is not None:
            torch.testing.assert_close(grads[name], reference, rtol=1e-4, atol=tol, msg=name)


@pytest.mark.parametrize(
    "family, settings, kwargs",
    [
        ("llama", {"logits_scaling": 4.0}, {"temperature": 0.7, "outputs": ALL_OUTPUTS}),  # Granite-style: / 4
        ("qwen2", {"tie": False}, {"temperature": 1.0, "outputs": ("log_probs", "entropy", "is_top1")}),
        # a cap small enough to bend these logits (the tiny model's are well below its default 30)
        ("gemma3", {"final_logit_softcapping": 0.2}, {"temperature": 1.3, "outputs": ALL_OUTPUTS}),
        ("qwen3_moe", {"tie": False, "output_router_logits": True, "router_aux_loss_coef": 0.02}, {}),
        ("mixtral", {"tie": False, "output_router_logits": True, "router_aux_loss_coef": 0.02}, {}),
    ],
)
def test_outputs_and_gradients_equal_trls(trl_utils, family, settings, kwargs):
    model = build_tiny_model(_Vocab(), family=family, **settings).float()
    batch = _batch()
    theirs = _run(copy.deepcopy(model), trl_utils.add_fused_lm_head, batch, **kwargs)
    ours = _run(copy.deepcopy(model), add_fused_lm_head, batch, **kwargs)
    assert isinstance(ours[0], FusedCausalLMOutput)
    assert ours[0].log_probs.shape == (3, 10) and int(ours[0].label_mask.sum()) == 7 + 4 + 7
    assert (ours[0].aux_loss is not None) == (family in ("qwen3_moe", "mixtral"))
    _compare(ours, theirs)


def test_shift_labels_num_items_and_fp32_head_under_autocast_equal_trls(trl_utils):
    model = build_tiny_model(_Vocab(), family="qwen2", tie=False).float()
    batch = _batch(seed=1)
    shift = torch.cat([batch.pop("labels")[:, 1:], torch.full((3, 1), -100)], 1)
    batch.update(shift_labels=shift, num_items_in_batch=torch.tensor(40))
    kwargs = {"cast_lm_head_to_fp32": True, "outputs": ("log_probs", "entropy")}
    results = []
    for patch in (trl_utils.add_fused_lm_head, add_fused_lm_head):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_run(copy.deepcopy(model), patch, batch, **kwargs))
    theirs, ours = results
    assert ours[0].log_probs.shape == (3, 11) and ours[0].log_probs.dtype == torch.float32
    # the backbone runs in bfloat16 in both, the head in float32: bfloat16's rounding, not the head's, sets the gap
    _compare(ours, theirs, tol=2e-2)
    torch.testing.assert_close(ours[0].loss, -ours[0].log_probs.sum() / 40)


def test_loss_is_the_models_own_and_the_unpatched_path_is_the_original_forward():
    model = build_tiny_model(_Vocab(), family="llama").float()
    batch = _batch(seed=2)
    with torch.no_grad():
        expected = model(**batch)
        face_add_fused_lm_head(model)
        plain = model(**batch)
        fused = model(**batch, fused_lm_head=True)
        generated = model.generate(batch["input_ids"][:1], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(plain.logits, expected.logits)
    torch.testing.assert_close(fused.loss, expected.loss, rtol=1e-5, atol=1e-6)
    # independently: the log-probs from the full logits of the original forward, zero where the label is -100
    labels = batch["labels"][:, 1:]
    logp = expected.logits[:, :-1].log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(fused.log_probs, logp * (labels != -100), rtol=1e-5, atol=1e-6)
    assert fused.entropy is None and generated.shape == (1, 14)


def test_a_batch_without_labels_gives_a_zero_loss_connected_to_the_model():
    model = build_tiny_model(_Vocab(), family="llama").float()
    add_fused_lm_head(model)
    batch = _batch(seed=3)
    batch["labels"][:] = -100
    out = model(**batch, fused_lm_head=True)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and not out.label_mask.any()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_signature_and_output_fields_are_trls(trl_utils):
    import dataclasses
    import inspect

    def described(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert described(add_fused_lm_head) == described(trl_utils.add_fused_lm_head)
    assert face_add_fused_lm_head is add_fused_lm_head
    fields = [(f.name, f.default) for f in dataclasses.fields(FusedCausalLMOutput)]
    assert fields == [(f.name, f.default) for f in dataclasses.fields(trl_utils.FusedCausalLMOutput)]


def test_an_unknown_output_name_or_missing_labels_stop_naming_them():
    model = build_tiny_model(_Vocab(), family="llama")
    with pytest.raises(ValueError, match=r"outputs \['entropies'\].*choose among"):
        add_fused_lm_head(model, outputs=("log_probs", "entropies"))
    add_fused_lm_head(model)
    batch = _batch()
    del batch["labels"]
    with pytest.raises(ValueError, match="pass labels="):
        model(**batch, fused_lm_head=True)
