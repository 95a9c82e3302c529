"""The former experimental trainers' helpers at `trl.experimental.utils` (posttrain/experimental/former_helpers.py)
against TRL 1.16's on the same inputs: padding, BOS/EOS insertion, a reward model's scores, and model preparation."""

import copy

import pytest
import torch
from _trl import import_trl_experimental
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from posttrain.errors import ConfigError
from posttrain.experimental import utils as ours


@pytest.fixture(scope="module")
def trl_utils():
    return import_trl_experimental("utils")


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


FEATURES = [
    {
        "prompt_input_ids": [5, 6, 7],
        "prompt_attention_mask": [1, 1, 1],
        "chosen_input_ids": [8],
        "chosen_attention_mask": [1],
        "chosen_labels": [8],
        "rejected_input_ids": [9, 10, 11, 12],
        "rejected_attention_mask": [1, 1, 1, 1],
        "rejected_labels": [9, 10, 11, 12],
        "reference_chosen_logps": -1.5,
        "prompt": "a",
    },
    {
        "prompt_input_ids": [5],
        "prompt_attention_mask": [1],
        "chosen_input_ids": [13, 14, 15],
        "chosen_attention_mask": [1, 1, 1],
        "chosen_labels": [13, 14, 15],
        "rejected_input_ids": [16],
        "rejected_attention_mask": [1],
        "rejected_labels": [16],
        "reference_chosen_logps": -0.25,
        "prompt": "b",
    },
]


@pytest.mark.parametrize("encoder_decoder", [False, True])
def test_dpo_padding_collator_pads_as_trls(trl_utils, encoder_decoder):
    theirs = trl_utils.DPODataCollatorWithPadding(pad_token_id=3, is_encoder_decoder=encoder_decoder)
    mine = ours.DPODataCollatorWithPadding(pad_token_id=3, is_encoder_decoder=encoder_decoder)
    expected, got = theirs(copy.deepcopy(FEATURES)), mine(copy.deepcopy(FEATURES))
    _same(got, expected)
    assert got["prompt_input_ids"][1].tolist() == ([5, 3, 3] if encoder_decoder else [3, 3, 5])


def test_dpo_padding_collator_needs_a_pad_token():
    with pytest.raises(ConfigError, match="pad token"):
        ours.DPODataCollatorWithPadding(pad_token_id=None)(copy.deepcopy(FEATURES))


@pytest.mark.parametrize("bos", [None, 1, 5])
def test_bos_and_eos_insertion_as_trls(trl_utils, bos):
    prompt = {"prompt_input_ids": [5, 6], "prompt_attention_mask": [1, 1]}
    chosen = {"prompt_input_ids": [], "prompt_attention_mask": [], "input_ids": [7, 2], "attention_mask": [1, 1]}
    rejected = {"prompt_input_ids": [1, 6], "prompt_attention_mask": [1, 1], "input_ids": [], "attention_mask": []}

    def run(module):
        p, c, r = copy.deepcopy((prompt, chosen, rejected))
        out = module.add_bos_token_if_needed(bos, len(p["prompt_input_ids"]), p, 0, c, 2, r)
        return out, module.add_eos_token_if_needed(2, out[1], out[2])

    assert run(ours) == run(trl_utils)


def test_get_reward_as_trls(trl_utils, tiny_model_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).eval()
    pad = 0
    rows = torch.tensor([[4, 5, 6, 7, 8, pad, pad], [9, 10, 11, 12, 13, 14, 15], [pad, 16, 17, 18, pad, pad, pad]])
    with torch.no_grad():
        expected, got = trl_utils.get_reward(model, rows, pad, 3), ours.get_reward(model, rows, pad, 3)
    assert got[2].tolist() == expected[2].tolist() == [4, 6, 3]
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


def _state(model):
    """What preparation changes: trainable names, dtypes, checkpointing, and whether the embeddings' output needs a
    gradient (the input hook)."""
    embeds = model.get_input_embeddings()(torch.tensor([[4, 5]]))
    return (
        sorted(n for n, p in model.named_parameters() if p.requires_grad),
        {n: p.dtype for n, p in model.named_parameters()},
        getattr(model, "is_gradient_checkpointing", None),
        embeds.requires_grad,
    )


@pytest.mark.parametrize("quantized", [False, True])
def test_kbit_preparation_as_trls(trl_utils, tiny_model_path, quantized):
    def run(module):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        model.quantization_method = "hqq" if quantized else None
        return _state(module.prepare_model_for_kbit_training(model, True, {"use_reentrant": False}))

    got = run(ours)
    assert got == run(trl_utils)
    assert got[0] == [] and got[2] is quantized


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}])
def test_gradient_checkpointing_as_trls(trl_utils, tiny_model_path, kwargs):
    def run(module):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        model.get_input_embeddings().weight.requires_grad_(False)  # so only the input hook makes it need a grad
        return _state(module.enable_gradient_checkpointing(model, kwargs))

    got = run(ours)
    assert got == run(trl_utils)
    assert got[2] is True and got[3] is True  # transformers adds the input hook with its default reentrant checkpoints


@pytest.mark.parametrize("checkpointing", [False, True])
def test_peft_preparation_as_trls(trl_utils, tiny_model_path, checkpointing):
    from peft import LoraConfig
    from transformers import TrainingArguments

    def run(module, tmp):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        args = TrainingArguments(output_dir=tmp, gradient_checkpointing=checkpointing, use_cpu=True, report_to=[])
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        return _state(module.prepare_peft_model(model, config, args))

    got = run(ours, "a")
    assert got == run(trl_utils, "b")
    assert got[0] and all("lora_" in name for name in got[0])


def test_peft_preparation_refuses_an_adapter_and_a_config(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4))
    with pytest.raises(ConfigError, match="merge and unload"):
        ours.prepare_peft_model(model, LoraConfig(r=4), None)


def test_bf16_casting_as_trls(trl_utils, tiny_model_path):
    def run(module):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path).to(torch.bfloat16)
        model.model.norm.to(torch.bfloat16)
        model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features)  # float32
        module.peft_module_casting_to_bf16(model)
        return {n: p.dtype for n, p in model.named_parameters()}

    got = run(ours)
    assert got == run(trl_utils)
    assert got["lm_head.weight"] == torch.bfloat16 and got["model.norm.weight"] == torch.float32
