"""The decode loop's in-place key/value cache (generation/decode_cache.py) against transformers' concatenating
`DynamicLayer`, the cache the loop used before: the same keys and values after any sequence of updates, row
selections and repeats, and, through the whole loop, bitwise the same tokens and sampler log-probs on three
families (Llama, Qwen2, Gemma 3 with its sliding-window layers left as they are)."""

import pytest
import torch
from test_generation import prompts  # noqa: F401  (the same prompts as the backend tests)
from transformers.cache_utils import DynamicLayer

from posttrain.generation import SamplingParams, TransformersBackend, decode_cache
from posttrain.generation.decode_cache import ReservedLayer


def test_reserved_layer_holds_what_a_dynamic_layer_holds():
    torch.manual_seed(0)
    first = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    plain = DynamicLayer()
    plain.update(*first)
    reserved = ReservedLayer(*first, chunk=2, limit=40)
    steps = [("update", 1), ("update", 1), ("update", 3), ("repeat", 3), ("update", 1), ("select", [0, 2, 5])]
    steps += [("update", 1)] * 5 + [("select", [2]), ("update", 2)]
    for action, arg in steps:
        if action == "update":
            new = torch.randn(plain.keys.shape[0], 3, arg, 4), torch.randn(plain.keys.shape[0], 3, arg, 4)
            expected, got = plain.update(*new), reserved.update(*new)
            assert all(torch.equal(e, g) for e, g in zip(expected, got))
        elif action == "repeat":
            plain.batch_repeat_interleave(arg)
            reserved.batch_repeat_interleave(arg)
        else:
            plain.batch_select_indices(torch.tensor(arg))
            reserved.batch_select_indices(torch.tensor(arg))
        assert torch.equal(plain.keys, reserved.keys) and torch.equal(plain.values, reserved.values)
        assert reserved.get_seq_length() == plain.get_seq_length()
    assert reserved.key_buffer.shape[-2] <= 40 and reserved.keys.data_ptr() == reserved.key_buffer.data_ptr()


SAMPLINGS = [
    SamplingParams(max_tokens=14, top_k=1),
    SamplingParams(max_tokens=14, temperature=1.2),
    SamplingParams(max_tokens=14, temperature=0.8, top_k=20, repetition_penalty=1.3),
]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_decode_with_the_reserved_cache_samples_bitwise_what_the_concatenating_cache_samples(
    tokenizer, prompts, family, monkeypatch
):
    """Chunks of 3 positions make the cache grow several times within 14 tokens; stop tokens sampled early make
    rows leave the batch at different steps (their rows copied out of the buffer)."""
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=4, family=family).eval()
    reserved_layers = []
    real_init = ReservedLayer.__init__
    monkeypatch.setattr(
        ReservedLayer, "__init__", lambda self, *a, **k: (reserved_layers.append(self), real_init(self, *a, **k))[1]
    )
    free = TransformersBackend(model, tokenizer.pad_token_id, []).generate(prompts, 2, SAMPLINGS[1], seed=9)
    stops = [tokenizer.eos_token_id, free[0].token_ids[3], free[3].token_ids[5]]
    lengths = set()
    for sampling in SAMPLINGS:
        runs = {}
        for chunk in (None, 3):
            backend = TransformersBackend(model, tokenizer.pad_token_id, stops, return_logprobs=True)
            backend.reserve_chunk = chunk
            runs[chunk] = backend.generate(prompts, 3, sampling, seed=[31, 32, 33])
        old, new = runs[None], runs[3]
        assert [c.token_ids for c in new] == [c.token_ids for c in old], sampling
        assert [c.finished_with_eos for c in new] == [c.finished_with_eos for c in old]
        for a, b in zip(old, new):
            assert torch.equal(
                torch.tensor(a.logprobs, dtype=torch.float64), torch.tensor(b.logprobs, dtype=torch.float64)
            )
        lengths.add(tuple(len(c.token_ids) for c in old))
    assert any(len(set(run)) >= 2 for run in lengths)  # rows left the batch at different steps
    sliding = [
        i for i, layer in enumerate(getattr(model.config, "layer_types", None) or []) if layer == "sliding_attention"
    ]
    assert reserved_layers and len(reserved_layers) % (model.config.num_hidden_layers - len(sliding)) == 0


def test_reserve_replaces_only_plain_layers():
    class Cache:
        layers = [DynamicLayer(), DynamicLayer(), "sliding"]

    Cache.layers[0].update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    decode_cache.reserve(Cache, chunk=4, limit=10)
    assert type(Cache.layers[0]) is ReservedLayer and Cache.layers[0].key_buffer.shape[-2] == 6
    assert type(Cache.layers[1]) is DynamicLayer and Cache.layers[2] == "sliding"  # empty / another kind: as is
