"""GOLD (posttrain.experimental.gold): the ULD loss against float64 references and against TRL 1.16's ULDLoss on the
same tensors, GOLD without ULD against TRL's GOLDTrainer at step 0, and a student learning from a teacher with a
different tokenizer."""

import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch
from _trl import import_trl_experimental
from test_gkd import _messages

from posttrain.errors import ConfigError
from posttrain.experimental.gold import GOLDConfig, GOLDTrainer
from posttrain.losses.gold import align_by_byte_offsets, merge_groups, sorted_l1, uld_sequence_parts
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer


def _trl_gold():
    return import_trl_experimental("gold.gold_trainer")


# -- the loss against float64 references --------------------------------------------------------------------------
def test_alignment_closes_groups_where_byte_boundaries_agree():
    student = [(0, 2), (2, 5), (5, 6), (6, 9)]
    teacher = [(0, 5), (5, 7), (7, 9), (9, 10)]
    assert align_by_byte_offsets(student, teacher) == ([[0, 1], [2, 3], []], [[0], [1, 2], [3]])
    assert align_by_byte_offsets([(0, 1), (1, 2)], [(0, 2)]) == ([[0, 1]], [[0]])


def test_group_merge_follows_the_chain_rule():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(4, 5, generator=g, dtype=torch.float64).softmax(-1)
    ids = [3, 1, 4, 0]
    observed = merge_groups(probs, [[0, 1, 2], [3], []], ids, "observed")
    bayesian = merge_groups(probs, [[0, 1, 2], [3], []], ids, "bayesian")
    for v in range(5):
        assert observed[0, v].item() == pytest.approx(probs[0, v].item() * probs[1, 1].item() * probs[2, 4].item())
        assert bayesian[0, v].item() == pytest.approx(probs[2, v].item() * probs[0, 3].item() * probs[1, 1].item())
        assert observed[1, v].item() == probs[3, v].item() and observed[2, v].item() == 0.0
    with pytest.raises(ConfigError):
        merge_groups(probs, [[0]], ids, "greedy")


def test_sorted_l1_matches_a_float64_reference():
    g = torch.Generator().manual_seed(1)
    student = torch.rand(3, 6, generator=g, dtype=torch.float64).softmax(-1)
    teacher = torch.rand(3, 9, generator=g, dtype=torch.float64).softmax(-1)
    ref = 0.0
    for n in range(3):
        s = sorted(student[n].tolist(), reverse=True) + [0.0] * 3
        t = sorted(teacher[n].tolist(), reverse=True)
        ref += sum(abs(a - b) for a, b in zip(s, t))
    assert sorted_l1(student, teacher).item() == pytest.approx(ref / 3, rel=1e-12)


def test_uld_of_one_to_one_tokens_matches_a_float64_reference():
    """Same byte boundaries on both sides: the ULD of each position's sorted softmax, EOS left out."""
    g = torch.Generator().manual_seed(2)
    s_logits, t_logits = (
        torch.randn(6, 7, generator=g, dtype=torch.float64),
        torch.randn(5, 11, generator=g, dtype=torch.float64),
    )
    s_labels, t_labels = torch.tensor([-100, -100, 1, 2, 3, 4]), torch.tensor([-100, 5, 6, 7, 8])
    offsets = [(0, 0)] * 2 + [(0, 1), (1, 3), (3, 4), (4, 4)]
    s_off, t_off = torch.tensor(offsets), torch.tensor(offsets[1:])
    got = uld_sequence_parts(
        s_logits,
        t_logits,
        s_labels,
        t_labels,
        s_labels.clamp(min=0),
        t_labels.clamp(min=0),
        s_off,
        t_off,
        student_temperature=2.0,
        teacher_temperature=0.5,
    )[0]
    ref = 0.0
    for k in range(3):
        s = [math.exp(x / 2.0) for x in s_logits[2 + k].tolist()]
        t = [math.exp(x / 0.5) for x in t_logits[1 + k].tolist()]
        s, t = sorted((x / sum(s) for x in s), reverse=True) + [0.0] * 4, sorted((x / sum(t) for x in t), reverse=True)
        ref += sum(abs(a - b) for a, b in zip(s, t))
    assert got.item() == pytest.approx(ref / 3, rel=1e-10)


