"""Offline stand-ins for the Hub repositories that TRL's test suite names.

TRL's tests load `trl-internal-testing/tiny-<Architecture>` models and the `trl-internal-testing/zen` dataset from
the Hub. Nothing can be downloaded here, so this module builds look-alikes once and caches them:

- each model: the same transformers architecture class with a small config and random weights, and a byte-level BPE
  tokenizer trained here carrying the model family's special tokens and its chat template. The templates are the
  model vendors' templates as the installed `trl` package ships them (read at build time, never stored in this
  repository); without `trl` installed a ChatML template is used. Models are written in the Hugging Face hub cache
  layout (`<cache>/hub/models--org--name/snapshots/<rev>/`) so that `from_pretrained("<id>")` finds them with
  HF_HUB_OFFLINE=1;
- the `zen` dataset: every config TRL's tests read (standard / conversational x language modeling, prompt-only,
  prompt-completion, preference, implicit-prompt preference, unpaired preference, stepwise supervision), built from
  the Zen of Python (17 train rows, 2 test rows), written as parquet with a README that declares the configs, so that
  `load_dataset(<dir>, "<config>")` reads it (the harness plugin points the dataset id at that directory).

Run: python scripts/trl_suite/standins.py <cache_dir>   (idempotent; a stamp records the build recipe version)
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import shutil
import sys
from pathlib import Path

BUILD_VERSION = "7"  # bump when what is built changes: the cache is rebuilt
REVISION = "0" * 40  # the snapshot "commit" every stand-in is stored under

# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A Mistral-instruct style template (written here; TRL ships none for Mistral).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

_CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
]

# family -> template (a file name in trl/chat_templates, or a template string), special tokens, plain added tokens
# (kept by skip_special_tokens, as tool-call markers are in the real vocabularies), bos/eos/pad/unk, and whether
# encoding prepends bos.
FAMILIES: dict[str, dict] = {
    "qwen2_5": dict(
        template="qwen2_5", special=_CHATML_SPECIALS, plain=_QWEN_TOOL_TOKENS[:4], eos="<|im_end|>", pad="<|endoftext|>"
    ),
    "qwen3": dict(
        template="qwen3", special=_CHATML_SPECIALS, plain=_QWEN_TOOL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>"
    ),
    "qwen3_2507": dict(
        template="qwen3_instruct_2507",
        special=_CHATML_SPECIALS,
        plain=_QWEN_TOOL_TOKENS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
    ),
    "chatml": dict(template=CHATML, special=_CHATML_SPECIALS, plain=[], eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": dict(
        template="llama3", special=_LLAMA3_SPECIALS, plain=[], bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True
    ),
    "llama3_1": dict(
        template="llama3_1", special=_LLAMA3_SPECIALS, plain=[], bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True
    ),
    "llama3_2": dict(
        template="llama3_2", special=_LLAMA3_SPECIALS, plain=[], bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True
    ),
    "gptoss": dict(
        template="gptoss",
        special=[
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ],
        plain=[],
        bos="<|startoftext|>",
        eos="<|return|>",
        pad="<|endoftext|>",
    ),
    "glm4moe": dict(
        template="glm4moe",
        special=[
            "<|endoftext|>",
            "[MASK]",
            "[gMASK]",
            "[sMASK]",
            "<sop>",
            "<eop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
        ],
        plain=_QWEN_TOOL_TOKENS + ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"],
        eos="<|endoftext|>",
        pad="<|endoftext|>",
    ),
    "gemma": dict(
        template="gemma",
        special=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        plain=[],
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
    ),
    "mistral": dict(
        template=MISTRAL,
        special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        plain=[],
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        add_bos=True,
    ),
    "phi3": dict(
        template="phi3",
        special=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
        plain=[],
        bos="<s>",
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        unk="<unk>",
    ),
    "phi3_5": dict(
        template="phi3_5",
        special=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
        plain=[],
        bos="<s>",
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        unk="<unk>",
    ),
    "cohere": dict(
        template="cohere",
        special=[
            "<PAD>",
            "<UNK>",
            "<BOS_TOKEN>",
            "<EOS_TOKEN>",
            "<|START_OF_TURN_TOKEN|>",
            "<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
        ],
        plain=[],
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
        pad="<PAD>",
        unk="<UNK>",
        add_bos=True,
    ),
    "cohere2": dict(
        template="cohere2",
        special=[
            "<PAD>",
            "<UNK>",
            "<BOS_TOKEN>",
            "<EOS_TOKEN>",
            "<|START_OF_TURN_TOKEN|>",
            "<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
            "<|START_RESPONSE|>",
            "<|END_RESPONSE|>",
            "<|START_THINKING|>",
            "<|END_THINKING|>",
        ],
        plain=[],
        bos="<BOS_TOKEN>",
        eos="<|END_OF_TURN_TOKEN|>",
        pad="<PAD>",
        unk="<UNK>",
        add_bos=True,
    ),
    "lfm2": dict(
        template="lfm2",
        special=[
            "<|pad|>",
            "<|startoftext|>",
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ],
        plain=["<think>", "</think>"],
        bos="<|startoftext|>",
        eos="<|im_end|>",
        pad="<|pad|>",
        add_bos=True,
    ),
    "lfm2_2_5": dict(
        template="lfm2_2_5",
        special=[
            "<|pad|>",
            "<|startoftext|>",
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ],
        plain=["<think>", "</think>"],
        bos="<|startoftext|>",
        eos="<|im_end|>",
        pad="<|pad|>",
        add_bos=True,
    ),
    "deepseekv3": dict(
        template="deepseekv3",
        special=[
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        plain=["<think>", "</think>"],
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        add_bos=True,
    ),
    "nemotron_3_nano": dict(
        template="nemotron_3_nano",
        special=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        plain=_QWEN_TOOL_TOKENS,
        bos="<s>",
        eos="<|im_end|>",
        unk="<unk>",
    ),
    "nemotron_3_super": dict(
        template="nemotron_3_super",
        special=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        plain=_QWEN_TOOL_TOKENS,
        bos="<s>",
        eos="<|im_end|>",
        unk="<unk>",
    ),
    "nemotron_3_ultra": dict(
        template="nemotron_3_ultra",
        special=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        plain=_QWEN_TOOL_TOKENS,
        bos="<s>",
        eos="<|im_end|>",
        unk="<unk>",
    ),
    "olmo3": dict(
        template=CHATML,
        special=["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        plain=[],
        eos="<|im_end|>",
        pad="<|pad|>",
    ),
    # Base models: no chat template.
    "gpt2": dict(template=None, special=["<|endoftext|>"], plain=[], bos="<|endoftext|>", eos="<|endoftext|>"),
    "gptneox": dict(
        template=None, special=["<|endoftext|>", "<|padding|>"], plain=[], bos="<|endoftext|>", eos="<|endoftext|>"
    ),
    "opt": dict(
        template=None,
        special=["<pad>", "</s>", "<unk>"],
        plain=[],
        bos="</s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
    ),
    "bloom": dict(
        template=None,
        special=["<unk>", "<s>", "</s>", "<pad>"],
        plain=[],
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
    ),
    "t5": dict(template=None, special=["<pad>", "</s>", "<unk>"], plain=[], eos="</s>", pad="<pad>", unk="<unk>"),
    "bart": dict(
        template=None,
        special=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        plain=[],
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
    ),
}


def zen_lines() -> list[str]:
    """The 19 aphorisms of the Zen of Python (the `this` module's text, decoded)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the text
        import this
    text = "".join(this.d.get(c, c) for c in this.s)
    return [line.strip() for line in text.splitlines()[2:] if line.strip()]


def _corpus() -> list[str]:
    words = (
        "the a an is are was of to and in on for with that this it be as at by from or not what how why which who "
        "answer question user assistant system tool function call result hello world yes no good bad red green blue "
        "one two three four five six seven eight nine ten zero plus minus times equals sum number think because so "
        "then therefore final step first second cat dog bird fish sky sun moon tree image describe weather city "
        "temperature multiply add name arguments content role type text value key true false null"
    ).split()
    lines = zen_lines() * 4
    for i, word in enumerate(words):
        lines.append(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)))
        lines.append(f"{i} + {i + 3} = {2 * i + 3}. {word.capitalize()}? {word}!")
    lines.append('{"name": "multiply", "arguments": {"a": 3, "b": 4}} [] () <> </> :: == -- ** ## $$ %% @@')
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


