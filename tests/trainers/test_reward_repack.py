"""RewardTrainer scores a padded batch on a cheaper layout — each pair's prompt computed once under a 4D mask, or
the sequences repacked into fewer rows: the same scores and gradients as the classifier's own forward on the padded
batch, including its choice of the rightmost non-padding token."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

from posttrain import RewardConfig, RewardTrainer
from posttrain.models.tiny import FAMILIES


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory):
    """A tiny causal LM per family (windows of 128 tokens: the shared prompt's 4D mask is used on the windowed
    families too)."""
    from posttrain.models.tiny import FAMILIES, save_tiny_model

    root = tmp_path_factory.mktemp("families")
    windows = {"gemma3": {"sliding_window": 128}, "mistral": {"sliding_window": 128}}
    paths = {family: save_tiny_model(root / family, family=family, **windows.get(family, {})) for family in FAMILIES}
    # Windows of 8 tokens, shorter than the sequences: the shared layout's masks apply them (`windowed_masks`).
    for family in ("gemma3", "mistral"):
        paths[f"{family}-window8"] = save_tiny_model(root / f"{family}-8", family=family)
    qwen2 = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    paths["qwen2-window8"] = save_tiny_model(root / "qwen2-8", family="qwen2", **qwen2)
    return paths


def _trainer(tmp_path, model_path):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
    rows = [
        {"prompt": "the " * n + "sky is", "chosen": " blue" * (1 + n % 3), "rejected": " red"} for n in (1, 12, 3, 20)
    ]
    args = RewardConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    return RewardTrainer(model, args=args, train_dataset=Dataset.from_list(rows))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FAMILY_CASES = [("llama", False), ("llama", True)] + [(f, False) for f in FAMILIES if f != "llama"]
FAMILY_CASES += [("gemma3-window8", False), ("mistral-window8", False), ("qwen2-window8", False)]


@pytest.mark.parametrize("layout", ["shared_prompt", "repacked"])
@pytest.mark.parametrize(("family", "trailing_pad"), FAMILY_CASES)
def test_cheaper_layouts_give_the_scores_and_gradients_of_the_padded_forward(
    tmp_path, family_paths, family, trailing_pad, layout, monkeypatch
):
    """On every family's sequence classifier: the layouts need only a decoder built with transformers' mask
    functions and a linear score head, whatever the family."""
    import posttrain.trainers.reward as reward

    if layout == "repacked":
        monkeypatch.setattr(reward, "model_shared_layout", lambda *args: None)
    trainer = _trainer(tmp_path, family_paths[family])
    model = trainer.model
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"]
    if trailing_pad:  # a sequence whose last real token is the pad id: the classifier reads the token before it
        ids[0, int(mask[0].sum()) - 1] = model.config.pad_token_id
    lengths = mask.sum(-1)
    assert (lengths.max() * len(lengths) - lengths.sum()) / (lengths.max() * len(lengths)) > 0.3  # worth repacking
    model.train()
    expected = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    expected.pow(2).sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    seen = []
    handle = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            ((args[0] if args else kwargs["input_ids"]).shape, kwargs.get("attention_mask"))
        ),
        with_kwargs=True,
    )
    got = trainer._scores(model, ids, mask)
    handle.remove()
    ((shape, attention_mask),) = seen
    assert shape[0] < ids.shape[0]  # the decoder ran on fewer rows than the padded batch has
    if layout == "shared_prompt":  # each pair's prompt once: fewer positions than the sequences' tokens
        if isinstance(attention_mask, dict):  # by layer type: the sliding layers' mask keeps to the window
            cut = not torch.equal(attention_mask["sliding_attention"], attention_mask["full_attention"])
            assert cut == family.endswith("window8")
            attention_mask = attention_mask["full_attention"]
        assert attention_mask.dim() == 4 and shape[0] * shape[1] < lengths.sum()
    else:
        assert attention_mask is None
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grads = _grads(model)
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5)
