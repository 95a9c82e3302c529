"""Reference log-probs kept per row (`cache_ref_log_probs`, on by default): a row's reference forward runs once,
later epochs and evaluations reuse its values, and training is the same as with a reference forward every step."""

import pytest
import torch
from datasets import Dataset

from posttrain import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from posttrain.data.preference import PreferenceCollator
from posttrain.training.reference_memo import DIGESTS, ReferenceMemo, row_digests

WORDS = "cat dog sun moon tree fish bird sky red green blue one two three".split()


def _common(tmp_path, **kw):
    return dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        max_length=64,
        disable_tqdm=True,
        **kw,
    )


def _pairs(n=8):
    return Dataset.from_list(
        [
            {
                "prompt": f"the {WORDS[i]} is" + " very" * (i % 3),
                "chosen": " so" * (i % 2) + " good",
                "rejected": " bad" * (1 + i % 3),
            }
            for i in range(n)
        ]
    )


def _unpaired(n=8):
    return Dataset.from_list(
        [
            {
                "prompt": f"{WORDS[i]} is",
                "completion": (" good" if i % 2 == 0 else " bad") + f" {WORDS[(3 * i) % 14]}" * (1 + i % 3),
                "label": i % 2 == 0,
            }
            for i in range(n)
        ]
    )


def _count_reference_forwards(trainer) -> list[int]:
    """From now on, the list gets one entry per batch that goes through the reference."""
    calls = []
    original = trainer.reference_columns

    def counted(reference, batch):
        calls.append(len(batch["input_ids"]))
        return original(reference, batch)

    trainer.reference_columns = counted
    return calls


def _train_counting_reference(trainer) -> tuple[list[float], list[int]]:
    """Trains; returns the logged losses and the reference forwards (one entry per batch)."""
    calls = _count_reference_forwards(trainer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], calls


def test_digests_tell_rows_apart_by_content_and_by_column():
    rows = [{"a": [1, 2], "b": [3]}, {"a": [1], "b": [2, 3]}, {"a": [1, 2], "b": [3]}, {"a": [1, 2], "b": [4]}]
    digests = row_digests(rows, ("a", "b"))
    assert digests.shape == (4, 2) and digests.dtype == torch.int64
    assert torch.equal(digests[0], digests[2])  # same content, same digest
    assert not torch.equal(digests[0], digests[1])  # the same token stream split differently is another row
    assert not torch.equal(digests[0], digests[3])
    assert torch.equal(row_digests([{"a": torch.tensor([1, 2]), "b": [3]}], ("a", "b"))[0], digests[0])


def test_memo_answers_only_when_every_row_is_known_and_keeps_the_dtype():
    memo = ReferenceMemo(("x", "y"))
    digests = row_digests([{"a": [i]} for i in range(3)], ("a",))
    values = {"x": torch.tensor([0.1, 0.2], dtype=torch.float64), "y": torch.tensor([-1.5, 2.5], dtype=torch.float64)}
    memo.store(digests[:2], values)
    assert memo.lookup(digests, None) is None  # row 2 unknown
    known = memo.lookup(digests[[1, 0]], None)
    assert known["x"].dtype == torch.float64
    assert torch.equal(known["x"], torch.tensor([0.2, 0.1], dtype=torch.float64))
    assert torch.equal(known["y"], torch.tensor([2.5, -1.5], dtype=torch.float64))


def test_memo_state_round_trips_values_and_dtype_exactly(tmp_path):
    """A checkpoint's memo (through torch.save) answers as the memo it was taken from, bits and dtype."""
    memo = ReferenceMemo(("x", "y"))
    assert memo.state_dict()["digests"].shape == (0, 2)  # an empty memo saves too
    digests = row_digests([{"a": [i]} for i in range(3)], ("a",))
    values = {"x": torch.randn(3, dtype=torch.float32), "y": torch.randn(3, dtype=torch.float32) * 1e-7}
    memo.store(digests, values)
    torch.save(memo.state_dict(), tmp_path / "memo.pt")
    loaded = ReferenceMemo(("x", "y"))
    loaded.load_state_dict(torch.load(tmp_path / "memo.pt"))
    assert len(loaded) == 3
    known = loaded.lookup(digests[[2, 0, 1]], None)
    assert known["x"].dtype == torch.float32
    assert torch.equal(known["x"], values["x"][[2, 0, 1]]) and torch.equal(known["y"], values["y"][[2, 0, 1]])


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_later_epochs_skip_the_reference_and_train_as_without_the_memo(method, tmp_path, tiny_model_path):
    def make(cache: bool, out: str):
        if method == "dpo":
            return DPOTrainer(
                tiny_model_path,
                args=DPOConfig(**_common(tmp_path / out, cache_ref_log_probs=cache)),
                train_dataset=_pairs(),
                eval_dataset=_pairs(),
            )
        return KTOTrainer(
            tiny_model_path,
            args=KTOConfig(**_common(tmp_path / out, cache_ref_log_probs=cache)),
            train_dataset=_unpaired(),
            eval_dataset=_unpaired(),
        )

    cached = make(True, "cached")
    assert cached.ref_memo is not None
    losses, forwards = _train_counting_reference(cached)
    plain = make(False, "plain")
    assert plain.ref_memo is None
    plain_losses, plain_forwards = _train_counting_reference(plain)
    assert len(losses) == 6 and len(plain_forwards) == 6
    assert len(forwards) == 2  # the first epoch's two batches only (the shuffled later epochs meet known rows)
    assert len(cached.ref_memo) == 8
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    for name, value in cached.model.named_parameters():
        torch.testing.assert_close(value, dict(plain.model.named_parameters())[name], atol=1e-6, rtol=0)
    # The evaluation set holds the training rows: their reference values are known, and give the same loss.
    eval_loss = cached.evaluate()["eval_loss"]
    assert len(forwards) == 2
    assert eval_loss == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5)
    assert len(plain_forwards) == 7  # one evaluation batch of 8 rows


def test_a_batch_with_one_new_row_runs_the_reference(tmp_path, tiny_model_path):
    trainer = KTOTrainer(tiny_model_path, args=KTOConfig(**_common(tmp_path)), train_dataset=_unpaired())
    rows = [trainer.train_dataset[i] for i in range(8)]
    calls = _count_reference_forwards(trainer)
    model = trainer.model.eval()
    with torch.no_grad():
        first = trainer.compute_loss(model, trainer._prepare_inputs(trainer.data_collator(rows[:4])))
        again = trainer.compute_loss(model, trainer._prepare_inputs(trainer.data_collator(rows[:4])))
        assert len(calls) == 1 and torch.equal(first, again)
        trainer.compute_loss(model, trainer._prepare_inputs(trainer.data_collator(rows[:3] + rows[4:5])))
        assert len(calls) == 2


@pytest.mark.parametrize("setting", ["sync_ref_model", "own_collator"])
def test_no_memo_when_the_reference_moves_or_the_collator_is_the_users(setting, tmp_path, tiny_model_path):
    kwargs, extra = {}, {}
    if setting == "sync_ref_model":
        kwargs = dict(sync_ref_model=True, ref_model_sync_steps=1)
    else:
        extra = dict(data_collator=PreferenceCollator(0))
    trainer = DPOTrainer(
        tiny_model_path, args=DPOConfig(**_common(tmp_path, **kwargs)), train_dataset=_pairs(), **extra
    )
    assert trainer.ref_memo is None
    assert DIGESTS not in trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    _, forwards = _train_counting_reference(trainer)
    assert len(forwards) == 6
