"""The configs check themselves: every field's choices and bounds are declared with it (posttrain/training/fields.py),
and one generic check in `PosttrainConfig.__post_init__` enforces them. The cases below are generated from the
declarations, so a field that gains a rule is covered without a new test."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing
import warnings
from pathlib import Path

import pytest

import posttrain.experimental
import posttrain.trainers
from posttrain.errors import ConfigError
from posttrain.training.base import PosttrainConfig
from posttrain.training.fields import check_options, check_value, config_field, declared_rules

ROOT = Path(__file__).resolve().parents[2]
CONFIG_MODULES = [
    "posttrain.training.base",
    "posttrain.training.reference_trainer",
    "posttrain.training.reference_free",
    "posttrain.online.config",
    "posttrain.experimental",
    *(f"posttrain.trainers.{m.name}" for m in pkgutil.iter_modules(posttrain.trainers.__path__)),
    *(m.name for m in pkgutil.walk_packages(posttrain.experimental.__path__, "posttrain.experimental.")),
]
CONFIGS = sorted(
    {
        cls
        for module in CONFIG_MODULES
        for cls in vars(importlib.import_module(module)).values()
        if inspect.isclass(cls) and issubclass(cls, PosttrainConfig) and cls.__module__ == module
    },
    key=lambda cls: f"{cls.__module__}.{cls.__qualname__}",
)
REQUIRED = {"ServerDistillationConfig": {"teacher_model_server_url": "http://localhost:8000"}}
# Fields a config sets itself from another before its checks run (GKD's max_new_tokens sets max_completion_length).
DERIVED_FROM = {"max_completion_length": "max_new_tokens"}


def build(cls, **settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated import paths and TRL's spellings warn
        return cls(output_dir="unused", use_cpu=True, **REQUIRED.get(cls.__name__, {}), **settings)


def checked_fields(cls):
    """The fields with rules that a user can set to any value (an unsupported option only takes its default)."""
    return {
        name: rules
        for name, rules in declared_rules(cls).items()
        if name not in cls.unsupported_options
        and DERIVED_FROM.get(name) not in {f.name for f in dataclasses.fields(cls)}
    }


def is_int(cls, name: str) -> bool:
    hint = typing.get_type_hints(cls)[name]
    members = typing.get_args(hint) or (hint,)
    return int in members and float not in members


def takes_lists(cls, name: str) -> bool:
    hint = typing.get_type_hints(cls)[name]
    return any(typing.get_origin(member) is list for member in typing.get_args(hint) or (hint,))


def outside_and_boundary(cls, name: str, rules: dict) -> tuple[list, list]:
    """Values just outside the rules and values on their edge (an open bound's edge is outside)."""
    if "choices" in rules:
        wrap = (lambda v: [v]) if takes_lists(cls, name) else (lambda v: v)
        return [wrap("not-a-choice")], [wrap(choice) for choice in rules["choices"]]
    step = 1 if is_int(cls, name) else 0.001
    outside, boundary = [], []
    if "min" in rules:
        outside.append(rules["min"] - step)
        boundary.append(rules["min"])
    if "gt" in rules:
        outside.append(rules["gt"])
        boundary.append(rules["gt"] + step)
    if "max" in rules:
        outside.append(rules["max"] + step)
        boundary.append(rules["max"])
    if "lt" in rules:
        outside.append(rules["lt"])
        boundary.append(rules["lt"] - step)
    return outside, boundary


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda cls: cls.__name__)
def test_a_value_outside_a_declared_rule_stops_the_config(cls):
    """Built with one field just outside its rules, every config raises ConfigError naming the field and value."""
    escaped = []
    for name, (rules, _) in checked_fields(cls).items():
        for value in outside_and_boundary(cls, name, rules)[0]:
            try:
                build(cls, **{name: value})
                escaped.append(f"{name}={value!r} was accepted")
            except ConfigError as error:
                if name not in str(error) or repr(value) not in str(error):
                    escaped.append(f"{name}={value!r} raised, but not naming it: {error}")
    assert not escaped, f"{cls.__name__}:\n" + "\n".join(escaped)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda cls: cls.__name__)
