"""The public base of the trainers on unpaired examples, each labelled desirable (True) or undesirable (False):
KTO and BCO. Their batches hold the B labelled examples first (`label` [B]), then possibly B more sequences that
only feed the loss (KTO's mismatched KL pairs). `ClassMetricsMixin` counts the loss over the labelled examples,
gives `compute_metrics` only those, and logs the rewards and log-probs of each class as TRL does."""

from __future__ import annotations

import torch


def labelled_rows(batch: dict, part: slice) -> dict:
    """The sequences `part` of such a batch, trailing all-padding columns dropped."""
    width = int(batch["attention_mask"][part].sum(-1).max())
    return {k: batch[k][part, :width] for k in ("input_ids", "attention_mask", "completion_mask")}


class ClassMetricsMixin:
    """For a `BaseTrainer` whose batches carry a boolean `label` per example (see the module docstring)."""

    def count_loss_items(self, batch):
        return len(batch["label"])

    def metric_inputs(self, inputs):
        return labelled_rows(inputs, slice(None, len(inputs["label"])))

    def record_class_metrics(self, labels, rewards, logps, kl=None) -> None:
        """Means over the desirable and the undesirable examples of all processes (a class may be absent), and
        `kl`, the KL reference point z0, for a method that has one (None: no `kl` metric)."""
        desirable = labels.float()
        undesirable = 1 - desirable
        stats = torch.stack(
            [
                desirable.sum(),
                undesirable.sum(),
                (rewards * desirable).sum(),
                (rewards * undesirable).sum(),
                (logps * desirable).sum(),
                (logps * undesirable).sum(),
            ]
        )
        n_d, n_u, reward_d, reward_u, logp_d, logp_u = self.accelerator.gather(stats[None]).sum(0).tolist()
        metrics = {} if kl is None else {"kl": kl}
        if n_d:
            metrics.update({"rewards/chosen": reward_d / n_d, "logps/chosen": logp_d / n_d})
        if n_u:
            metrics.update({"rewards/rejected": reward_u / n_u, "logps/rejected": logp_u / n_u})
        if n_d and n_u:
            metrics["rewards/margins"] = reward_d / n_d - reward_u / n_u
        self.record_metrics(metrics)