_BASE_TOKENIZER = None


def _base_tokenizer():
    """A byte-level BPE (the scheme of Qwen, Llama 3, GPT-2) trained on a small corpus; shared by all families."""
    global _BASE_TOKENIZER
    if _BASE_TOKENIZER is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        _BASE_TOKENIZER = tok.to_str()
    return _BASE_TOKENIZER


def _trl_template(name: str) -> str | None:
    """The vendor template `name` as the installed trl package ships it (None if trl is not installed)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "chat_templates" / f"{name}.jinja"
    return path.read_text(encoding="utf-8") if path.exists() else None


def build_tokenizer(family: str):
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer.from_str(_base_tokenizer())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    if spec["plain"]:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    bos = spec.get("bos")
    if spec.get("add_bos") and bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=spec.get("eos"),
        pad_token=spec.get("pad"),
        unk_token=spec.get("unk"),
    )
    template = spec["template"]
    if template is not None:
        if "{" not in template:  # a file name in trl/chat_templates
            template = _trl_template(template) or CHATML
        fast.chat_template = template
    return fast


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------

# Small sizes, applied to whichever of these names a config class takes.
TINY_SIZES = dict(
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=4,
    max_position_embeddings=4096,
    state_size=4,
    ssm_state_size=4,
    mamba_num_heads=4,
    mamba_head_dim=4,
    n_groups=1,
    time_step_rank=4,
    chunk_size=16,
    num_mtp_layers=0,
    num_nextn_predict_layers=0,
    # encoder-decoder and older architectures
    d_model=16,
    d_ff=32,
    d_kv=4,
    num_layers=2,
    num_heads=4,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    n_embd=16,
    n_layer=2,
    n_head=4,
    n_positions=1024,
    ffn_dim=32,
    word_embed_proj_dim=16,
)

# model id -> (architecture class, tokenizer family, extra config arguments)
MODELS: dict[str, tuple[str, str, dict]] = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("Qwen2ForCausalLM", "qwen2_5", {}),
    "trl-internal-testing/small-Qwen2ForCausalLM-2.5": (
        "Qwen2ForCausalLM",
        "qwen2_5",
        dict(hidden_size=64, intermediate_size=128, head_dim=16),
    ),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": (
        "Qwen2ForSequenceClassification",
        "qwen2_5",
        dict(num_labels=1),
    ),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("Qwen3ForCausalLM", "qwen3", {}),
    "trl-internal-testing/small-Qwen3ForCausalLM": (
        "Qwen3ForCausalLM",
        "qwen3",
        dict(hidden_size=64, intermediate_size=128, head_dim=16),
    ),
    "trl-internal-testing/tiny-Qwen3ForCausalLM-Instruct-2507": ("Qwen3ForCausalLM", "qwen3_2507", {}),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": (
        "Qwen3ForSequenceClassification",
        "qwen3",
        dict(num_labels=1),
    ),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", "qwen3", {}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3": ("LlamaForCausalLM", "llama3", {}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.1": ("LlamaForCausalLM", "llama3_1", {}),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("LlamaForCausalLM", "llama3_2", {}),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": (
        "LlamaForSequenceClassification",
        "llama3_2",
        dict(num_labels=1),
    ),
    "trl-internal-testing/tiny-GptOssForCausalLM": ("GptOssForCausalLM", "gptoss", {}),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ("Glm4MoeForCausalLM", "glm4moe", {}),
    "trl-internal-testing/tiny-MistralForCausalLM-0.1": ("MistralForCausalLM", "mistral", {}),
    "trl-internal-testing/tiny-MistralForCausalLM-0.2": ("MistralForCausalLM", "mistral", {}),
    "trl-internal-testing/tiny-GemmaForCausalLM": ("GemmaForCausalLM", "gemma", {}),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ("Gemma2ForCausalLM", "gemma", {}),
    "trl-internal-testing/tiny-Phi3ForCausalLM": ("Phi3ForCausalLM", "phi3", {}),
    "trl-internal-testing/tiny-Phi3ForCausalLM-3": ("Phi3ForCausalLM", "phi3", {}),
    "trl-internal-testing/tiny-Phi3ForCausalLM-3.5": ("Phi3ForCausalLM", "phi3_5", {}),
    "trl-internal-testing/tiny-CohereForCausalLM": ("CohereForCausalLM", "cohere", {}),
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ("Cohere2ForCausalLM", "cohere2", {}),
    "trl-internal-testing/tiny-Lfm2ForCausalLM": ("Lfm2ForCausalLM", "lfm2", {}),
    "trl-internal-testing/tiny-Lfm2ForCausalLM-2.5": ("Lfm2ForCausalLM", "lfm2_2_5", {}),
    "trl-internal-testing/tiny-DeepseekV3ForCausalLM": (
        "DeepseekV3ForCausalLM",
        "deepseekv3",
        dict(num_key_value_heads=4),
    ),
    "trl-internal-testing/tiny-DeepseekV3ForCausalLM-0528": (
        "DeepseekV3ForCausalLM",
        "deepseekv3",
        dict(num_key_value_heads=4),
    ),
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": (
        "NemotronHForCausalLM",
        "nemotron_3_nano",
        dict(layers_block_type=["mamba", "attention"]),
    ),
    "trl-internal-testing/tiny-NemotronHForCausalLM-super": (
        "NemotronHForCausalLM",
        "nemotron_3_super",
        dict(layers_block_type=["mamba", "attention"]),
    ),
    "trl-internal-testing/tiny-NemotronHForCausalLM-ultra": (
        "NemotronHForCausalLM",
        "nemotron_3_ultra",
        dict(layers_block_type=["mamba", "attention"]),
    ),
    "trl-internal-testing/tiny-Olmo3ForCausalLM": ("Olmo3ForCausalLM", "olmo3", {}),
    "trl-internal-testing/tiny-GPT2LMHeadModel": ("GPT2LMHeadModel", "gpt2", {}),
    "trl-internal-testing/tiny-GPTNeoXForCausalLM": ("GPTNeoXForCausalLM", "gptneox", {}),
    "trl-internal-testing/tiny-GptNeoXForSequenceClassification": (
        "GPTNeoXForSequenceClassification",
        "gptneox",
        dict(num_labels=1),
    ),
    "trl-internal-testing/tiny-OPTForCausalLM": ("OPTForCausalLM", "opt", {}),
    "trl-internal-testing/tiny-BloomForCausalLM": ("BloomForCausalLM", "bloom", {}),
    "trl-internal-testing/tiny-FalconMambaForCausalLM": ("FalconMambaForCausalLM", "gptneox", {}),
    "trl-internal-testing/tiny-T5ForConditionalGeneration": (
        "T5ForConditionalGeneration",
        "t5",
        dict(decoder_start_token_id=0),
    ),
    "trl-internal-testing/tiny-BartModel": ("BartModel", "bart", {}),
}

# Custom-code models (trust_remote_code): id -> (base stand-in whose weights and tokenizer it takes, class name)
REMOTE_MODELS = {
    "trl-internal-testing/tiny-RemoteForCausalLM": (
        "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5",
        "RemoteForCausalLM",
    )
}
_REMOTE_CONFIG_CODE = """from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
"""
_REMOTE_MODELING_CODE = """from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class {name}(Qwen2ForCausalLM):
    config_class = RemoteConfig
