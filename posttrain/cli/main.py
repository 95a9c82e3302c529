"""The `posttrain` command: `posttrain sft|dpo|kto|reward|grpo|rloo|ppo [--flag value ...]`, plus
`posttrain env`, `posttrain report OUTPUT_DIR`, `posttrain vllm-serve MODEL` and `posttrain --version`.

A training command takes the flags of TRL's `trl <method>` (the method's config, TRL's ModelConfig,
ScriptArguments and DatasetMixtureConfig fields, `--config run.yaml`) plus posttrain's own (eval_dataset_name,
eval_split_size, num_processes, ...). It builds its flags from the dataclasses (see `posttrain.cli.args`), loads the
data (`posttrain.cli.data`), trains in this process (or re-launches itself through `accelerate launch` for
several processes), then saves the model, the trainer state and the report, and prints a one-screen summary.
Mistakes in flags, YAML or data exit with status 2 and one message; anything else keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.cli.args import (
    CommandParser,
    FlagGroup,
    LaunchArguments,
    RewardArguments,
    build_parser,
    flag_groups,
    parse_flags,
    parse_settings,
    spec_parser,
)
from posttrain.cli.data import DataArguments, check_data_arguments, load_training_data
from posttrain.cli.environment import environment_report, model_fast_paths_report
from posttrain.cli.launch import LAUNCHED_ENV, relaunch
from posttrain.cli.model import LORA_FIELDS, ModelConfig, get_peft_config, get_quantization_config
from posttrain.cli.rewards import check_rewards, reward_arguments
from posttrain.cli.runtime import prepare_training_process
from posttrain.cli.spec import command_spec, is_deferred, load_spec, spec_hints, spec_names, store_spec
from posttrain.cli.summary import show_live_metrics, summary, write_run_report
from posttrain.errors import ConfigError, PosttrainError
from posttrain.version import __version__

USAGE_ERROR = 2
# Set in the processes that `accelerate launch` starts for us, so that they train instead of launching again.
# Logged values shown on the progress bar as they arrive.


@dataclass(frozen=True)
class Method:
    """A training method: where its trainer and config live (imported only when the command runs) and its kind.

    kind: "offline" learns from fixed data, "reward" trains a sequence classifier (LoRA task SEQ_CLS),
    "online" generates completions and scores them with reward functions (adds the reward flags).
    """

    module: str
    trainer: str
    config: str
    kind: str
    summary: str

    def load(self) -> tuple[type, type]:
        module = importlib.import_module(self.module)
        return getattr(module, self.trainer), getattr(module, self.config)


METHODS: dict[str, Method] = {
    "sft": Method("posttrain.trainers.sft", "SFTTrainer", "SFTConfig", "offline", "supervised fine-tuning"),
    "dpo": Method("posttrain.trainers.dpo", "DPOTrainer", "DPOConfig", "offline", "direct preference optimization"),
    "kto": Method(
        "posttrain.trainers.kto",
        "KTOTrainer",
        "KTOConfig",
        "offline",
        "preference tuning from thumbs-up/down labels (KTO)",
    ),
    "reward": Method(
        "posttrain.trainers.reward", "RewardTrainer", "RewardConfig", "reward", "reward model from preference pairs"
    ),
    "grpo": Method(
        "posttrain.trainers.grpo",
        "GRPOTrainer",
        "GRPOConfig",
        "online",
        "group relative policy optimization with reward functions",
    ),
    "rloo": Method(
        "posttrain.trainers.rloo",
        "RLOOTrainer",
        "RLOOConfig",
        "online",
        "REINFORCE leave-one-out with reward functions",
    ),
    "ppo": Method(
        "posttrain.trainers.ppo", "PPOTrainer", "PPOConfig", "online", "proximal policy optimization with a value model"
    ),
    "distill": Method(
        "posttrain.trainers.distillation",
        "DistillationTrainer",
        "DistillationConfig",
        "offline",
        "teacher -> student distillation (--teacher_model_name_or_path)",
    ),
}
ALIASES = {"distillation": "distill"}  # TRL's name for the command
TOOLS = {
    "env": "versions of posttrain, its dependencies and extras, and the accelerator",
    "report": "rebuild report.html and the plots of a run: posttrain report OUTPUT_DIR",
    "vllm-serve": "start the vLLM server of server-mode online training: posttrain vllm-serve MODEL",
}


def main(argv: list[str] | None = None) -> int:
    """The console script: returns the exit status (0 done, 2 usage error)."""
    console = argv is None  # this process is the command: it may set its threads and re-execute (not in a test)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ALIASES:
        argv[0] = ALIASES[argv[0]]
    command = argv[0] if argv and (argv[0] in METHODS or argv[0] in TOOLS) else None
    if console and command in METHODS and not {"-h", "--help"} & set(argv):
        prepare_training_process(argv)  # tcmalloc/jemalloc preloaded, OpenMP threads = physical cores
    prog = f"posttrain {command}" if command else "posttrain"
    try:
        if command in METHODS:
            return train_command(command, argv[1:])
        if command == "env":
            return env_command(argv[1:])
        if command == "report":
            return report_command(argv[1:])
        if command == "vllm-serve":
            from posttrain.cli.vllm_serve import main as vllm_serve_main

            return vllm_serve_main(argv[1:])
        return top_level(argv)
    except PosttrainError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return USAGE_ERROR


def top_level(argv: list[str]) -> int:
    if argv and argv[0] == "--version":
        print(f"posttrain {__version__}")
        return 0
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv:
        print(usage(), file=sys.stderr)
        return USAGE_ERROR
    known = list(METHODS) + list(TOOLS)
    close = difflib.get_close_matches(argv[0], known, n=1)
    suggestion = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(f"unknown command {argv[0]!r}.{suggestion} Commands: {', '.join(known)}, --version.")


def usage() -> str:
    lines = ["usage: posttrain COMMAND [--flag VALUE ...] [--config run.yaml]", "", "training commands:"]
    lines += [f"  {name:<8}  {method.summary}" for name, method in METHODS.items()]
    lines += ["", "other commands:"] + [f"  {name:<8}  {text}" for name, text in TOOLS.items()]
    lines += ["  --version", "", "`posttrain COMMAND --help` lists that command's flags."]
    return "\n".join(lines)


# -- training ----------------------------------------------------------------------------------------------------


def command_groups(method: Method, config_class: type) -> list[FlagGroup]:
    """The flags of a training command: the config's fields first (a name it defines is its own), then the
    model (TRL's ModelConfig), data (TRL's ScriptArguments and DatasetMixtureConfig), reward (online methods)
    and process flags: the flags of TRL's `trl <method>`."""
    classes = [(f"training ({config_class.__name__})", config_class), ("model", ModelConfig), ("data", DataArguments)]
    if method.kind == "online":
        classes.append(("rewards", RewardArguments))
    return flag_groups(*classes, ("processes", LaunchArguments))


