"""models/fast_forward.py on every family it serves, against the model's own forward bit for bit: the prefill of
left-padded prompts, decode steps with the group's cache copied (the 4D SDPA mask where the decode loop gives one,
the 2D mask on sliding-window models), the caches, a cache-less forward in training mode (old log-probs) and the
hidden states the shared-prompt log-probs read. Models it cannot reproduce exactly go through their own forward."""

from unittest import mock

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from posttrain.generation.transformers_backend import left_pad
from posttrain.models.computes import KINDS, kind_of
from posttrain.models.fast_forward import fast_forward, fast_forward_name
from posttrain.models.fused_layers import fuse_layers
from posttrain.models.tiny import FAMILIES, build_tiny_model

PROMPTS = ["what is one plus two", "hello", "the cat and the dog are in the tree"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in PROMPTS]


def _family_model(tokenizer, family, **settings):
    model = build_tiny_model(tokenizer, seed=1, family=family, num_layers=3, **settings).eval()
    fuse_layers(model)  # as trainers load models
    return model


def _decode_steps(model, forward, caches, logits, mask, positions, steps):
    """`steps` decode steps of the model and of `forward`, each on its own copy of the cache."""
    sliding = any(layer.is_sliding for layer in caches[0].layers)
    tokens, position = logits[:, -1].argmax(-1), positions[:, -1:] + 1
    for _ in range(steps):
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        step_mask = mask if sliding else mask[:, None, None, :].bool()
        expected = model(
            input_ids=tokens[:, None], attention_mask=step_mask, position_ids=position, cache=caches[0], use_cache=True
        ).logits
        assert torch.equal(forward(tokens[:, None], step_mask, position, caches[1]), expected)
        tokens, position = (expected[:, -1] + torch.randn_like(expected[:, -1])).argmax(-1), position + 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_forward_gives_the_models_logits_cache_and_hidden_states_bit_for_bit(tokenizer, prompts, family):
    model = _family_model(tokenizer, family)
    input_ids, mask = left_pad(prompts, tokenizer.pad_token_id, "cpu")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    torch.manual_seed(0)
    with torch.no_grad():
        forward = fast_forward(model)
        assert forward is not None
        logits = model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=caches[0], use_cache=True
        ).logits
        assert torch.equal(forward(input_ids, mask, positions, caches[1]), logits)
        for cache in caches:
            cache.batch_repeat_interleave(2)
        twice = (t.repeat_interleave(2, 0) for t in (logits, mask, positions))
        _decode_steps(model, forward, caches, *twice, steps=10)  # past the sliding window of 8 tokens
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

        model.train()
        sequences, mask = left_pad([p + [5, 6, 7] for p in prompts], tokenizer.pad_token_id, "cpu")
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        outputs = model(
            input_ids=sequences, attention_mask=mask, position_ids=positions, use_cache=False, output_hidden_states=True
        )
        assert torch.equal(fast_forward(model)(sequences, mask, positions, logits_to_keep=4), outputs.logits[:, -4:])
        assert torch.equal(fast_forward(model)(sequences, mask, positions, hidden=True), outputs.hidden_states[-1])


def test_each_family_is_served_as_the_kinds_it_computes(tokenizer):
    """The parts are recognised by their code: every family's parts are known kinds (the MoE blocks run as
    they are), and a subclass that changes a formula is not taken for its parent."""
    expected_attention = {"qwen3": "head_norms", "qwen3_moe": "head_norms", "gemma3": "head_norms_transposed"}
    expected_attention["phi3"] = "fused_projection"
    for family in FAMILIES:
        model = _family_model(tokenizer, family)
        attention = kind_of(model.model.layers[0].self_attn, "attention")
        assert attention == expected_attention.get(family, "projections"), family
        assert fast_forward_name(model) is not None

    llama = _family_model(tokenizer, "llama")
    attention = llama.model.layers[0].self_attn

    class Rescaled(type(attention)):
        def forward(self, hidden_states, *args, **kwargs):
            out, weights = super().forward(hidden_states, *args, **kwargs)
            return 2 * out, weights

    attention.__class__ = Rescaled
    assert kind_of(attention, "attention") is None
    with torch.no_grad():
        assert fast_forward(llama) is None
    assert set(KINDS) == {"causal_lm", "decoder", "layer", "attention", "mlp", "norm"}