"""

# PEFT adapters: id -> (base model id, LoRA seed)
ADAPTERS = {
    "trl-internal-testing/tiny-PeftModel": ("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", 1),
    "trl-internal-testing/tiny-PeftModel-2": ("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", 2),
}


def tiny_config(architecture: str, tokenizer, extra: dict):
    import transformers

    model_cls = getattr(transformers, architecture)
    config_cls = model_cls.config_class
    params = inspect.signature(config_cls.__init__).parameters
    kwargs = {k: v for k, v in TINY_SIZES.items() if k in params}
    kwargs.update(extra)
    vocab = len(tokenizer)
    kwargs["vocab_size"] = vocab
    for name, token_id in (
        ("eos_token_id", tokenizer.eos_token_id),
        ("bos_token_id", tokenizer.bos_token_id),
        ("pad_token_id", tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id),
    ):
        kwargs[name] = token_id
    config = config_cls(**kwargs)
    if "pad_token_id" not in params:
        config.pad_token_id = kwargs["pad_token_id"]
    if getattr(config, "head_dim", None) is None and getattr(config, "num_attention_heads", None):
        # real checkpoints of these families state it in config.json (Qwen3-MoE does, its config class takes no
        # argument for it); the value the model computes anyway
        config.head_dim = config.hidden_size // config.num_attention_heads
    return model_cls, config


def _snapshot_dir(hub: Path, repo_id: str, kind: str = "models") -> Path:
    repo_dir = hub / f"{kind}--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(REVISION)
    return repo_dir / "snapshots" / REVISION


def build_model(hub: Path, repo_id: str, architecture: str, family: str, extra: dict, seed: int) -> None:
    import torch
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(family)
    model_cls, config = tiny_config(architecture, tokenizer, extra)
    torch.manual_seed(seed)
    model = model_cls(config)
    # A forward pass proves the config is consistent before it is stored.
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        if config.is_encoder_decoder:
            model(input_ids=ids, decoder_input_ids=ids)
        else:
            model(input_ids=ids)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=config.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
    target = _snapshot_dir(hub, repo_id)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def build_remote(hub: Path, repo_id: str, base_id: str, class_name: str) -> None:
    """A model whose classes live in the repository (configuration_remote.py, modeling_remote.py)."""
    target = _snapshot_dir(hub, repo_id)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(_snapshot_dir(hub, base_id), target)
    (target / "configuration_remote.py").write_text(_REMOTE_CONFIG_CODE)
    (target / "modeling_remote.py").write_text(_REMOTE_MODELING_CODE.format(name=class_name))
    config = json.loads((target / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=[class_name],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": f"modeling_remote.{class_name}",
        },
    )
    (target / "config.json").write_text(json.dumps(config, indent=2))


def build_adapter(hub: Path, repo_id: str, base_id: str, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(_snapshot_dir(hub, base_id)))
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    target = _snapshot_dir(hub, repo_id)
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target)
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_id
    config_path.write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------------------------------------------------
# The zen dataset
# ---------------------------------------------------------------------------------------------------------------------


def _split(line: str) -> tuple[str, str]:
    """A prompt and its completion: "X is better than" + " Y.", otherwise the first half of the words + the rest."""
    marker = " better than "
    if marker in line:
        i = line.index(marker) + len(marker) - 1
        return line[:i], line[i:]
    words = line.split(" ")
    half = max(1, len(words) // 2)
    return " ".join(words[:half]), " " + " ".join(words[half:])


def zen_configs() -> dict[str, dict[str, list[dict]]]:
    """config name -> split -> rows."""
    lines = zen_lines()
    pairs = [_split(line) for line in lines]
    wrong = [pairs[(i + 5) % len(pairs)][1] for i in range(len(pairs))]  # a completion from another aphorism

    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text.strip()}]

    def question(prompt):
        return f"Complete the aphorism: {prompt}..."

    rows: dict[str, list[dict]] = {
        "standard_language_modeling": [{"text": line} for line in lines],
        "conversational_language_modeling": [{"messages": user(question(p)) + assistant(p + c)} for p, c in pairs],
        "standard_prompt_only": [{"prompt": p} for p, _ in pairs],
        "conversational_prompt_only": [{"prompt": user(question(p))} for p, _ in pairs],
        "standard_prompt_completion": [{"prompt": p, "completion": c} for p, c in pairs],
        "conversational_prompt_completion": [
            {"prompt": user(question(p)), "completion": assistant(p + c)} for p, c in pairs
        ],
        "standard_preference": [{"prompt": p, "chosen": c, "rejected": w} for (p, c), w in zip(pairs, wrong)],
        "conversational_preference": [
            {"prompt": user(question(p)), "chosen": assistant(p + c), "rejected": assistant(p + w)}
            for (p, c), w in zip(pairs, wrong)
        ],
        "standard_implicit_prompt_preference": [
            {"chosen": p + c, "rejected": p + w} for (p, c), w in zip(pairs, wrong)
        ],
        "conversational_implicit_prompt_preference": [
            {"chosen": user(question(p)) + assistant(p + c), "rejected": user(question(p)) + assistant(p + w)}
            for (p, c), w in zip(pairs, wrong)
        ],
        "standard_unpaired_preference": [
            {"prompt": p, "completion": c if i % 2 == 0 else w, "label": i % 2 == 0}
            for i, ((p, c), w) in enumerate(zip(pairs, wrong))
        ],
        "conversational_unpaired_preference": [
            {"prompt": user(question(p)), "completion": assistant(p + (c if i % 2 == 0 else w)), "label": i % 2 == 0}
            for i, ((p, c), w) in enumerate(zip(pairs, wrong))
        ],
        "standard_stepwise_supervision": [
            {
                "prompt": question(p),
                "completions": [p.split(" ")[0], p, p + (c if i % 3 else w)],
                "labels": [True, True, i % 3 != 0],
            }
            for i, ((p, c), w) in enumerate(zip(pairs, wrong))
        ],
    }
    return {name: {"train": r[:17], "test": r[17:]} for name, r in rows.items()}


def build_zen(directory: Path) -> None:
    from datasets import Dataset

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    card = ["---", "configs:"]
    for name, splits in zen_configs().items():
        card += [f"- config_name: {name}", "  data_files:"]
        for split, rows in splits.items():
            path = f"{name}/{split}-00000-of-00001.parquet"
            (tmp / name).mkdir(exist_ok=True)
            Dataset.from_list(rows).to_parquet(str(tmp / path))
            card += [f"  - split: {split}", f"    path: {path}"]
    card += ["---", "", "Offline stand-in for trl-internal-testing/zen (the Zen of Python), built by the TRL harness."]
    (tmp / "README.md").write_text("\n".join(card) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


# ---------------------------------------------------------------------------------------------------------------------


def recipe_hash() -> str:
    return hashlib.sha256((BUILD_VERSION + Path(__file__).read_text()).encode()).hexdigest()[:16]


def build_all(cache: Path, force: bool = False) -> None:
    import warnings

    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
    stamp = cache / "standins.stamp"
    want = recipe_hash()
    if not force and stamp.exists() and stamp.read_text() == want:
        return
    hub = cache / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    failures = {}
    for seed, (repo_id, (architecture, family, extra)) in enumerate(MODELS.items()):
        try:
            build_model(hub, repo_id, architecture, family, extra, seed)
        except Exception as error:  # an architecture this transformers cannot build small: its tests fail on both
            failures[repo_id] = f"{type(error).__name__}: {error}"
    for repo_id, (base_id, class_name) in REMOTE_MODELS.items():
        try:
            build_remote(hub, repo_id, base_id, class_name)
        except Exception as error:
            failures[repo_id] = f"{type(error).__name__}: {error}"
    for repo_id, (base_id, seed) in ADAPTERS.items():
        try:
            build_adapter(hub, repo_id, base_id, seed)
        except Exception as error:
            failures[repo_id] = f"{type(error).__name__}: {error}"
    build_zen(cache / "datasets" / "zen")
    (cache / "standins_failures.json").write_text(json.dumps(failures, indent=2))
    for repo_id, reason in failures.items():
        print(f"standins: {repo_id} not built ({reason[:200]})", file=sys.stderr)
    stamp.write_text(want)


if __name__ == "__main__":
    build_all(Path(sys.argv[1]), force="--force" in sys.argv)
