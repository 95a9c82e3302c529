"""The one padding routine (posttrain.data.batches.pad / pad_rows) that the collators, the TRL-named collators and
the rollout all pad through: edge cases checked against hand-written tensors."""

import pytest
import torch

from posttrain.data.batches import pad, pad_rows
from posttrain.data.collators import LanguageModelingCollator
from posttrain.online import rollout
from posttrain.trainer import utils


def test_lists_right_and_left_with_a_multiple():
    rows = [[5, 6, 7], [8]]
    assert pad(rows, 0).tolist() == [[5, 6, 7], [8, 0, 0]]
    assert pad(rows, 9, "left").tolist() == [[5, 6, 7], [9, 9, 8]]
    assert pad(rows, 0, "right", 4).tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert pad(rows, 0, "left", 4).tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    # a width already a multiple is not grown
    assert pad(rows, 0, "right", 3).shape == (2, 3)


def test_ids_stay_long_even_with_empty_rows_and_an_empty_batch():
    assert pad([[1, 2], [3]], 0).dtype == torch.long
    empty_row = pad([[], [4, 5]], -100)
    assert empty_row.dtype == torch.long
    assert empty_row.tolist() == [[-100, -100], [4, 5]]
    only_empty = pad([[], []], 0, pad_to_multiple_of=8)
    assert only_empty.shape == (2, 0) and only_empty.dtype == torch.long
    none = pad([], 0, pad_to_multiple_of=8)
    assert none.shape == (0, 0) and none.dtype == torch.long


def test_tensors_keep_their_dtype_unless_one_is_given():
    floats = pad([torch.tensor([0.5, 1.5]), torch.tensor([2.5])], float("nan"))
    assert floats.dtype == torch.float32
    assert floats[1, 1].isnan() and floats[0].tolist() == [0.5, 1.5]
    assert pad([[1, 2]], 0, dtype=torch.int32).dtype == torch.int32
    two_d = pad([torch.ones(2, 3), torch.ones(1, 1)], 0, "left")
    assert two_d.shape == (2, 2, 3) and two_d[1].tolist() == [[0, 0, 0], [0, 0, 1]]


def test_a_bad_side_is_named():
    with pytest.raises(ValueError, match="padding_side"):
        pad([[1]], 0, "middle")


def test_pad_rows_gives_the_mask_of_the_real_positions():
    ids, mask = pad_rows([[1, 2, 3], [], [4]], 0, left=True, multiple=2)
    assert ids.tolist() == [[0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 0, 4]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long
    ids, mask = pad_rows([[7], [8, 9]], 3, left=False)
    assert ids.tolist() == [[7, 3], [8, 9]] and mask.tolist() == [[1, 0], [1, 1]]


def test_every_face_is_the_one_routine():
    assert utils.pad is pad
    assert rollout.pad_rows is pad_rows
    batch = LanguageModelingCollator(pad_token_id=0, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
