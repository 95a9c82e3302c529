"""IW-OPD with TRL's `trl.experimental.iw_opd` API: importance-weighted on-policy distillation (the loss is in
posttrain/losses/iw_opd.py), on posttrain's DistillationTrainer (the student samples completions, the teacher
scores them).

`distillation_objective='iw_opd'` (always on-policy, lmbda=1) is a policy-gradient step on the teacher's log-ratio of
each sampled token; 'jsd' is the generalized JSD, over the full vocabulary (loss_top_k=0), a top-k support, or with
loss_top_k=1 and beta>0 the mixed support {teacher's argmax, the sampled token (or the student's argmax)}, with
the rest of the mass as one more element when `loss_add_tail`. Data: TRL's `messages` rows (a final assistant
message is the completion) or posttrain's prompt(-completion) rows; prompts keep at most max_prompt_length tokens.
"""

from __future__ import annotations

import torch

from posttrain.data.samplers import RepeatBatchLoader as _RepeatBatchDataLoader
from posttrain.errors import ConfigError
from posttrain.experimental.iw_opd.iw_opd_config import IWOPDConfig
from posttrain.generation.teacher_server import (
    TeacherServer,
    build_teacher_request_inputs,
    server_divergence,
    teacher_server_scores,
)
from posttrain.losses.distillation import generalized_jsd, shared_vocab
from posttrain.losses.iw_opd import add_tail_bucket as _add_tail_bucket
from posttrain.losses.iw_opd import (
    iw_opd_token_losses,
    support_divergence,
    top1_mixed_support,
    top_k_generalized_jsd_loss,
    top_k_support,
)
from posttrain.losses.iw_opd import jsd_terms as _jsd_divergence
from posttrain.losses.sft import IGNORE_INDEX, nll_sum, shift_for_next_token
from posttrain.trainers.distillation import DistillationTrainer
from posttrain.training.streaming import PreparesEvalOnUse


def _messages_to_prompt(example: dict) -> dict:
    """TRL's IW-OPD split: a final assistant message is the completion, everything before it the prompt."""
    messages = example["messages"]
    if len(messages) > 1 and messages[-1].get("role") == "assistant":
        return {"prompt": messages[:-1], "completion": messages[-1:]}
    return {"prompt": messages, "completion": None}


def _truncate_prompt(example: dict, max_prompt_length: int, keep_end: bool) -> dict:
    """Cuts a tokenized row's prompt (the tokens before its first trained one) to max_prompt_length tokens."""
    ids = example["input_ids"]
    trained = (
        example["labels"]
        if "labels" in example
        else [IGNORE_INDEX if m == 0 else t for t, m in zip(ids, example["completion_mask"])]
    )
    start = next((i for i, label in enumerate(trained) if label != IGNORE_INDEX), len(ids))
    if start <= max_prompt_length:
        return example
    keep = slice(start - max_prompt_length, None) if keep_end else slice(None, max_prompt_length)
    cut = lambda values: values[:start][keep] + values[start:]  # noqa: E731
    return {key: cut(value) for key, value in example.items() if isinstance(value, list) and len(value) == len(ids)}