def test_an_mlp_of_unknown_code_runs_as_it_is(tokenizer, prompts):
    """A part the fast forward has no kind for, below the layer (an MLP or expert block), is called as its own
    forward: the logits stay the model's."""
    model = _family_model(tokenizer, "qwen2")
    mlp = model.model.layers[1].mlp

    class Shifted(type(mlp)):
        def forward(self, x):
            return super().forward(x) + 0.5

    mlp.__class__ = Shifted
    input_ids, mask = left_pad(prompts, tokenizer.pad_token_id, "cpu")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
        assert torch.equal(fast_forward(model)(input_ids, mask, positions), expected)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fast_forward_is_only_taken_where_it_is_exact(tokenizer, family):
    """Hooks (offloading, FSDP, spies), gradients, other attention implementations, layers that are not plain
    linear layers (quantized, LoRA) and PEFT models go through the model's forward."""
    from peft import LoraConfig, get_peft_model

    model = _family_model(tokenizer, family)
    with torch.no_grad():
        assert fast_forward(model) is not None
        handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
        assert fast_forward(model) is None
        handle.remove()
        eager = _family_model(tokenizer, family)
        eager.set_attn_implementation("eager")
        assert fast_forward(eager) is None
        lora = get_peft_model(_family_model(tokenizer, family), LoraConfig(r=2, target_modules=["q_proj"])).eval()
        assert fast_forward(lora) is None and fast_forward(lora.get_base_model()) is None
        quantized = _family_model(tokenizer, family)

        class Int8Linear(nn.Linear):
            pass

        quantized.model.layers[0].self_attn.v_proj.__class__ = Int8Linear
        assert fast_forward(quantized) is None
    assert fast_forward(model) is None  # a gradient is wanted


def _tiny_gemma2(tokenizer):
    """A family none of whose decoders is a known kind (Gemma 2: soft-capped attention logits)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_a_family_it_does_not_know_falls_back_to_its_own_forward(tokenizer, prompts):
    from posttrain.generation import SamplingParams, TransformersBackend
    from posttrain.models.fast_paths import fast_paths
    from posttrain.models.segment_attention import supports_segment_attention

    model = _tiny_gemma2(tokenizer)
    assert fuse_layers(model) == 11  # its gated MLPs (tanh-GELU) and its (1 + weight) norms (Gemma 3's code)
    with torch.no_grad():
        assert fast_forward(model) is None
        assert fast_paths(model)["no-grad forward"].startswith("off")
    assert not supports_segment_attention(model)
    completions = TransformersBackend(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(
        prompts, 2, SamplingParams(max_tokens=4, top_k=1)
    )
    assert all(len(c.token_ids) == 4 or c.finished_with_eos for c in completions)


def test_the_fast_paths_are_logged_and_shown_by_env(tmp_path, caplog):
    import logging

    from posttrain import SFTConfig
    from posttrain.cli.environment import model_fast_paths_report
    from posttrain.models.tiny import save_tiny_model
    from posttrain.training.model_setup import prepare_model

    path = save_tiny_model(tmp_path / "qwen3", family="qwen3")
    report = model_fast_paths_report(path).splitlines()
    assert report[0].endswith("(Qwen3ForCausalLM)")
    assert report[1].endswith("  mask_per_layer_type, pre_norm/head_norms")
    assert report[2].endswith("11 norms and MLPs") and report[3].endswith("on for padding-free rows")
    with caplog.at_level(logging.INFO, logger="posttrain"):
        prepare_model(path, SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Fast paths")]
    assert lines == [
        "Fast paths for Qwen3ForCausalLM: no-grad forward: mask_per_layer_type, pre_norm/head_norms; "
        "fused layers: 11 norms and MLPs; segment attention: on for padding-free rows"
    ]


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral", "qwen3_moe"])
def test_reference_log_probs_take_the_fast_forward_under_the_shared_layout(tokenizer, family):
    """`forward_hidden` (DPO's and KTO's reference log-probs, the online shared-prompt log-probs) without gradient:
    the fast forward's hidden states under the shared prompt's 4D mask (Gemma 3's and Mistral's windows of 8 tokens
    applied to it: by layer type, or alone), bitwise the decoder's own."""
    from posttrain.models.layouts import forward_hidden, model_shared_layout, right_padded_view

    model = _family_model(tokenizer, family)
    prompt = tokenizer("the cat and the dog are in the tree")["input_ids"]
    sequences = [prompt + [5, 6, 7], prompt + [8, 9], prompt[:4] + [5], prompt[:4] + [6, 7, 8, 9]]
    ids = torch.full((4, max(map(len, sequences))), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = torch.tensor(sequence), 1
    inputs, _ = model_shared_layout(model, right_padded_view(ids, mask))
    masks = inputs["attention_mask"]
    assert isinstance(masks, dict) == (family == "gemma3")  # (one mask for every layer elsewhere)
    with torch.no_grad():
        expected = model.model(**inputs, use_cache=False).last_hidden_state
        with mock.patch.object(type(model.model), "__call__", side_effect=AssertionError("the model ran")):
            hidden, outputs = forward_hidden(model, inputs)
    assert outputs is None and torch.equal(hidden, expected)
