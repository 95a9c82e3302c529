"""Per-sequence attention of padding-free rows (posttrain/models/segment_attention.py): every token's output and
gradient equal to its sequence run alone, the cases handed to transformers' sdpa, where it applies, and the SFT
trainer's loss with it."""

import copy
from unittest import mock

import pytest
import torch
from datasets import Dataset

from posttrain import SFTConfig, SFTTrainer
from posttrain.data.collators import LanguageModelingCollator
from posttrain.models import segment_attention as sa
from posttrain.models.segment_attention import segment_attention, supports_segment_attention
from posttrain.models.tiny import FAMILIES, MOE_FAMILIES, build_tiny_model

# Sequences of 1..9 tokens; collated one row per example, the shorter rows end in the padding dummy sequence.
EXAMPLES = [[5, 1, 9], [1], [3, 3, 1, 2], [8], [1, 1, 1]]


@pytest.fixture()
def model(tokenizer):
    model = build_tiny_model(tokenizer, seed=3).double()
    return model


def _batch():
    torch.manual_seed(0)
    examples = []
    for lengths in EXAMPLES:
        ids = torch.randint(3, 60, (sum(lengths),)).tolist()
        examples.append({"input_ids": ids, "seq_lengths": lengths})
    return LanguageModelingCollator(0, padding_free=True, one_row=False)(examples)


def _run(model, input_ids, position_ids, weights):
    """Logits and the gradient of (weights * logits).sum() with respect to the input embeddings."""
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False).logits
    (weights * logits).sum().backward()
    return logits.detach(), embeds.grad


def _sequences(position_ids):
    """(row, start, length) of each sequence: positions restart at 0 (the collator's rows)."""
    out = []
    for row, positions in enumerate(position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        out += [(row, a, b - a) for a, b in zip(starts, starts[1:])]
    return out


@pytest.mark.parametrize("call_cost", [0, None], ids=["per-sequence", "default"])
def test_each_token_as_its_sequence_alone_float64(model, call_cost):
    _each_token_as_its_sequence_alone(model, call_cost)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_attends_per_sequence(tokenizer, family):
    """Recognised by what its parts compute (`computes.KINDS`); Gemma 3's and Mistral's sliding-window layers
    keep transformers' masks (8 tokens: the 9-token sequence is longer), their other layers attend per sequence."""
    model = build_tiny_model(tokenizer, seed=3, family=family).double()
    if family in MOE_FAMILIES:
        model.set_experts_implementation("eager")  # (grouped_mm has no float64 kernel)
    assert supports_segment_attention(model)
    _each_token_as_its_sequence_alone(model, 0)


def _each_token_as_its_sequence_alone(model, call_cost):
    batch = _batch()
    ids, positions = batch["input_ids"], batch["position_ids"]
    weights = torch.randn(*ids.shape, model.config.vocab_size, dtype=torch.float64)
    cost = sa._CALL_COST if call_cost is None else call_cost
    with mock.patch.object(sa, "_CALL_COST", cost), segment_attention(model):
        assert model.config._attn_implementation == sa.NAME
        logits, grad = _run(model, ids, positions, weights)
    assert model.config._attn_implementation == "sdpa"
    sequences = _sequences(positions)
    assert any(n == 1 for _, _, n in sequences) and len(sequences) > len(EXAMPLES) + 5
    for row, start, n in sequences:
        part = slice(start, start + n)
        alone, alone_grad = _run(
            model, ids[row : row + 1, part], positions[row : row + 1, part], weights[row : row + 1, part]
        )
        torch.testing.assert_close(logits[row : row + 1, part], alone, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad[row : row + 1, part], alone_grad, rtol=0, atol=1e-12)
    masked, masked_grad = _run(model, ids, positions, weights)  # transformers' block-diagonal mask
    torch.testing.assert_close(logits, masked, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, masked_grad, rtol=0, atol=1e-12)


def _sdpa_calls(model, batch, call_cost):
    calls = []
    real, per_sequence = torch.nn.functional.scaled_dot_product_attention, sa._PerSequence.apply

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal"), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    def flash(query, key, value, row_lengths, scale):  # SDPA's flash kernel on each sequence, called directly
        calls.extend([(True, False)] * sum(map(len, row_lengths)))
        return per_sequence(query, key, value, row_lengths, scale)

    with (
        mock.patch.object(sa, "_CALL_COST", call_cost),
        segment_attention(model),
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy),
        mock.patch.object(sa._PerSequence, "apply", flash),
    ):
        model(**{k: v.clone() for k, v in batch.items()}, use_cache=False)  # (the layout is kept on the tensor)
    return calls