class IWOPDTrainer(PreparesEvalOnUse, DistillationTrainer):
    """`IWOPDTrainer(model, teacher_model, args=IWOPDConfig(...), train_dataset=...)`, TRL's keyword arguments in
    TRL's order (posttrain's extras after them). Logged: TRL's iw_opd/mean_advantage, iw_opd/mean_abs_advantage,
    iw_opd/mean_weight, iw_opd/min_weight, iw_opd/max_weight, and DistillationTrainer's metrics."""

    _name = "IW-OPD"
    generalized_jsd_loss = staticmethod(top_k_generalized_jsd_loss)
    ordered_when_unshuffled = False  # batches drawn at random, as TRL

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: IWOPDConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        *,
        teacher_processing_class=None,
        quantization_config=None,
        **kwargs,
    ):
        args = args or IWOPDConfig(output_dir="outputs/iw_opd")
        args.remove_unused_columns = False  # every column kept, as TRL's trainer forces
        self.teacher_server = None
        if args.use_teacher_server:
            if teacher_model is not None or args.teacher_model_name_or_path is not None:
                raise ConfigError(
                    "use_teacher_server=True scores with the teacher at teacher_model_server_url; drop teacher_model "
                    "/ teacher_model_name_or_path (or set use_teacher_server=False for a local teacher)."
                )
            self.teacher_server = TeacherServer(args.teacher_model_server_url)
        super().__init__(
            model,
            teacher_model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            teacher_processing_class=teacher_processing_class,
            data_collator=data_collator,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **kwargs,
        )

    @staticmethod
    def _resolve_teacher(model, teacher_model, args):
        if args.use_teacher_server:
            return None  # the teacher is the server's
        return DistillationTrainer._resolve_teacher(model, teacher_model, args)

    def prepare_dataset(self, dataset, tokenizer, args: IWOPDConfig, name: str):
        columns = dataset.column_names
        if "messages" in columns and not {"prompt", "completion", "input_ids"} & set(columns):
            dataset = dataset.map(
                _messages_to_prompt,
                remove_columns=columns,
                num_proc=args.dataset_num_proc,
                desc=f"Splitting {name} into prompts and completions",
            )
            if all(c is None for c in dataset["completion"]):
                dataset = dataset.remove_columns("completion")
        dataset = super().prepare_dataset(dataset, tokenizer, args, name)
        if args.max_prompt_length is None:
            return dataset
        return dataset.map(
            _truncate_prompt,
            num_proc=args.dataset_num_proc,
            desc=f"Cutting the prompts of {name}",
            fn_kwargs=dict(
                max_prompt_length=args.max_prompt_length,
                keep_end=getattr(tokenizer, "truncation_side", "right") == "left",
            ),
        )

    def _forward_nll(self, model, inputs, labels):
        args = self.args
        student_logits = model(**inputs).logits
        targets = shift_for_next_token(labels)  # position t predicts token t + 1
        mask, tokens = targets != IGNORE_INDEX, targets.clamp(min=0)
        metrics = self._metrics["train" if model.training else "eval"]
        if args.use_teacher_server and args.distillation_objective != "iw_opd":  # ServerDistillationTrainer's loss
            divergence = server_divergence(self.teacher_server, args, inputs, student_logits, mask, args.temperature)[0]
        else:
            if args.distillation_objective == "iw_opd":
                losses = self._iw_opd_losses(inputs, student_logits, tokens, mask, metrics)
            else:
                losses = self._jsd_losses(inputs, student_logits, tokens, mask)
            divergence = torch.where(mask, losses, 0.0).sum()
        nll, correct, count = nll_sum(student_logits, labels)
        metrics["distill_loss"].append(divergence.item() / max(int(count), 1))
        return divergence, correct, count

    def _teacher_logits(self, inputs, student_logits):
        with torch.no_grad():
            return shared_vocab(student_logits, self.teacher_model(**inputs).logits)

    def _iw_opd_losses(self, inputs, s_logits, tokens, mask, metrics):
        """IW-OPD's per-token losses; the teacher's log-prob of each sampled token comes from the local teacher or
        the teacher server (the one ServerDistillationTrainer reads)."""
        args = self.args
        dtype = torch.float64 if s_logits.dtype == torch.float64 else torch.float32
        s_logps = (s_logits.to(dtype) / args.temperature).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        if args.use_teacher_server:
            own = teacher_server_scores(self.teacher_server, inputs, mask, 1, args.temperature, lambda top, own: own)[2]
            t_logps = torch.where(mask, own, 0.0).to(dtype)
        else:
            t_logits = self._teacher_logits(inputs, s_logits)
            with torch.no_grad():
                t_logps = (t_logits.to(dtype) / args.temperature).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        gamma, epsilon = args.iw_opd_gamma, args.iw_opd_epsilon
        losses, advantages, weights = iw_opd_token_losses(s_logps, t_logps, mask, gamma, epsilon)
        if mask.any():
            metrics["iw_opd/mean_advantage"].append(advantages[mask].mean().item())
            metrics["iw_opd/mean_abs_advantage"].append((t_logps - s_logps.detach())[mask].abs().mean().item())
            metrics["iw_opd/mean_weight"].append(weights[mask].mean().item())
            metrics["iw_opd/min_weight"].append(weights[mask].min().item())
            metrics["iw_opd/max_weight"].append(weights[mask].max().item())
        return losses

    def _jsd_losses(self, inputs, s_logits, tokens, mask):
        args = self.args
        t_logits = self._teacher_logits(inputs, s_logits)
        if args.beta > 0 and args.loss_top_k == 1:
            reverse = s_logits.argmax(-1) if args.reverse_kl_top_1_mode == "argmax" else tokens
            support, valid = top1_mixed_support(t_logits, reverse, args.beta)
            return support_divergence(
                s_logits, t_logits, support, valid, args.beta, args.loss_add_tail, args.temperature
            )
        if 0 < args.loss_top_k < s_logits.shape[-1]:
            support, valid = top_k_support(
                s_logits / args.temperature, t_logits / args.temperature, args.loss_top_k, args.beta
            )
            return support_divergence(
                s_logits, t_logits, support, valid, args.beta, args.loss_add_tail, args.temperature
            )
        return generalized_jsd(s_logits, t_logits, args.beta, mask, args.temperature)

    def _write_completions(self) -> None:
        if self.state.global_step % self.args.log_completions_steps == 0:
            super()._write_completions()


__all__ = [
    "IWOPDConfig",
    "IWOPDTrainer",
    "_RepeatBatchDataLoader",
    "_add_tail_bucket",
    "_jsd_divergence",
    "build_teacher_request_inputs",
]
