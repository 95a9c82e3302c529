"""QLoRA on a CPU: `ModelConfig(load_in_4bit=True)` builds TRL's BitsAndBytesConfig, the tiny model loads with
bitsandbytes' 4-bit layers, and LoRA SFT and DPO train on them. The checks that the 4-bit weights are the ones used:
each Linear4bit's output equals a plain matmul with its own dequantized weight (and differs from the float weight it
was quantized from), the packed weights are unchanged by training, and the LoRA weights changed."""

import importlib.util

import pytest
import torch
from _trl import trl_module
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from posttrain.cli.model import ModelConfig, get_quantization_config
from posttrain.errors import ConfigError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed (posttrain[qlora])"
)

COMMON = dict(
    max_steps=3, learning_rate=5e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
    disable_tqdm=True, per_device_train_batch_size=4,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    """The tiny model with 64-wide layers: bitsandbytes' CPU inference repacking needs a full 64-value block per row
    (the 32-wide tiny model fails there in bitsandbytes 0.50, on CPUs with AVX512-BF16)."""
    from posttrain.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny64") / "model", hidden_size=64)


def _lora():
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])


def _linear4bit_modules(model):
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _packed(model):
    return {name: m.weight.detach().clone() for name, m in _linear4bit_modules(model).items()}


def test_model_config_builds_trls_4bit_config():
    config = get_quantization_config(
        ModelConfig(load_in_4bit=True, use_peft=True, dtype="float32", bnb_4bit_quant_type="fp4")
    )
    assert config.load_in_4bit and not config.load_in_8bit
    assert (config.bnb_4bit_quant_type, config.bnb_4bit_compute_dtype) == ("fp4", torch.float32)
    trl = trl_module()
    fields = dict(load_in_4bit=True, use_peft=True, dtype="bfloat16", use_bnb_nested_quant=True)
    theirs = trl.get_quantization_config(trl.ModelConfig(model_name_or_path="m", **fields)).to_dict()
    assert get_quantization_config(ModelConfig(**fields)).to_dict() == theirs
    assert get_quantization_config(ModelConfig(load_in_8bit=True)).load_in_8bit


def test_without_bitsandbytes_the_flag_is_refused_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(ConfigError, match=r"--load_in_4bit .* pip install 'posttrain\[qlora\]'"):
        get_quantization_config(ModelConfig(load_in_4bit=True, use_peft=True))


def test_the_4bit_weights_are_the_ones_the_forward_uses(tiny_model_path):
    import bitsandbytes.functional as bnbf

    full = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    config = get_quantization_config(ModelConfig(load_in_4bit=True, use_peft=True))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, quantization_config=config)
    layers = _linear4bit_modules(model)
    assert len(layers) >= 7 * 2  # every projection of both decoder layers (lm_head stays full precision)
    name, layer = next((n, m) for n, m in layers.items() if n.endswith("q_proj"))
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() * 2 == layer.out_features * layer.in_features
    x = torch.randn(3, layer.in_features)
    dequantized = bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    original = full.get_submodule(name).weight.detach()
    layer.train()
    out = layer(x.clone().requires_grad_()).detach()  # the training path: bitsandbytes' 4-bit matmul
    assert torch.allclose(out, x @ dequantized.t(), atol=1e-6)
    assert not torch.allclose(out, x @ original.t(), atol=1e-3)  # nf4 rounding shows: not the float weights
    assert (dequantized - original).abs().max() < 0.2 * original.abs().max()  # but it is their quantization
    layer.eval()
    with torch.no_grad():  # inference (on CPUs with AVX512-BF16 repacked for a bf16 kernel: bf16 rounding)
        assert torch.allclose(layer(x), out, atol=1e-2 * out.abs().max().item())


def _sft(tmp_path, tiny_model_path):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"the cat {'sat ' * (i % 4)}on the mat"} for i in range(8)])
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_length=32, **COMMON)
    config = get_quantization_config(ModelConfig(load_in_4bit=True, use_peft=True))
    return SFTTrainer(tiny_model_path, args=args, train_dataset=data, peft_config=_lora(), quantization_config=config)


def _dpo(tmp_path, tiny_model_path):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    data = Dataset.from_list(
        [{"prompt": f"the {w} is", "chosen": " good", "rejected": " bad bad"} for w in ["cat", "dog", "sky", "sun"]]
    )
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=32, ref_cache_dir=str(tmp_path / "ref"), **COMMON)
    config = get_quantization_config(ModelConfig(load_in_4bit=True, use_peft=True))
    return DPOTrainer(tiny_model_path, args=args, train_dataset=data, peft_config=_lora(), quantization_config=config)


@pytest.mark.parametrize("build", [_sft, _dpo], ids=["sft", "dpo"])
def test_qlora_trains_the_adapter_over_fixed_4bit_weights(tmp_path, tiny_model_path, build):
    trainer = build(tmp_path, tiny_model_path)
    model = trainer.model
    assert getattr(model, "is_loaded_in_4bit", False) or model.get_base_model().is_loaded_in_4bit
    before = _packed(model)
    assert len(before) >= 14
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    assert lora and all(p.abs().max() == 0 for p in lora.values())  # LoRA B starts at zero
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # every step has a gradient (on a CPU, bitsandbytes' inference repacking after a no-grad forward cut it off)
    assert all(e["grad_norm"] > 0 for e in trainer.state.log_history if "grad_norm" in e)
    after = _packed(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the 4-bit base is frozen
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(trained[n].abs().max() > 0 for n in lora)  # every LoRA B moved off zero
