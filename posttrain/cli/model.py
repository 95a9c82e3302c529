"""The model flags (TRL's `ModelConfig`) and what they build: the LoRA config and the quantization config.

Used by the `posttrain` command line, by `posttrain.scripts` and, re-exported, by TRL scripts that import
`ModelConfig`, `get_peft_config` and `get_quantization_config` from posttrain. A LoRA or quantization setting
that would have no effect (e.g. `lora_r` without `use_peft`) stops the run instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from posttrain.errors import ConfigError

LORA_FIELDS = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)
BNB_4BIT_FIELDS = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")


@dataclass
class ModelConfig:
    """The model flags of a TRL-style training script: what to load, how, and the LoRA and quantization settings.

    Which model to train, how to load it, and whether to train a LoRA adapter (TRL's fields and defaults).

    See docs/cli.md.
    """

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Required. Hub id, local directory, or 'builtin:SmolLM2-135M-Instruct'."},
    )
    model_revision: str = field(
        default="main", metadata={"help": "Branch, tag or commit of a hub model (ignored by local directories)."}
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = field(
        default="float32", metadata={"help": "Weight dtype at load time ('auto' keeps the checkpoint's)."}
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel, e.g. 'sdpa', 'eager', 'flash_attention_2'."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Module names to adapt, e.g. q_proj v_proj, or all-linear (default: "
            "PEFT's choice for the architecture)."
        },
    )
    lora_target_parameters: list[str] | None = field(
        default=None, metadata={"help": "Parameter names to adapt directly (e.g. experts of a mixture-of-experts)."}
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved beside the adapter (e.g. lm_head)."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type; 'SEQ_CLS' for reward models."})
    use_rslora: bool = field(
        default=False,
        metadata={"help": "Rank-stabilised LoRA: scale the adapter by alpha / sqrt(r) instead of alpha / r."},
    )
    use_dora: bool = field(
        default=False,
        metadata={
            "help": "DoRA: learn a magnitude per output beside the LoRA direction (slower; "
            "merge the weights for inference)."
        },
    )
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base model in 8 bit with bitsandbytes (LoRA only)."}
    )
    load_in_4bit: bool = field(
        default=False, metadata={"help": "Load the base model in 4 bit with bitsandbytes (QLoRA; LoRA only)."}
    )
    bnb_4bit_quant_type: Literal["fp4", "nf4"] = field(
        default="nf4", metadata={"help": "4-bit quantization type (with load_in_4bit)."}
    )
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Quantize the quantization constants too (with load_in_4bit)."}
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None, metadata={"help": "Storage dtype of the 4-bit weights, e.g. 'uint8' or 'bfloat16'."}
    )

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ConfigError("load_in_8bit and load_in_4bit are both set; choose one quantization.")
        # One module name means that name (e.g. 'all-linear'), as PEFT reads a string.
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


def _changed(model_args: ModelConfig, names: tuple[str, ...]) -> list[str]:
    """The fields among `names` whose value differs from the class default."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return [name for name in names if getattr(model_args, name) != defaults[name]]


def get_peft_config(model_args: ModelConfig):
    """Builds the LoRA config of a `ModelConfig` for a trainer's `peft_config=`.

    A peft `LoraConfig` from the `lora_*` fields when `use_peft` is set, else None.

    LoRA settings without `use_peft` would train the full model while the user asked for an adapter's shape:
    that is an error here, not a silent no-op.

    See docs/peft.md.
    """
    if not model_args.use_peft:
        changed = _changed(model_args, LORA_FIELDS)
        if changed:
            raise ConfigError(
                f"{changed[0]}={getattr(model_args, changed[0])!r} has no effect without use_peft; "
                "set use_peft (--use_peft) or drop the LoRA settings."
            )
        return None
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("use_peft needs the peft library: pip install peft.")
    from peft import LoraConfig

    extra = {}
    if model_args.lora_target_parameters is not None:
        extra["target_parameters"] = model_args.lora_target_parameters
    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
        **extra,
    )


def get_quantization_config(model_args: ModelConfig):
    """Builds the bitsandbytes quantization config of a `ModelConfig` (QLoRA).

    A transformers `BitsAndBytesConfig` for `load_in_4bit` / `load_in_8bit`, else None.

    The 4-bit compute dtype is the model's `dtype` (as TRL sets it; 'auto' leaves bitsandbytes' default). Recent
    bitsandbytes releases (>= 0.50) quantize on CPU tensors too, so no GPU is required: without bitsandbytes the
    flag is refused here, before any model is loaded, rather than failing inside from_pretrained.

    See docs/peft.md and docs/gpu.md.
    """
    flag = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit" if model_args.load_in_8bit else None
    if flag is None:
        changed = _changed(model_args, BNB_4BIT_FIELDS)
        if changed:
            raise ConfigError(
                f"{changed[0]}={getattr(model_args, changed[0])!r} only applies with load_in_4bit; "
                "set --load_in_4bit or drop it."
            )
        return None
    if flag == "load_in_8bit" and _changed(model_args, BNB_4BIT_FIELDS):
        raise ConfigError(
            f"{_changed(model_args, BNB_4BIT_FIELDS)[0]} only applies with load_in_4bit, not "
            "load_in_8bit; drop it or quantize in 4 bit."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            f"--{flag} quantizes the model with bitsandbytes, which is not installed: pip install "
            f"'posttrain[qlora]' (bitsandbytes>=0.50), or drop --{flag} to train unquantized."
        )
    from transformers import BitsAndBytesConfig

    if flag == "load_in_8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_compute_dtype=None if model_args.dtype in (None, "auto") else model_args.dtype,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
        bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
    )


def model_init_kwargs(model_args: ModelConfig, trust_remote_code: bool = False) -> dict:
    """The from_pretrained keyword arguments TRL's scripts build from the model flags (revision, trust_remote_code,
    attn_implementation, dtype); a config's own `model_init_kwargs` are merged over them by the caller."""
    return {
        "revision": model_args.model_revision,
        "trust_remote_code": trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
