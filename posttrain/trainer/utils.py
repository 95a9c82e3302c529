"""TRL's `trl.trainer.utils` import path: the helpers TRL's trainers share, each living in posttrain's core
(batches and samplers in `data/`, log-probs and reductions in `losses/`, adapters and fingerprints in `models/`,
MFU, the model card and the sample table in `training/`)."""

from posttrain.cli.model import get_peft_config, get_quantization_config
from posttrain.data.batches import (
    flush_left,
    identity,
    pad,
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)
from posttrain.data.row_cleaning import remove_none_values, strip_images_from_messages
from posttrain.data.samplers import RepeatSampler, repeat_iterable_dataset
from posttrain.losses.logprob_entropy import selective_log_softmax_and_entropy
from posttrain.losses.logprobs import gather_log_softmax as selective_log_softmax
from posttrain.losses.policy import entropy_from_logits
from posttrain.losses.reductions import nanmax, nanmin, nanstd
from posttrain.models.from_path import create_model_from_path, get_config_model_id
from posttrain.models.fused_lm_head import FusedCausalLMOutput, add_fused_lm_head
from posttrain.models.utils import hash_module, use_adapter
from posttrain.rewards.scoring import get_callable_name
from posttrain.runtime.distributed_backend import gather_partitioned as maybe_gather_lm_head_ctx
from posttrain.runtime.event_loop import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon
from posttrain.runtime.process_env import ensure_master_addr_port, global_then_local_main_first
from posttrain.training.model_card import generate_model_card
from posttrain.training.model_setup import disable_dropout_in_model
from posttrain.training.sample_table import print_prompt_completions_sample
from posttrain.training.throughput import (
    adjusted_mfu,
    compute_flops_per_token,
    compute_mfu,
    get_peak_flops,
    get_peak_flops_per_device,
)
from posttrain.training.trackers import get_comet_experiment_url, get_trackio_space_url, log_table_to_comet_experiment

__all__ = [
    "FusedCausalLMOutput",
    "add_fused_lm_head",
    "create_model_from_path",
    "ensure_master_addr_port",
    "get_comet_experiment_url",
    "get_config_model_id",
    "get_trackio_space_url",
    "global_then_local_main_first",
    "is_async_callable",
    "log_table_to_comet_experiment",
    "maybe_gather_lm_head_ctx",
    "remove_none_values",
    "selective_log_softmax_and_entropy",
    "shutdown_event_loop_in_daemon",
    "start_event_loop_in_daemon",
    "strip_images_from_messages",
    "RepeatSampler",
    "adjusted_mfu",
    "compute_flops_per_token",
    "compute_mfu",
    "disable_dropout_in_model",
    "entropy_from_logits",
    "flush_left",
    "generate_model_card",
    "get_callable_name",
    "get_peak_flops",
    "get_peak_flops_per_device",
    "get_peft_config",
    "get_quantization_config",
    "hash_module",
    "identity",
    "nanmax",
    "nanmin",
    "nanstd",
    "pad",
    "print_prompt_completions_sample",
    "repeat_iterable_dataset",
    "selective_log_softmax",
    "shuffle_sequence_dict",
    "split_pixel_values_by_grid",
    "split_tensor_dict",
    "unsplit_pixel_values_by_grid",
    "use_adapter",
]
