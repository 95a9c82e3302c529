"""Tiny models and tokenizers built locally, for tests, examples and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on a small
built-in corpus and carries a ChatML chat template (the one SmolLM2 and Qwen use); the model is a
Llama with random weights. Both are saved to a directory so that the real loading code
(`from_pretrained(path)`) is what runs.
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


def build_tiny_model(tokenizer, seed: int = 0, hidden_size: int = 32, num_layers: int = 2, tie: bool = True):
    """A randomly initialised Llama small enough to train in milliseconds per step on a CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
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
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_moe_model(tokenizer, seed: int = 0, num_experts: int = 4, router_aux_loss_coef: float = 0.01):
    """A randomly initialised Qwen3-MoE (two of `num_experts` experts per token), for the load-balancing loss."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=num_experts,
        num_experts_per_tok=2,
        router_aux_loss_coef=router_aux_loss_coef,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


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
