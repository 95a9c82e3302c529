"""TRL's vision collators at TRL's paths (posttrain.trainer.{sft,dpo,kto}_trainer) give TRL 1.16's batches on the
same tiny batch, for each tiny vision-language architecture: the same keys, shapes and values (token ids compared
where the attention mask is 1: the padding id differs, see posttrain/data/trl_vision_collators.py)."""

import copy

import pytest
import torch
from _trl import import_trl
from _vlm import ARCHS, messages_data, preference_data, prompt_completion_data, vlm_paths  # noqa: F401
from transformers import AutoProcessor

import posttrain.trainer.dpo_trainer as ours_dpo
import posttrain.trainer.kto_trainer as ours_kto
import posttrain.trainer.sft_trainer as ours_sft


def _same_batches(theirs: dict, ours: dict) -> None:
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        assert value.shape == ours[key].shape, key
        if key.endswith("input_ids"):
            mask = theirs[key.replace("input_ids", "attention_mask")].bool()
            assert torch.equal(value[mask], ours[key][mask]), key
        else:
            assert torch.equal(value, ours[key]), key


def _unpaired_rows(n: int = 3) -> list[dict]:
    return [
        dict(images=r["images"], prompt=r["prompt"], completion=r["chosen" if i % 2 else "rejected"], label=i % 2 == 0)
        for i, r in enumerate(preference_data(n))
    ]


@pytest.fixture(scope="module")
def trl_trainer_modules():
    import_trl("dpo_trainer", "kto_trainer", "sft_trainer")
    import trl.trainer.dpo_trainer as dpo
    import trl.trainer.kto_trainer as kto
    import trl.trainer.sft_trainer as sft

    return dpo, kto, sft


@pytest.mark.parametrize("arch", ARCHS)
def test_vision_collators_match_trl(vlm_paths, trl_trainer_modules, arch):  # noqa: F811
    dpo, kto, sft = trl_trainer_modules
    processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    rows = list(preference_data(3))
    _same_batches(
        dpo.DataCollatorForVisionPreference(processor)(copy.deepcopy(rows)),
        ours_dpo.DataCollatorForVisionPreference(processor)(copy.deepcopy(rows)),
    )
    for rows, options in (
        (list(prompt_completion_data(3)), {}),
        (list(prompt_completion_data(3)), {"completion_only_loss": True}),
        (list(messages_data(3)), {}),
    ):
        _same_batches(
            sft.DataCollatorForVisionLanguageModeling(processor, **options)(copy.deepcopy(rows)),
            ours_sft.DataCollatorForVisionLanguageModeling(processor, **options)(copy.deepcopy(rows)),
        )
    rows = _unpaired_rows()
    for calculate_kl in (True, False):
        _same_batches(
            kto.DataCollatorForVisionUnpairedPreference(processor, calculate_kl=calculate_kl)(copy.deepcopy(rows)),
            ours_kto.DataCollatorForVisionUnpairedPreference(processor, calculate_kl=calculate_kl)(copy.deepcopy(rows)),
        )


def test_unpaired_kl_rows_pair_each_prompt_with_the_previous_completion(vlm_paths):  # noqa: F811
    """Independent of TRL: KL row i is row i's prompt followed by row i-1's completion (row 0 takes the last)."""
    processor = AutoProcessor.from_pretrained(vlm_paths["llava"])
    rows = _unpaired_rows()
    batch = ours_kto.DataCollatorForVisionUnpairedPreference(processor)(rows)
    completions = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["completion_mask"])]
    kl = [ids[mask.bool()].tolist() for ids, mask in zip(batch["KL_input_ids"], batch["KL_completion_mask"])]
    assert kl == completions[-1:] + completions[:-1]
    assert batch["label"].tolist() == [True, False, True]


def _same_chatml_batches(theirs: dict, ours: dict) -> None:
    """TRL's and posttrain's ChatML batches: texts as lists, every tensor equal (padding included: both pad with
    the processor's own padding)."""
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert value.shape == ours[key].shape and torch.equal(value, ours[key]), key
        else:
            assert value == ours[key], key


@pytest.mark.parametrize("arch", ARCHS)
def test_vision_chatml_collator_matches_trl(vlm_paths, arch):  # noqa: F811
    from _trl import import_trl_experimental

    from posttrain.experimental.utils import DataCollatorForVisionLanguageChatML

    theirs = import_trl_experimental("utils").DataCollatorForVisionLanguageChatML
    processor = AutoProcessor.from_pretrained(vlm_paths[arch])
    conversational = list(prompt_completion_data(3))
    from _vlm import PLACEHOLDER

    prompt = f"{PLACEHOLDER[arch]} look:"
    plain = [dict(image=r["images"][0], prompt=prompt, completion=f" digit {i}") for i, r in enumerate(conversational)]
    for rows, max_length in ((conversational, None), (conversational, 40), (plain, None)):
        expected = theirs(processor, max_length=max_length)(copy.deepcopy(rows))
        got = DataCollatorForVisionLanguageChatML(processor, max_length=max_length)(copy.deepcopy(rows))
        _same_chatml_batches(expected, got)
        assert (got["labels"] != -100).any() and got["byte_offsets"][..., 1].max() > 0