# The command's own dataclasses, which need no torch: their values are checked before the trainer is imported.
CLI_CLASSES = (ModelConfig, DataArguments, RewardArguments, LaunchArguments)


def help_order(groups: list[FlagGroup]) -> list[FlagGroup]:
    """--help shows the model and data flags first (every run needs them), then the rewards, the method's own
    config and the process flags."""
    rank = {ModelConfig: 0, DataArguments: 1, RewardArguments: 2, LaunchArguments: 4}
    return sorted(groups, key=lambda group: rank.get(group.cls, 3))


def check_flags_early(name: str, argv: list[str]) -> dict[str, Any] | None:
    """With the command's flag spec cached (`posttrain.cli.spec`), answers --help and rejects unknown flags,
    badly typed values and contradictory model/data/launch settings before torch is imported. Returns the spec
    (None when there is none yet)."""
    spec = load_spec(name)
    if spec is None:
        return None
    hints = spec_hints(spec)
    parser = spec_parser(spec["prog"], spec["description"], spec["groups"])
    settings = parse_flags(parser, hints, argv, skip=frozenset(key for key, hint in hints.items() if is_deferred(hint)))
    values = {cls: {key: settings[key] for key in spec_names(spec, cls) if key in settings} for cls in CLI_CLASSES}
    check_settings(METHODS[name], values, settings)
    return spec


