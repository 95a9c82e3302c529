"""Gaps that TRL's own test suite found (scripts/trl_testsuite.sh), each closed with posttrain's own check: TRL's
attributes and error texts on the stable trainers."""

import pytest

from posttrain import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from posttrain.errors import DataError


@pytest.mark.parametrize(
    "trainer_cls, config_cls",
    [(SFTTrainer, SFTConfig), (DPOTrainer, DPOConfig), (KTOTrainer, KTOConfig), (RewardTrainer, RewardConfig)],
)
def test_stable_offline_trainers_require_a_train_dataset(tmp_path, tiny_model_path, trainer_cls, config_cls):
    args = config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(DataError, match="`train_dataset` is required"):  # TRL's words
        trainer_cls(tiny_model_path, args=args)


def test_grpo_high_entropy_mask_takes_trls_quantile_threshold_over_all_processes():
    from types import SimpleNamespace

    import torch

    from posttrain import GRPOTrainer

    other_process = torch.tensor([5.0, 6.0])  # a second process's valid entropies raise the threshold

    def gather(local):
        return torch.cat([local, other_process, torch.tensor([-1.0])])  # -1: padding between processes

    fake = SimpleNamespace(accelerator=SimpleNamespace(gather=gather, pad_across_processes=lambda x, dim, pad_index: x))
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    population = torch.cat([entropies[mask.bool()], other_process])
    for threshold in (0.0, 0.5, 0.8, 1.0):
        got = GRPOTrainer.get_high_entropy_mask(fake, entropies, mask, threshold)
        expected = (entropies >= torch.quantile(population, threshold)) & mask.bool()
        assert torch.equal(got, expected), threshold
    assert GRPOTrainer.get_high_entropy_mask(fake, entropies, mask, 0.8).sum() == 1  # only 1.0 of the valid ones
    assert not GRPOTrainer.get_high_entropy_mask(fake, entropies, mask, 1.0).any()  # max is the other process's


def test_grpo_off_policy_mask_in_trls_argument_order():
    import torch

    from posttrain import GRPOTrainer

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    logps = torch.tensor([[-2.0, -2.0, 1e4], [-0.5, -0.5, -0.5], [-2.0, -2.0, -2.0]])
    advantages = torch.tensor([[-1.0], [-1.0], [1.0]])
    keep = GRPOTrainer.get_off_policy_mask(advantages, logps, torch.zeros(3, 3), mask, 1.0)
    # row 0: negative advantage, mean KL 2 over its valid tokens (the padded 1e4 ignored) -> dropped
    assert keep.tolist() == [[0.0], [1.0], [1.0]]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_warns_when_built_that_sequence_level_ratios_with_token_sums_weigh_by_length(
    tmp_path, tiny_model_path, caplog, loss_type
):
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        importance_sampling_level="sequence",
        loss_type=loss_type,
        per_device_train_batch_size=4,
        num_generations=2,
        report_to="none",
        use_cpu=True,
    )
    with caplog.at_level("WARNING"):
        GRPOTrainer(
            tiny_model_path,
            lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a b", "c d", "e f", "g h"]}),
        )
    assert ("weights each sequence by its completion length" in caplog.text) == (loss_type != "grpo")
