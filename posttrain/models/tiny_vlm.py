"""Tiny vision-language models, built locally with random weights and saved with their processor.

Nothing is downloaded: the tokenizer is posttrain's tiny byte-level BPE (`posttrain.models.tiny`) with each
architecture's image tokens added, the image processor is the PIL one constructed from its class, and the
model is built from a config. Each builder writes a directory that `AutoProcessor.from_pretrained` and
`AutoModelForImageTextToText.from_pretrained` load, so the real loading code is what tests run.

Architectures: LLaVA (SigLIP tower + MLP projector + Llama), Gemma 3 (adds `token_type_ids`), Idefics3 /
SmolVLM (pixel-shuffle connector, image splitting off). Qwen2-VL's processor cannot be built here: in
transformers 5.24 it always constructs a video processor, which needs torchvision, and torchvision from PyPI
does not load against this CPU build of torch (`ProcessorMixin.__init__` checks the video processor's class
through a torchvision-gated mapping and fails even with `video_processor=None`); `build_tiny_qwen2_vl_model`
builds the model alone and `qwen2_vl_processor_parts` what its processor is made of.
"""

from __future__ import annotations

import os

from posttrain.models.tiny import build_tiny_tokenizer

# ChatML that also renders content given as typed blocks ({"type": "text" | "image"}); `image` is the text an
# image block becomes (each processor expands it into the image's tokens).
_BLOCK = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '__IMAGE__' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    + _BLOCK
    + "{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def multimodal_chat_template(image_text: str) -> str:
    """ChatML for block content, an image block rendered as `image_text`."""
    return _TEMPLATE.replace("__IMAGE__", image_text)


def _tokenizer(extra_tokens: list[str], special_attributes: dict[str, str] | None = None):
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": extra_tokens})
    if special_attributes:  # named tokens the processor reads, e.g. tokenizer.boi_token
        tokenizer._set_model_specific_special_tokens(special_tokens=special_attributes)
    return tokenizer


def _text_config(config_class, tokenizer, hidden_size: int, **extra):
    return config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **extra,
    )


def _save(model, processor, path: str | os.PathLike, seed: int) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _siglip(image_size: int, patch_size: int, hidden_size: int):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )


def build_tiny_llava(
    path,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    hidden_size: int = 32,
    text_config=None,
    tokenizer=None,
) -> str:
    """A LLaVA model (SigLIP tower, 2-layer MLP projector, Llama LM) and its `LlavaProcessor` saved to `path`;
    (image_size / patch_size)^2 image tokens per image. Returns `path`."""
    import torch
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = tokenizer or _tokenizer(["<image>"])
    if "<image>" not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    template = multimodal_chat_template("<image>")
    tokenizer.chat_template = template
    image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        chat_template=template,
    )
    text_config = text_config or _text_config(LlamaConfig, tokenizer, hidden_size, tie_word_embeddings=True)
    config = LlavaConfig(
        vision_config=_siglip(image_size, patch_size, hidden_size),
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        image_seq_length=(image_size // patch_size) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    return _save(model, processor, path, seed)


def build_tiny_gemma3(path, seed: int = 0, image_size: int = 32, patch_size: int = 8, hidden_size: int = 32) -> str:
    """A Gemma 3 vision-language model and its `Gemma3Processor` saved to `path` (the processor returns
    `token_type_ids`, 1 on image tokens, which the model needs in training). Returns `path`."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = _tokenizer(list(tokens.values()), tokens)
    template = multimodal_chat_template("<start_of_image>")
    tokenizer.chat_template = template
    tokens_per_side = 2
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, do_pan_and_scan=False)
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=template,
        image_seq_length=tokens_per_side**2,
    )
    text_config = _text_config(
        Gemma3TextConfig, tokenizer, hidden_size, head_dim=8, sliding_window=64, tie_word_embeddings=True
    )
    config = Gemma3Config(
        text_config=text_config,
        vision_config=_siglip(image_size, patch_size, hidden_size).to_dict(),
        mm_tokens_per_image=tokens_per_side**2,
        boi_token_index=tokenizer.convert_tokens_to_ids(tokens["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(tokens["eoi_token"]),
        image_token_index=tokenizer.convert_tokens_to_ids(tokens["image_token"]),
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    return _save(model, processor, path, seed)


def build_tiny_idefics3(
    path, seed: int = 0, image_size: int = 32, patch_size: int = 8, hidden_size: int = 32, scale_factor: int = 2
) -> str:
    """An Idefics3 (SmolVLM's architecture) model and its `Idefics3Processor` saved to `path`; image splitting
    is off, so each image is one global image of ((image_size / patch_size) / scale_factor)^2 tokens."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    row_col = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *row_col])
    template = multimodal_chat_template("<image>")
    tokenizer.chat_template = template
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}
    )
    seq_len = ((image_size // patch_size) // scale_factor) ** 2
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len, chat_template=template
    )
    text_config = _text_config(LlamaConfig, tokenizer, hidden_size, tie_word_embeddings=True)
    vision = {
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    config = Idefics3Config(
        text_config=text_config.to_dict(),
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    return _save(model, processor, path, seed)


def build_tiny_qwen2_vl_model(tokenizer=None, seed: int = 0, hidden_size: int = 32):
    """A Qwen2-VL model with random weights (no processor: see the module docstring); the tokenizer gets
    Qwen2-VL's vision tokens. Returns (model, tokenizer)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = tokenizer or _tokenizer(tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }
    vision = {
        "depth": 1,
        "embed_dim": hidden_size,
        "hidden_size": hidden_size,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config), tokenizer


def qwen2_vl_processor_parts(tokenizer, image_size: int = 32):
    """What a `Qwen2VLProcessor` for `build_tiny_qwen2_vl_model` is made of: (PIL image processor, tokenizer with
    a chat template); (image_size / 4)^2 / 4 image tokens per image. Constructing the processor itself fails here
    (see the module docstring) unless its video-processor check is bypassed."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer.chat_template = multimodal_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    pixels = image_size * image_size
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=4, merge_size=2, temporal_patch_size=2
    )
    return image_processor, tokenizer


def build_llava_from_causal_lm(
    lm_path: str, path, seed: int = 0, image_size: int = 32, patch_size: int = 8, vision_hidden_size: int = 64
) -> str:
    """A LLaVA model whose language model is the causal LM at `lm_path` (e.g. SmolLM2) and whose SigLIP tower
    and projector are fresh, with a `LlavaProcessor` (that LM's tokenizer plus an `<image>` token) saved to
    `path`. Returns `path`."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(lm_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    template = multimodal_chat_template("<image>")
    tokenizer.chat_template = template
    lm = AutoModelForCausalLM.from_pretrained(lm_path)
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessorPil(size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=0,
        chat_template=template,
    )
    config = LlavaConfig(
        vision_config=_siglip(image_size, patch_size, vision_hidden_size),
        text_config=lm.config,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        image_seq_length=(image_size // patch_size) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.resize_token_embeddings(len(tokenizer))
    if not lm.config.tie_word_embeddings:
        model.lm_head.weight.data[: lm.lm_head.weight.shape[0]] = lm.lm_head.weight.data
    return _save(model, processor, path, seed)
