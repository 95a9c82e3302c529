"""Win rate against the reference policy, decided by a pairwise judge."""

from __future__ import annotations

import types
from contextlib import nullcontext

from transformers import TrainerCallback

from posttrain.callbacks.completions import eval_prompts, generate_completions, raw_prompts
from posttrain.models.reference import is_peft_model, reference_forward


def _prompts(trainer, dataset) -> list:
    """The eval prompts: the ``prompt`` column, or, for an eval set the trainer has already tokenized (DPO, KTO keep
    only ``prompt_ids``), the prompt ids decoded back to the text the model reads (chat template included)."""
    if "prompt" not in dataset.column_names and "prompt_ids" in dataset.column_names:
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        return [tokenizer.decode(list(ids), skip_special_tokens=False) for ids in dataset["prompt_ids"]]
    return raw_prompts(dataset, "WinRateCallback")


class WinRateCallback(TrainerCallback):
    """At each evaluation, generates a completion for each eval prompt with the policy, has `judge` compare it with
    the reference policy's completion for the same prompt, and logs ``eval_win_rate``: the fraction of prompts where
    the judge prefers the policy's.

    The reference completions are generated once, when training begins, by the trainer's ``ref_model`` if it has
    one, else by the PEFT policy with its adapter disabled (its "ref" adapter when it has one), else by the policy
    itself, which at that point holds its initial weights. (If evaluation runs before any training, they are made
    at the first evaluation the same way.) At training start the reference is also judged against itself, logged as
    the step-0 ``eval_win_rate``, as in TRL.

    Each pair is given to the judge as ``[reference, policy]``, so the judge's answer 1 is a policy win; a judge
    failure (-1) counts as no win. With `use_soft_judge`, the judge is called with ``return_scores=True`` and
    returns the probability that the reference's completion is better: ``eval_avg_win_prob`` is one minus its mean,
    and a policy win is a probability at or below 0.5. Prompts are the eval dataset's ``prompt`` column (the first
    `num_prompts`), or the decoded ``prompt_ids`` of an eval set the trainer tokenized; conversational prompts are
    rendered with the chat template and the judge receives the rendered text. Every judged pair is kept in
    ``self.table`` as ``(step, prompt, reference, policy, winner_index)``, and each evaluation's pairs go to wandb
    as the table ``win_rate_completions`` when ``report_to`` includes wandb.
    """

    def __init__(
        self,
        judge,
        trainer,
        generation_config=None,
        num_prompts: int | None = None,
        shuffle_order: bool = True,
        use_soft_judge: bool = False,
    ):
        self.judge, self.trainer, self.generation_config = judge, trainer, generation_config
        self.shuffle_order, self.use_soft_judge = shuffle_order, use_soft_judge
        self.eval_dataset = eval_prompts(trainer, num_prompts, "WinRateCallback")
        self.prompts = _prompts(trainer, self.eval_dataset)
        self.ref_completions: list[str] | None = None
        self._rendered_prompts: list[str] = []
        self.table: list[tuple[str, str, str, str, int]] = []

    @staticmethod
    def _tokenizer(kwargs, trainer):
        tokenizer = kwargs.get("processing_class") or trainer.processing_class
        return getattr(tokenizer, "tokenizer", tokenizer)  # a processor's text tokenizer

    def _generate_reference(self, args, tokenizer) -> None:
        ref_model = getattr(self.trainer, "ref_model", None)
        source, context = self.trainer, nullcontext()
        if ref_model is not None:  # generate_completions reads these two attributes of a trainer
            source = types.SimpleNamespace(accelerator=self.trainer.accelerator, model_wrapped=ref_model)
        elif is_peft_model(self.trainer.model):
            context = reference_forward(self.trainer.model, None)
        with context:
            self._rendered_prompts, self.ref_completions = generate_completions(
                source, self.prompts, tokenizer, self.generation_config, args.per_device_eval_batch_size
            )

    def _judge_and_log(self, state, prompts: list[str], completions: list[str]) -> None:
        if not self.trainer.accelerator.is_main_process:
            return
        pairs = [[ref, policy] for ref, policy in zip(self.ref_completions, completions, strict=True)]
        metrics = {}
        if self.use_soft_judge:
            ref_probs = self.judge.judge(prompts, pairs, self.shuffle_order, return_scores=True)
            winners = [0 if p > 0.5 else 1 for p in ref_probs]
            metrics["eval_avg_win_prob"] = 1.0 - sum(ref_probs) / len(ref_probs)
        else:
            winners = self.judge.judge(prompts, pairs, self.shuffle_order)
        metrics["eval_win_rate"] = sum(w == 1 for w in winners) / len(winners)
        rows = [
            (str(state.global_step), p, ref, policy, int(w))
            for p, (ref, policy), w in zip(prompts, pairs, winners, strict=True)
        ]
        self.table += rows
        self.trainer.log(metrics)
        self._log_to_wandb(rows)

    def _log_to_wandb(self, rows) -> None:
        """This evaluation's pairs as a wandb table ``win_rate_completions`` (TRL's name and columns)."""
        if "wandb" not in (self.trainer.args.report_to or []):
            return
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is not None:
            columns = ["step", "prompt", "reference_model", "policy", "winner_index"]
            wandb.log({"win_rate_completions": wandb.Table(columns=columns, data=[list(r) for r in rows])})

    def on_train_begin(self, args, state, control, **kwargs):
        tokenizer = self._tokenizer(kwargs, self.trainer)
        self._generate_reference(args, tokenizer)
        self._judge_and_log(state, self._rendered_prompts, self.ref_completions)

    def on_evaluate(self, args, state, control, **kwargs):
        tokenizer = self._tokenizer(kwargs, self.trainer)
        if self.ref_completions is None:
            self._generate_reference(args, tokenizer)
        prompts, completions = generate_completions(
            self.trainer, self.prompts, tokenizer, self.generation_config, args.per_device_eval_batch_size
        )
        self._judge_and_log(state, prompts, completions)
