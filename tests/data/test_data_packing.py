"""Packing, collation and the invariant that packed / padding-free batches compute exactly what each
sequence computes alone."""

import pytest
import torch
from datasets import Dataset

from posttrain.data.collators import IGNORE_INDEX, LanguageModelingCollator
from posttrain.data.packing import _bfd_bins, pack_dataset, pack_sequences


def test_bfd_bins_by_hand():
    # capacity 10, lengths: 7 6 5 4 3 2 -> longest first, best fit:
    # 7 -> bin0 (room 3); 6 -> bin1 (4); 5 -> bin2 (5); 4 -> bin1 (0); 3 -> bin0 (0); 2 -> bin2 (3)
    bins = _bfd_bins([7, 6, 5, 4, 3, 2], 10)
    assert bins == [[0, 4], [1, 3], [2, 5]]


def test_pack_dataset_bfd_keeps_sequences_whole():
    ds = Dataset.from_dict(
        {
            "input_ids": [[1] * 7, [2] * 6, [3] * 5, [4] * 4, [5] * 3, [6] * 2],
            "completion_mask": [[1] * 7, [0] * 6, [1] * 5, [0] * 4, [1] * 3, [1] * 2],
            "other": ["a", "b", "c", "d", "e", "f"],
        }
    )
    packed = pack_sequences(ds, 10, "bfd")  # the trainer-side packing drops non-token columns
    assert packed.column_names == ["input_ids", "completion_mask", "seq_lengths"]
    assert packed["seq_lengths"] == [[7, 3], [6, 4], [5, 2]]
    assert packed["input_ids"][0] == [1] * 7 + [5] * 3
    assert packed["completion_mask"][1] == [0] * 10


def test_pack_dataset_bfd_truncates_or_splits_long_sequences():
    ds = Dataset.from_dict({"input_ids": [list(range(13)), [7, 7]]})
    truncated = pack_dataset(ds, 5, "bfd")
    assert sorted(sum(truncated["seq_lengths"], [])) == [2, 5]
    split = pack_dataset(ds, 5, "bfd_split")
    assert sorted(sum(split["seq_lengths"], [])) == [2, 3, 5, 5]
    assert sorted(t for row in split["input_ids"] for t in row) == sorted(list(range(13)) + [7, 7])


def test_pack_dataset_wrapped_cuts_every_seq_length():
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8, 9]]})
    packed = pack_sequences(ds, 4, "wrapped")
    assert packed["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert packed["seq_lengths"] == [[3, 1], [3, 1], [1]]  # posttrain keeps the boundaries
    trl_style = pack_dataset(ds, 4, "wrapped")
    assert trl_style.column_names == ["input_ids"] and trl_style["input_ids"] == packed["input_ids"]


def test_pack_sequences_wrapped_boundaries_only_at_sequence_ends():
    # A 13-token sequence spans several rows: its positions continue across its own pieces (no restart
    # inside it), and restart only where the next sequence begins.
    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], list(range(10, 23))]})
    packed = pack_sequences(ds, 5, "wrapped")
    assert packed["seq_lengths"] == [[3, 2], [5], [5], [1]]


def test_padded_collator_labels_element_by_element():
    collate = LanguageModelingCollator(pad_token_id=0)
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
            {"input_ids": [8, 9], "completion_mask": [1, 0]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_padding_free_collator_position_ids_and_labels():
    collate = LanguageModelingCollator(pad_token_id=0, padding_free=True)
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "completion_mask": [1, 1, 1]},
            {"input_ids": [8, 9, 10, 11, 12], "completion_mask": [0, 0, 1, 1, 1], "seq_lengths": [2, 3]},
        ]
    )
    assert "attention_mask" not in batch and batch["use_cache"] is False
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    # First token of every sequence is never a target; untrained tokens are -100.
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100, -100, 11, 12]]


def test_per_row_padding_free_collator_element_by_element():
    collate = LanguageModelingCollator(pad_token_id=0, padding_free=True, one_row=False)
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "completion_mask": [1, 1, 1]},
            {"input_ids": [8, 9, 10, 11, 12], "completion_mask": [0, 0, 1, 1, 1], "seq_lengths": [2, 3]},
            {"input_ids": [13], "completion_mask": [1]},
        ]
    )
    assert "attention_mask" not in batch and batch["use_cache"] is False
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12], [13, 0, 0, 0, 0]]
    # The padding tail of each row is one more sequence (positions from 0) that is never trained.
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2], [0, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100, -100, -100, 11, 12], [-100] * 5]


@pytest.mark.parametrize("one_row", [True, False])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_logits_equal_each_sequence_alone(tiny_model_path, attn, one_row):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attn).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 1, 7, 4)]
    # Two packed examples and a plain one: in the per-row layout rows get padding tails of 6 and 10 tokens.
    examples = [
        {"input_ids": seqs[0] + seqs[1], "seq_lengths": [5, 9]},
        {"input_ids": seqs[2] + seqs[3], "seq_lengths": [1, 7]},
        {"input_ids": seqs[4]},
    ]
    batch = LanguageModelingCollator(0, padding_free=True, one_row=one_row)(examples)
    assert batch["input_ids"].shape[0] == (1 if one_row else 3)
    real = batch["input_ids"] != 0  # the random sequences never contain the pad id 0
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[real]
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # The same batch with plain positions (no restarts) would mix sequences: the check has teeth.
    with torch.no_grad():
        mixed = model(input_ids=batch["input_ids"]).logits[real]
    assert (mixed - alone).abs().max() > 1e-3


def test_packed_rows_logits_equal_alone(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ds = Dataset.from_dict({"input_ids": [[10, 11, 12, 13], [20, 21], [30, 31, 32], [40]]})
    packed = pack_dataset(ds, 6, "bfd")
    batch = LanguageModelingCollator(0)([packed[i] for i in range(len(packed))])
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    offset = 0
    for row in packed:
        start = 0
        for n in row["seq_lengths"]:
            ids = row["input_ids"][start : start + n]
            with torch.no_grad():
                alone = model(input_ids=torch.tensor([ids])).logits[0]
            torch.testing.assert_close(logits[offset : offset + n], alone, atol=1e-5, rtol=1e-5)
            offset += n
            start += n


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_pack_dataset_keeps_a_streams_format(strategy):
    """A stream (IterableDataset) has no .format; its format type survives packing as a map-style dataset's does."""
    stream = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7], [8]]}).to_iterable_dataset().with_format("numpy")
    packed = pack_dataset(stream, 4, strategy=strategy)
    assert packed._formatting.format_type == "numpy"
    rows = [list(map(int, row["input_ids"])) for row in packed]
    assert rows == ([[4, 5, 6, 7], [1, 2, 3, 8]] if strategy == "bfd" else [[1, 2, 3, 4], [5, 6, 7, 8]])
