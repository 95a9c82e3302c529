"""Nash-MD (Munos et al. 2023, "Nash Learning from Human Feedback", arXiv:2312.00886), on online DPO's trainer.

Each prompt gets one completion y from the policy and one y' from the geometric mixture
pi_mix ∝ pi^(1 - mixture_coef) * pi_ref^mixture_coef (sampled token by token from both models' logits); the
reward functions or judge give P(y beats y'), and the policy follows the Nash mirror-descent step through the
REINFORCE surrogate of losses/online_preference.py:nash_md_loss (only y is trained on). As in TRL's former
NashMDTrainer, the preference is sigmoid(score(y) - score(y')) with reward functions, and the judge's soft
probability with a judge; `mixture_coef` (a list: one value per epoch) defaults to 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer, epoch_value
from posttrain.losses.online_preference import geometric_mixture_logps, nash_md_loss
from posttrain.models.reference import reference_forward, unwrap
from posttrain.online.engine import Advantages, Episode, Rollout
from posttrain.online.rollout import PROMPT_IDS_COLUMN
from posttrain.training.fields import config_field

__all__ = ["NashMDConfig", "NashMDTrainer", "sample_completions"]


@torch.no_grad()
def sample_completions(
    next_logits, prompts: list[list[int]], sampling, seeds: list[int], eos_ids: set[int], pad_id: int, device
) -> list[Episode]:
    """One completion per prompt from `next_logits(input_ids, attention_mask, position_ids) -> [B, V]` (the
    next-token logits of some model or mixture), with the sampling filters of `sampling` and a generator seeded
    per prompt. A plain loop without a KV cache: meant for the second completion of XPO / Nash-MD."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        processors.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        processors.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p:
        processors.append(MinPLogitsWarper(sampling.min_p))
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
    tokens, finished = [[] for _ in prompts], [False] * len(prompts)
    for _ in range(sampling.max_tokens):
        logits = next_logits(ids, mask, (mask.cumsum(1) - 1).clamp(min=0)).float()
        probs = torch.softmax(processors(ids, logits), dim=-1).cpu()
        column, live = [], [int(not f) for f in finished]  # a token is attended to if sampled this step
        for i, generator in enumerate(generators):
            token = pad_id if finished[i] else int(torch.multinomial(probs[i], 1, generator=generator))
            if not finished[i]:
                tokens[i].append(token)
                finished[i] = token in eos_ids
            column.append(token)
        ids = torch.cat([ids, torch.tensor(column, device=device).unsqueeze(1)], dim=1)
        mask = torch.cat([mask, torch.tensor(live, device=device).unsqueeze(1)], dim=1)
        if all(finished):
            break
    return [Episode(t, [1] * len(t), None, f) for t, f in zip(tokens, finished)]


class PairedSamplerMixin:
    """Online DPO with the second completion of each prompt drawn from another sampler (`second_logits`)."""

    def second_logits(self, ids, mask, position_ids) -> torch.Tensor:
        raise NotImplementedError

    def generate_episodes(self, rows: list[dict], n: int, seeds: list[int]) -> list[Episode]:
        own = super().generate_episodes(rows, 1, seeds)
        eos = {self.processing_class.eos_token_id}
        configured = unwrap(self.model).generation_config.eos_token_id
        eos |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        other = sample_completions(
            self.second_logits,
            [row[PROMPT_IDS_COLUMN] for row in rows],
            self.sampling,
            [s + 1 for s in seeds],
            eos,
            self.processing_class.pad_token_id,
            self.accelerator.device,
        )
        return [episode for pair in zip(own, other) for episode in pair]

    def _next_logits(self, model, ids, mask, position_ids) -> torch.Tensor:
        return model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False, logits_to_keep=1
        ).logits[:, -1]


@dataclass
class NashMDConfig(OnlineDPOConfig):
    """OnlineDPOConfig plus `mixture_coef`."""

    method: ClassVar[str] = "Nash-MD"
    schedules: ClassVar[tuple[str, ...]] = (*OnlineDPOConfig.schedules, "mixture_coef")

    mixture_coef: list[float] | float = config_field(
        help="Weight of the reference in the geometric mixture pi^(1-c) pi_ref^c that samples the opponent "
        "completion, in [0, 1]. A list gives one value per epoch.",
        default_factory=lambda: [0.5],
        min=0,
        max=1,
    )


class NashMDTrainer(PairedSamplerMixin, OnlineDPOTrainer):
    """`NashMDTrainer(model, ref_model=None, reward_funcs=..., args=NashMDConfig(...), train_dataset=...)`."""

    _name = "Nash-MD"
    config_class = NashMDConfig
    soft_judge = True

    @property
    def mixture_coef(self) -> float:
        return epoch_value(self.args.mixture_coef, self.state.epoch)

    def second_logits(self, ids, mask, position_ids) -> torch.Tensor:
        policy = self._next_logits(unwrap(self.model), ids, mask, position_ids)
        with reference_forward(self.model, self.ref_model) as reference:
            ref = self._next_logits(reference, ids, mask, position_ids)
        return geometric_mixture_logps(policy.float(), ref.float(), self.mixture_coef)

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> Advantages:
        """Each pair's probability that the policy's completion wins (on both rows; NaN: no preference)."""
        scores = self.pair_scores(rewards, rollout)
        probability = scores[:, 0] if self.judge is not None else torch.sigmoid(scores[:, 0] - scores[:, 1])
        finished = self.accelerator.gather(rollout.finished).float().view(-1, 2)
        metrics = {
            "val/model_contain_eos_token": float(finished[:, 0].mean()),
            "val/ref_contain_eos_token": float(finished[:, 1].mean()),
            "objective/model_scores": float(scores[:, 0].nanmean()),
            "objective/mixture_scores": float(scores[:, 1].nanmean()),
        }
        return Advantages(
            self.local_share(probability.repeat_interleave(2)),
            returns=self.local_share(scores.reshape(-1)),
            metrics=metrics,
        )

    def pair_loss(self, inputs, logps, ref_logps, mask):
        beta = self.beta
        probability = inputs["advantages"][0::2]
        valid = ~probability.isnan()
        losses, score, kl = nash_md_loss(logps[0::2], ref_logps[0::2], mask[0::2], probability.nan_to_num(0.5), beta)
        sums = (logps.detach() * mask).sum(1)
        metrics = {
            "loss/kl": kl.mean(),
            "loss/score": score[valid].mean() if valid.any() else 0.0,
            "objective/entropy": -sums[0::2].mean(),
            "logps/chosen": sums[0::2].mean(),
            "logps/rejected": sums[1::2].mean(),
            "beta": beta,
            "mixture_coef": self.mixture_coef,
        }
        if valid.any():
            metrics.update(
                {
                    "rewards/probabilities": probability[valid].mean(),
                    "rewards/accuracies": (probability[valid] > 0.5).float().mean(),
                }
            )
        return losses * valid, metrics
