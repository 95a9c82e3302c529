"""The online RL engine: one rollout loop that GRPO, RLOO and PPO configure through a few hooks.

Every `steps_per_generation` optimizer steps the engine generates a fresh batch and then trains on it:

    prompts ──► generation backend: num_generations completions per prompt, as token ids
            ──► RewardScorer (decoded text goes to the reward functions only)
            ──► old log-probs (policy before the update) and reference log-probs (beta > 0)
            ──► compute_advantages (the method's hook; rewards of the whole batch, all processes)
            ──► steps_per_generation optimizer steps, repeated num_iterations times, each made of
                gradient_accumulation_steps micro-batches of per_device_train_batch_size completions:
                clipped policy loss + aggregation over the whole optimizer step's totals.

Hooks for a method: `compute_advantages` (required), `attach_rollout_tensors` (more per-completion tensors,
e.g. PPO's values), `needs_old_logps`, `kl_in_loss`, and `policy_loss` / `compute_loss` (PPO adds a value loss).

Batching. per_device_train_batch_size counts completions. One generation round produces
generation_batch_size = per_device_train_batch_size x gradient_accumulation_steps x steps_per_generation x
processes completions; each process generates for its own prompts, and all num_generations completions of
a prompt are generated on the same process. Rewards are gathered, so group or batch statistics see every
process. Sampling is seeded per prompt (from the seed, the round and the prompt's position in the round),
so the completions do not depend on how a round is split across processes or micro-batches.

Metrics, per logging window (TRL's names): num_tokens (prompt + completion tokens seen), reward, reward_std
(over the whole generation batch), frac_reward_zero_std (groups whose rewards are all equal), rewards/<name>/mean
and /std, completions/mean_length, /min_length, /max_length, /clipped_ratio (fraction cut at
max_completion_length), /mean_terminated_length, /min_.., /max_.. (completions that ended); posttrain's own:
frac_reward_none (no reward applies), advantages/mean and /std, time/generation and time/scoring (seconds per
generation round);
and per micro-batch: kl (when there is a reference), clip_ratio/low_mean, /high_mean, /region_mean,
entropy, time/update (seconds per optimizer step, forward and backward). Evaluation (online_eval.py) logs the
same keys with the eval_ prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader

from ..data.chat import apply_chat_template, require_chat_template
from ..data.formats import is_message_list
from ..errors import ConfigError, DataError
from ..generation import create_generation_backend
from ..generation.vllm_backend import sampler_logps_tensor, sampler_mismatch_metrics
from ..losses.logprobs import selective_log_softmax
from ..losses.policy import (
    aggregate_loss,
    entropy_from_logits,
    objective_metrics,
    policy_objective,
)
from ..losses.token_weights import sampler_importance_weights, sampler_ratio_metrics
from ..models.loading import load_tokenizer
from ..models.reference import create_reference_model, is_peft_model, reference_forward, unwrap
from ..rewards.scoring import RewardScorer
from ..callbacks import SyncRefModelCallback
from ..callbacks.sync_ref import load_sync_ref_checkpoint_state, sync_ref_checkpoint_state
from .base import BaseTrainer, setup_router_aux_loss
from .online_config import OnlineConfig
# Columns the engine adds or reads itself; every other dataset column is passed to the reward functions.
from .online_eval import COMPLETIONS_LOG, PROMPT_COLUMN, PROMPT_IDS_COLUMN, OnlineEvaluation, nanstd

__all__ = ["COMPLETIONS_LOG", "OnlineConfig", "OnlineTrainer", "Rollout", "RolloutSampler", "groupwise_advantages",
           "nanstd"]


# -- prompts -----------------------------------------------------------------------------------------------
def _tokenize_prompt(example: dict, row: int, tokenizer, conversational: bool, max_prompt_length: int | None,
                     chat_template_kwargs: dict | None = None):
    prompt = example[PROMPT_COLUMN]
    if conversational != is_message_list(prompt) or not (conversational or isinstance(prompt, str)):
        expected = "a non-empty list of {'role', 'content'} messages" if conversational else "a string"
        raise DataError(f"Row {row}, column 'prompt': expected {expected} like row 0, got {prompt!r:.80}. "
                        "Fix or drop that row.")
    if conversational:
        text = apply_chat_template({PROMPT_COLUMN: prompt}, tokenizer, **(chat_template_kwargs or {}))[PROMPT_COLUMN]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise DataError(f"Row {row}: the prompt is empty after tokenization; generation needs at least one prompt "
                        "token. Remove the row or give it a prompt.")
    if max_prompt_length is not None:
        ids = ids[-max_prompt_length:]
    return {PROMPT_IDS_COLUMN: ids}


def _require_prompt_column(dataset, name: str) -> None:
    if PROMPT_COLUMN not in dataset.column_names:
        raise DataError(f"{name} needs a 'prompt' column (strings or lists of messages) but has the columns "
                        f"{dataset.column_names}; rename the column holding the prompts, e.g. "
                        "dataset.rename_column('question', 'prompt').")
    if len(dataset) == 0:
        raise DataError(f"{name} is empty; pass at least one prompt.")


# -- the order in which prompts are used -------------------------------------------------------------------
class RolloutSampler:
    """For every micro-step, this process's share of the current round's prompts, tagged with the round, the
    micro-step and each prompt's position ("slot") in the round.

    Each epoch shuffles the prompts with (seed, epoch) (with shuffle=False they keep the dataset's order);
    round r of the epoch takes the next prompts_per_round of them, and process p takes the p-th contiguous block.
    A batch is repeated for every micro-step of its round, which lets the trainer find its place in the round
    (also after resuming).
    """

    def __init__(self, num_prompts: int, prompts_per_round: int, num_processes: int, process_index: int,
                 micro_steps_per_round: int, seed: int, shuffle: bool = True) -> None:
        self.num_prompts, self.prompts_per_round, self.shuffle = num_prompts, prompts_per_round, shuffle
        self.num_processes, self.process_index = num_processes, process_index
        self.micro_steps_per_round, self.seed = micro_steps_per_round, seed
        self.rounds_per_epoch = num_prompts // prompts_per_round
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.rounds_per_epoch * self.micro_steps_per_round

    def __iter__(self):
        order = (torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + self.epoch))
                 if self.shuffle else torch.arange(self.num_prompts))
        local = self.prompts_per_round // self.num_processes
        slots = range(self.process_index * local, (self.process_index + 1) * local)
        for r in range(self.rounds_per_epoch):
            round_index = self.epoch * self.rounds_per_epoch + r
            indices = order[r * self.prompts_per_round + slots.start:][:local].tolist()
            for micro_step in range(self.micro_steps_per_round):
                yield [(round_index, micro_step, slot, index) for slot, index in zip(slots, indices)]


class _TaggedPrompts(torch.utils.data.Dataset):
    """Looks up the rows named by RolloutSampler's tags, keeping the tags."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, tag: tuple[int, int, int, int]):
        return tag, self.dataset[tag[3]]


def _collate_tagged(items: list) -> dict[str, Any]:
    tags, rows = zip(*items)
    return {"round": tags[0][0], "micro_step": tags[0][1], "slots": [t[2] for t in tags], "rows": list(rows)}


class _RolloutLoader(DataLoader):
    """A DataLoader whose epoch reaches the RolloutSampler (the Trainer calls set_epoch on the loader)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


# -- the generated batch -----------------------------------------------------------------------------------
@dataclass
class Rollout:
    """One round's completions on this process, N = per-process generation batch, prompt-major.

    Prompts are left-padded [N, P], completions right-padded [N, T]. `completion_mask` marks generated
    tokens; `loss_mask` the ones trained on (without truncated completions when those are masked).
    `tensors` holds the per-completion tensors the loss reads: shape [N] or [N, T] (completion-aligned):
    advantages, old_logps, ref_logps, and whatever a method adds.
    """

    round: int
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    finished: torch.Tensor  # [N] bool: ended with a stop token (else cut at max_completion_length)
    rewards: torch.Tensor  # [N], NaN where no reward function applies
    per_function_rewards: torch.Tensor  # [N, reward functions], unweighted, NaN where a function does not apply
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    step_tokens: list[float] = field(default_factory=list)  # loss tokens per optimizer step, all processes
    num_generations: int = 1  # completions per prompt (a group): num_generations, or num_generations_eval
    pad_to_multiple_of: int | None = None  # batch widths are rounded up to a multiple of this

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) with the padding columns no row of the slice needs removed."""
        rows = slice(start, stop)
        prompt_width = self._width(self.prompt_mask[rows].sum(1).max(), self.prompt_mask.shape[1])
        width = self._width(self.completion_mask[rows].sum(1).max(), self.completion_mask.shape[1])
        out = {"prompt_ids": self.prompt_ids[rows, -prompt_width:],
               "prompt_mask": self.prompt_mask[rows, -prompt_width:]}
        per_completion = {"completion_ids": self.completion_ids, "completion_mask": self.completion_mask,
                          "loss_mask": self.loss_mask, **self.tensors}
        for name, value in per_completion.items():
            out[name] = value[rows, :width] if value.dim() == 2 else value[rows]
        return out


    def _width(self, needed, available: int) -> int:
        multiple = self.pad_to_multiple_of or 1
        return min(-(-int(needed) // multiple) * multiple, available)


def _pad(rows: list[list[int]], value: int, left: bool,
         multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    width = -(-width // (multiple or 1)) * (multiple or 1)
    padded = [[value] * (width - len(r)) + r if left else r + [value] * (width - len(r)) for r in rows]
    masks = [[0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded), torch.tensor(masks)


def groupwise_advantages(
    rewards: torch.Tensor, num_generations: int, advantage_fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`advantage_fn(group)` for each prompt's group of rewards, over the completions some reward applies to.

    A completion whose reward is NaN (no reward function applies) gets advantage 0 and is left out of its
    group's statistics; so does every completion of a group with fewer than two scored completions.
    `advantage_fn` receives the k scored rewards of one group (1-D) and returns their k advantages.
    """
    advantages = torch.zeros_like(rewards)
    for start in range(0, rewards.numel(), num_generations):
        group = rewards[start:start + num_generations]
        scored = ~group.isnan()
        if int(scored.sum()) >= 2:
            advantages[start:start + num_generations][scored] = advantage_fn(group[scored])
    return advantages


# -- the engine --------------------------------------------------------------------------------------------
class OnlineTrainer(OnlineEvaluation, BaseTrainer):
    """`XTrainer(model, reward_funcs, args=XConfig(...), train_dataset=..., eval_dataset=..., peft_config=...)`.

    `train_dataset` (and `eval_dataset`) need a 'prompt' column (strings, or conversations rendered with the
    chat template and its generation prompt); every other column reaches the reward functions by name.
    `reward_funcs` is one or a list of reward functions, reward models or reward model names (see
    `posttrain.rewards.scoring`). Tool calling (`tools`, `rollout_func`, `environment_factory`) is not
    supported yet.
    """

    config_class: ClassVar[type[OnlineConfig]] = OnlineConfig
    # The loss returned by compute_loss is already this micro-batch's share of the optimizer step's loss.
    loss_is_scaled_for_ga = True
    # Whether beta's KL term goes into the loss (GRPO) rather than into the rewards (RLOO, PPO).
    kl_in_loss: ClassVar[bool] = True

    def __init__(
        self,
        model,
        reward_funcs,
        args: OnlineConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes: list | None = None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        args = args or self.config_class(output_dir=f"outputs/{type(self).__name__.removesuffix('Trainer').lower()}")
        for name, value in (("tools", tools), ("rollout_func", rollout_func),
                            ("environment_factory", environment_factory)):
            if value is not None:
                raise ConfigError(f"{type(self).__name__}({name}=...): tool calling and custom rollouts are not "
                                  f"supported yet (issue #18); drop {name}.")
        if train_dataset is None:
            raise DataError(f"{type(self).__name__} needs a train_dataset with a 'prompt' column.")
        _require_prompt_column(train_dataset, "train_dataset")
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not reward_funcs or any(f is None for f in reward_funcs):
            raise ConfigError("No reward functions given: pass reward_funcs, e.g. a function "
                              "f(prompts, completions, **columns) -> list[float], a reward model, or a list of them.")
        self.reward_columns = [c for c in train_dataset.column_names if c not in (PROMPT_COLUMN, PROMPT_IDS_COLUMN)]
        self.reward_scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes,
                                          args.reward_timeout_s)
        self.reward_scorer.check_columns(self.reward_columns)
        self._check_eval_setup(eval_dataset, args)
        if args.sync_ref_model and (peft_config is not None or is_peft_model(model)):
            raise ConfigError("sync_ref_model=True needs a separate reference model, but with a PEFT policy the "
                                  "reference is the adapter-disabled base; set sync_ref_model=False.")
        processing_class = processing_class or load_tokenizer(model)
        if processing_class.eos_token_id is None:
            raise ConfigError("The tokenizer has no EOS token, so a completion could never end before "
                              "max_completion_length; set tokenizer.eos_token (for a chat model, its end-of-turn "
                              "token).")
        prompts_per_round = args.generation_batch_size // args.num_generations
        if len(train_dataset) < prompts_per_round:
            raise DataError(
                f"train_dataset has {len(train_dataset)} prompts but one generation round uses {prompts_per_round} "
                f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}); "
                "add prompts or lower per_device_train_batch_size, gradient_accumulation_steps or "
                "steps_per_generation.")
        super().__init__(model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config)
        self.sampling = args.sampling_params()
        self.generation_backend = create_generation_backend(self.model, self.processing_class, args)
        self.reward_scorer.to(self.accelerator.device)
        self.ref_model = None
        if args.beta > 0:
            reference = create_reference_model(self.model, peft=is_peft_model(self.model))
            if reference is not None:
                self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
        if args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(self.ref_model, args.ref_model_mixup_alpha,
                                                   args.ref_model_sync_steps))
        self.router_aux_loss_coef = setup_router_aux_loss(self.model, args.router_aux_loss_coef)
        self.rollout: Rollout | None = None
        self._update_seconds = 0.0
        self._pending_completions: list[dict] = []

    def check_prompt_dataset(self, dataset, name: str) -> None:
        """A prompt column, and every column the reward functions read from the training set."""
        _require_prompt_column(dataset, name)
        missing = [c for c in self.reward_columns if c not in dataset.column_names]
        if missing:
            raise DataError(f"{name} lacks the columns {missing} that train_dataset passes to the reward functions; "
                            "add them to it.")

    def _check_eval_setup(self, eval_dataset, args: OnlineConfig) -> None:
        datasets = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
        for name, dataset in datasets:
            if dataset is not None:
                self.check_prompt_dataset(dataset, name if name == "eval_dataset" else f"eval_dataset[{name!r}]")
        n = args.num_generations_eval or args.num_generations
        if eval_dataset is not None and args.per_device_eval_batch_size % n:
            raise ConfigError(f"per_device_eval_batch_size={args.per_device_eval_batch_size} counts completions and "
                              f"must be a multiple of num_generations_eval={n} (all completions of an eval prompt "
                              "are generated together); change one of them.")

    # -- data ------------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, tokenizer, args: OnlineConfig, name: str):
        """Tokenizes each prompt once (cached by datasets' fingerprint) into a 'prompt_ids' column."""
        self.conversational = is_message_list(dataset[0][PROMPT_COLUMN])
        if self.conversational:
            require_chat_template(tokenizer, "conversational prompts")
        return dataset.map(
            _tokenize_prompt, with_indices=True, num_proc=args.dataset_num_proc,
            fn_kwargs=dict(tokenizer=tokenizer, conversational=self.conversational,
                           max_prompt_length=args.max_prompt_length, chat_template_kwargs=args.chat_template_kwargs),
            desc=f"Tokenizing the prompts of {name}",
        )

    def default_collator(self, tokenizer, args):
        return _collate_tagged

    @property
    def micro_steps_per_round(self) -> int:
        return self.args.steps_per_generation * self.args.gradient_accumulation_steps * self.args.num_iterations

    def get_train_dataloader(self) -> DataLoader:
        args = self.args
        sampler = RolloutSampler(
            num_prompts=len(self.train_dataset), prompts_per_round=args.generation_batch_size // args.num_generations,
            num_processes=self.accelerator.num_processes, process_index=self.accelerator.process_index,
            micro_steps_per_round=self.micro_steps_per_round,
            seed=args.data_seed if args.data_seed is not None else args.seed, shuffle=args.shuffle_dataset,
        )
        return _RolloutLoader(_TaggedPrompts(self.train_dataset), batch_sampler=sampler, collate_fn=_collate_tagged)

    # -- one micro-step ----------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generates a new round when the batch belongs to one not yet generated, then trains on this
        micro-step's slice of it."""
        if self.rollout is None or self.rollout.round != inputs["round"]:
            self.rollout = self.make_rollout(inputs["rows"], inputs["slots"], inputs["round"])
        args = self.args
        position = inputs["micro_step"] % (args.steps_per_generation * args.gradient_accumulation_steps)
        size = args.per_device_train_batch_size
        batch = self.rollout.batch(position * size, (position + 1) * size)
        batch["total_sequences"] = size * args.gradient_accumulation_steps * self.accelerator.num_processes
        batch["total_tokens"] = self.rollout.step_tokens[position // args.gradient_accumulation_steps]
        start = time.perf_counter()
        loss = super().training_step(model, batch, num_items_in_batch)
        self._update_seconds += time.perf_counter() - start
        if (inputs["micro_step"] + 1) % args.gradient_accumulation_steps == 0:
            self._metrics["train"]["time/update"].append(self._update_seconds)
            self._update_seconds = 0.0
        return loss

    # -- resuming ----------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """This process's rollout when the checkpoint falls inside its round (steps_per_generation or
        num_iterations > 1), so that a resumed run finishes the round on the same completions instead of
        generating new ones with the updated policy; and the TR-GRPO synced reference."""
        state = sync_ref_checkpoint_state(self)
        steps_per_round = self.args.steps_per_generation * self.args.num_iterations
        if self.rollout is not None and self.state.global_step % steps_per_round:
            state["rollout"] = {f.name: getattr(self.rollout, f.name) for f in fields(Rollout)}
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        state = dict(state)
        load_sync_ref_checkpoint_state(self, state)
        if "rollout" in state:
            self.rollout = Rollout(**state.pop("rollout"))
        super().load_checkpoint_state(state)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The entropy keeps its gradient only where a method trains on it (GRPO's entropy bonus).
        logps, entropy, outputs = self.completion_logps(model, inputs, with_entropy=True, return_outputs=True,
                                                        entropy_grad=getattr(self, "trains_entropy", False))
        loss, metrics = self.policy_loss(inputs, logps, entropy)
        loss = self.add_router_aux_loss(loss, outputs, metrics)
        mask = inputs["loss_mask"].to(entropy.dtype)
        metrics["entropy"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
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

    def policy_loss(self, inputs: dict[str, torch.Tensor], logps: torch.Tensor, entropy: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None):
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
            logps, old_logps, inputs["advantages"], mask, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
            importance_sampling_level=args.importance_sampling_level, keep=keep, sampler_ratio=ratio,
            ref_logps=inputs.get("ref_logps"), beta=args.beta if self.kl_in_loss else 0.0, **self.objective_options())
        loss = aggregate_loss(per_token, mask, args.loss_type, total_sequences=inputs["total_sequences"],
                              total_tokens=inputs["total_tokens"], max_completion_length=args.max_completion_length)
        metrics = objective_metrics(stats, self.accelerator.gather)
        if sampler_logps is not None:
            metrics.update(sampler_mismatch_metrics(old_logps, sampler_logps, mask))
            if ratio is not None:
                metrics.update(sampler_ratio_metrics(ratio, old_logps, sampler_logps, mask))
        return loss * self.accelerator.num_processes, metrics

    def objective_options(self) -> dict:
        """Extra keyword arguments of `policy_objective` (GRPO: its loss type and the options that shape it)."""
        return {}

    def sampler_ratio(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """Per-token importance weights min(pi_trainer / pi_sampler, vllm_importance_sampling_cap) (GRPO: its
        vllm_importance_sampling_mode)."""
        return sampler_importance_weights(trainer_logps, sampler_logps, mask, "token_truncate",
                                          clip_max=self.args.vllm_importance_sampling_cap)

    def completion_logps(self, model, batch: dict[str, torch.Tensor], with_entropy: bool = False,
                         return_outputs: bool = False, entropy_grad: bool = False):
        """Per-token log-probs [B, T] of the completion tokens under `model` (logits divided by the sampling
        temperature, as they were sampled), and their entropies when `with_entropy` (with a gradient only if
        `entropy_grad`). With `return_outputs` the model's outputs come third (PPO reads its values from the
        same forward)."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
        width = batch["completion_ids"].shape[1]
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        logits_to_keep=width + 1, use_cache=False)
        logits = outputs.logits[:, :-1] / self.args.temperature
        logps = selective_log_softmax(logits, batch["completion_ids"])
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_from_logits(logits)
        return (logps, entropy, outputs) if return_outputs else (logps, entropy)

    # -- generation rounds -------------------------------------------------------------------------------
    @property
    def needs_old_logps(self) -> bool:
        """The policy changes between generation and training only with several steps or passes per round."""
        return self.args.steps_per_generation > 1 or self.args.num_iterations > 1

    def make_rollout(self, rows: list[dict], slots: list[int], round_index: int) -> Rollout:
        """Generates, scores and prepares this process's share of a round: of training, or of evaluation while
        `rollout_mode` is "eval" (num_generations_eval completions per prompt, nothing in completions.jsonl)."""
        args, mode = self.args, self.rollout_mode
        n = args.num_generations if mode == "train" else args.num_generations_eval or args.num_generations
        if mode == "train":
            self.generation_backend.sync_weights(self.model)
        start = time.perf_counter()
        completions = self.generation_backend.generate(
            [row[PROMPT_IDS_COLUMN] for row in rows], n, self.sampling, seed=self.round_seeds(round_index, slots, mode))
        generation_seconds = time.perf_counter() - start

        start = time.perf_counter()
        completion_ids = [c.token_ids for c in completions]
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [row[PROMPT_COLUMN] for row in rows for _ in range(n)]
        per_function, rewards = self.reward_scorer(
            prompts=prompts,
            completions=([[{"role": "assistant", "content": t}] for t in texts] if is_message_list(prompts[0])
                         else texts),
            completion_ids=completion_ids,
            columns={c: [row[c] for row in rows for _ in range(n)] for c in self.reward_columns},
            trainer_state=self.state,
        )
        scoring_seconds = time.perf_counter() - start

        device = self.accelerator.device
        multiple = self.pad_multiple
        prompt_ids, prompt_mask = _pad([row[PROMPT_IDS_COLUMN] for row in rows for _ in range(n)],
                                       self.processing_class.pad_token_id, left=True, multiple=multiple)
        completion_tensor, completion_mask = _pad(completion_ids, self.processing_class.pad_token_id, left=False,
                                                  multiple=multiple)
        finished = torch.tensor([c.finished_with_eos for c in completions])
        loss_mask = completion_mask * finished.unsqueeze(1) if args.mask_truncated_completions else completion_mask
        rollout = Rollout(round_index, prompt_ids.to(device), prompt_mask.to(device), completion_tensor.to(device),
                          completion_mask.to(device), loss_mask.to(device), finished.to(device), rewards.to(device),
                          per_function.to(device), num_generations=n, pad_to_multiple_of=multiple)
        sampler_logps = sampler_logps_tensor(completions, completion_tensor.shape[1])
        if sampler_logps is not None:
            rollout.tensors["sampler_logps"] = sampler_logps.to(device)
        self.attach_rollout_tensors(rollout)
        all_rewards = self.accelerator.gather(rollout.rewards)
        rollout.tensors["advantages"] = self.compute_advantages(all_rewards, rollout)
        rollout.step_tokens = self._step_token_totals(rollout) if mode == "train" else []

        self.record_round(rollout, all_rewards, self.accelerator.gather(rollout.per_function_rewards), mode,
                          {"time/generation": generation_seconds, "time/scoring": scoring_seconds})
        if args.log_completions and mode == "train":
            self.log_completions(prompts, texts, rewards.tolist())
        return rollout

    @property
    def pad_multiple(self) -> int | None:
        """pad_to_multiple_of resolved: 'auto' pads to 128 on Neuron (a compile per shape), else not at all."""
        multiple = self.args.pad_to_multiple_of
        if multiple == "auto":
            return 128 if self.accelerator.device.type == "neuron" else None
        return multiple

    def attach_rollout_tensors(self, rollout: Rollout) -> None:
        """Adds the tensors computed from the policy before the update: old log-probs (when the policy will
        have changed by the time a micro-batch is trained) and reference log-probs (beta > 0)."""
        if self.needs_old_logps:
            rollout.tensors["old_logps"] = self._rollout_logps(rollout, unwrap(self.model))
        if self.args.beta > 0:
            with reference_forward(self.model, self.ref_model) as reference:
                rollout.tensors["ref_logps"] = self._rollout_logps(rollout, reference)

    @torch.no_grad()
    def _rollout_logps(self, rollout: Rollout, model) -> torch.Tensor:
        """Log-probs [N, T] of all completions of the rollout, computed in micro-batches."""
        logps = torch.zeros(rollout.completion_ids.shape, device=rollout.completion_ids.device)
        size = self.args.per_device_train_batch_size
        for start in range(0, len(rollout), size):
            chunk, _ = self.completion_logps(model, rollout.batch(start, start + size))
            logps[start:start + size, :chunk.shape[1]] = chunk
        return logps

    def compute_advantages(self, rewards: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """The method's advantages for this process's completions, [N] or per token [N, T].

        `rewards` [num_processes * N] are the round's rewards over all processes in prompt order (NaN where
        no reward function applies); `rollout` is this process's share, with its tensors attached.
        """
        raise NotImplementedError

    def local_share(self, values: torch.Tensor) -> torch.Tensor:
        """This process's rows of a tensor gathered over processes (in process order)."""
        size = values.shape[0] // self.accelerator.num_processes
        return values[self.accelerator.process_index * size:][:size]

    def _step_token_totals(self, rollout: Rollout) -> list[float]:
        """Loss tokens of each optimizer step of the round, summed over processes (aggregate_loss's totals)."""
        per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        local = rollout.loss_mask.sum(1).view(-1, per_step).sum(1).float()
        return self.accelerator.gather(local).view(-1, local.numel()).sum(0).tolist()
