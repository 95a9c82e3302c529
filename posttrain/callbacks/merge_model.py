"""Merging the trained policy with another checkpoint (its base / reference by default): model soups and
SLERP-merged checkpoints, TRL's `MergeModelCallback` with TRL's names.

TRL hands the merge to mergekit. posttrain merges in-process with its own linear and SLERP merges (pure functions
below, the two methods TRL's `MergeConfig` parameterises most simply), so mergekit is not needed; TIES and DARE-TIES
are refused with a clear error rather than approximated.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
from transformers import TrainerCallback

from posttrain.errors import ConfigError
from posttrain.models.reference import is_peft_model, unwrap

logger = logging.getLogger("posttrain")

MERGE_METHODS = ("linear", "slerp")
_REFUSED = ("ties", "dare_ties")


def linear_merge(
    policy: torch.Tensor,
    target: torch.Tensor,
    policy_weight: float = 0.5,
    target_weight: float = 0.5,
    normalize: bool = True,
) -> torch.Tensor:
    """Weighted average w_p * policy + w_t * target, divided by (w_p + w_t) when `normalize` (as mergekit's linear
    merge does by default). Computed in float32 at least; returned in `policy`'s dtype."""
    dtype = torch.promote_types(policy.dtype, torch.float32)
    out = policy_weight * policy.to(dtype) + target_weight * target.to(dtype)
    if normalize:
        total = policy_weight + target_weight
        if total == 0:
            raise ConfigError(
                "linear merge: policy_model_weight + target_model_weight is 0; the weights must not "
                "cancel out (or set normalize=False)."
            )
        out = out / total
    return out.to(policy.dtype)


def slerp(
    t: float, v0: torch.Tensor, v1: torch.Tensor, dot_threshold: float = 0.9995, eps: float = 1e-8
) -> torch.Tensor:
    """Spherical linear interpolation (Shoemake 1985) from `v0` (t=0) to `v1` (t=1), each tensor taken as one
    vector: with Ω the angle between their directions, (sin((1-t)Ω) v0 + sin(tΩ) v1) / sin Ω. When the directions
    are almost parallel (|cos Ω| > `dot_threshold`) sin Ω vanishes and this falls back to the linear
    (1-t) v0 + t v1. Computed in float32 at least; returned in `v0`'s dtype."""
    dtype = torch.promote_types(v0.dtype, torch.float32)
    a, b = v0.to(dtype), v1.to(dtype)
    dot = ((a / (a.norm() + eps)) * (b / (b.norm() + eps))).sum().clamp(-1.0, 1.0)
    if dot.abs() > dot_threshold:
        out = (1 - t) * a + t * b
    else:
        omega = torch.arccos(dot)
        out = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)
    return out.to(v0.dtype)


class MergeConfig:
    """What to merge and how, with TRL's attribute names and per-method defaults.

    `method`: ``"linear"`` (policy_model_weight * policy + target_model_weight * target, normalised by their sum;
    defaults 0.5 / 0.5) or ``"slerp"`` (`t_values`: 0 keeps the policy, 1 gives the target; default 0.5).
    `target_model_path`: the checkpoint to merge with (None: the model the policy was loaded from,
    ``config._name_or_path``). `dtype`: the merged model's saved dtype (default ``"float16"``, as in TRL).
    ``"ties"`` and ``"dare_ties"`` need mergekit's implementations, which posttrain does not include.
    """

    def __init__(self, method: str = "linear"):
        if method in _REFUSED:
            raise ConfigError(
                f"MergeConfig(method={method!r}): posttrain merges in-process and implements only "
                f"{MERGE_METHODS}; TIES and DARE-TIES are not built in (TRL runs them through mergekit). "
                "Use method='linear' or 'slerp', or merge the saved checkpoint with mergekit yourself."
            )
        if method not in MERGE_METHODS:
            raise ConfigError(f"Unsupported merge method {method!r}; use one of {MERGE_METHODS}.")
        self.method = method
        self.policy_model_path: str | None = None
        self.target_model_path: str | None = None
        self.dtype = "float16"
        if method == "linear":
            self.policy_model_weight, self.target_model_weight = 0.5, 0.5
        else:
            self.t_values = 0.5

    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, str(self.dtype), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(
                f"MergeConfig.dtype={self.dtype!r} is not a torch dtype; use e.g. 'float16', 'bfloat16' or 'float32'."
            )
        return dtype

    def merge_tensors(self, policy: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One parameter merged by this config's method (non-float tensors keep the policy's value)."""
        if not policy.is_floating_point():
            return policy
        if policy.shape != target.shape:
            raise ConfigError(
                f"Cannot merge tensors of shapes {tuple(policy.shape)} and {tuple(target.shape)}; "
                "the target model must have the policy's architecture."
            )
        if self.method == "linear":
            return linear_merge(policy, target, self.policy_model_weight, self.target_model_weight)
        return slerp(self.t_values, policy, target)


def merge_state_dicts(config: MergeConfig, policy: dict, target: dict) -> dict:
    """Every policy tensor merged with the target's tensor of the same name."""
    missing = sorted(set(policy) - set(target))
    if missing:
        raise ConfigError(
            f"The merge target lacks {len(missing)} of the policy's tensors (e.g. {missing[:3]}); it "
            "must be a checkpoint of the same architecture. Set MergeConfig.target_model_path."
        )
    return {name: config.merge_tensors(tensor, target[name]) for name, tensor in policy.items()}


