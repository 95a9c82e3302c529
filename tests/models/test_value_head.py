"""The causal LM with a value head: shapes, what the head computes, save/load, PEFT, gradients."""

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from posttrain.errors import ConfigError
from posttrain.models.value_head import VALUE_HEAD_FILE, AutoModelForCausalLMWithValueHead

IDS = torch.tensor([[1, 274, 273, 201, 85, 67], [0, 0, 5, 90, 12, 44]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.fixture()
def model(tiny_model_path):
    torch.manual_seed(0)
    return AutoModelForCausalLMWithValueHead.from_pretrained(tiny_model_path)


def test_logits_are_the_lm_and_values_the_head_on_final_hidden_states(model, tiny_model_path):
    out = model(input_ids=IDS, attention_mask=MASK)
    assert out.loss is None and out.logits.shape == (2, 6, model.config.vocab_size) and out.values.shape == (2, 6)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.testing.assert_close(out.logits, lm(input_ids=IDS, attention_mask=MASK).logits)
    # Independent float64 computation of the head: w . h + b on the decoder's final (normed) output, per token.
    hidden = lm.model(input_ids=IDS, attention_mask=MASK).last_hidden_state.double()
    weight, bias = model.v_head.summary.weight.double(), model.v_head.summary.bias.double()
    expected = torch.einsum("bth,h->bt", hidden, weight[0]) + bias[0]
    torch.testing.assert_close(out.values.double(), expected, rtol=1e-5, atol=1e-7)


def test_save_and_load_round_trip_gives_identical_logits_and_values(model, tmp_path):
    with torch.no_grad():  # a head that is not the fresh initialisation, so loading it is what is tested
        model.v_head.summary.weight.normal_()
        model.v_head.summary.bias.fill_(0.37)
    model.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).is_file() and (tmp_path / "config.json").is_file()
    torch.manual_seed(123)  # a fresh head would differ: the loaded one must replace it
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    before, after = model(input_ids=IDS, attention_mask=MASK), loaded(input_ids=IDS, attention_mask=MASK)
    assert torch.equal(before.logits, after.logits)
    assert torch.equal(before.values, after.values)


def test_trainer_state_dict_is_split_between_lm_and_head(model, tmp_path):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["v_head.summary.bias"] = torch.tensor([2.5])
    model.save_pretrained(tmp_path, state_dict=state)
    loaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert loaded.v_head.summary.bias.item() == 2.5
    torch.testing.assert_close(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_peft_trains_only_lora_and_head_and_disabling_gives_the_base(tiny_model_path):
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_path)(input_ids=IDS).logits
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_model_path, peft_config=lora)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("v_head.") for name in trainable)
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= trainable
    assert not torch.allclose(model(input_ids=IDS).logits, base_logits, atol=1e-4)  # the adapter is live
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(input_ids=IDS).logits, base_logits)


def test_gradients_flow_into_the_head_and_the_trunk(model):
    out = model(input_ids=IDS, attention_mask=MASK)
    out.values.sum().backward()
    # d(sum of values)/d(bias) is the number of positions; the weight's gradient is the summed hidden states.
    assert model.v_head.summary.bias.grad.item() == pytest.approx(IDS.numel())
    assert model.v_head.summary.weight.grad.abs().sum() > 0
    trunk = model.pretrained_model.model.layers[0].self_attn.q_proj.weight
    assert trunk.grad is not None and trunk.grad.abs().sum() > 0


def test_generate_delegates_and_bad_dropout_is_rejected(model, tiny_model_path):
    out = model.generate(input_ids=IDS[:1], max_new_tokens=3, do_sample=False)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert torch.equal(out, lm.generate(input_ids=IDS[:1], max_new_tokens=3, do_sample=False))
    with pytest.raises(ConfigError, match="value_head_dropout"):
        AutoModelForCausalLMWithValueHead.from_pretrained(tiny_model_path, value_head_dropout=1.5)
