"""GKD with TRL's `trl.experimental.gkd` API: Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes").

A configuration of posttrain's DistillationTrainer: per micro-batch, with probability `lmbda` the student samples
the completions (on-policy); otherwise the data's completions are used, or with `seq_kd=True` the teacher's
samples (sequence-level KD, Kim & Rush 2016). The loss is the generalized JSD

    JSD_beta = beta * KL(p_T ‖ m) + (1 - beta) * KL(p_S ‖ m),   m = beta * p_T + (1 - beta) * p_S

summed over completion tokens and divided by the effective batch's completion tokens. As in TRL, `temperature`
is the sampling temperature only: the divergence compares the untempered distributions.

Data: TRL's `messages` rows (the last message is the completion, the rest the prompt); posttrain also takes
prompt-completion rows.
"""

from __future__ import annotations

from posttrain.experimental.gkd.gkd_config import GKDConfig
from posttrain.trainers.on_policy_generation import OnPolicyGenerationTrainer


class GKDTrainer(OnPolicyGenerationTrainer):
    """`GKDTrainer(model, teacher_model, args=GKDConfig(...), train_dataset=...)`, with TRL's keyword arguments
    in TRL's order; posttrain's extras (teacher_processing_class, quantization_config, compute_loss_func, ...)
    after them. The loss and metrics are DistillationTrainer's (distill_loss, teacher_agreement, on_policy, ...).
    """

    _name = "GKD"

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: GKDConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
        **kwargs,
    ):
        args = args or GKDConfig(output_dir="outputs/gkd")
        args.remove_unused_columns = False  # every column kept, as TRL's trainer forces
        super().__init__(
            model,
            teacher_model,
            args,
            data_collator,
            train_dataset,
            eval_dataset,
            processing_class,
            compute_metrics,
            callbacks,
            optimizers,
            preprocess_logits_for_metrics,
            peft_config,
            formatting_func,
            **kwargs,
        )


__all__ = ["GKDConfig", "GKDTrainer"]
