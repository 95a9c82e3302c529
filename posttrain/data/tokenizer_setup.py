"""Tokenizer options shared by the offline trainers: `eos_token`, `pad_token`, `chat_template_path`.

Two steps, because a model given by name is loaded after the tokenizer is known:
- `configure_tokenizer(tokenizer, args)` changes the tokenizer (before the data is tokenized), and
- `sync_model_with_tokenizer(model, tokenizer, added_token_ids)` makes the model agree with it
  (eos / pad ids in its config and generation config; embeddings grown for tokens a cloned template added).
Options are read with `getattr`, so any config that has some of these fields can use them.
"""

from __future__ import annotations

import logging
import os

from posttrain.errors import ConfigError

logger = logging.getLogger("posttrain")

JINJA_SUFFIXES = (".jinja", ".j2")
# A cloned template may add tokens; the embedding matrix is grown to a multiple of this (as TRL does).
RESIZE_TO_MULTIPLE_OF = 64


def text_tokenizer(processing_class):
    """The tokenizer inside a processor (vision models), or the tokenizer itself."""
    return getattr(processing_class, "tokenizer", None) or processing_class


def _require_in_vocab(tokenizer, token: str, option: str) -> None:
    if token not in tokenizer.get_vocab():
        raise ConfigError(
            f"{option}={token!r} is not a token of the tokenizer's vocabulary ({type(tokenizer).__name__}, "
            f"{len(tokenizer)} tokens), so it has no id to train or pad with. Use an existing token (e.g. "
            f"{tokenizer.eos_token!r}), or add it first with tokenizer.add_special_tokens(...) and "
            "model.resize_token_embeddings(len(tokenizer))."
        )


def _load_template_source(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - re-raised with the option's name and the fix
        raise ConfigError(
            f"chat_template_path={path!r} is neither a Jinja file ({'/'.join(JINJA_SUFFIXES)}) nor a tokenizer that "
            f"can be loaded ({type(error).__name__}: {error}). Give an existing .jinja file, or a tokenizer "
            "directory / hub id whose chat template should be cloned."
        ) from error


def configure_tokenizer(processing_class, args) -> list[int]:
    """Applies `args.eos_token`, `args.chat_template_path` and `args.pad_token` (in that order) to the tokenizer.

    - `eos_token`: becomes the tokenizer's EOS (must already be in the vocabulary).
    - `chat_template_path`: a `.jinja`/`.j2` file is read as the template; anything else is loaded as a tokenizer
      whose template is cloned, together with its added tokens (appended to this vocabulary) and its EOS token.
    - `pad_token`: becomes the pad token; without it the tokenizer's pad token, else its EOS, is used.
    Returns the ids of the tokens added by cloning (the model's embeddings must grow to hold them:
    `sync_model_with_tokenizer`).
    """
    tokenizer = text_tokenizer(processing_class)
    eos_token = getattr(args, "eos_token", None)
    if eos_token is not None:
        _require_in_vocab(tokenizer, eos_token, "eos_token")
        tokenizer.eos_token = eos_token

    added: list[int] = []
    path = getattr(args, "chat_template_path", None)
    if path is not None:
        if path.endswith(JINJA_SUFFIXES) or os.path.isfile(path):
            if not os.path.isfile(path):
                raise ConfigError(
                    f"chat_template_path={path!r}: no such file. Give the path of an existing Jinja "
                    "template file, or a tokenizer directory / hub id to clone the template from."
                )
            if not path.endswith(JINJA_SUFFIXES):
                raise ConfigError(
                    f"chat_template_path={path!r} is a file but not a Jinja template "
                    f"({'/'.join(JINJA_SUFFIXES)}). Rename it, or give the tokenizer's directory."
                )
            with open(path, encoding="utf-8") as f:
                processing_class.chat_template = f.read()
        else:
            source = _load_template_source(path)
            template = source.get_chat_template() if getattr(source, "chat_template", None) else None
            if not template:
                raise ConfigError(
                    f"chat_template_path={path!r}: that tokenizer has no chat template to clone. "
                    "Give a tokenizer that has one, or a .jinja file."
                )
            processing_class.chat_template = template
            vocab = tokenizer.get_vocab()
            missing = [t for t in source.added_tokens_decoder.values() if t.content not in vocab]
            tokenizer.add_tokens(missing)
            added = tokenizer.convert_tokens_to_ids([t.content for t in missing])
            if source.eos_token is not None:
                tokenizer.eos_token = source.eos_token

    pad_token = getattr(args, "pad_token", None) or tokenizer.pad_token
    if pad_token is None and tokenizer.eos_token is not None:
        pad_token = tokenizer.eos_token
        logger.warning(
            "The tokenizer has no pad token; padding with its EOS token %r (padding is never trained or attended).",
            pad_token,
        )
    if pad_token is None:
        raise ConfigError(
            "The tokenizer has neither a pad token nor an EOS token, and pad_token is not set; set "
            "pad_token (or eos_token) to a token of the vocabulary."
        )
    _require_in_vocab(tokenizer, pad_token, "pad_token")
    tokenizer.pad_token = pad_token
    return added


def sync_model_with_tokenizer(model, processing_class, added_token_ids=(), eos_changed: bool = True) -> None:
    """Makes `model` agree with a configured tokenizer: its embeddings hold every token id (grown to a multiple of
    64, the rows beyond the vocabulary filled with placeholder tokens, when a cloned template added tokens), and its
    config and generation config name the tokenizer's pad and (if `eos_changed`) EOS ids."""
    from transformers import AddedToken

    tokenizer = text_tokenizer(processing_class)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if added_token_ids:
        base.resize_token_embeddings(new_num_tokens=len(tokenizer), pad_to_multiple_of=RESIZE_TO_MULTIPLE_OF)
        index = 0
        while base.get_input_embeddings().num_embeddings > len(tokenizer):
            tokenizer.add_tokens(AddedToken(f"<extra_id_{index}>"))
            index += 1
    text_config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    generation = getattr(base, "generation_config", None) if base.can_generate() else None
    if eos_changed and tokenizer.eos_token_id is not None:
        text_config.eos_token_id = tokenizer.eos_token_id
        if generation is not None:
            # Generation stops on any of its EOS ids: keep the old ones, add the new one first.
            old = generation.eos_token_id
            old = [] if old is None else [old] if isinstance(old, int) else list(old)
            if tokenizer.eos_token_id not in old:
                generation.eos_token_id = [tokenizer.eos_token_id, *old]
    if tokenizer.pad_token_id is not None:
        text_config.pad_token_id = tokenizer.pad_token_id
        if generation is not None:
            generation.pad_token_id = tokenizer.pad_token_id


def make_added_tokens_trainable(peft_config, added_token_ids: list[int]) -> None:
    """With a PEFT adapter, the embedding rows of tokens added by a cloned template must be trained, and so must the
    output layer (or the model could never produce them)."""
    if peft_config is None or not added_token_ids:
        return
    indices = dict(getattr(peft_config, "trainable_token_indices", None) or {})
    indices["embed_tokens"] = [*indices.get("embed_tokens", []), *added_token_ids]
    peft_config.trainable_token_indices = indices
    modules = list(peft_config.modules_to_save or [])
    if "lm_head" not in modules:
        logger.warning(
            "The cloned chat template added %d tokens; training lm_head fully (added to the adapter's "
            "modules_to_save) so that the model can learn to emit them.",
            len(added_token_ids),
        )
        peft_config.modules_to_save = [*modules, "lm_head"]