def _full_weights_model(model):
    """A CPU copy of the policy with any PEFT adapter folded into its weights."""
    model = unwrap(model)
    if is_peft_model(model):
        return copy.deepcopy(model).cpu().merge_and_unload()
    return copy.deepcopy(model).cpu()


def merge_model_weights(config: MergeConfig, model, out_path: str, processing_class=None) -> str:
    """Merges the in-memory policy `model` with `config.target_model_path` and saves the result (and the tokenizer)
    to `out_path`, in `config.dtype`."""
    from posttrain.models.loading import load_causal_lm

    if config.target_model_path is None:
        raise ConfigError(
            "MergeConfig.target_model_path is not set and the policy's config has no _name_or_path to "
            "merge with; set it to the checkpoint to merge the policy with."
        )
    merged = _full_weights_model(model)
    target = load_causal_lm(config.target_model_path).state_dict()
    with torch.no_grad():
        merged.load_state_dict(merge_state_dicts(config, merged.state_dict(), target))
    merged.to(config.torch_dtype()).save_pretrained(out_path)
    if processing_class is not None:
        processing_class.save_pretrained(out_path)
    return out_path


def upload_model_to_hf(folder_path: str, repo_id: str) -> None:
    """Creates the Hub model repository `repo_id` and uploads `folder_path` to it (needs the network and a token)."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=folder_path, repo_id=repo.repo_id, repo_type="model")


class MergeModelCallback(TrainerCallback):
    """Merges the policy with `merge_config.target_model_path` (default: the checkpoint the policy was loaded
    from) into ``<output_dir>/checkpoint-<step>/merged``: at every save with `merge_at_every_checkpoint`, else once
    when training ends. The policy's weights are taken from memory (a PEFT adapter folded in), so the final merge
    does not need a checkpoint to have been saved at the last step. `push_to_hub` uploads each merged model to the
    Hub repository ``<output_dir>_checkpoint-<step>_merged``, as in TRL."""

    def __init__(
        self,
        merge_config: MergeConfig | None = None,
        merge_at_every_checkpoint: bool = False,
        push_to_hub: bool = False,
    ):
        self.merge_config = merge_config or MergeConfig()
        self.merge_at_every_checkpoint = merge_at_every_checkpoint
        self.push_to_hub = push_to_hub
        self.merged_paths: list[str] = []

    def _merge(self, args, state, model, processing_class) -> None:
        if not state.is_world_process_zero:
            return
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.merge_config.policy_model_path = checkpoint
        if self.merge_config.target_model_path is None:
            self.merge_config.target_model_path = getattr(unwrap(model).config, "_name_or_path", None) or None
        path = merge_model_weights(self.merge_config, model, os.path.join(checkpoint, "merged"), processing_class)
        self.merged_paths.append(path)
        logger.info(
            "Merged the policy with %s (%s) into %s",
            self.merge_config.target_model_path,
            self.merge_config.method,
            path,
        )
        if self.push_to_hub:
            upload_model_to_hf(path, f"{args.output_dir}_checkpoint-{state.global_step}_merged")

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.merge_at_every_checkpoint:
            self._merge(args, state, model, processing_class)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not self.merge_at_every_checkpoint:
            self._merge(args, state, model, processing_class)


__all__ = [
    "MergeConfig",
    "MergeModelCallback",
    "linear_merge",
    "merge_model_weights",
    "merge_state_dicts",
    "slerp",
    "upload_model_to_hf",
]
