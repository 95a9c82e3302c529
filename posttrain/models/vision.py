"""Vision-language models: recognising and loading them, and adapting them before training (the vision tower
frozen, LoRA on the language model with the projector trained in full)."""

from __future__ import annotations

from posttrain.data.vision import is_vision_model

VISION_TOWERS = ("vision_tower", "vision_model", "visual")
PROJECTORS = ("multi_modal_projector", "connector", "merger", "mm_projector")


def is_vision_checkpoint(name: str, trust_remote_code: bool = False) -> bool:
    from transformers import AutoConfig

    from posttrain.models.loading import resolve_model_path

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False
    return getattr(config, "vision_config", None) is not None


def load_vision_model(name: str, init_kwargs: dict | None = None):
    """A vision-language model by name or path (`AutoModelForImageTextToText`)."""
    from transformers import AutoModelForImageTextToText

    from posttrain.models.loading import resolve_model_path

    return AutoModelForImageTextToText.from_pretrained(resolve_model_path(name), **(init_kwargs or {}))


def load_processor(model, trust_remote_code: bool = False):
    from transformers import AutoProcessor

    from posttrain.models.loading import resolve_model_path

    name = model if isinstance(model, str) else model.config._name_or_path
    return AutoProcessor.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)


# -- model set-up ----------------------------------------------------------------------------------------
def _module_names(model, names) -> list[str]:
    found = [n for n, _ in model.named_modules() if n.split(".")[-1] in names]
    return [n for n in found if not any(n.startswith(other + ".") for other in found if other != n)]


def freeze_vision_tower(model) -> list[str]:
    """Stops gradients into the vision tower (its projector / connector stays trainable). Returns the towers."""
    towers, projectors = _module_names(model, VISION_TOWERS), _module_names(model, PROJECTORS)
    for name, parameter in model.named_parameters():
        in_tower = any(f".{t}." in f".{name}" for t in towers)
        if in_tower and not any(f".{p}." in f".{name}" for p in projectors):
            parameter.requires_grad_(False)
    return towers


def configure_vision_peft(peft_config, model, freeze_tower: bool) -> None:
    """LoRA on the language model with the projector fully trained: `peft_config` (a copy the trainer owns) gets
    the projector in `modules_to_save` and, with a frozen tower, the tower in `exclude_modules` (a setting the
    user gave is kept)."""
    projectors = sorted({n.split(".")[-1] for n in _module_names(model, PROJECTORS)})
    if projectors and hasattr(peft_config, "modules_to_save"):
        peft_config.modules_to_save = list(dict.fromkeys([*(peft_config.modules_to_save or []), *projectors]))
    if freeze_tower and hasattr(peft_config, "exclude_modules") and peft_config.exclude_modules is None:
        peft_config.exclude_modules = r".*\b(" + "|".join(VISION_TOWERS) + r")\b.*"


def adapt_vision_model(model, peft_config, freeze_tower: bool):
    """Before PEFT wrapping (every trainer, offline and online): with LoRA, the projector trained in full and no
    adapter in a frozen tower (`configure_vision_peft`); the tower frozen when `freeze_tower`. A text-only model is
    left as it is. Returns `model`."""
    if is_vision_model(model):
        if peft_config is not None:
            configure_vision_peft(peft_config, model, freeze_tower)
        if freeze_tower:
            freeze_vision_tower(model)
    return model
