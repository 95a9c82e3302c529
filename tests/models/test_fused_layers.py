"""The fused RMSNorm / SwiGLU functions (posttrain/models/fused_layers.py): the modules' values and gradients, the
activations they no longer keep, and the cases that fall back to the modules' own forward."""

import copy
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from posttrain.models import fused_layers
from posttrain.models.fused_layers import fuse_layers
from posttrain.models.tiny import MOE_FAMILIES, build_tiny_model, build_tiny_tokenizer


def _grads(module, inputs, grad_out):
    inputs = inputs.detach().requires_grad_()
    out = module(inputs)
    out.backward(grad_out)
    return out.detach(), inputs.grad, {n: p.grad for n, p in module.named_parameters()}


def _mlp(dtype, act="silu"):
    torch.manual_seed(0)
    return LlamaMLP(
        LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, hidden_act=act)
    ).to(dtype)


def test_swiglu_equals_the_module_in_float64():
    module = _mlp(torch.float64)
    fused = copy.deepcopy(module)
    assert fuse_layers(fused) == 1
    x, grad_out = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(3, 5, 16, dtype=torch.float64)
    (out, dx, dw), (f_out, f_dx, f_dw) = _grads(module, x, grad_out), _grads(fused, x, grad_out)
    torch.testing.assert_close(f_out, out, rtol=0, atol=1e-13)
    torch.testing.assert_close(f_dx, dx, rtol=0, atol=1e-12)
    for name in dw:
        torch.testing.assert_close(f_dw[name], dw[name], rtol=0, atol=1e-12)


def test_rmsnorm_gradient_against_a_float64_reference():
    """Llama's norm computes in float32 whatever the input; its gradient against exact float64 autograd."""
    torch.manual_seed(0)
    x, weight, grad_out = (
        torch.randn(4, 7, 24, dtype=torch.float64),
        torch.randn(24, dtype=torch.float64),
        torch.randn(4, 7, 24, dtype=torch.float64),
    )
    eps = 1e-5
    ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    (ref_w * ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + eps)).backward(grad_out)
    x_, w_ = x.clone().requires_grad_(), weight.clone().requires_grad_()
    fused_layers._RMSNorm.apply(x_, w_, eps).backward(grad_out)
    torch.testing.assert_close(x_.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_.grad, ref_w.grad, rtol=1e-5, atol=1e-5)


def test_one_plus_weight_rmsnorm_gradient_against_a_float64_reference():
    """Gemma's norm, (x / rms(x)) * (1 + weight) in float32 then cast back; its gradient against exact float64
    autograd of that formula."""
    torch.manual_seed(0)
    x, weight, grad_out = (
        torch.randn(4, 7, 24, dtype=torch.float64),
        torch.randn(24, dtype=torch.float64),
        torch.randn(4, 7, 24, dtype=torch.float64),
    )
    eps = 1e-6
    ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ((1 + ref_w) * ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + eps)).backward(grad_out)
    x_, w_ = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_layers._OnePlusWeightRMSNorm.apply(x_, w_, eps)
    out.backward(grad_out)
    assert out.dtype == x_.grad.dtype == w_.grad.dtype == torch.float64
    torch.testing.assert_close(x_.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_.grad, ref_w.grad, rtol=1e-5, atol=1e-5)