def check_settings(method: Method, values: dict[type, dict[str, Any]], settings: dict[str, Any]) -> None:
    """The mistakes in the model, data, reward and launch flags that need no model, data or torch to see."""
    launch = LaunchArguments(**values.get(LaunchArguments, {}))
    if launch.num_processes < 1 and not (os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ):
        raise ConfigError(f"--num_processes {launch.num_processes}: use 1 or more.")
    model_args = ModelConfig(**values.get(ModelConfig, {}))
    check_model_path(model_args)
    check_lora_flags(model_args, settings)
    if method.kind == "online":
        check_rewards(RewardArguments(**values.get(RewardArguments, {})))
    check_data_arguments(DataArguments(**values.get(DataArguments, {})))


def train_command(name: str, argv: list[str]) -> int:
    started = time.perf_counter()
    method = METHODS[name]
    spec = check_flags_early(name, argv)
    trainer_class, config_class = method.load()
    groups = command_groups(method, config_class)
    prog, description = f"posttrain {name}", f"{method.summary}; every {config_class.__name__} field is a flag."
    if spec is None:
        store_spec(name, command_spec(prog, description, help_order(groups)))
    parser = build_parser(prog, description, help_order(groups))
    settings = parse_settings(parser, groups, argv)
    values = {group.cls: group.split(settings) for group in groups}
    check_settings(method, values, settings)

    launch = LaunchArguments(**values[LaunchArguments])
    if not (os.environ.get(LAUNCHED_ENV) or "LOCAL_RANK" in os.environ):
        if launch.num_processes > 1 or launch.accelerate_config:
            return relaunch(name, argv, launch, settings)

    model_args = ModelConfig(**values[ModelConfig])
    config = build_config(name, config_class, values[config_class], model_args, given=set(settings))
    peft_config = lora_config(model_args, method.kind, settings)
    quantization_config = get_quantization_config(model_args)
    extra = reward_arguments(RewardArguments(**values[RewardArguments])) if method.kind == "online" else {}
    if quantization_config is not None:
        extra["quantization_config"] = quantization_config
    data_args = DataArguments(**values[DataArguments])
    with config.main_process_first(desc="loading the dataset"):
        train_dataset, eval_dataset = load_training_data(
            data_args, seed=config.seed, evaluate=config.eval_strategy != "no"
        )

    _configure_logging()
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        args=config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        **extra,
    )
    if data_args.ignore_bias_buffers:
        ignore_bool_buffers(trainer.model)
    show_live_metrics(trainer)
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    if eval_dataset is not None and config.eval_strategy == "no":
        trainer.evaluate()
    trainer.save_model(config.output_dir)
    trainer.save_state()
    if trainer.is_world_process_zero():
        report = write_run_report(config.output_dir, trainer.state.log_history)
        print(summary(name, trainer, report, time.perf_counter() - started))
    return 0


def _configure_logging() -> None:
    """posttrain's own notices (e.g. the built-in model's one-time conversion) at INFO on stderr."""
    logger = logging.getLogger("posttrain")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[posttrain] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def ignore_bool_buffers(model) -> None:
    """TRL's `ignore_bias_buffers`: DDP leaves boolean buffers (causal masks) out of its buffer broadcast."""
    import torch

    model._ddp_params_and_buffers_to_ignore = [
        name for name, buffer in model.named_buffers() if buffer.dtype == torch.bool
    ]


