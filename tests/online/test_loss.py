"""The online engine's loss dispatch (posttrain.online.loss.OnlineLoss) on its own: a stub trainer with plain
settings, hand-made log-probs and hand-worked expected losses, no model and no generation."""

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.online.loss import OnlineLoss


class _Accelerator:
    def __init__(self, processes: int = 1):
        self.num_processes = processes

    @staticmethod
    def gather(values):
        return values


class _Trainer(OnlineLoss):
    """The attributes OnlineLoss reads of a trainer, and nothing else."""

    def __init__(self, processes: int = 1, loss_type: str = "grpo", **settings):
        defaults = dict(
            epsilon=0.2,
            epsilon_high=0.2,
            importance_sampling_level="token",
            beta=0.0,
            loss_type=loss_type,
            max_completion_length=4,
            vllm_importance_sampling_correction=False,
            vllm_importance_sampling_cap=2.0,
            gradient_accumulation_steps=4,
        )
        self.args = SimpleNamespace(**{**defaults, **settings})
        self.accelerator = _Accelerator(processes)
        self.kl_in_loss = False
        self.router_aux_loss_coef = 0.0
        self.logps_temperature = 1.0
        self.recorded = []

    def record_metrics(self, metrics):
        self.recorded.append(metrics)


def _inputs(**extra):
    # two completions: 2 valid tokens (advantage 1) and 1 valid token (advantage -0.5)
    return {
        "loss_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        "advantages": torch.tensor([1.0, -0.5]),
        "total_sequences": 2,
        "total_tokens": 3,
        **extra,
    }


def _logps():
    return torch.tensor([[-0.5, -1.0, -9.0], [-2.0, -9.0, -9.0]], requires_grad=True)


@pytest.mark.parametrize(
    "loss_type, processes, expected",
    [
        # on-policy the ratio is 1, so each token's term is -A; grpo: mean per completion, then / total_sequences
        ("grpo", 1, (-1.0 + 0.5) / 2),
        # dapo: the sum over all tokens / total_tokens; times the processes (DDP averages their gradients)
        ("dapo", 1, (-1.0 - 1.0 + 0.5) / 3),
        ("dapo", 2, 2 * (-1.0 - 1.0 + 0.5) / 3),
        # dr_grpo: the sum / (total_sequences x max_completion_length)
        ("dr_grpo", 1, (-1.0 - 1.0 + 0.5) / (2 * 4)),
    ],
)
def test_on_policy_loss_is_minus_the_advantage_aggregated_by_the_loss_type(loss_type, processes, expected):
    trainer = _Trainer(processes, loss_type)
    logps = _logps()
    loss, metrics = trainer.policy_loss(_inputs(), logps)
    assert loss.item() == pytest.approx(expected)
    assert metrics["clip_ratio/region_mean"].item() == 0.0
    if loss_type == "dapo":
        loss.backward()  # d(-A r)/d logp = -A on a valid token (r = 1), / total_tokens, x processes; padding 0
        scale = processes / 3
        assert logps.grad.flatten().tolist() == pytest.approx([-scale, -scale, 0.0, 0.5 * scale, 0.0, 0.0])


def test_sampler_logps_weigh_tokens_only_when_the_correction_is_on():
    # old = trainer log-probs; the sampler gave the first token ln 4 less (ratio 4, capped at 2) and the
    # second ln 2 more (ratio 1/2)
    old = torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    sampler = old + torch.tensor([[-math.log(4), math.log(2), 0.0], [0.0, 0.0, 0.0]])
    inputs = _inputs(old_logps=old, sampler_logps=sampler)
    logps = old.clone().requires_grad_(True)
    plain, metrics = _Trainer(loss_type="dapo").policy_loss(inputs, logps)
    assert plain.item() == pytest.approx((-1.0 - 1.0 + 0.5) / 3)
    # the mismatch is logged either way: mean |old - sampler| over the 3 valid tokens, its max
    assert metrics["sampler/logp_diff_mean"].item() == pytest.approx((math.log(4) + math.log(2)) / 3)
    assert metrics["sampler/logp_diff_max"].item() == pytest.approx(math.log(4))
    corrected, _ = _Trainer(loss_type="dapo", vllm_importance_sampling_correction=True).policy_loss(inputs, logps)
    assert corrected.item() == pytest.approx((-1.0 * 2 - 1.0 * 0.5 + 0.5 * 1) / 3)


def test_router_aux_loss_is_added_per_micro_batch_only_with_a_coefficient():
    trainer = _Trainer()
    loss, outputs = torch.tensor(1.0), SimpleNamespace(aux_loss=torch.tensor(2.0))
    metrics = {}
    assert trainer.add_router_aux_loss(loss, outputs, metrics).item() == 1.0 and metrics == {}
    trainer.router_aux_loss_coef = 0.5
    assert trainer.add_router_aux_loss(loss, outputs, metrics).item() == pytest.approx(1.0 + 0.5 * 2.0 / 4)
    assert metrics["aux_loss"].item() == 2.0
    assert trainer.add_router_aux_loss(loss, SimpleNamespace(), {}).item() == 1.0  # a model without one


def test_compute_loss_records_the_masked_mean_entropy():
    trainer = _Trainer()
    entropy = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    trainer.completion_logps = lambda model, inputs, **kw: (_logps(), entropy)
    loss = trainer.compute_loss(None, _inputs())
    assert loss.item() == pytest.approx((-1.0 + 0.5) / 2)
    (metrics,) = trainer.recorded
    assert metrics["entropy"].item() == pytest.approx((1.0 + 3.0 + 5.0) / 3)  # padding's 100s left out
    loss, outputs = trainer.compute_loss(None, _inputs(), return_outputs=True)
    assert outputs is None
