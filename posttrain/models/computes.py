"""What a model's modules compute, recognised by the code of their forwards rather than by their class names.

The fast paths (`fast_forward`, `fused_layers`, `segment_attention`) reproduce or replace what a module computes.
They must not trust a class name: a subclass or a remote-code copy may change the formula, and a family that
copies Llama's code line for line computes what Llama's does whatever it is called. So a module is recognised by
the code of its class's forward and of the methods the forward calls (bytecode, the names it looks up and its
constants, nested functions included; the docstring and line numbers left out), compared with those of the
transformers classes listed in `KINDS`, each a fact checked by a test on that family's tiny model against the
model's own forward. Families whose modeling files
copy a listed forward (transformers' modular files generate most of them) are recognised without being listed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types

# For each part of a decoder model, its kinds, and for each kind the transformers forwards (family module: class)
# that compute it. The fast forward implements each kind once (`fast_forward.py`).
KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    # logits = lm_head(hidden states at the kept positions), soft-capped where the config says so (Gemma).
    "causal_lm": {
        "head": (
            "llama:LlamaForCausalLM",
            "qwen2:Qwen2ForCausalLM",
            "qwen3:Qwen3ForCausalLM",
            "mistral:MistralForCausalLM",
            "phi3:Phi3ForCausalLM",
            "qwen3_moe:Qwen3MoeForCausalLM",  # (and Mixtral's: the router loss only when asked for)
        ),
        "soft_capped_head": ("gemma3:Gemma3ForCausalLM",),
    },
    # embeddings, the masks (`create_causal_mask` / `create_sliding_window_causal_mask`), rotary embeddings, the
    # layers, the final norm.
    "decoder": {
        "one_mask": ("llama:LlamaModel",),
        "window_mask": ("mistral:MistralModel", "qwen3_moe:Qwen3MoeModel"),  # sliding if config.sliding_window
        "mask_per_layer_type": ("qwen2:Qwen2Model",),
        "mask_and_rotary_per_layer_type": ("gemma3:Gemma3TextModel",),
    },
    "layer": {
        "pre_norm": ("llama:LlamaDecoderLayer", "mixtral:MixtralDecoderLayer"),
        "pre_norm_dropout": ("phi3:Phi3DecoderLayer",),  # residual dropouts
        "sandwich_norm": ("gemma3:Gemma3DecoderLayer",),  # norms before and after attention and MLP
    },
    # q/k/v projections, rotary, cache, the attention function, o_proj
    "attention": {
        "projections": ("llama:LlamaAttention", "qwen2:Qwen2Attention", "mistral:MistralAttention"),
        "head_norms": ("qwen3:Qwen3Attention",),  # q/k RMSNorm per head, before the transpose
        "head_norms_transposed": ("gemma3:Gemma3Attention",),  # the same, after it
        "fused_projection": ("phi3:Phi3Attention",),  # one qkv projection
    },
    "mlp": {
        "gated": ("llama:LlamaMLP",),  # down(act(gate(x)) * up(x))
        "fused_gated": ("phi3:Phi3MLP",),  # one gate_up projection
    },
    "norm": {
        "rms": ("llama:LlamaRMSNorm",),  # weight * (x / rms(x)) in float32, cast back before the weight
        "one_plus_weight_rms": ("gemma3:Gemma3RMSNorm",),  # (1 + weight) * (x / rms(x)) in float32, then cast
    },
}


def _code_key(code: types.CodeType, function: bool = False) -> tuple:
    """What a code object computes: its bytecode, the names it looks up and its constants (nested code compared
    the same way), without a function's docstring or the line numbers."""
    consts = code.co_consts
    if function and consts and isinstance(consts[0], str):
        consts = consts[1:]  # (a function's docstring is its first constant)
    return (
        code.co_code,
        code.co_names,
        tuple(_code_key(c) if isinstance(c, types.CodeType) else c for c in consts),
    )


def code_key(function) -> tuple | None:
    """`_code_key` of a function under its decorators; None for something without Python code."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return None if code is None else _code_key(code, function=True)


def _class_key(cls) -> tuple | None:
    """What a module class computes: `code_key` of its forward and of the methods of the class that the forward
    names (a norm's `_norm`, say): a subclass that changes such a helper computes something else."""
    key = code_key(cls.forward)
    if key is None:
        return None
    names = inspect.unwrap(cls.forward).__code__.co_names
    helpers = tuple(
        (name, code_key(getattr(cls, name)))
        for name in names
        if name != "forward" and inspect.isfunction(getattr(cls, name, None))
    )
    return key, helpers


def _reference(name: str) -> type:
    family, class_name = name.split(":")
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), class_name)


def _imported_first(names: tuple[str, ...]) -> list[str]:
    """References whose modules are already imported first: a model's own family needs no other module imported."""
    return sorted(names, key=lambda n: f"transformers.models.{n.split(':')[0]}" not in sys.modules)


@functools.cache
def _kind_of_class(cls: type, part: str) -> str | None:
    key = _class_key(cls)
    if key is None:
        return None
    for kind, names in KINDS[part].items():
        for name in _imported_first(names):
            try:
                if _class_key(_reference(name)) == key:
                    return kind
            except (ImportError, AttributeError):  # a transformers without that family or class
                continue
    return None


def kind_of(module, part: str) -> str | None:
    """The kind of `part` (a key of KINDS) that `module`'s class computes, or None if it is none of them."""
    return _kind_of_class(type(module), part)