def build_config(
    name: str, config_class: type, values: dict[str, Any], model_args: ModelConfig, given: set[str] | None = None
):
    """The method's config from the given settings; the model flags (`--dtype`, `--attn_implementation`,
    `--model_revision`) go to model_init_kwargs, under the config's own model_init_kwargs (as in TRL's scripts),
    and a flag given explicitly that contradicts them is an error."""
    check_model_path(model_args)
    values = dict(values)
    values.setdefault("output_dir", f"outputs/{name}")
    given = set(values) | {"dtype", "attn_implementation"} if given is None else given
    init_kwargs = dict(values.get("model_init_kwargs") or {})
    flags = {"dtype": "dtype", "attn_implementation": "attn_implementation", "revision": "model_revision"}
    for key, flag in flags.items():
        flag_value = getattr(model_args, flag)
        if flag_value is None or (key == "revision" and flag_value == "main"):  # main: from_pretrained's default
            continue
        if key in init_kwargs and init_kwargs[key] != flag_value:
            if flag in given:
                raise ConfigError(
                    f"--{flag} {flag_value} conflicts with model_init_kwargs {{'{key}': "
                    f"{init_kwargs[key]!r}}}; set it in one place."
                )
            continue
        init_kwargs[key] = flag_value
    values["model_init_kwargs"] = init_kwargs or None
    try:
        return config_class(**values)
    except PosttrainError:
        raise
    except ValueError as err:  # TrainingArguments' own checks of incompatible settings, some over several lines
        raise ConfigError(f"{config_class.__name__}: {' '.join(str(err).split())}") from None


def check_model_path(model_args: ModelConfig) -> None:
    if not model_args.model_name_or_path:
        raise ConfigError(
            "--model_name_or_path is required (a hub id, a local directory, or "
            "builtin:SmolLM2-135M-Instruct), as a flag or as model_name_or_path: in the YAML config."
        )
    path = Path(model_args.model_name_or_path).expanduser()
    if model_args.model_name_or_path.startswith(("/", "./", "../", "~")) and not path.exists():
        raise ConfigError(f"--model_name_or_path {model_args.model_name_or_path}: no such directory.")


def check_lora_flags(model_args: ModelConfig, settings: dict[str, Any]) -> None:
    """LoRA flags without --use_peft are a mistake, not silently ignored."""
    lora_flags = sorted(name for name in settings if name in LORA_FIELDS)
    if not model_args.use_peft and lora_flags:
        raise ConfigError(
            f"--{lora_flags[0]} has no effect without --use_peft; add --use_peft true or drop the LoRA settings."
        )


def lora_config(model_args: ModelConfig, kind: str, settings: dict[str, Any]):
    """A peft LoraConfig when --use_peft is on (TRL's get_peft_config); LoRA flags without it are a mistake.
    A reward model's adapter is a sequence classifier's unless --lora_task_type says otherwise."""
    check_lora_flags(model_args, settings)
    if not model_args.use_peft:
        return None
    if kind == "reward" and "lora_task_type" not in settings:
        model_args = dataclasses.replace(model_args, lora_task_type="SEQ_CLS")
    return get_peft_config(model_args)


# -- env and report ----------------------------------------------------------------------------------------------


def env_command(argv: list[str]) -> int:
    parser = CommandParser(prog="posttrain env", description=TOOLS["env"])
    parser.add_argument("--model", default=None, help="Also show which fast paths this model (name or path) gets.")
    parser.add_argument("--estimate", default=None, metavar="CONFIG", help="Predict the step and run time of CONFIG.")
    parser.add_argument("--trainer", default=None, help="--estimate's trainer (default: the file name's start).")
    args = parser.parse_args(argv)
    if args.estimate is not None:
        from posttrain.cli.estimate import estimate_report

        print(estimate_report(args.estimate, args.trainer))
        return 0
    print(environment_report())
    if args.model is not None:
        print(model_fast_paths_report(args.model))
    return 0


def report_command(argv: list[str]) -> int:
    from posttrain.training.report import write_report

    parser = CommandParser(prog="posttrain report", description=TOOLS["report"])
    parser.add_argument("output_dir", help="A training run's output_dir (with trainer_state.json or checkpoints).")
    parser.add_argument("--title", default=None, help="Title of the report page.")
    args = parser.parse_args(argv)
    print(write_report(args.output_dir, title=args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
