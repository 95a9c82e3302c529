"""SDPO with TRL's `trl.experimental.sdpo` API: self-distillation policy optimization (Hübotter et al. 2026,
"Reinforcement Learning via Self-Distillation"), on posttrain's self-distillation trainer (posttrain.experimental.sdft).

Each prompt gets `num_generations` completions, scored by the reward functions. A completion's teacher is the
student itself (by default an EMA of it) given the prompt re-asked with a successful sibling completion (reward >=
`success_reward_threshold`) as a worked solution, and optionally the environment's feedback (the row's
`privileged_context`); completions without either are not distilled (they still count in the batch mean, as TRL).
The loss is (1 - distillation_weight) * GRPO's clipped policy loss on group-normalised advantages +
distillation_weight * the self-distillation loss (default: all distillation, sampled-token reverse KL).
"""

from __future__ import annotations

import logging
import re

import torch

from posttrain.errors import ConfigError
from posttrain.experimental.sdpo.sdpo_config import SDPOConfig
from posttrain.generation.teacher_server import build_teacher_request_inputs
from posttrain.losses.advantages import group_advantages
from posttrain.losses.policy import aggregate_loss, clipped_policy_loss
from posttrain.losses.self_distillation import successful_demonstrations
from posttrain.rewards.scoring import RewardScorer
from posttrain.trainers.self_distillation import SelfDistillationTrainer
from posttrain.trainers.self_distillation_data import with_user_text

logger = logging.getLogger("posttrain")


