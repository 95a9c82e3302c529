"""TRL's `trl.experimental.sdft.loss_utils` path: the self-distillation losses (posttrain.losses.self_distillation)
under TRL's names."""

from posttrain.losses.self_distillation import full_logit_self_distillation as compute_full_logit_self_distillation_loss
from posttrain.losses.self_distillation import importance_sampling_clipped as apply_importance_sampling_clipping
from posttrain.losses.self_distillation import logps_divergence as compute_divergence
from posttrain.losses.self_distillation import (
    sampled_token_self_distillation as compute_sampled_token_self_distillation_loss,
)
from posttrain.losses.self_distillation import topk_self_distillation as compute_topk_self_distillation_loss
from posttrain.losses.self_distillation import with_tail_bucket as add_tail_bucket

__all__ = [
    "add_tail_bucket",
    "compute_divergence",
    "apply_importance_sampling_clipping",
    "compute_full_logit_self_distillation_loss",
    "compute_sampled_token_self_distillation_loss",
    "compute_topk_self_distillation_loss",
]
