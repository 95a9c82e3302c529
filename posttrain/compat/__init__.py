"""TRL-facing names for scripts written against TRL: the parser, the script/model/dataset-mixture dataclasses
and their helpers. Glue only: each name is posttrain's own implementation in `posttrain.cli`, exported here
and at the top level (`from posttrain import TrlParser, ModelConfig, ...`)."""

from posttrain.cli.data import DatasetConfig, DatasetMixtureConfig, ScriptArguments, get_dataset
from posttrain.cli.model import ModelConfig, get_peft_config, get_quantization_config
from posttrain.cli.parser import TrlParser, init_zero_verbose

__all__ = [
    "DatasetConfig",
    "DatasetMixtureConfig",
    "ModelConfig",
    "ScriptArguments",
    "TrlParser",
    "get_dataset",
    "get_peft_config",
    "get_quantization_config",
    "init_zero_verbose",
]