def test_a_value_on_the_edge_of_a_rule_passes_the_check(cls):
    """Every choice, every closed bound and a step inside every open bound pass the generic check (and None where
    the type allows it), on a config built with its defaults, which pass too."""
    config = build(cls)
    for name, (rules, nullable) in declared_rules(cls).items():
        for value in outside_and_boundary(cls, name, rules)[1] + ([None] if nullable else []):
            setattr(config, name, value)
            check_options(config)


def test_every_config_declares_rules_and_runs_the_check():
    assert len(CONFIGS) >= 30
    assert all(declared_rules(cls) for cls in CONFIGS)  # max_nonfinite_steps and nonfinite_policy, at least
    assert sum(len(checked_fields(cls)) for cls in CONFIGS) > 400


@pytest.mark.parametrize(
    ("config", "settings", "message"),
    [  # each was a hand-written check before the rules were declared
        ("posttrain.SFTConfig", dict(max_nonfinite_steps=0), "max_nonfinite_steps=0 must be at least 1."),
        ("posttrain.SFTConfig", dict(packing_strategy="bfd-x"), "packing_strategy='bfd-x' is not one of ("),
        ("posttrain.SFTConfig", dict(loss_chunk_size=0), "loss_chunk_size=0 must be at least 1."),
        ("posttrain.DPOConfig", dict(precompute_ref_batch_size=0), "precompute_ref_batch_size=0 must be at least 1"),
        ("posttrain.GRPOConfig", dict(vllm_sync_steps=0), "vllm_sync_steps=0 must be at least 1."),
        ("posttrain.GRPOConfig", dict(top_entropy_quantile=1.5), "top_entropy_quantile=1.5 must lie in [0, 1]."),
        ("posttrain.PPOConfig", dict(kl_estimator="k2"), "kl_estimator='k2' is not one of ('k1', 'k3')."),
        ("posttrain.PPOConfig", dict(num_mini_batches=0), "num_mini_batches=0 must be at least 1 (or None)."),
        ("posttrain.experimental.tpo.TPOConfig", dict(tpo_alpha=-1.0), "tpo_alpha=-1.0 must be >= 0."),
        ("posttrain.experimental.gold.GOLDConfig", dict(uld_student_temperature=0.0), "must be > 0."),
        ("posttrain.experimental.sdft.SDFTConfig", dict(teacher_update_rate=1.5), "must lie in (0, 1]."),
        ("posttrain.experimental.sdpo.SDPOConfig", dict(max_reprompt_len=0), "max_reprompt_len=0 must be at least 1"),
        ("posttrain.experimental.bco.BCOConfig", dict(prompt_sample_size=0), "prompt_sample_size=0 must be at least"),
    ],
)
def test_the_rules_cover_the_checks_they_replaced(config, settings, message):
    module, _, name = config.rpartition(".")
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(getattr(importlib.import_module(module), name), **settings)


def test_the_message_names_the_field_the_value_and_what_is_allowed():
    cases = [
        ({"min": 1}, 0, False, "n=0 must be at least 1."),
        ({"min": 0}, -1, True, "n=-1 must be >= 0 (or None)."),
        ({"gt": 0}, 0.0, False, "n=0.0 must be > 0."),
        ({"gt": 0, "max": 1}, 1.5, False, "n=1.5 must lie in (0, 1]."),
        ({"min": 0, "lt": 1}, 1, False, "n=1 must lie in [0, 1)."),
        ({"max": 0.5}, 0.75, False, "n=0.75 must be at most 0.5."),
        ({"choices": ("a", "b")}, "c", False, "n='c' is not one of ('a', 'b')."),
        ({"choices": ("a", "b")}, ["a", "c"], False, "n=['a', 'c']: 'c' is not one of ('a', 'b')."),
        ({"min": 1}, None, False, "n=None must be at least 1."),
        ({"min": 1}, "2", False, "n='2' must be at least 1."),
        ({"gt": 0}, float("nan"), False, "n=nan must be > 0."),
    ]
    for rules, value, nullable, message in cases:
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            check_value("n", value, rules, nullable)
    check_value("n", None, {"min": 1}, nullable=True)
    check_value("n", [0.5, 1.0], {"gt": 0, "max": 1})


