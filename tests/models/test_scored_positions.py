"""models/scored_positions.py: the last layer computed at the read positions only gives the stock classifier's scores
and gradients (float64, to rounding), through the reward trainer's layouts too; families it does not know, and a
wrapped model, keep the whole forward."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from posttrain.models.scored_positions import hidden_at, last_layer_parts
from posttrain.models.tiny import build_tiny_tokenizer, tiny_config


def _classifier(family, layers=2, seed=0, **settings):
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(tokenizer, family, 32, layers, True, **settings)
    config.num_labels = 1
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config).double(), tokenizer


def _batch(pad_id, lengths=(9, 5, 12, 3), vocab=100, seed=1):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, vocab, (length,), generator=generator)
        mask[row, :length] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_scores_and_gradients_equal_the_stock_classifier(family, layers):
    model, tokenizer = _classifier(family, layers)
    ids, mask = _batch(model.config.pad_token_id)
    reference = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    expected = torch.autograd.grad(reference.pow(2).sum(), [p for p in model.parameters()])
    decoder, layer = model.model, last_layer_parts(model.model)
    assert layer is model.model.layers[-1]
    last = (torch.arange(ids.shape[1]) * (ids != model.config.pad_token_id)).argmax(-1)
    where = torch.arange(ids.numel()).view_as(ids)[torch.arange(len(ids)), last]
    scores = model.score(hidden_at(model, decoder, layer, {"input_ids": ids, "attention_mask": mask}, where))
    scores = scores.squeeze(-1)
    torch.testing.assert_close(scores, reference, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(scores.pow(2).sum(), [p for p in model.parameters()])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_under_a_4d_shared_prompt_mask_each_read_position_sees_only_its_sequence():
    """Two sequences sharing a prompt in one row (the reward trainer's layout): each score equals the sequence's
    own forward alone."""
    model, _ = _classifier("qwen2")
    prompt, first, second = [7, 8, 9, 10], [11, 12, 13], [14, 15]
    ids = torch.tensor([prompt + first + second])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 4, 5]])
    segment = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    causal = torch.arange(9)[None, :] <= torch.arange(9)[:, None]
    allowed = causal & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    inputs = {"input_ids": ids, "position_ids": positions, "attention_mask": allowed[None, None]}
    hidden = hidden_at(model, model.model, last_layer_parts(model.model), inputs, torch.tensor([6, 8]))
    alone = [model(input_ids=torch.tensor([prompt + s])).logits[0, 0] for s in (first, second)]
    torch.testing.assert_close(model.score(hidden).squeeze(-1), torch.stack(alone), rtol=1e-12, atol=1e-12)


def test_families_it_does_not_know_are_left_to_the_whole_forward():
    gemma, _ = _classifier("gemma3")  # sandwich norms
    assert last_layer_parts(gemma.model) is None
    windowed, _ = _classifier("mistral", sliding_window=4)
    assert last_layer_parts(windowed.model) is None


def test_reward_trainer_scores_equal_the_stock_classifier(tmp_path):
    """The trainer's own `_scores` (shared-prompt layout or padded rows, last layer at the scored positions)."""
    from datasets import Dataset

    from posttrain import RewardConfig, RewardTrainer

    model, tokenizer = _classifier("qwen2", seed=3)
    rows = [
        {"prompt": "the sky is", "chosen": " blue" * (1 + i % 3), "rejected": " red green" * (1 + i % 2)}
        for i in range(8)
    ]
    args = RewardConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        write_report=False,
        save_strategy="no",
    )
    trainer = RewardTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    scores = trainer._scores(trainer.model, batch["input_ids"], batch["attention_mask"])
    reference = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(scores, reference.squeeze(-1), rtol=1e-10, atol=1e-12)
