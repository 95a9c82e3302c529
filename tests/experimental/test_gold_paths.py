"""GOLD at TRL's module paths (`posttrain.experimental.gold.gold_trainer`, `posttrain.experimental.utils`): the
`ULDLoss` module and `build_teacher_inputs_from_texts` equal TRL 1.16's on the same inputs, the byte-offset helpers
equal TRL's and the text's own UTF-8 bytes, GOLD's on-policy step returns the decoded texts, and the generalized JSD
on probabilities matches a float64 reference."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from _trl import import_trl_experimental
from test_gold import _random_pair, teacher_tokenizer_path  # noqa: F401 (a fixture)
from transformers import AutoTokenizer

from posttrain.experimental.gold import GOLDTrainer
from posttrain.experimental.gold.gold_trainer import ULDLoss, build_teacher_inputs_from_texts
from posttrain.experimental.utils import encode_with_byte_offsets, pad_byte_offsets


def _config(**overrides):
    settings = dict(
        uld_crossentropy_weight=0.3,
        uld_distillation_weight=0.7,
        uld_student_temperature=1.2,
        uld_teacher_temperature=0.9,
        uld_skip_student_eos=True,
        uld_skip_teacher_eos=False,
        use_extended_uld=True,
        uld_token_merge_strategy="observed",
        uld_use_hybrid_loss=False,
        uld_hybrid_matched_weight=None,
        uld_hybrid_unmatched_weight=None,
        beta=0.5,
    )
    return SimpleNamespace(**{**settings, **overrides})


def _batch(sides):
    """Rows of (logits, labels, offsets) right-padded to one width: labels -100, offsets (0, 0)."""
    width = max(len(labels) for _, labels, _ in sides)
    logits = torch.zeros(len(sides), width, sides[0][0].shape[-1], dtype=torch.float64)
    labels = torch.full((len(sides), width), -100)
    offsets = torch.zeros(len(sides), width, 2, dtype=torch.long)
    for i, (row_logits, row_labels, row_offsets) in enumerate(sides):
        n = len(row_labels)
        logits[i, :n], labels[i, :n], offsets[i, :n] = row_logits, row_labels, row_offsets
    return logits, labels, labels.clamp(min=0), offsets


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(uld_token_merge_strategy="bayesian"), dict(use_extended_uld=False), dict(uld_skip_student_eos=False)],
)
def test_uld_loss_module_equals_trls(settings):
    gold = import_trl_experimental("gold.gold_trainer")
    config = _config(**settings)
    g, rng = torch.Generator().manual_seed(5), random.Random(5)
    pairs = [_random_pair(g, rng) for _ in range(3)]
    student = _batch([s for s, _ in pairs])
    teacher = _batch([t for _, t in pairs])
    args = (student[0], teacher[0], student[1], teacher[1], student[2], teacher[2], student[3], teacher[3])
    ours, theirs = ULDLoss(config)(*args), gold.ULDLoss(config)(*args)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)  # the NLL term is summed in float32
    config.uld_crossentropy_weight = 0.0  # the ULD term alone, in float64
    assert ULDLoss(config)(*args).item() == pytest.approx(gold.ULDLoss(config)(*args).item(), rel=1e-9)


def test_teacher_inputs_equal_trls(tokenizer):
    gold = import_trl_experimental("gold.gold_trainer")
    prompts = ["Hi?", "Explain gravity in detail please"]
    completions = ["Hello there, naïve café!", "OK"]
    for extended in (True, False):
        ours = build_teacher_inputs_from_texts(tokenizer, prompts, completions, use_extended_uld=extended)
        theirs = gold.build_teacher_inputs_from_texts(tokenizer, prompts, completions, use_extended_uld=extended)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_byte_offsets_spell_the_texts_utf8_bytes(tokenizer, teacher_tokenizer_path):  # noqa: F811
    utils = import_trl_experimental("utils")
    texts = ["naïve café — 1+1=2", "plain ascii", "日本語 and emoji 🙂"]
    for tok in (tokenizer, AutoTokenizer.from_pretrained(teacher_tokenizer_path)):
        ours = encode_with_byte_offsets(tok.backend_tokenizer, texts)
        assert ours == utils.encode_with_byte_offsets(tok.backend_tokenizer, texts)
        for text, (ids, offsets) in zip(texts, ours):
            data = text.encode("utf-8")
            assert offsets[0][0] == 0 and offsets[-1][1] == len(data)
            assert all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))  # consecutive spans
            assert ids == tok(text, add_special_tokens=False)["input_ids"]
    offsets = [(0, 2), (2, 5)]
    for side in ("left", "right"):
        assert torch.equal(pad_byte_offsets(offsets, 4, side), utils.pad_byte_offsets(offsets, 4, side))
    assert pad_byte_offsets(offsets, 4, "left").tolist() == [[0, 0], [0, 0], [0, 2], [2, 5]]
    assert pad_byte_offsets(offsets, 1, "right").tolist() == [[0, 2], [2, 5]]


def test_on_policy_step_returns_the_decoded_prompt_and_completion(tokenizer):
    prompt = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    answer = tokenizer(" fine thanks", add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = torch.tensor([[pad, pad] + prompt])
    mask = torch.tensor([[0, 0] + [1] * len(prompt)])
    sequences = torch.cat([prompts, torch.tensor([answer + [eos, pad]])], dim=1)

    class Model:
        def generate(self, input_ids, attention_mask, generation_config, return_dict_in_generate):
            assert torch.equal(input_ids, prompts) and torch.equal(attention_mask, mask)
            return SimpleNamespace(sequences=sequences)

    trainer = GOLDTrainer.__new__(GOLDTrainer)
    trainer.processing_class = tokenizer
    ids, attention, labels, prompt_texts, completion_texts = trainer.generate_on_policy_outputs(
        Model(), {"prompts": prompts, "prompt_attention_mask": mask}, SimpleNamespace(eos_token_id=eos)
    )
    width = prompts.shape[1]
    assert torch.equal(ids, sequences) and attention[0].tolist() == mask[0].tolist() + [1] * (len(answer) + 1) + [0]
    assert labels[0, width:].tolist() == answer + [eos, -100]
    assert prompt_texts == ["hello world"]
    assert completion_texts == [tokenizer.decode(answer + [eos], skip_special_tokens=False)]


def test_generalized_jsd_on_probabilities_matches_a_float64_reference():
    student = torch.tensor([[[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]], dtype=torch.float64)
    teacher = torch.tensor([[[0.5, 0.4, 0.1], [0.7, 0.0, 0.3]]], dtype=torch.float64)
    for beta in (0.0, 0.3, 1.0):
        got = GOLDTrainer.generalized_jsd_loss(student, teacher, beta=beta, reduction="sum", logits_are_probs=True)
        ref = 0.0
        for s, t in zip(student[0].tolist(), teacher[0].tolist()):
            s, t = [max(x, 1e-8) for x in s], [max(x, 1e-8) for x in t]
            m = [beta * b + (1 - beta) * a for a, b in zip(s, t)]
            if beta == 0:
                ref += sum(b * math.log(b / a) for a, b in zip(s, t))
            elif beta == 1:
                ref += sum(a * math.log(a / b) for a, b in zip(s, t))
            else:
                ref += beta * sum(b * math.log(b / x) for b, x in zip(t, m))
                ref += (1 - beta) * sum(a * math.log(a / x) for a, x in zip(s, m))
        assert got.item() == pytest.approx(ref, rel=1e-9)


def test_uld_sample_table_shows_what_trls_shows(capsys):
    """TRL's print_prompt_completions_sample_uld: every prompt and completion under the step's title; a
    non-positive num_samples prints nothing; a larger one prints every row (the table's style may differ)."""
    from posttrain.experimental.gold.gold_trainer import print_prompt_completions_sample_uld as ours

    theirs = import_trl_experimental("gold.gold_trainer").print_prompt_completions_sample_uld
    prompts, completions = ["The sky is", "The sun is"], [" blue.", " hot today."]
    for num_samples in (None, 5, 0, -1):
        outputs = []
        for fn in (theirs, ours):
            fn(prompts, completions, 42, num_samples)
            outputs.append(capsys.readouterr().out)
        for out in outputs:
            shown = all(text.strip() in out for text in prompts + completions) and "Step 42" in out
            assert shown is (num_samples is None or num_samples > 0), (num_samples, out)
