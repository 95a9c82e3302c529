"""The default output_dir of a trainer given no config (training/run_artifacts.default_output_dir), as TRL names it:
the model's last path part, then the method."""

from posttrain.trainers.sft import _sft_args
from posttrain.training.run_artifacts import default_output_dir


def test_the_last_part_of_the_name_then_the_method():
    assert default_output_dir("Qwen/Qwen2-0.5B", "SFT") == "Qwen2-0.5B-SFT"
    assert default_output_dir("/models/tiny/", "AsyncGRPO") == "tiny-AsyncGRPO"
    assert default_output_dir("tiny", "AsyncDistillation") == "tiny-AsyncDistillation"


def test_sft_without_a_config_writes_there():
    assert _sft_args(None, "org/model/").output_dir == "model-SFT"
