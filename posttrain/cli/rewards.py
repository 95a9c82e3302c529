"""The rewards of an online method's command (`--reward_funcs`, `--reward_model_name_or_path`): library reward
functions by name, functions by dotted import path (from the working directory too), reward models by id or path.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any

from posttrain.cli.args import RewardArguments
from posttrain.errors import ConfigError

DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def reward_arguments(args: RewardArguments) -> dict[str, Any]:
    """The trainer's `reward_funcs`: a reward model first (as TRL's scripts order them), then library
    functions, imported functions, or reward model names."""
    check_rewards(args)
    models = [args.reward_model_name_or_path] if args.reward_model_name_or_path else []
    return {"reward_funcs": models + [resolve_reward(spec) for spec in args.reward_funcs or []]}


def check_rewards(args: RewardArguments) -> None:
    if not args.reward_funcs and not args.reward_model_name_or_path:
        raise ConfigError(
            "--reward_funcs is required for this method: name one or more rewards, e.g. "
            "--reward_funcs accuracy_reward think_format_reward (or give --reward_model_name_or_path)."
        )


def resolve_reward(spec: str):
    """A reward by library name, a function by dotted import path, or a reward model id/path (kept as text for
    the trainer to load)."""
    from posttrain.rewards import REWARD_FUNCTIONS

    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if spec.startswith("builtin:") or "/" in spec or Path(spec).expanduser().exists():
        return spec
    if DOTTED_NAME.fullmatch(spec):
        return _import_reward(spec)
    close = difflib.get_close_matches(spec, list(REWARD_FUNCTIONS), n=1)
    suggestion = f" Did you mean {close[0]}?" if close else ""
    raise ConfigError(
        f"--reward_funcs: unknown reward function {spec!r}.{suggestion} The library has: "
        f"{', '.join(REWARD_FUNCTIONS)}; or pass a dotted import path (mypkg.rewards.my_reward) or "
        "a reward model id/path."
    )


def _import_reward(spec: str):
    module_name, attribute = spec.rsplit(".", 1)
    if os.getcwd() not in sys.path:  # the console script does not put the working directory on the path
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise  # the module exists but one of its own imports failed: a real error, keep the traceback
        raise ConfigError(f"--reward_funcs {spec}: cannot import module {module_name!r} ({err}).") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"--reward_funcs {spec}: {module_name} has no function {attribute!r}.")
    return function