def test_per_sequence_calls_and_the_mask_for_many_short_sequences(model):
    batch = _batch()
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    layers, sequences = model.config.num_hidden_layers, len(_sequences(batch["position_ids"]))
    assert _sdpa_calls(model, inputs, 0) == [(True, False)] * (layers * sequences)
    # Sequences this short cost more as separate calls: one masked call per layer, as transformers makes.
    assert _sdpa_calls(model, inputs, 10**6) == [(False, True)] * layers
    rows, width = inputs["input_ids"].shape
    whole = {"input_ids": inputs["input_ids"], "position_ids": torch.arange(width).expand(rows, width)}
    assert _sdpa_calls(model, whole, 0) == [(True, False)] * layers  # no restarts: plain causal rows


def test_mask_given_goes_to_sdpa_unchanged(model):
    """With an attention mask transformers ignores restarting positions; so does this implementation."""
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (2, 7))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2)
    for mask in (torch.ones(2, 7, dtype=torch.long), torch.tensor([[1] * 7, [1] * 4 + [0] * 3])):
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        with segment_attention(model):
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_rows_without_padding_run_causal_without_a_mask(model):
    """An attention mask of ones (a collator's unpadded batch): transformers would skip the mask and run SDPA's
    is_causal, whose flash kernel skips the blocks above the diagonal; an explicit mask would make it compute the
    whole square. Padded rows still get their mask."""
    torch.manual_seed(2)
    ids = torch.randint(3, 60, (2, 9))
    layers = model.config.num_hidden_layers
    ones = {"input_ids": ids, "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    assert _sdpa_calls(model, ones, 0) == [(True, False)] * layers
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 9, [1] * 5 + [0] * 4])}
    assert _sdpa_calls(model, padded, 0) == [(False, True)] * layers
    for inputs in (ones, padded):
        expected = model(**inputs, use_cache=False).logits
        with segment_attention(model):
            got = model(**inputs, use_cache=False).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_gradient_checkpointing_same_gradients(model):
    batch = _batch()
    weights = torch.randn(*batch["input_ids"].shape, model.config.vocab_size, dtype=torch.float64)
    model.train()
    with mock.patch.object(sa, "_CALL_COST", 0):
        with segment_attention(model):
            _, plain = _run(model, batch["input_ids"], batch["position_ids"], weights)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        with segment_attention(model):
            _, checkpointed = _run(model, batch["input_ids"], batch["position_ids"], weights)
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-12)


def test_where_it_applies(model, tokenizer):
    assert supports_segment_attention(model)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert not supports_segment_attention(eager)
    with segment_attention(eager):
        assert eager.config._attn_implementation == "eager"
    bidirectional = build_tiny_model(tokenizer, family="gemma3", use_bidirectional_attention=True)
    assert not supports_segment_attention(bidirectional)

    class OtherAttention(type(model.model.layers[0].self_attn)):
        def forward(self, *args, **kwargs):  # another formula: its attention may not read the interface
            return super().forward(*args, **kwargs)

    other = copy.deepcopy(model)
    other.model.layers[1].self_attn.__class__ = OtherAttention
    assert not supports_segment_attention(other)
    with pytest.raises(RuntimeError), segment_attention(model):
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"


