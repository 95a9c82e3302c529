"""Config fields that state their own rules, the one check that enforces them, and the fields several configs share.

A field is declared with `config_field(default, help, **rules)`. The rules are `choices=(...)` and the bounds `min`
(>=), `gt` (>), `max` (<=) and `lt` (<). `PosttrainConfig.__post_init__` runs `check_options`, so every config
refuses a value that breaks a rule before training, with one message naming the field, the value and what it may
be. A list is checked entry by entry; None passes where the field's type allows it. A subclass that declares a
field again (a new default or help) keeps its base's rules unless it states its own. Checks that relate several
fields stay in the configs' `__post_init__`.
"""

from __future__ import annotations

import functools
import operator
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, field, fields
from typing import Any

from posttrain.data.preference import TRUNCATION_MODES
from posttrain.errors import ConfigError
from posttrain.generation.vllm_backend import VLLM_MODES

RULE_NAMES = ("choices", "min", "gt", "max", "lt")


class FieldMetadata(Mapping):
    """A field's metadata: its help text and, under "rules", its rules. transformers' HfArgumentParser hands every
    key it finds by iterating a field's metadata to argparse's `add_argument`, which refuses keywords it does not
    know; so iteration shows "help" alone, and the rules are read by name (`metadata.get("rules")`)."""

    def __init__(self, help: str, rules: dict[str, Any]):
        self._entries = {"help": help, "rules": rules}

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("help",))

    def __len__(self) -> int:
        return 1


def config_field(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, **rules: Any) -> Any:
    """A config field with its default, its help text (the command line's --help) and its rules (see the module
    docstring)."""
    unknown = sorted(set(rules) - set(RULE_NAMES))
    if unknown:
        raise TypeError(f"config_field() got unknown rules {unknown}; the rules are {RULE_NAMES}.")
    if "choices" in rules:
        rules["choices"] = tuple(rules["choices"])
    return field(default=default, default_factory=default_factory, metadata=FieldMetadata(help, rules))


@functools.cache
def declared_rules(config_class: type) -> dict[str, tuple[dict[str, Any], bool]]:
    """Each field of `config_class` that has rules, the field declared last first: the rules of its nearest
    declaration that states any, and whether its type allows None."""
    found, hints = {}, None
    for info in reversed(fields(config_class)):
        rules = next(filter(None, (_own_rules(klass, info.name) for klass in config_class.__mro__)), None)
        if rules:
            hints = hints or typing.get_type_hints(config_class)
            found[info.name] = (rules, type(None) in typing.get_args(hints[info.name]))
    return found


def _own_rules(klass: type, name: str) -> dict[str, Any] | None:
    declared = vars(klass).get("__dataclass_fields__", {}).get(name)
    return declared.metadata.get("rules") if declared is not None else None


def check_options(config: Any) -> None:
    """Raises ConfigError for the first field whose value breaks its rules. The fields declared last are checked
    first: a subclass's own field often feeds an inherited one (GKD's max_new_tokens sets max_completion_length),
    and the message should name the one the user set."""
    for name, (rules, nullable) in declared_rules(type(config)).items():
        check_value(name, getattr(config, name), rules, nullable)


def check_value(name: str, value: Any, rules: dict[str, Any], nullable: bool = False) -> None:
    """Raises ConfigError naming `name`, `value` and what the rules allow if `value` (a list or tuple: any entry)
    breaks `rules`."""
    if value is None and nullable:
        return
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if not _obeys(item, rules):
            shown = f"{name}={value!r}" + (f": {item!r}" if item is not value else "")
            raise ConfigError(f"{shown} {_allowed(rules)}{' (or None)' if nullable else ''}.")


BOUNDS = {"min": (operator.ge, "["), "gt": (operator.gt, "("), "max": (operator.le, "]"), "lt": (operator.lt, ")")}


