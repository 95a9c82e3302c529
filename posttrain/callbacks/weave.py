"""Completions and scores at each evaluation, logged to W&B Weave."""

from __future__ import annotations

import importlib.util
import logging

from transformers import TrainerCallback

from posttrain.callbacks.completions import eval_prompts, generate_completions, raw_prompts

logger = logging.getLogger("posttrain")


class WeaveCallback(TrainerCallback):
    """Logs evaluation completions to Weights & Biases Weave for inspection.

    At each evaluation, generates completions for the eval prompts and logs them to Weave with an
    ``EvaluationLogger``: predictions only (tracing) without `scorers`, or each prediction scored by every
    ``scorer(prompt, completion) -> number`` plus their averages (evaluation). Needs the ``weave`` package
    (``pip install weave``); the project is `project_name`, an already initialised Weave client, or the active
    wandb run's project.

    See docs/trackers.md.
    """

    def __init__(
        self,
        trainer,
        project_name: str | None = None,
        scorers: dict | None = None,
        generation_config=None,
        num_prompts: int | None = None,
        dataset_name: str = "eval_dataset",
        model_name: str | None = None,
    ):
        if importlib.util.find_spec("weave") is None:
            raise ImportError("WeaveCallback requires the `weave` package. To install, run `pip install weave`.")
        self.trainer, self.project_name, self.scorers = trainer, project_name, scorers or {}
        self.generation_config, self.dataset_name, self.model_name = generation_config, dataset_name, model_name
        self.eval_dataset = eval_prompts(trainer, num_prompts, "WeaveCallback")
        self.prompts = raw_prompts(self.eval_dataset, "WeaveCallback")
        self._client = None
        self._last_logged_step = -1

    @property
    def is_evaluation_mode(self) -> bool:
        return bool(self.scorers)

    def _init_weave(self):
        if self._client is not None:
            return
        import weave
        from weave.trace.context import weave_client_context

        self._client = weave_client_context.get_weave_client()
        if self._client is None:
            if self.project_name is None:
                try:
                    import wandb

                    if wandb.run is not None:
                        self.project_name = f"{wandb.run.entity}/{wandb.run.project}"
                except ImportError:
                    pass
            if self.project_name is None:
                raise ValueError(
                    "WeaveCallback: no Weave client and no project. Call weave.init('project'), pass "
                    "project_name=..., or start a wandb run first."
                )
            self._client = weave.init(self.project_name)
        if self.model_name is None:
            self.model_name = getattr(self.trainer.model.config, "_name_or_path", "unknown_model")

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._init_weave()

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self._last_logged_step:
            return
        tokenizer = kwargs.get("processing_class") or self.trainer.processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        prompts, completions = generate_completions(
            self.trainer, self.prompts, tokenizer, self.generation_config, args.per_device_eval_batch_size
        )
        if self.trainer.accelerator.is_main_process:
            self._init_weave()
            self._log(state, prompts, completions)
        self._last_logged_step = state.global_step

    def _log(self, state, prompts, completions):
        from weave import EvaluationLogger

        attributes = {
            "training_step": state.global_step,
            "model_name": self.model_name,
            "generation_config": self.generation_config.to_dict() if self.generation_config else None,
        }
        evaluation = EvaluationLogger(model=self.model_name, dataset=self.dataset_name, eval_attributes=attributes)
        scores: dict[str, list] = {name: [] for name in self.scorers}
        for prompt, completion in zip(prompts, completions):
            prediction = evaluation.log_prediction(inputs={"prompt": prompt}, output=completion)
            for name, scorer in self.scorers.items():
                score = scorer(prompt, completion)
                prediction.log_score(scorer=name, score=score)
                scores[name].append(score)
            prediction.finish()
        if self.is_evaluation_mode:
            summary = {"total_predictions": len(prompts), "successful_predictions": len(prompts)}
            summary.update({f"avg_{name}": sum(v) / len(v) for name, v in scores.items() if v})
            evaluation.log_summary(summary)
        else:
            evaluation.finish()