def test_lora_model(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert supports_segment_attention(peft_model)
    batch = _batch()
    expected = peft_model(**{k: batch[k] for k in ("input_ids", "position_ids")}, use_cache=False).logits
    with mock.patch.object(sa, "_CALL_COST", 0), segment_attention(peft_model):
        got = peft_model(**{k: batch[k] for k in ("input_ids", "position_ids")}, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def _counting(calls: list, function):
    """`function`, noting each call in `calls`."""

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_sft_packed_step0_loss_unchanged(tmp_path, tiny_model_path, strategy):
    words = "the cat sat on a mat and then it ran far away from the big red dog".split()
    data = Dataset.from_list([{"text": " ".join(words[: 3 + (i * 7) % 14])} for i in range(12)])
    losses, used = {}, {}
    for enabled in (False, True):
        args = SFTConfig(
            output_dir=str(tmp_path / str(enabled)),
            per_device_train_batch_size=4,
            max_steps=2,
            max_length=48,
            packing=True,
            packing_strategy=strategy,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=0,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=data)
        assert trainer._segment_attention
        trainer._segment_attention = enabled
        seen = []
        forward = sa.segment_attention_forward
        with (
            mock.patch.object(sa, "segment_attention_forward", _counting(seen, forward)),
            mock.patch.object(sa, "_CALL_COST", 0),
        ):
            trainer.train()
        losses[enabled] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        used[enabled] = bool(seen)
        assert trainer.model.config._attn_implementation == "sdpa"
    assert used == {False: False, True: True}
    assert losses[True] == pytest.approx(losses[False], rel=1e-6, abs=0)


def test_sft_keeps_eager(tmp_path, tiny_model_path):
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_length=32,
        packing=True,
        report_to="none",
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"attn_implementation": "eager"},
    )
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list([{"text": "a b c"}] * 4))
    assert not trainer._segment_attention