def test_a_subclass_keeps_its_base_rules_unless_it_states_its_own():
    """GKDConfig declares beta again (its default) without rules: DistillationConfig's [0, 1] still holds. SDPO's
    loss_type states its own choices, which replace SFTConfig's."""
    from posttrain.experimental.gkd import GKDConfig
    from posttrain.experimental.sdpo.sdpo_config import LOSS_TYPES, SDPOConfig

    assert declared_rules(GKDConfig)["beta"] == ({"min": 0, "max": 1}, False)
    with pytest.raises(ConfigError, match=re.escape("beta=1.5 must lie in [0, 1].")):
        build(GKDConfig, beta=1.5)
    assert declared_rules(SDPOConfig)["loss_type"][0] == {"choices": LOSS_TYPES}
    assert build(SDPOConfig, loss_type="grpo").loss_type == "grpo"


def test_a_misspelt_rule_fails_where_it_is_declared():
    with pytest.raises(TypeError, match="unknown rules \\['mn'\\]"):
        config_field(1, "A count.", mn=1)


def test_hf_argument_parser_sees_only_the_help():
    """transformers' HfArgumentParser passes a field's metadata to argparse as keywords: the rules stay out of it,
    and a declared choice is checked by the config (ConfigError), not by argparse."""
    from transformers import HfArgumentParser

    import posttrain

    field = next(f for f in dataclasses.fields(posttrain.GRPOConfig) if f.name == "loss_type")
    assert dict(field.metadata) == {"help": field.metadata["help"]} and field.metadata["rules"]["choices"]
    for name in ("SFTConfig", "DPOConfig", "KTOConfig", "RewardConfig", "GRPOConfig", "RLOOConfig", "PPOConfig"):
        parser = HfArgumentParser(getattr(posttrain, name))
        (config,) = parser.parse_args_into_dataclasses(["--output_dir", "unused", "--use_cpu", "true"])
        assert isinstance(config, getattr(posttrain, name))
    with pytest.raises(ConfigError, match="loss_type='ppo' is not one of"):
        HfArgumentParser(posttrain.GRPOConfig).parse_args_into_dataclasses(
            ["--output_dir", "unused", "--use_cpu", "true", "--loss_type", "ppo"]
        )


# -- fields several configs share: declared once, in posttrain/training/fields.py --------------------------------

SHARED_WITHOUT_RULES = ("learning_rate", "disable_dropout", "sync_ref_model")
SHARED_WITH_RULES = (
    "max_length",
    "max_prompt_length",
    "max_completion_length",
    "truncation_mode",
    "router_aux_loss_coef",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "num_generations_eval",
    "num_completions_to_print",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_max_model_length",
)


def having(name: str) -> list[type]:
    return [cls for cls in CONFIGS if name in {f.name for f in dataclasses.fields(cls)}]


@pytest.mark.parametrize("name", SHARED_WITH_RULES)
def test_a_shared_field_has_the_same_rules_in_every_config(name):
    rules = {cls.__name__: declared_rules(cls).get(name, ({}, None))[0] for cls in having(name)}
    assert len(rules) >= 2 and all(rules.values()) and len({repr(r) for r in rules.values()}) == 1, rules


@pytest.mark.parametrize("name", SHARED_WITHOUT_RULES + SHARED_WITH_RULES)
def test_a_shared_field_is_first_declared_through_its_one_declaration(name):
    """Wherever a config first declares a shared field (not overriding a base's default), it uses the declaration
    in posttrain/training/fields.py (`max_length_field(...)`, ...), which states the rules and the common help once;
    an override keeps those rules (the test above)."""
    owners = [
        [k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}) and k.__module__.startswith("posttrain")]
        for cls in having(name)
    ]
    first = {declared[-1] for declared in owners if declared}  # (PosttrainConfig keeps transformers' learning_rate)
    spelled_out = [
        k.__qualname__
        for k in first
        if not re.search(rf"^\s+{name}\s*:[^=]+=\s*{name}_field\(", inspect.getsource(k), re.M)
    ]
    assert len(first) >= 2 and not spelled_out, spelled_out
