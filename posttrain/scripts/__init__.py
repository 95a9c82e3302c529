"""TRL's training scripts (`trl/scripts/<method>.py`) on posttrain: `python -m posttrain.scripts.sft --config
run.yaml` (likewise dpo, kto, reward, grpo, rloo) runs `posttrain sft`, which takes the flags and YAML keys of
`trl sft`. Each module also has TRL's `make_parser()` and `main(script_args, training_args, model_args,
dataset_args)`. The parser names are here as in `trl.scripts`."""

from posttrain.scripts.utils import DatasetMixtureConfig, ScriptArguments, TrlParser, get_dataset, init_zero_verbose

__all__ = ["DatasetMixtureConfig", "ScriptArguments", "TrlParser", "get_dataset", "init_zero_verbose"]