def test_position_ids_made_under_inference_mode(model):
    batch = _batch()
    with torch.inference_mode():
        positions = batch["position_ids"].clone()
    expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    with torch.no_grad(), mock.patch.object(sa, "_CALL_COST", 0), segment_attention(model):
        got = model(input_ids=batch["input_ids"], position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


class _Attention:
    """The attributes of an attention layer that the attention function reads."""

    def __init__(self, groups):
        self.num_key_value_groups, self.is_causal = groups, True


def _packed(rows, heads, kv_heads, dim, dtype):
    """Position ids of rows of sequences of the given lengths, and q/k/v laid out as LlamaAttention's (transposed
    views of [batch, tokens, heads, dim] leaves, returned too)."""
    torch.manual_seed(0)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    leaves = [
        torch.randn(len(rows), positions.shape[1], h, dim, dtype=dtype, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]
    return positions, leaves, [leaf.transpose(1, 2) for leaf in leaves]


def _per_sequence_reference(rows, leaves, grad, scale):
    """Output and q/k/v gradients of F.scaled_dot_product_attention on each sequence alone."""
    out, grads = torch.empty_like(grad), [torch.empty_like(leaf) for leaf in leaves]
    for row, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            part = slice(start, start + n)
            q, k, v = (leaf[row, part].detach().transpose(0, 1)[None].requires_grad_() for leaf in leaves)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out[row, part] = o[0].transpose(0, 1).detach()
            for whole, g in zip(grads, torch.autograd.grad(o, (q, k, v), grad[row, part].transpose(0, 1)[None])):
                whole[row, part] = g[0].transpose(0, 1)
            start += n
    return out, grads


ROWS = [[5, 1, 6], [3, 9], [12]]  # a sequence of one token, and a row that is one sequence


@pytest.mark.parametrize("scale", [0.3, None], ids=["scale", "default-scale"])  # None: 1 / sqrt(dim)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_per_sequence_kernel_gradients_equal_sdpa(dtype, kv_heads, scale):
    heads, dim = 4, 8
    positions, leaves, (q, k, v) = _packed(ROWS, heads, kv_heads, dim, dtype)
    with mock.patch.object(sa, "_CALL_COST", 0):
        out, _ = sa.segment_attention_forward(
            _Attention(heads // kv_heads), q, k, v, None, scaling=scale, position_ids=positions
        )
    assert type(out.grad_fn).__name__ == "_PerSequenceBackward"
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad)
    expected, expected_grads = _per_sequence_reference(ROWS, leaves, grad, dim**-0.5 if scale is None else scale)
    tolerance = {"rtol": 0, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(out, expected, **tolerance)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_attention_output_kept_once(dtype, kv_heads):
    """Saved for backward by the attention and o_proj: q, k, v, the output once (o_proj's input is a view of it,
    as LlamaAttention makes it), and a logsumexp per head and token. SDPA per sequence and a concatenation keep
    the output a second time."""
    heads, dim = 4, 8
    positions, leaves, (q, k, v) = _packed(ROWS, heads, kv_heads, dim, dtype)
    weight = torch.randn(heads * dim, heads * dim, dtype=dtype, requires_grad=True)
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with mock.patch.object(sa, "_CALL_COST", 0), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = sa.segment_attention_forward(
            _Attention(heads // kv_heads), q, k, v, None, scaling=dim**-0.5, position_ids=positions
        )
        o_proj_input = out.reshape(*out.shape[:2], -1).contiguous()  # LlamaAttention's, before o_proj
        torch.nn.functional.linear(o_proj_input, weight)
    assert o_proj_input.data_ptr() == out.data_ptr()
    del saved[weight.untyped_storage().data_ptr()]
    tokens, sequences = positions.numel(), sum(map(len, ROWS))
    logsumexp_size = 4 if dtype in (torch.bfloat16, torch.float16) else dtype.itemsize  # (float32 for half types)
    expected = (sum(leaf.numel() for leaf in leaves) + out.numel()) * dtype.itemsize + tokens * heads * logsumexp_size
    assert sum(saved.values()) == expected
    assert len(saved) == 3 + 1 + sequences


def test_per_sequence_kernel_under_autocast():
    """Cast as autocast casts SDPA's inputs: float32 in, SDPA's bfloat16 results out."""
    heads, dim, scale = 4, 8, 0.3
    positions, leaves, (q, k, v) = _packed(ROWS, heads, 2, dim, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16), mock.patch.object(sa, "_CALL_COST", 0):
        out, _ = sa.segment_attention_forward(_Attention(2), q, k, v, None, scaling=scale, position_ids=positions)
        assert type(out.grad_fn).__name__ == "_PerSequenceBackward" and out.dtype == torch.bfloat16
        grad = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad)
        expected, expected_grads = _per_sequence_reference(ROWS, leaves, grad, scale)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_left_to_sdpa_where_it_would_not_run_the_flash_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, dim, scale = 4, 8, 0.3
    positions, leaves, (q, k, v) = _packed(ROWS, heads, 2, dim, torch.float64)
    attention = _Attention(2)
    with mock.patch.object(sa, "_CALL_COST", 0):
        with sdpa_kernel([SDPBackend.MATH]):
            out, _ = sa.segment_attention_forward(attention, q, k, v, None, scaling=scale, position_ids=positions)
            grad = torch.randn_like(out)
            grads = torch.autograd.grad(out, leaves, grad)
            expected, expected_grads = _per_sequence_reference(ROWS, leaves, grad, scale)
        out_dropout, _ = sa.segment_attention_forward(
            attention, q, k, v, None, dropout=0.5, scaling=scale, position_ids=positions
        )
    assert type(out.grad_fn).__name__ != "_PerSequenceBackward"
    assert type(out_dropout.grad_fn).__name__ != "_PerSequenceBackward"
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