def _random_pair(g, rng, student_vocab=13, teacher_vocab=17):
    """Random logits and a completion tokenized two ways (random byte boundaries on each side)."""
    length = 12

    def side(vocab, prompt):
        cuts = sorted(rng.sample(range(1, length), rng.randint(3, 7))) + [length]
        offsets = [(a, b) for a, b in zip([0] + cuts, cuts)] + [(length, length)]  # + EOS
        size = prompt + len(offsets)
        labels = torch.full((size + 1,), -100)
        labels[prompt:size] = torch.randint(0, vocab, (len(offsets),), generator=g)
        padded = torch.zeros(size + 1, 2, dtype=torch.long)
        padded[prompt:size] = torch.tensor(offsets)
        return torch.randn(size + 1, vocab, generator=g, dtype=torch.float64), labels, padded

    return side(student_vocab, rng.randint(0, 3)), side(teacher_vocab, rng.randint(0, 3))


@pytest.mark.parametrize(
    "strategy,extended,skip_eos", list(itertools.product(("observed", "bayesian"), (True, False), (True, False)))
)
def test_uld_equals_trls_uld_loss(strategy, extended, skip_eos):
    gold = _trl_gold()
    g, rng = torch.Generator().manual_seed(3), random.Random(3)
    config = SimpleNamespace(
        uld_crossentropy_weight=0.0,
        uld_distillation_weight=1.0,
        uld_student_temperature=1.3,
        uld_teacher_temperature=0.8,
        uld_skip_student_eos=skip_eos,
        uld_skip_teacher_eos=skip_eos,
        use_extended_uld=extended,
        uld_token_merge_strategy=strategy,
        uld_use_hybrid_loss=False,
        beta=0.5,
    )
    trl_loss = gold.ULDLoss(config)
    for _ in range(4):
        (s_logits, s_labels, s_off), (t_logits, t_labels, t_off) = _random_pair(g, rng)
        theirs = trl_loss(
            s_logits[None],
            t_logits[None],
            s_labels[None],
            t_labels[None],
            s_labels.clamp(min=0)[None],
            t_labels.clamp(min=0)[None],
            s_off[None],
            t_off[None],
        )
        ours = uld_sequence_parts(
            s_logits,
            t_logits,
            s_labels,
            t_labels,
            s_labels.clamp(min=0),
            t_labels.clamp(min=0),
            s_off,
            t_off,
            extended=extended,
            strategy=strategy,
            student_temperature=1.3,
            teacher_temperature=0.8,
            skip_student_eos=skip_eos,
            skip_teacher_eos=skip_eos,
        )[0]
        assert float(ours) == pytest.approx(float(theirs), rel=1e-9, abs=1e-12)


def test_hybrid_uld_matches_a_float64_reference():
    from posttrain.losses.gold import hybrid_uld

    g = torch.Generator().manual_seed(5)
    student = torch.rand(2, 5, generator=g, dtype=torch.float64).softmax(-1)
    teacher = torch.rand(2, 6, generator=g, dtype=torch.float64).softmax(-1)
    shared = (torch.tensor([1, 4]), torch.tensor([3, 0]))  # teacher id 1 is student id 3, teacher 4 is student 0
    total, matched, unmatched = hybrid_uld(student, teacher, shared, beta=0.4)
    ref_matched, ref_unmatched = 0.0, 0.0
    for n in range(2):
        for t_id, s_id in ((1, 3), (4, 0)):
            p, q = student[n, s_id].item(), teacher[n, t_id].item()
            m = 0.4 * q + 0.6 * p
            ref_matched += 0.4 * q * math.log(q / m) + 0.6 * p * math.log(p / m)
        s_rest = sorted((student[n, i].item() for i in (1, 2, 4)), reverse=True) + [0.0]
        t_rest = sorted((teacher[n, i].item() for i in (0, 2, 3, 5)), reverse=True)
        ref_unmatched += sum(abs(a - b) for a, b in zip(s_rest, t_rest))
    assert matched.item() == pytest.approx(ref_matched / 2, rel=1e-12)
    assert unmatched.item() == pytest.approx(ref_unmatched / 2, rel=1e-12)
    assert total.item() == pytest.approx(2 / 6 * ref_matched / 2 + 4 / 6 * ref_unmatched / 2, rel=1e-12)
    fixed = hybrid_uld(student, teacher, shared, beta=0.4, matched_weight=0.2, unmatched_weight=0.7)[0]
    assert fixed.item() == pytest.approx(0.2 * ref_matched / 2 + 0.7 * ref_unmatched / 2, rel=1e-12)