def _gemma_norm(dtype, transposed: bool):
    """Gemma 3's RMSNorm with a random weight, and an input laid out as its q/k norms see it when `transposed`
    (a non-contiguous [batch, heads, tokens, head_dim] view)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    module = Gemma3RMSNorm(24, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.normal_()
    x, grad_out = torch.randn(4, 7, 3, 24).to(dtype), torch.randn(4, 3, 7, 24).to(dtype)
    return module, x.transpose(1, 2) if transposed else x.reshape(4, 3, 7, 24), grad_out


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_plus_weight_rmsnorm_equals_gemmas_module(dtype, transposed):
    module, x, grad_out = _gemma_norm(dtype, transposed)
    fused = copy.deepcopy(module)
    assert fuse_layers(fused) == 1
    (out, dx, dw), (f_out, f_dx, f_dw) = _grads(module, x, grad_out), _grads(fused, x, grad_out)
    assert torch.equal(f_out, out) and f_out.dtype == dtype  # the same operations in the forward
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(f_dx, dx, **tol)
    torch.testing.assert_close(f_dw["weight"], dw["weight"], **tol)
    with torch.no_grad():
        assert torch.equal(fused(x), module(x))  # (its own forward without gradient)


def test_a_gemma3_model_keeps_fewer_activations_and_rebuilds_its_norms_bit_for_bit():
    """Per (1 + weight) norm autograd keeps x / rms(x) besides x; fused, x alone. Inside `rebuilt_activations` the
    layers reading a norm's output keep its recipe instead, and the gradients are those without the recipes."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=2, family="gemma3")
    fused = copy.deepcopy(model)
    assert fuse_layers(fused) == FUSED_PER_FAMILY["gemma3"]
    ids = torch.randint(0, len(tokenizer), (3, 20))
    tokens, layers, hidden, inter, q_k = ids.numel(), 2, 32, 64, 4 * 8 + 2 * 8
    saved_less = 4 * tokens * (2 * inter * layers + hidden * (4 * layers + 1) + q_k * layers)
    assert _saved_bytes(model, ids) - _saved_bytes(fused, ids) >= saved_less
    results = []
    for m, rebuilt in ((model, False), (fused, False), (fused, True)):
        m.zero_grad(set_to_none=True)
        with fused_layers.rebuilt_activations(rebuilt):
            out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[2][0], results[0][0])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6)
        assert torch.equal(results[2][1][name], results[1][1][name])


