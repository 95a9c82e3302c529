"""A model built from a path or Hub id with `from_pretrained` keyword arguments, and the id a config came from."""

from __future__ import annotations

import contextlib
import logging

import torch

from posttrain.errors import ConfigError

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": "auto"}


def get_config_model_id(config) -> str:
    """The path or Hub id `config` was loaded from (`_name_or_path`), or "" for a config built in memory."""
    return getattr(config, "_name_or_path", "") or ""


def create_model_from_path(model_id: str, architecture=None, **kwargs):
    """`architecture.from_pretrained(model_id, **kwargs)`, the architecture read from the config's `architectures`
    when not given (a transformers class of that name). `dtype` may be a torch dtype or "bfloat16", "float16",
    "float32" or "auto"; float32 when not given."""
    import transformers

    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)} or a torch.dtype; pick one of them.")
        dtype = _DTYPES[dtype]
    kwargs["dtype"] = dtype
    if architecture is None:
        config = transformers.AutoConfig.from_pretrained(model_id, trust_remote_code=kwargs.get("trust_remote_code"))
        names = getattr(config, "architectures", None) or []
        if not names or not hasattr(transformers, names[0]):
            raise ConfigError(
                f"{model_id}'s config names no transformers architecture ({names}); pass architecture= (e.g. "
                "transformers.AutoModelForCausalLM)."
            )
        architecture = getattr(transformers, names[0])
    return architecture.from_pretrained(model_id, **kwargs)


class _NewHeadFilter:
    def filter(self, record) -> bool:
        message = record.getMessage()
        return not (("newly initialized" in message or "not initialized" in message) and ("score" in message))


@contextlib.contextmanager
def suppress_seqcls_warning():
    """Inside, transformers' loading log does not report a sequence-classification head (`score`) as newly
    initialized: a reward model built from a causal LM always starts its head from scratch, so the warning says
    nothing. Other loading messages pass."""
    loggers = [logging.getLogger(name) for name in ("transformers.modeling_utils", "transformers.utils.loading_report")]
    head_filter = _NewHeadFilter()
    for logger in loggers:
        logger.addFilter(head_filter)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(head_filter)


__all__ = ["create_model_from_path", "get_config_model_id", "suppress_seqcls_warning"]