@pytest.mark.parametrize("beta,weights", [(0.5, (None, None)), (0.0, (0.3, 0.9)), (1.0, (None, None))])
def test_hybrid_uld_equals_trls(tokenizer, teacher_tokenizer_path, beta, weights):
    from transformers import AutoTokenizer

    from posttrain.losses.gold import shared_token_ids

    gold = _trl_gold()
    teacher_tok = AutoTokenizer.from_pretrained(teacher_tokenizer_path)
    config = SimpleNamespace(
        uld_crossentropy_weight=0.0,
        uld_distillation_weight=1.0,
        uld_student_temperature=1.0,
        uld_teacher_temperature=1.0,
        uld_skip_student_eos=True,
        uld_skip_teacher_eos=True,
        use_extended_uld=True,
        uld_token_merge_strategy="observed",
        uld_use_hybrid_loss=True,
        uld_hybrid_matched_weight=weights[0],
        uld_hybrid_unmatched_weight=weights[1],
        beta=beta,
    )
    trl_loss = gold.ULDLoss(config, student_tokenizer=tokenizer, teacher_tokenizer=teacher_tok)
    shared = shared_token_ids(tokenizer.get_vocab(), teacher_tok.get_vocab())
    # The teacher's BPE is the student's with fewer merges: every teacher token is shared; 16 padded logits of the
    # teacher and the student's extra merges are not.
    assert len(shared[0]) == len(teacher_tok) < len(tokenizer)
    g, rng = torch.Generator().manual_seed(4), random.Random(4)
    for _ in range(3):
        (s_logits, s_labels, s_off), (t_logits, t_labels, t_off) = _random_pair(
            g, rng, len(tokenizer), len(teacher_tok) + 16
        )
        theirs = trl_loss(
            s_logits[None],
            t_logits[None],
            s_labels[None],
            t_labels[None],
            s_labels.clamp(min=0)[None],
            t_labels.clamp(min=0)[None],
            s_off[None],
            t_off[None],
        )
        ours = uld_sequence_parts(
            s_logits,
            t_logits,
            s_labels,
            t_labels,
            s_labels.clamp(min=0),
            t_labels.clamp(min=0),
            s_off,
            t_off,
            shared=shared,
            beta=beta,
            matched_weight=weights[0],
            unmatched_weight=weights[1],
        )[0]
        assert float(ours) == pytest.approx(float(theirs), rel=1e-9, abs=1e-12)


# -- the trainer against TRL's GOLDTrainer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_tokenizer_path(tmp_path_factory):
    """A byte-level BPE with a smaller vocabulary: the same text splits into different tokens."""
    path = tmp_path_factory.mktemp("teacher_tokenizer")
    build_tiny_tokenizer(vocab_size=320).save_pretrained(path)
    return str(path)


def _teacher(tokenizer):
    teacher = build_tiny_model(tokenizer, seed=1, hidden_size=64, tie=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(5.0)
    return teacher


def _kw(tmp_path, **kw):
    return {
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=2,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            seed=0,
            lmbda=0.0,
        ),
        **kw,
    }