class SDPOTrainer(SelfDistillationTrainer):
    """`SDPOTrainer(model, reward_funcs, args=SDPOConfig(...), train_dataset=...)`, TRL's keyword arguments in TRL's
    order. Data: a 'prompt' per row (+ 'privileged_context' feedback, + the columns the rewards read). Logged: TRL's
    self_distillation/* keys (distillation_loss, policy_loss, reward_*, success/feedback/reprompt fractions),
    sdpo/distillation_loss and completions/*."""

    _name = "SDPO"
    reports_teacher_context = True  # TRL's SDPO dispatches on_teacher_context_built

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: SDPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        **kwargs,
    ):
        args = args or SDPOConfig(output_dir="outputs/sdpo")
        if reward_funcs is None or reward_funcs == []:
            raise ConfigError(
                "SDPOTrainer needs reward_funcs: successful completions (reward >= "
                "success_reward_threshold) are the teacher's demonstrations."
            )
        funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        classes = reward_processing_classes
        if classes is not None and not isinstance(classes, list):
            classes = [classes]
        self._scorer = RewardScorer(funcs, args.reward_weights, classes)
        self._flat_steps = self._flat_reward_steps = 0
        super().__init__(
            model, args, train_dataset, eval_dataset, processing_class, callbacks, optimizers, peft_config, **kwargs
        )
        self._scorer.to(self.accelerator.device)

    # -- teacher prompts from successful siblings ----------------------------------------------------------------
    def _teacher_prompts(self, rows, prompts, completions, mode):
        args, tokenizer = self.args, self.processing_class
        group = args.num_generations if mode == "train" else (args.num_generations_eval or args.num_generations)
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        conversational = isinstance(rows[0]["prompt"], list)
        shown = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k not in ("prompt", "completion")}
        per_func, _ = self._scorer([row["prompt"] for row in rows], shown, completions, columns, self.state)
        rewards = torch.nansum(per_func * self._scorer.weights, dim=1)
        advantages = group_advantages(rewards, group, args.scale_rewards) if group > 1 else torch.zeros_like(rewards)
        self._advantages = advantages.tolist()
        demos = (
            successful_demonstrations(
                rewards.tolist(), group, args.success_reward_threshold, args.dont_reprompt_on_self_success
            )
            if args.use_successful_as_teacher
            else [None] * len(rows)
        )
        teacher, active, used_feedback, has_feedback = [], [], 0, 0
        for i, row in enumerate(rows):
            feedback = row.get("privileged_context")
            available = isinstance(feedback, str) and feedback.strip() != ""
            has_feedback += available
            use_feedback = (
                args.include_environment_feedback
                and available
                and not (args.environment_feedback_only_without_solution and demos[i] is not None)
            )
            used_feedback += use_feedback
            if demos[i] is None and not use_feedback:
                teacher.append(prompts[i])  # not distilled: the student's own prompt (masked out of the loss)
                active.append(False)
                continue
            solution = ""
            if demos[i] is not None:
                demo = texts[demos[i]]
                if args.remove_thinking_from_demonstration:
                    demo = re.sub(r"<think>.*?</think>", "", demo, flags=re.DOTALL).strip()
                solution = args.solution_template.format(successful_previous_attempt=demo)
            feedback_text = args.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
            prompt = with_user_text(row["prompt"], args.reprompt_template, solution=solution, feedback=feedback_text)
            teacher.append(self._prompt_ids(prompt, i, args.max_reprompt_len))
            active.append(True)
        self._record_rewards(mode, rewards, per_func, group, demos, active, has_feedback, used_feedback)
        return teacher, active

    def _attach_teacher_inputs(self, batches, mode):
        super()._attach_teacher_inputs(batches, mode)
        start, ends = 0, self._stop_ids | {self._own_collator.pad_token_id}
        for batch in batches:
            rows = batch["input_ids"].shape[0]
            batch["advantages"] = torch.tensor(self._advantages[start : start + rows], device=batch["input_ids"].device)
            start += rows
            if self.args.mask_truncated_completions:  # a completion cut at the length limit leaves the loss
                for r, labels in enumerate(batch["labels"]):
                    completion = labels[labels != -100]
                    if len(completion) and int(completion[-1]) not in ends:
                        batch["labels"][r] = -100
                        batch["teacher_labels"][r] = -100

    def _record_rewards(self, mode, rewards, per_func, group, demos, active, has_feedback, used_feedback):
        """TRL's self_distillation/* reward and reprompting metrics (this process's rollouts)."""
        metrics, n = self._metrics[mode], max(len(rewards), 1)
        grouped = rewards.view(-1, group)
        group_std = grouped.std(dim=1) if group > 1 else torch.zeros(grouped.shape[0])
        tolerance = self.args.diagnostics_flat_tolerance
        metrics["self_distillation/reward_mean"].append(rewards.mean().item())
        metrics["self_distillation/reward_std"].append(rewards.std().item() if len(rewards) > 1 else 0.0)
        metrics["self_distillation/reward_min"].append(rewards.min().item())
        metrics["self_distillation/reward_max"].append(rewards.max().item())
        metrics["self_distillation/group_reward_std_mean"].append(group_std.mean().item())
        metrics["self_distillation/flat_group_fraction"].append((group_std <= tolerance).float().mean().item())
        for name, mean in zip(self._scorer.names, per_func.nanmean(dim=0).tolist()):
            metrics[f"self_distillation/rewards/{name}"].append(mean)
        successes = (rewards >= self.args.success_reward_threshold).view(-1, group).any(dim=1)
        metrics["self_distillation/success_group_fraction"].append(successes.float().mean().item())
        metrics["self_distillation/success_sample_fraction"].append(sum(d is not None for d in demos) / n)
        metrics["self_distillation/feedback_available_fraction"].append(has_feedback / n)
        metrics["self_distillation/feedback_used_fraction"].append(used_feedback / n)
        metrics["self_distillation/reprompt_sample_fraction"].append(sum(active) / n)
        flat = bool((rewards.std() if len(rewards) > 1 else rewards.new_zeros(())) <= tolerance)
        self._flat_reward_steps = self._flat_reward_steps + 1 if flat and bool((group_std <= tolerance).all()) else 0
        self._flat_steps = 0 if any(active) else self._flat_steps + 1
        interval = self.args.diagnostics_warning_interval
        if interval and self._flat_reward_steps and self._flat_reward_steps % interval == 0:
            logger.warning(  # TRL's text
                "Observed flat SDPO rewards across all sampled generations (%d steps in a row). Policy advantages "
                "collapse to zero and SDPO will not learn: check the reward functions or success_reward_threshold.",
                self._flat_reward_steps,
            )
        if interval and self._flat_steps and self._flat_steps % interval == 0:
            logger.warning(  # TRL's text, then which threshold
                "SDPO self-distillation is inactive because no reprompted samples were constructed: for %d steps "
                "in a row no completion reached success_reward_threshold=%s and no feedback was used.",
                self._flat_steps,
                self.args.success_reward_threshold,
            )

    # -- the loss ----------------------------------------------------------------------------------------------
    def _needs_teacher(self) -> bool:
        return self.args.distillation_weight > 0

    def _objective(self, student_logits, teacher_logits, tokens, slots, inputs, mode):
        args, weight = self.args, self.args.distillation_weight
        loss = 0.0
        if weight > 0:
            loss = weight * self._distillation_loss(student_logits, teacher_logits, tokens, slots, inputs, mode)
        if weight < 1:
            logps = torch.log_softmax(student_logits.float() / self.loss_temperature(), -1).gather(
                -1, tokens[..., None]
            )[..., 0]
            per_token, _ = clipped_policy_loss(
                logps,
                inputs.get("old_logps", logps.detach()),  # a rollout of an earlier step of its round
                inputs["advantages"],
                slots,
                epsilon_low=args.epsilon,
                epsilon_high=args.epsilon_high,
                importance_sampling_level=args.importance_sampling_level,
            )
            policy = aggregate_loss(
                per_token,
                slots,
                "bnpo" if args.loss_type == "dapo" else args.loss_type,
                max_completion_length=args.max_completion_length,
            )
            self._metrics[mode]["self_distillation/policy_loss"].append(
                self.accelerator.gather(policy.detach()[None]).mean().item()
            )
            loss = loss + (1 - weight) * policy
        return loss


__all__ = ["SDPOConfig", "SDPOTrainer", "build_teacher_request_inputs"]
