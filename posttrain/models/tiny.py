"""Tiny models and tokenizers built locally, for tests, examples and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on a small built-in corpus and
carries a ChatML chat template (the one SmolLM2 and Qwen use); the model is a Llama with random weights, or a model of
one of the other FAMILIES. Both are saved to a directory so that the real loading code (`from_pretrained(path)`) is
what runs.
"""

from __future__ import annotations

import os
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS_WORDS = (
    "the a an is are was of to and in on for with that this it be as at by from or not what how why "
    "which who answer question user assistant system tool hello world yes no good bad red green blue "
    "one two three four five six seven eight nine ten zero plus minus times equals sum number think "
    "because so then therefore result final step first second cat dog bird fish sky sun moon tree"
).split()


def _corpus() -> list[str]:
    lines = []
    for i, word in enumerate(_CORPUS_WORDS):
        lines.append(" ".join(_CORPUS_WORDS[(i * 7 + j) % len(_CORPUS_WORDS)] for j in range(12)))
        lines.append(f"{i} + {i + 3} = {2 * i + 3}. {word.capitalize()}? {word}!")
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# Per family: the config class and what its config needs beyond the shared sizes, chosen so that each family's
# own features run in a tiny model (Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 3's sliding window of 8 tokens
# on every other layer, its soft-capped logits and scaled embeddings, Mistral's window on every layer, Phi-3's fused
# projections, the experts of Qwen3-MoE and Mixtral: two of four per token).
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": 8,
            "layer_types": None,  # filled in per layer count: sliding, full, sliding, ...
            "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 8, "head_dim": 8}),
    "phi3": ("Phi3Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "mixtral": ("MixtralConfig", {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def tiny_config(
    tokenizer, family: str = "llama", hidden_size: int = 32, num_layers: int = 2, tie: bool = True, **extra
):
    """A small config of `family` (a key of FAMILIES): 4 attention heads, 2 key-value heads, the tokenizer's
    vocabulary; `extra` overrides any field (e.g. a larger `vocab_size` or `num_attention_heads`)."""
    import transformers

    class_name, family_settings = FAMILIES[family]
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **family_settings,
    )
    if "layer_types" in settings:
        settings["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)]
    if "head_dim" in settings:
        settings["head_dim"] = hidden_size // 4
    if family == "gemma3":
        settings["query_pre_attn_scalar"] = hidden_size // 4
    settings.update(extra)
    return getattr(transformers, class_name)(**settings)


def build_tiny_model(
    tokenizer,
    seed: int = 0,
    hidden_size: int = 32,
    num_layers: int = 2,
    tie: bool = True,
    family: str = "llama",
    **config_settings,
):
    """A randomly initialised causal LM of `family` (a key of FAMILIES) small enough to train in milliseconds per
    step on a CPU; `config_settings` override the config's fields."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(tokenizer, family, hidden_size, num_layers, tie, **config_settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_moe_model(tokenizer, seed: int = 0, num_experts: int = 4, router_aux_loss_coef: float = 0.01):
    """A randomly initialised Qwen3-MoE (two of `num_experts` experts per token), for the load-balancing loss."""
    return build_tiny_model(
        tokenizer,
        seed=seed,
        tie=False,
        family="qwen3_moe",
        num_experts=num_experts,
        router_aux_loss_coef=router_aux_loss_coef,
    )


def save_tiny_model(directory: str | os.PathLike, seed: int = 0, moe: bool = False, **model_kwargs) -> str:
    """Builds the tiny tokenizer and model (the Mixture-of-Experts one with `moe`) and saves both to `directory`
    (skipped if already there)."""
    directory = Path(directory)
    if not (directory / "config.json").exists():
        tokenizer = build_tiny_tokenizer()
        build = build_tiny_moe_model if moe else build_tiny_model
        model = build(tokenizer, seed=seed, **model_kwargs)
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(directory)
        model.save_pretrained(directory)
    return str(directory)
