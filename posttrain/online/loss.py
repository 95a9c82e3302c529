"""The online engine's loss: the policy objective of a micro-batch, its share of the optimizer step's loss, the
sampler correction and a Mixture-of-Experts balancing term. A mixin of OnlineTrainer (engine.py); methods
override `policy_loss`, `objective_options` or `sampler_ratio`."""

from __future__ import annotations

import torch

from posttrain.generation.vllm_backend import sampler_mismatch_metrics
from posttrain.losses.policy import aggregate_loss, objective_metrics, policy_objective
from posttrain.losses.reductions import masked_mean
from posttrain.losses.token_weights import sampler_importance_weights, sampler_ratio_metrics
from posttrain.online.logps import completion_logps

__all__ = ["OnlineLoss"]


class OnlineLoss:
    """compute_loss -> completion_logps -> policy_loss (+ the router's aux loss)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The entropy keeps its gradient only where a method trains on it (GRPO's entropy bonus); the model's
        # outputs are needed only for a Mixture-of-Experts balancing loss.
        logps, entropy, *outputs = self.completion_logps(
            model,
            inputs,
            with_entropy=True,
            return_outputs=bool(self.router_aux_loss_coef),
            entropy_grad=getattr(self, "trains_entropy", False),
        )
        loss, metrics = self.policy_loss(inputs, logps, entropy)
        loss = self.add_router_aux_loss(loss, outputs[0] if outputs else None, metrics)
        mask = inputs["loss_mask"].to(entropy.dtype)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        self.record_metrics(metrics)
        return (loss, None) if return_outputs else loss

    def add_router_aux_loss(self, loss: torch.Tensor, outputs, metrics: dict) -> torch.Tensor:
        """Adds a Mixture-of-Experts model's load-balancing loss (per micro-batch, so divided by the accumulation
        steps as the policy loss is shared out over them), and records it as `aux_loss`."""
        aux_loss = getattr(outputs, "aux_loss", None)
        if not self.router_aux_loss_coef or aux_loss is None:
            return loss
        metrics["aux_loss"] = aux_loss.detach()
        return loss + self.router_aux_loss_coef * aux_loss / self.args.gradient_accumulation_steps

    def policy_loss(
        self,
        inputs: dict[str, torch.Tensor],
        logps: torch.Tensor,
        entropy: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ):
        """This micro-batch's share of the optimizer step's policy loss, and its metrics.

        The per-token objective is `policy_objective` with `self.objective_options()` (GRPO's loss types), the
        0/1 `keep` selection and, when the sampler returned its log-probs (vLLM), `self.sampler_ratio`. The
        share uses the step's totals over all micro-batches and processes; it is multiplied by the number of
        processes because DDP averages the processes' gradients. `entropy` is for methods that select tokens
        or add a bonus by it (GRPO overrides this method).
        """
        args, mask = self.args, inputs["loss_mask"]
        old_logps = inputs.get("old_logps", logps.detach())
        sampler_logps = inputs.get("sampler_logps")  # the sampler's own log-probs of these tokens (vLLM)
        ratio = None
        if sampler_logps is not None and args.vllm_importance_sampling_correction:
            ratio = self.sampler_ratio(old_logps, sampler_logps, mask)
        per_token, stats = policy_objective(
            logps,
            old_logps,
            inputs["advantages"],
            mask,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            importance_sampling_level=args.importance_sampling_level,
            keep=keep,
            sampler_ratio=ratio,
            ref_logps=inputs.get("ref_logps"),
            beta=args.beta if self.kl_in_loss else 0.0,
            **self.objective_options(),
        )
        loss = aggregate_loss(
            per_token,
            mask,
            args.loss_type,
            total_sequences=inputs["total_sequences"],
            total_tokens=inputs["total_tokens"],
            max_completion_length=args.max_completion_length,
        )
        metrics = objective_metrics(stats, self.accelerator.gather)
        if sampler_logps is not None:
            metrics.update(sampler_mismatch_metrics(old_logps, sampler_logps, mask))
            if ratio is not None:
                metrics.update(sampler_ratio_metrics(ratio, old_logps, sampler_logps, mask))
        return loss * self.accelerator.num_processes, metrics

    def objective_options(self) -> dict:
        """Extra keyword arguments of `policy_objective` (GRPO: its loss type and the options that shape it)."""
        return {}

    def sampler_ratio(
        self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Per-token importance weights min(pi_trainer / pi_sampler, vllm_importance_sampling_cap) (GRPO: its
        vllm_importance_sampling_mode)."""
        return sampler_importance_weights(
            trainer_logps, sampler_logps, mask, "token_truncate", clip_max=self.args.vllm_importance_sampling_cap
        )

    def completion_logps(
        self,
        model,
        batch: dict[str, torch.Tensor],
        with_entropy: bool = False,
        return_outputs: bool = False,
        entropy_grad: bool = False,
    ):
        """`online_logps.completion_logps` at the sampling temperature."""
        return completion_logps(
            model,
            batch,
            self.logps_temperature,
            with_entropy=with_entropy,
            return_outputs=return_outputs,
            entropy_grad=entropy_grad,
        )
