"""What every `posttrain.scripts.<method>` module shares: TRL's `make_parser` / `main(script_args, training_args,
model_args, dataset_args)` pair for callers that drive a script from Python, and the module's command line,
which is the `posttrain <method>` command (the same flags and YAML keys as `trl <method>`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from posttrain.cli.args import RewardArguments
from posttrain.cli.data import DatasetMixtureConfig, ScriptArguments, get_dataset, load_source
from posttrain.cli.model import ModelConfig, get_peft_config, get_quantization_config, model_init_kwargs
from posttrain.errors import ConfigError


@dataclass
class RewardScriptArguments(RewardArguments, ScriptArguments):
    """ScriptArguments of the online scripts (TRL's GRPOScriptArguments / RLOOScriptArguments): the script's
    data set flags plus the reward flags of `posttrain.cli.args.RewardArguments`, declared there once."""


@dataclass
class GRPOScriptArguments(RewardScriptArguments):
    """ScriptArguments plus the reward model and reward functions of the GRPO script."""


@dataclass
class RLOOScriptArguments(RewardScriptArguments):
    """ScriptArguments plus the reward model and reward functions of the RLOO script."""


def script_entry_points(name: str, script_arguments: type = ScriptArguments):
    """The `make_parser(subparsers=None, prog=None)` and `main(script_args, training_args, model_args,
    dataset_args)` of TRL's `trl/scripts/<name>.py`, for `posttrain.scripts.<name>`."""

    def make(subparsers=None, prog: str | None = None):
        return make_parser(name, script_arguments, subparsers, prog)

    def main(script_args, training_args, model_args, dataset_args):
        run(name, script_args, training_args, model_args, dataset_args)

    return make, main


def make_parser(name: str, script_arguments: type = ScriptArguments, subparsers=None, prog: str | None = None):
    """TRL's parser of the `name` script: (script arguments, the method's config, ModelConfig, mixture)."""
    from posttrain.cli.main import ALIASES, METHODS
    from posttrain.cli.parser import TrlParser

    config_class = METHODS[ALIASES.get(name, name)].load()[1]
    types = (script_arguments, config_class, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser(name, help=f"Run the {name} training script", dataclass_types=types)
    return TrlParser(types, prog=prog)


def _reward_funcs(script_args) -> list:
    """TRL's scripts' rewards: the reward model first, then names (with TRL's overlong-punishment settings) or
    dotted import paths."""
    from posttrain.cli.rewards import resolve_reward
    from posttrain.rewards import get_soft_overlong_punishment

    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for spec in script_args.reward_funcs or []:
        if spec == "get_soft_overlong_punishment":
            rewards.append(get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256))
        else:
            rewards.append(resolve_reward(spec))
    return rewards


def _datasets(script_args, training_args, dataset_args):
    """(train, eval or None) as TRL's scripts choose them: the mixture when given, else `dataset_name`; eval
    rows only when eval_strategy is not 'no'."""
    evaluate = training_args.eval_strategy != "no"
    if dataset_args.datasets:
        if script_args.dataset_name:
            raise ConfigError("both `datasets` and dataset_name are given; TRL would ignore dataset_name. Drop one.")
        splits = get_dataset(dataset_args, seed=training_args.seed)
        train = splits[script_args.dataset_train_split] if script_args.dataset_train_split in splits else None
        if train is None:
            raise ConfigError(
                f"the mixture has splits {sorted(splits)}, not dataset_train_split={script_args.dataset_train_split!r}."
            )
        if evaluate and script_args.dataset_test_split not in splits:
            raise ConfigError(
                f"eval_strategy is not 'no' but the mixture has no {script_args.dataset_test_split!r} "
                "split; set test_split_size."
            )
        return train, splits[script_args.dataset_test_split] if evaluate else None
    if not script_args.dataset_name:
        raise ConfigError("Either `datasets` (in the YAML config) or dataset_name must be given.")

    def split(name):
        return load_source(
            script_args.dataset_name, script_args.dataset_config, name, streaming=script_args.dataset_streaming
        )

    return split(script_args.dataset_train_split), split(script_args.dataset_test_split) if evaluate else None


def run(name: str, script_args, training_args, model_args, dataset_args) -> None:
    """TRL's script body on posttrain: model flags into model_init_kwargs, data, trainer, train, save."""
    from posttrain.cli.main import ALIASES, METHODS, ignore_bool_buffers

    name = ALIASES.get(name, name)
    trainer_class = METHODS[name].load()[0]
    init_kwargs = model_init_kwargs(model_args, training_args.trust_remote_code)
    init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = init_kwargs
    train_dataset, eval_dataset = _datasets(script_args, training_args, dataset_args)
    extra = {"reward_funcs": _reward_funcs(script_args)} if METHODS[name].kind == "online" else {}
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        **extra,
    )
    if script_args.ignore_bias_buffers:
        ignore_bool_buffers(trainer.model)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()


def command_line(name: str) -> int:
    """`python -m posttrain.scripts.<name> ...` is `posttrain <name> ...`."""
    from posttrain.cli.main import main

    return main([name, *sys.argv[1:]])