@pytest.mark.parametrize(
    "settings",
    [
        dict(beta=0.3, temperature=0.7),
        dict(use_uld_loss=True),
        dict(
            use_uld_loss=True,
            uld_token_merge_strategy="bayesian",
            uld_crossentropy_weight=0.5,
            uld_student_temperature=1.2,
            uld_teacher_temperature=0.8,
        ),
        dict(use_uld_loss=True, use_extended_uld=False, uld_skip_teacher_eos=False),
        dict(use_uld_loss=True, uld_use_hybrid_loss=True, beta=0.3),
    ],
)
def test_step0_loss_equals_trls(tmp_path, tokenizer, teacher_tokenizer_path, settings):
    from transformers import AutoTokenizer

    gold = _trl_gold()
    uld = settings.get("use_uld_loss", False)
    teacher_tok = AutoTokenizer.from_pretrained(teacher_tokenizer_path) if uld else tokenizer
    extra = dict(teacher_tokenizer_name_or_path=teacher_tokenizer_path) if uld else {}
    data = _messages(4, tokenizer)
    theirs = gold.GOLDTrainer(
        model=build_tiny_model(tokenizer),
        teacher_model=_teacher(teacher_tok),
        train_dataset=data,
        processing_class=tokenizer,
        args=gold.GOLDConfig(**_kw(tmp_path / "trl", bf16=False, gradient_checkpointing=False, **settings, **extra)),
    )
    batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
    theirs.model.eval()
    with torch.no_grad():
        trl_loss = theirs.compute_loss(theirs.model, batch).item()
    ours = GOLDTrainer(
        build_tiny_model(tokenizer),
        _teacher(teacher_tok),
        args=GOLDConfig(**_kw(tmp_path / "ours", **settings, **extra)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    ours_batch = ours.data_collator([ours.train_dataset[i] for i in range(4)])
    assert ours_batch["labels"].tolist() == batch["labels"].tolist()
    ours.model.eval()
    with torch.no_grad():
        our_loss = ours.compute_loss(ours.model, ours_batch).item()
    assert our_loss > 1e-3
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)


def test_config_defaults_and_signature_are_trls():
    import dataclasses
    import inspect

    gold = _trl_gold()

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    ours = {f.name: default(f) for f in dataclasses.fields(GOLDConfig)}
    for f in dataclasses.fields(gold.GOLDConfig):
        if f.name != "gradient_checkpointing":  # a posttrain-wide difference
            assert f.name in ours, f.name
            assert ours[f.name] == default(f), f.name
    params = list(inspect.signature(GOLDTrainer.__init__).parameters)[1:]
    theirs = list(inspect.signature(gold.GOLDTrainer.__init__).parameters)[1:]
    assert params[: len(theirs)] == theirs


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(num_generations=2), "num_generations"),
        (dict(uld_hybrid_matched_weight=0.5), "hybrid"),
        (dict(uld_token_merge_strategy="mean"), "merge_strategy"),
        (dict(callbacks=["x"]), "callbacks"),
        (dict(max_completion_length=1024), "max_completion_length"),
    ],
)
def test_bad_settings_stop_before_training(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        GOLDConfig(**_kw(tmp_path, **settings))


def test_uld_needs_the_teachers_tokenizer(tmp_path, tokenizer, teacher_tokenizer_path):
    from transformers import AutoTokenizer

    teacher = _teacher(AutoTokenizer.from_pretrained(teacher_tokenizer_path))
    with pytest.raises(ConfigError, match="teacher_tokenizer_name_or_path"):
        GOLDTrainer(
            build_tiny_model(tokenizer),
            teacher,
            args=GOLDConfig(**_kw(tmp_path, use_uld_loss=True)),
            train_dataset=_messages(4, tokenizer),
            processing_class=tokenizer,
        )
    with pytest.raises(ConfigError, match="vocabulary|tokens"):  # without ULD the ids must agree
        GOLDTrainer(
            build_tiny_model(tokenizer),
            teacher,
            args=GOLDConfig(**_kw(tmp_path)),
            teacher_processing_class=AutoTokenizer.from_pretrained(teacher_tokenizer_path),
            train_dataset=_messages(4, tokenizer),
            processing_class=tokenizer,
        )


def test_learns_from_a_teacher_with_another_tokenizer(tmp_path, tokenizer, teacher_tokenizer_path):
    from transformers import AutoTokenizer

    teacher = _teacher(AutoTokenizer.from_pretrained(teacher_tokenizer_path))
    trainer = GOLDTrainer(
        build_tiny_model(tokenizer),
        teacher,
        processing_class=tokenizer,
        train_dataset=_messages(16, tokenizer),
        args=GOLDConfig(
            **_kw(
                tmp_path,
                use_uld_loss=True,
                teacher_tokenizer_name_or_path=teacher_tokenizer_path,
                max_steps=20,
                learning_rate=3e-3,
                logging_steps=1,
            )
        ),
    )
    trainer.train()
    # (the end-of-training summary, which repeats the last window's metrics, is left out)
    losses = [h["distill_loss"] for h in trainer.state.log_history if "distill_loss" in h and "train_loss" not in h]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses


# -- TRL's extra GOLD metrics: on/off-policy losses, hybrid ULD's matched/unmatched terms ---------------------------
def test_on_and_off_policy_losses_split_the_step_loss(tmp_path, tokenizer):
    """Per optimizer step (logging_steps=1) with k of G micro-batches on-policy, TRL's definition gives
    loss = on_policy_loss * k / G + off_policy_loss * (G - k) / G, each key present only when its kind occurred."""
    trainer = GOLDTrainer(
        build_tiny_model(tokenizer),
        _teacher(tokenizer),
        processing_class=tokenizer,
        train_dataset=_messages(16, tokenizer),
        args=GOLDConfig(
            **_kw(
                tmp_path,
                per_device_train_batch_size=1,
                gradient_accumulation_steps=4,
                max_steps=4,
                lmbda=0.5,
                max_completion_length=6,
                logging_steps=1,
                learning_rate=1e-3,
            )
        ),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    mixed = 0
    for h in logs:
        on = round(h["on_policy"] * 4)
        assert ("on_policy_loss" in h) == (on > 0) and ("off_policy_loss" in h) == (on < 4)
        total = h.get("on_policy_loss", 0.0) * on / 4 + h.get("off_policy_loss", 0.0) * (4 - on) / 4
        assert total == pytest.approx(h["loss"], abs=2e-4), h
        mixed += 0 < on < 4
    assert mixed  # the seed gives steps with both kinds, so the split is exercised


def test_extra_metrics_equal_trls_over_a_logging_window(tmp_path, tokenizer, teacher_tokenizer_path):
    """Two one-row steps in one logging window, hybrid ULD, no on-policy sampling: TRL's logged off_policy_loss,
    matched_loss and unmatched_loss (rounded by TRL to 4 decimals) against ours. Without accumulation: TRL's GOLD
    does not divide a micro-batch's loss by the accumulation steps, so with it TRL's values are that many times
    ours (its logged loss too)."""
    from transformers import AutoTokenizer

    gold = _trl_gold()
    teacher_tok = AutoTokenizer.from_pretrained(teacher_tokenizer_path)
    row = _messages(1, tokenizer)[0]
    from datasets import Dataset

    data = Dataset.from_list([row, row])  # the same row twice: the sampling order cannot matter
    settings = dict(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=2,
        logging_steps=2,
        use_uld_loss=True,
        uld_use_hybrid_loss=True,
        beta=0.3,
        learning_rate=1e-3,
        teacher_tokenizer_name_or_path=teacher_tokenizer_path,
    )
    theirs = gold.GOLDTrainer(
        model=build_tiny_model(tokenizer),
        teacher_model=_teacher(teacher_tok),
        train_dataset=data,
        processing_class=tokenizer,
        args=gold.GOLDConfig(**_kw(tmp_path / "trl", bf16=False, gradient_checkpointing=False, **settings)),
    )
    theirs.train()
    ours = GOLDTrainer(
        build_tiny_model(tokenizer),
        _teacher(teacher_tok),
        train_dataset=data,
        processing_class=tokenizer,
        args=GOLDConfig(**_kw(tmp_path / "ours", **settings)),
    )
    ours.train()
    trl_log, our_log = theirs.state.log_history[0], ours.state.log_history[0]
    assert "on_policy_loss" not in trl_log and "on_policy_loss" not in our_log
    assert our_log["loss"] == pytest.approx(trl_log["loss"], abs=1e-4)
    assert our_log["matched_loss"] > 1e-3
    for key in ("off_policy_loss", "matched_loss", "unmatched_loss"):
        assert our_log[key] == pytest.approx(trl_log[key], abs=1.5e-4), key
