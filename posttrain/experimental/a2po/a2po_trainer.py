"""A*-PO, optimal advantage regression (Brantley et al. 2025, arXiv:2505.20686), at TRL's import path
`trl.experimental.a2po`, on the online engine.

Stage 1, before training: num_value_samples completions per prompt (training and eval prompts) are sampled from
the reference policy -- the policy itself before its first update -- and scored; V*(x) = beta1 * log(mean
exp(r / beta1)) is kept per prompt, and with filter_all_incorrect the training prompts whose samples all scored
0 are dropped. Stage 2: one on-policy completion per prompt (num_generations=1) and the loss
(beta2 * log(pi(y|x) / pi_ref(y|x)) - (r - V*(x)))^2 (`posttrain.losses.grpo_family.a2po_loss`). The reward is
meant to be binary (0/1). Stage 1 is seeded, so a resumed run re-estimates the same V* from the initial weights.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError, DataError
from posttrain.experimental.a2po.a2po_config import A2POConfig
from posttrain.generation.base import derive_seed
from posttrain.losses.grpo_family import a2po_loss, a2po_optimal_values
from posttrain.online.rollout import PROMPT_IDS_COLUMN, Advantages
from posttrain.trainers.grpo import GRPOTrainer

__all__ = ["A2POConfig", "A2POTrainer"]

_STAGE1_TAG = 20250526  # keeps Stage 1's sampling seeds apart from the rounds'

# Why A2PO takes none of the online trainer's episode arguments (TRL's A2POTrainer has none of them either).
_REFUSED = {
    "tools": "a tool-calling episode's completion interleaves tool output with the policy's tokens, while "
    "A2PO regresses log pi(y|x) of one plain completion on r - V*(x), V* estimated from plain samples",
    "rollout_func": "a custom rollout replaces the sampler that Stage 1 (V* from the reference's samples) and "
    "Stage 2 (one completion per prompt) share, and may return prompts V* was not estimated for",
    "environment_factory": "an environment gives its own reward and turns, so V*(x) estimated from the reward "
    "functions' scores of Stage 1's samples would not be the value of the episodes Stage 2 trains on",
}


def _refuse_episode_arguments(**given) -> None:
    for name, value in given.items():
        if value is not None:
            raise ConfigError(
                f"A2POTrainer does not take {name}=: {_REFUSED[name]}. Leave {name} out, or train with "
                "GRPOTrainer, which takes it."
            )


class A2POTrainer(GRPOTrainer):
    """`A2POTrainer(model, reward_funcs, args=A2POConfig(...), train_dataset=..., eval_dataset=...)`."""

    _name = "A2PO"
    config_class = A2POConfig

    def __init__(
        self,
        model,
        reward_funcs,
        args: A2POConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        reward_processing_classes=None,
        peft_config=None,
        quantization_config=None,
        *,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        _refuse_episode_arguments(tools=tools, rollout_func=rollout_func, environment_factory=environment_factory)
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.optimal_values: dict[tuple[int, ...], float] | None = None

    @property
    def uses_reference(self) -> bool:
        return True

    @property
    def logps_temperature(self) -> float:
        return 1.0  # log pi(y|x) of the model itself, as TRL's A2PO (not of the tempered sampler)

    # -- Stage 1 -------------------------------------------------------------------------------------------
    def estimate_optimal_values(self) -> None:
        """V* for every training and eval prompt from num_value_samples samples of the initial policy (the
        reference), then the filter of all-incorrect training prompts."""
        args, n = self.args, self.args.num_value_samples
        values, all_incorrect = {}, set()
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        for dataset in [self.train_dataset, *[self._prepared_eval(d) for d in evals if d is not None]]:
            for start in range(0, len(dataset), args.per_device_train_batch_size):
                rows = [dataset[i] for i in range(start, min(start + args.per_device_train_batch_size, len(dataset)))]
                seeds = [derive_seed(args.seed, _STAGE1_TAG, start + i) for i in range(len(rows))]
                scored = self.generate_and_score(rows, n, seeds, -1, "train")
                rewards = scored.rewards.nan_to_num(0.0).view(len(rows), n).double()
                for row, value, group in zip(rows, a2po_optimal_values(rewards, args.beta1).tolist(), rewards):
                    key = tuple(row[PROMPT_IDS_COLUMN])
                    values[key] = value
                    if bool((group == 0).all()):
                        all_incorrect.add(key)
        self.optimal_values = values
        if args.filter_all_incorrect and all_incorrect:
            kept = self.train_dataset.filter(lambda row: tuple(row[PROMPT_IDS_COLUMN]) not in all_incorrect)
            if len(kept) == 0:  # fewer than a round trains: the round repeats them (online/rollout.py)
                raise DataError(
                    f"filter_all_incorrect dropped all {len(self.train_dataset)} prompts: their {n} reference "
                    "samples all scored 0; set filter_all_incorrect=False or add prompts the model can solve."
                )
            self.train_dataset = kept

    def train(self, *args, **kwargs):
        if self.optimal_values is None:
            self.estimate_optimal_values()
        return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        if self.optimal_values is None:
            self.estimate_optimal_values()
        return super().evaluate(*args, **kwargs)

    # -- Stage 2 -------------------------------------------------------------------------------------------
    def compute_advantages(self, rewards, rollout) -> Advantages:
        """The optimal advantage r - V*(x) (the regression target), per completion; V* looked up by the
        completion's prompt, read from the rollout."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu())]
        values = torch.tensor(
            [self.optimal_values[tuple(ids)] for ids in prompts], dtype=torch.float32, device=self.accelerator.device
        )
        target = self.local_share(rewards).nan_to_num(0.0) - values
        return Advantages(target, metrics={"v_star": float(values.mean())})

    def policy_loss(self, inputs, logps, entropy=None, keep=None):
        """This micro-batch's share of the step's mean squared regression error."""
        mask = inputs["loss_mask"].to(logps.dtype)
        sequence_logps = (torch.where(mask.bool(), logps, 0.0)).sum(1)
        ref_sequence_logps = (torch.where(mask.bool(), inputs["ref_logps"], 0.0)).sum(1)
        rewards = inputs["advantages"] + 0.0  # r - V*: V* enters only through the target
        per_sequence, stats = a2po_loss(
            sequence_logps, ref_sequence_logps, rewards, torch.zeros_like(rewards), self.args.beta2
        )
        loss = per_sequence.sum() / inputs["total_sequences"]
        return loss * self.accelerator.num_processes, stats