def test_the_fast_paths_report_gemma3s_fused_norms(tmp_path, caplog):
    """`posttrain env --model` and the trainers' log line count Gemma 3's (1 + weight) norms with its MLPs."""
    import logging

    from posttrain import SFTConfig
    from posttrain.cli.environment import model_fast_paths_report
    from posttrain.models.tiny import save_tiny_model
    from posttrain.training.model_setup import prepare_model

    path = save_tiny_model(tmp_path / "gemma3", family="gemma3")
    report = [line for line in model_fast_paths_report(path).splitlines() if line.startswith("fused layers")]
    assert report == [f"{'fused layers':<18} 15 norms and MLPs"]
    with caplog.at_level(logging.INFO, logger="posttrain"):
        model = prepare_model(path, SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Fast paths")]
    assert len(lines) == 1 and "; fused layers: 15 norms and MLPs;" in lines[0]
    assert sum("forward" in vars(m) for m in model.modules()) == 15


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_unfuse_layers_restores_every_fused_module(family):
    import pickle

    model = build_tiny_model(build_tiny_tokenizer(), family=family)
    count = fuse_layers(model)
    assert fused_layers.unfuse_layers(model) == count
    assert not any("forward" in vars(m) for m in model.modules())
    pickle.dumps(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_the_module(dtype):
    torch.manual_seed(0)
    module = LlamaRMSNorm(24, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.normal_()
    fused = copy.deepcopy(module)
    assert fuse_layers(fused) == 1
    x, grad_out = torch.randn(4, 7, 24).to(dtype), torch.randn(4, 7, 24).to(dtype)
    (out, dx, dw), (f_out, f_dx, f_dw) = _grads(module, x, grad_out), _grads(fused, x, grad_out)
    assert torch.equal(f_out, out)  # the same operations in the forward
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(f_dx, dx, **tol)
    torch.testing.assert_close(f_dw["weight"], dw["weight"], **tol)


def _saved_bytes(model, ids) -> int:
    """Bytes of the tensors autograd keeps for the backward pass, parameters excluded, each storage once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}

    def pack_sized(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            sizes[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack_sized, lambda t: t):
        model.model(input_ids=ids)
    return sum(sizes.values())


def test_a_model_keeps_fewer_activations_and_gets_the_same_gradients():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2)
    fused = copy.deepcopy(model)
    layers, hidden, inter = 2, 32, 64
    assert fuse_layers(fused) == 2 * layers + 1 + layers  # two norms a layer, the final norm, one MLP a layer
    ids = torch.randint(0, len(tokenizer), (3, 20))
    tokens = ids.numel()
    # Per layer autograd keeps gate(x), silu(gate(x)), up(x) and their product; fused: gate(x) and up(x). Per norm
    # it keeps x and x / rms(x); fused: x.
    saved_less = 4 * tokens * (2 * inter * layers + hidden * (2 * layers + 1))
    assert _saved_bytes(model, ids) - _saved_bytes(fused, ids) >= saved_less
    mask = torch.ones_like(ids)
    mask[0, 14:] = 0
    results = []
    for m in (model, fused):
        out = m(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6)


def test_cpu_autocast_runs_the_backward_in_bfloat16_like_the_module():
    module = _mlp(torch.float32)
    fused = copy.deepcopy(module)
    fuse_layers(fused)
    x, grad_out = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out, dx, dw), (f_out, f_dx, f_dw) = _grads(module, x, grad_out), _grads(fused, x, grad_out)
    assert f_out.dtype == out.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in f_dw.values())
    torch.testing.assert_close(f_out, out, rtol=2e-2, atol=2e-2)
    assert f_dx.dtype == dx.dtype
    torch.testing.assert_close(f_dx, dx, rtol=5e-2, atol=5e-2)
    for name in dw:
        torch.testing.assert_close(f_dw[name], dw[name], rtol=5e-2, atol=5e-2)


def test_fallbacks_run_the_modules_own_forward():
    calls = []
    real = fused_layers._GatedMLP.apply
    with mock.patch.object(fused_layers._GatedMLP, "apply", side_effect=lambda *a: calls.append(1) or real(*a)):
        fused = _mlp(torch.float32)
        fuse_layers(fused)
        x = torch.randn(2, 3, 16)
        fused(x).sum().backward()
        assert len(calls) == 1
        with torch.no_grad():
            fused(x)  # no gradient wanted
        fused.up_proj.weight.ds_id = 7  # a DeepSpeed ZeRO-3 partitioned weight is not all here
        fused(x).sum().backward()
        del fused.up_proj.weight.ds_id
        fused.down_proj = torch.nn.Linear(40, 16, bias=True)  # a bias (or a LoRA / quantized layer)
        fused(x).sum().backward()
        assert len(calls) == 1
    relu = _mlp(torch.float32, act="relu")
    assert fuse_layers(relu) == 0  # only SiLU and tanh-GELU are fused
    assert fuse_layers(fused) == 0  # already rebound


def test_lora_on_the_mlp_keeps_the_adapters_gradients(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "q_proj"], task_type="CAUSAL_LM")
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    fuse_layers(base)
    fused = get_peft_model(base, lora)
    fused.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 300, (2, 12))
    grads = []
    for m in (plain, fused):
        m(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6)


def test_trainers_fuse_by_default_and_train_the_same(tiny_model_path):
    from datasets import Dataset

    from posttrain import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"the number {i} is followed by {i + 1}."} for i in range(16)])
    losses, rebound = [], []
    for fused in (True, False):
        args = SFTConfig(
            output_dir=f"/tmp/fused_{fused}",
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
            fused_layers=fused,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=data)
        rebound.append(sum("forward" in vars(m) for m in trainer.model.modules()))
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert rebound == [7, 0]
    assert len(losses[0]) == 3
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5, atol=1e-5)


# Modules fused per family in a two-layer model: its norms that compute Llama's RMSNorm (with Qwen3's q/k norms) or
# Gemma's (1 + weight) RMSNorm (four a layer, q/k norms, the final one) and its gated MLPs (not the expert blocks of
# Qwen3-MoE and Mixtral).
FUSED_PER_FAMILY = {
    "llama": 7,
    "qwen2": 7,
    "qwen3": 11,
    "gemma3": 15,
    "mistral": 7,
    "phi3": 7,
    "qwen3_moe": 9,
    "mixtral": 5,
}


@pytest.mark.parametrize("family", list(FUSED_PER_FAMILY))
def test_every_family_is_fused_where_it_computes_a_fused_formula(family):
    """In float64, the fused model's logits and every parameter's gradient against the unfused model's (to float32
    rounding: Llama's RMSNorm computes in float32 whatever its input, and the fused backward sums in another order)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=4, family=family).double()
    if family in MOE_FAMILIES:
        model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    fused = copy.deepcopy(model)
    assert fuse_layers(fused) == FUSED_PER_FAMILY[family]
    ids = torch.randint(0, len(tokenizer), (2, 12))
    results = []
    for m in (model, fused):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-12)
    assert results[1][1].keys() == results[0][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-7)


def test_activations_are_recognised_by_what_they_compute():
    from transformers.activations import ACT2FN

    names = {act: fused_layers.activation_name(ACT2FN[act]) for act in ("silu", "swish", "gelu_pytorch_tanh", "gelu")}
    assert names == {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": None}
    assert fused_layers.activation_name(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
