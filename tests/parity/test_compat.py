"""TRL's script layer from posttrain: TrlParser (YAML, env, flag precedence, mistakes), ModelConfig,
get_peft_config, get_quantization_config, get_dataset; side by side with TRL's own where it is installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field

import pytest
import yaml

import posttrain
from posttrain import (
    DatasetMixtureConfig,
    ModelConfig,
    ScriptArguments,
    SFTConfig,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)
from posttrain.compat import DatasetConfig
from posttrain.errors import ConfigError

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (side-by-side check)")


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sft_parser():
    return TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))


# -- TrlParser ----------------------------------------------------------------------------------------------------


def test_yaml_fills_every_dataclass_and_flags_override_it(tmp_path, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_COMPAT_VAR", raising=False)
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "env": {"POSTTRAIN_COMPAT_VAR": 7},
                "dataset_name": "some/data",
                "learning_rate": "1e-5",
                "max_steps": 5,
                "use_peft": True,
                "lora_r": 4,
                "lora_target_modules": ["q_proj", "v_proj"],
                "output_dir": str(tmp_path / "out"),
                "report_to": "none",
                "datasets": [{"path": "json", "data_files": "a.jsonl", "columns": ["prompt"]}],
                "test_split_size": 0.25,
            }
        )
    )
    script, training, model, mixture = _sft_parser().parse_args_and_config(
        ["--config", str(config), "--max_steps", "7", "--lora_r", "8", "--dataset_train_split", "train[:10]"]
    )
    assert os.environ["POSTTRAIN_COMPAT_VAR"] == "7"
    assert (script.dataset_name, script.dataset_train_split, script.dataset_test_split) == (
        "some/data",
        "train[:10]",
        "test",
    )
    assert (training.learning_rate, training.max_steps) == (1e-5, 7)  # YAML's string 1e-5 is a float
    assert (model.use_peft, model.lora_r, model.lora_target_modules) == (True, 8, ["q_proj", "v_proj"])
    assert mixture.datasets == [DatasetConfig(path="json", data_files="a.jsonl", columns=["prompt"])]
    assert mixture.test_split_size == 0.25


def test_unknown_keys_and_flags_are_errors_naming_them(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lerning_rate: 1.0e-5\n")
    parser = _sft_parser()
    with pytest.raises(ConfigError, match="unknown setting lerning_rate. Did you mean learning_rate?"):
        parser.parse_args_and_config(["--config", str(config)])
    # TRL's scripts pass fail_with_unknown_args=False; posttrain still refuses a key it would have to ignore.
    with pytest.raises(ConfigError, match=f"{config}: unknown setting lerning_rate"):
        _sft_parser().parse_args_and_config(["--config", str(config)], fail_with_unknown_args=False)
    with pytest.raises(ConfigError, match="unknown setting --max_stepz. Did you mean --max_steps?"):
        _sft_parser().parse_args_and_config(["--max_stepz", "3"])
    with pytest.raises(ConfigError, match="--max_steps: got 'many', expected an integer"):
        _sft_parser().parse_args_and_config(["--max_steps", "many"])


def test_launcher_keys_are_left_to_the_launcher_or_returned(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num_processes: 2\nmixed_precision: 'no'\nmax_steps: 3\n")
    _, training, _, _ = _sft_parser().parse_args_and_config(["--config", str(config)], fail_with_unknown_args=False)
    assert training.max_steps == 3
    with pytest.raises(ConfigError, match="num_processes"):
        _sft_parser().parse_args_and_config(["--config", str(config)])
    *outputs, from_config, from_flags = _sft_parser().parse_args_and_config(
        ["--config", str(config), "--gpu_ids", "0"], return_remaining_strings=True, separate_remaining_strings=True
    )
    assert from_config == ["--num_processes", "2", "--mixed_precision", "no"]
    assert from_flags == ["--gpu_ids", "0"] and outputs[1].max_steps == 3


@dataclass
class _First:
    shared: int = 1
    needed: str = field(default=None, metadata={"help": "x"})


@dataclass
class _Second:
    required: float = field(metadata={"help": "no default"})
    shared: int = 2


def test_shared_fields_required_fields_and_the_reserved_config_name(tmp_path):
    first, second = TrlParser([_First, _Second]).parse_args_into_dataclasses(["--shared", "5", "--required", "0.5"])
    assert (first.shared, second.shared, second.required) == (5, 5, 0.5)
    with pytest.raises(ConfigError, match="--required is required"):
        TrlParser([_First, _Second]).parse_args_into_dataclasses([])
    assert TrlParser([_First, _Second]).parse_dict({"required": "2", "needed": "x"})[1].required == 2.0
    with pytest.raises(ConfigError, match="unknown setting requird"):
        TrlParser([_First, _Second]).parse_dict({"requird": 1})

    @dataclass
    class _WithConfig:
        config: str = "x"

    with pytest.raises(ConfigError, match="reserved"):
        TrlParser(_WithConfig)


@needs_trl
def test_parser_matches_trls_on_the_same_yaml_and_flags(tmp_path):
    import trl

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dataset_name": "d",
                "dataset_config": "c",
                "model_name_or_path": "m",
                "dtype": "bfloat16",
                "use_peft": True,
                "lora_alpha": 8,
                "lora_target_modules": ["all-linear"],
                "load_in_4bit": True,
                "use_dora": True,
                "datasets": [
                    {"path": "json", "data_files": ["a.jsonl", "b.jsonl"], "split": "train[:5]", "fraction": 0.5}
                ],
                "streaming": False,
                "test_split_size": 0.1,
            }
        )
    )
    argv = [
        "--config",
        str(config),
        "--lora_r",
        "4",
        "--dataset_streaming",
        "--lora_modules_to_save",
        "lm_head",
        "score",
        "--bnb_4bit_quant_type",
        "fp4",
    ]
    ours = TrlParser((ScriptArguments, ModelConfig, DatasetMixtureConfig)).parse_args_and_config(list(argv))
    theirs = trl.TrlParser((trl.ScriptArguments, trl.ModelConfig, trl.DatasetMixtureConfig)).parse_args_and_config(
        list(argv)
    )
    for mine, trls in zip(ours, theirs):
        assert dataclasses.asdict(mine) == dataclasses.asdict(trls), type(mine).__name__


# -- ModelConfig, get_peft_config, get_quantization_config ----------------------------------------------------------


def test_model_config_defaults_are_trls():
    expected = {
        "model_name_or_path": None,
        "model_revision": "main",
        "dtype": "float32",
        "attn_implementation": None,
        "use_peft": False,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "lora_target_modules": None,
        "lora_target_parameters": None,
        "lora_modules_to_save": None,
        "lora_task_type": "CAUSAL_LM",
        "use_rslora": False,
        "use_dora": False,
        "load_in_8bit": False,
        "load_in_4bit": False,
        "bnb_4bit_quant_type": "nf4",
        "use_bnb_nested_quant": False,
        "bnb_4bit_quant_storage": None,
    }
    assert dataclasses.asdict(ModelConfig()) == expected
    if HAS_TRL:
        import trl

        assert dataclasses.asdict(trl.ModelConfig()) == expected
    with pytest.raises(ConfigError, match="load_in_8bit and load_in_4bit"):
        ModelConfig(load_in_8bit=True, load_in_4bit=True)


def test_peft_config_carries_the_lora_fields():
    args = ModelConfig(
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        lora_target_modules=["q_proj", "k_proj"],
        lora_modules_to_save=["lm_head"],
        lora_task_type="SEQ_CLS",
        use_rslora=True,
        use_dora=True,
        lora_target_parameters=["mlp.experts.down_proj"],
    )
    config = get_peft_config(args)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
    assert set(config.target_modules) == {"q_proj", "k_proj"} and config.modules_to_save == ["lm_head"]
    assert (config.task_type, config.use_rslora, config.use_dora, config.bias) == ("SEQ_CLS", True, True, "none")
    assert list(config.target_parameters) == ["mlp.experts.down_proj"]
    all_linear = get_peft_config(ModelConfig(use_peft=True, lora_target_modules=["all-linear"]))
    assert all_linear.target_modules == "all-linear"
    assert get_peft_config(ModelConfig()) is None
    with pytest.raises(ConfigError, match="lora_r=8 has no effect without use_peft"):
        get_peft_config(ModelConfig(lora_r=8))


@needs_trl
def test_peft_config_equals_trls():
    import trl

    fields = dict(
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        lora_target_modules=["q_proj", "v_proj"],
        lora_modules_to_save=["lm_head"],
        use_rslora=True,
    )
    assert get_peft_config(ModelConfig(**fields)).to_dict() == trl.get_peft_config(trl.ModelConfig(**fields)).to_dict()


def test_quantization_without_bitsandbytes_stops_naming_the_flag(monkeypatch):
    assert get_quantization_config(ModelConfig()) is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name))
    with pytest.raises(ConfigError, match="--load_in_4bit quantizes the model with bitsandbytes"):
        get_quantization_config(ModelConfig(load_in_4bit=True, use_peft=True))
    with pytest.raises(ConfigError, match="--load_in_8bit"):
        get_quantization_config(ModelConfig(load_in_8bit=True))
    with pytest.raises(ConfigError, match="bnb_4bit_quant_type='fp4' only applies with load_in_4bit"):
        get_quantization_config(ModelConfig(bnb_4bit_quant_type="fp4"))


# -- get_dataset -----------------------------------------------------------------------------------------------------


@pytest.fixture()
def two_files(tmp_path):
    first = [{"prompt": f"p{i}", "completion": f"c{i}", "extra": i} for i in range(8)]
    second = [{"prompt": f"q{i}", "completion": f"d{i}"} for i in range(5)]
    return (
        first,
        _write_jsonl(tmp_path / "first" / "train.jsonl", first),
        second,
        _write_jsonl(tmp_path / "second.jsonl", second),
    )


def test_mixture_of_two_local_files_with_columns_fractions_and_a_test_split(two_files):
    first, first_path, second, second_path = two_files
    mixture = DatasetMixtureConfig(
        datasets=[
            {"path": str(first_path.parent), "columns": ["prompt", "completion"]},  # a directory: its train.jsonl
            {"path": "json", "data_files": str(second_path), "split": "train[1:]"},  # a builder with data files
        ]
    )
    rows = get_dataset(mixture)["train"].to_list()
    assert rows == [{"prompt": r["prompt"], "completion": r["completion"]} for r in first] + second[1:]

    # Shares 3:1 of (8, 4) rows: N = min(8 / 0.75, 4 / 0.25) = 10.67 -> the first 8 and the first 3 rows.
    for entry, fraction in zip(mixture.datasets, (3, 1)):
        entry.fraction = fraction
    total = min(8 / 0.75, 4 / 0.25)
    rows = get_dataset(mixture)["train"].to_list()
    assert [round(0.75 * total), round(0.25 * total)] == [8, 3]
    assert [row["prompt"] for row in rows] == [r["prompt"] for r in first] + [r["prompt"] for r in second[1:4]]

    mixture.test_split_size = 0.25
    splits = get_dataset(mixture, seed=0)
    assert (len(splits["train"]), len(splits["test"])) == (8, 3)
    together = sorted(list(splits["train"]["prompt"]) + list(splits["test"]["prompt"]))
    assert together == sorted(row["prompt"] for row in rows)
    assert list(get_dataset(mixture, seed=0)["test"]["prompt"]) == list(splits["test"]["prompt"])


def test_mixture_mistakes_are_named(two_files):
    _, first_path, _, second_path = two_files
    with pytest.raises(ConfigError, match="datasets\\[1\\]: unknown setting colums"):
        DatasetMixtureConfig(datasets=[{"path": "a"}, {"path": "b", "colums": ["x"]}])
    half = DatasetMixtureConfig(datasets=[{"path": str(first_path), "fraction": 0.5}, {"path": str(second_path)}])
    with pytest.raises(ConfigError, match="`fraction` is set for some datasets and not others"):
        get_dataset(half)
    with pytest.raises(Exception, match="no column\\(s\\) \\['answer'\\]"):
        get_dataset(DatasetMixtureConfig(datasets=[{"path": str(second_path), "columns": ["answer"]}]))
    with pytest.raises(Exception, match="different columns"):
        get_dataset(DatasetMixtureConfig(datasets=[{"path": str(first_path)}, {"path": str(second_path)}]))


@needs_trl
def test_get_dataset_equals_trls_on_local_files(two_files):
    import trl
    from trl.scripts.utils import DatasetConfig as TrlDatasetConfig

    _, first_path, _, second_path = two_files
    entries = [
        dict(path="json", data_files=str(first_path), columns=["prompt", "completion"], fraction=2.0),
        dict(path="json", data_files=str(second_path), split="train[:4]", fraction=1.0),
    ]
    ours = get_dataset(DatasetMixtureConfig(datasets=[DatasetConfig(**entry) for entry in entries]))
    theirs = trl.get_dataset(trl.DatasetMixtureConfig(datasets=[TrlDatasetConfig(**entry) for entry in entries]))
    assert list(ours) == list(theirs) == ["train"]
    assert ours["train"].to_list() == theirs["train"].to_list()


# -- TRL import paths and scripts --------------------------------------------------------------------------------------


def test_trl_import_paths_exist():
    import posttrain.scripts.utils as script_utils
    import posttrain.trainer as trainer_module
    from posttrain.scripts import grpo, rloo, sft

    assert trainer_module.SFTTrainer is posttrain.SFTTrainer
    assert script_utils.TrlParser is TrlParser and script_utils.get_dataset is get_dataset
    assert {f.name for f in dataclasses.fields(grpo.GRPOScriptArguments)} >= {
        "reward_funcs",
        "reward_model_name_or_path",
    }
    assert issubclass(rloo.RLOOScriptArguments, ScriptArguments)
    parser = sft.make_parser(prog="sft")
    assert [cls.__name__ for cls in parser.dataclass_types] == [
        "ScriptArguments",
        "SFTConfig",
        "ModelConfig",
        "DatasetMixtureConfig",
    ]


def test_posttrain_scripts_main_trains_like_trls_script(tmp_path, tiny_model_path):
    from posttrain.scripts import sft

    rows = [{"prompt": f"{i} plus one is", "completion": f" {i + 1}"} for i in range(8)]
    _write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    _write_jsonl(tmp_path / "data" / "test.jsonl", rows[:4])
    args = sft.make_parser().parse_args_and_config(
        [
            "--model_name_or_path",
            tiny_model_path,
            "--dataset_name",
            str(tmp_path / "data"),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--output_dir",
            str(tmp_path / "out"),
            "--use_peft",
            "--lora_r",
            "4",
            "--lora_target_modules",
            "all-linear",
        ]
    )
    sft.main(*args)
    assert args[1].model_init_kwargs == {
        "revision": "main",
        "trust_remote_code": False,
        "attn_implementation": None,
        "dtype": "float32",
    }
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    # all-linear is expanded to the model's linear layers when the adapter is built.
    assert adapter["r"] == 4
    assert {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]} >= {"q_proj", "down_proj"}


def test_a_mixture_entry_without_path_is_a_config_error():
    # posttrain's earlier `datasets:` entries named a hub dataset with `name`; in TRL's format that is the config.
    with pytest.raises(ConfigError, match="datasets\\[0\\]: path is required"):
        DatasetMixtureConfig(datasets=[{"name": "org/data"}])


def test_python_m_posttrain_scripts_is_the_posttrain_command(monkeypatch, capsys):
    from posttrain.cli import trl_scripts as _run

    monkeypatch.setattr("sys.argv", ["posttrain/scripts/dpo.py", "--lerning_rate", "1e-5"])
    assert _run.command_line("dpo") == 2
    message = capsys.readouterr().err
    assert "posttrain dpo: error: unknown setting --lerning_rate. Did you mean --learning_rate?" in message


def test_hyphenated_and_no_flags_as_trls_parser_takes_them():
    _, training, model, _ = _sft_parser().parse_args_and_config(
        ["--learning-rate", "0.5", "--use-peft", "--no_log_on_each_node"]
    )
    assert (training.learning_rate, model.use_peft, training.log_on_each_node) == (0.5, True, False)
    assert _sft_parser().parse_args_and_config(["--no-log-on-each-node"])[1].log_on_each_node is False