def _obeys(value: Any, rules: dict[str, Any]) -> bool:
    if "choices" in rules:
        return value in rules["choices"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return all(compare(value, rules[name]) for name, (compare, _) in BOUNDS.items() if name in rules)


def _allowed(rules: dict[str, Any]) -> str:
    """What the rules allow, as the error message says it: "is not one of (...)", "must be at least 1", "must be
    >= 0" (for a minimum of 0), "must be > 0", "must be at most 1", "must lie in (0, 1]"."""
    if "choices" in rules:
        return f"is not one of {rules['choices']}"
    low = next((name for name in ("min", "gt") if name in rules), None)
    high = next((name for name in ("max", "lt") if name in rules), None)
    if low and high:
        return f"must lie in {BOUNDS[low][1]}{rules[low]}, {rules[high]}{BOUNDS[high][1]}"
    if low == "min":
        return "must be >= 0" if rules["min"] == 0 else f"must be at least {rules['min']}"
    if low == "gt":
        return f"must be > {rules['gt']}"
    return f"must be at most {rules['max']}" if high == "max" else f"must be < {rules['lt']}"


# -- fields several configs declare: the rules (and the help, where the configs say the same) stated once -----------


def learning_rate_field(default: float) -> Any:
    return config_field(default, "Peak learning rate.")


def disable_dropout_field(default: bool, help: str = "Turn dropout off in the model.") -> Any:
    return config_field(default, help)


def router_aux_loss_coef_field(help: str) -> Any:
    """A negative weight would reward unbalanced experts; None takes the model's own coefficient."""
    return config_field(None, help, min=0)


def max_length_field(default: int | None, help: str) -> Any:
    return config_field(default, help, min=1)


def remove_unused_columns_field() -> Any:
    """TRL's default (True) for the trainers whose collators read prepared columns: the trainer names those columns
    (`_set_signature_columns_if_needed`), so only the dataset's other columns go."""
    return config_field(
        True,
        "Drop the dataset columns the trainer's collator does not read (e.g. an extra 'metadata' column); False "
        "passes every column of the prepared dataset to the collator.",
    )


def max_prompt_length_field(default: int | None, help: str) -> Any:
    return config_field(default, help, min=1)


def max_completion_length_field(default: int | None, help: str = "Most tokens generated per completion.") -> Any:
    return config_field(default, help, min=1)


def truncation_mode_field(
    default: str = "keep_start",
    help: str = "How a sequence over max_length is cut: keep_start (drop its end) or keep_end (drop the start of "
    "the prompt).",
) -> Any:
    return config_field(default, help, choices=TRUNCATION_MODES)


def pad_to_multiple_of_field(
    default: int | str | None = "auto",
    help: str = "Pad each batch to a multiple of this length ('auto': no extra padding off Neuron).",
) -> Any:
    """Checked once `parse_pad_to_multiple_of` has turned the text forms into a number or None."""
    return config_field(default, help, min=1)


def parse_pad_to_multiple_of(value: int | str | None) -> int | None:
    """'auto' (TRL's default) pads to a multiple of 128 only on Neuron, which posttrain does not target: no extra
    padding. The command line passes numbers and 'none' as text."""
    if isinstance(value, str):
        return None if value.lower() in ("auto", "none", "null") else int(value)
    return value


# Generation, in the online engine and distillation (OnlineConfig, DistillationConfig, SelfDistillationConfig). The
# sampling settings (temperature, top_p, ...) are checked where they are used: SamplingParams, built by both configs.
VLLM_MODEL_IMPLS = ("vllm", "transformers")


def num_generations_eval_field(help: str) -> Any:
    return config_field(None, help, min=1)


def num_completions_to_print_field(help: str) -> Any:
    return config_field(None, help, min=1)


def vllm_mode_field(help: str) -> Any:
    return config_field("colocate", help, choices=VLLM_MODES)


def vllm_model_impl_field(help: str) -> Any:
    return config_field("vllm", help, choices=VLLM_MODEL_IMPLS)


def vllm_max_model_length_field(help: str) -> Any:
    return config_field(None, help, min=1)


# The reference model of the trainers that keep one (ReferenceConfig, OnlineConfig).
def sync_ref_model_field(help: str) -> Any:
    return config_field(False, help)


def ref_model_mixup_alpha_field(help: str) -> Any:
    return config_field(0.6, help, gt=0, max=1)


def ref_model_sync_steps_field(help: str) -> Any:
    return config_field(512, help, min=1)
