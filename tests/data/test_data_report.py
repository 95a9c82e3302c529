"""The "what was cut or dropped" report (issue #15 item 6): exact counts per dataset, computed here independently
from the tokenizer, for SFT truncation and packing, DPO prompt / completion / max_length cuts, and the rows KTO and
the reward trainer drop; logged once and written to output_dir/data_report.json when training begins."""

from __future__ import annotations

import json
import logging

from datasets import Dataset

from posttrain import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from posttrain.data.packing import pack_sequences
from posttrain.data.report import DataReport, DataReportCallback, DatasetReport, note_packing

WORDS = "cat dog sun moon tree fish bird sky red green blue one two three".split()


def _common(out, **kw):
    return dict(
        output_dir=str(out),
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        write_report=False,
        save_strategy="no",
        **kw,
    )


def _texts(n=10):
    return [" ".join(WORDS[(i + j) % 14] for j in range(2 + 3 * i)) for i in range(n)]


def _ids(tokenizer, text, special=True):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _sft_lengths(tokenizer, texts):
    """Token counts SFT trains on for plain text: the tokenizer's ids plus EOS when they do not end with it."""
    out = []
    for text in texts:
        ids = _ids(tokenizer, text)
        out.append(len(ids) + (ids[-1] != tokenizer.eos_token_id))
    return out


def _report(trainer, name="train_dataset"):
    return trainer._data_report.as_dict()[name]


def _train_with_report(trainer):
    """Trains one step; every trainer holds a DataReportCallback."""
    assert sum(isinstance(c, DataReportCallback) for c in trainer.callback_handler.callbacks) == 1
    trainer.train()


def test_sft_truncation_counts_are_exact_and_reported_once(tmp_path, tiny_model_path, tokenizer, caplog):
    texts, max_length = _texts(), 12
    lengths = _sft_lengths(tokenizer, texts)
    over = [n - max_length for n in lengths if n > max_length]
    assert 0 < len(over) < len(texts)  # the data has both kinds of row
    trainer = SFTTrainer(
        tiny_model_path,
        args=SFTConfig(**_common(tmp_path, max_length=max_length)),
        train_dataset=Dataset.from_dict({"text": texts}),
        eval_dataset=Dataset.from_dict({"text": texts[:3]}),
    )
    got = _report(trainer)
    assert got["rows_in"] == got["rows_kept"] == len(texts) and got["rows_dropped"] == 0
    assert (got["rows_truncated"], got["tokens_cut"]) == (len(over), sum(over))
    assert all(len(ids) == min(n, max_length) for ids, n in zip(trainer.train_dataset["input_ids"], lengths))
    assert not any(c.startswith("_posttrain") for c in trainer.train_dataset.column_names)
    eval_over = [n - max_length for n in lengths[:3] if n > max_length]
    assert _report(trainer, "eval_dataset")["tokens_cut"] == sum(eval_over)

    with caplog.at_level(logging.INFO, logger="posttrain"):
        _train_with_report(trainer)
    written = json.loads((tmp_path / "data_report.json").read_text())
    assert written == trainer._data_report.as_dict()
    said = [r for r in caplog.records if "Data preparation report" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert f"{len(over)} truncated, {sum(over)} tokens cut" in said[0].getMessage()
    assert (
        trainer._data_report.emit(str(tmp_path))
        and len([r for r in caplog.records if "Data preparation report" in r.getMessage()]) == 1
    )  # once


def test_sft_nothing_cut_is_logged_at_info(tmp_path, tiny_model_path, tokenizer, caplog):
    texts = _texts(4)
    trainer = SFTTrainer(
        tiny_model_path,
        args=SFTConfig(**_common(tmp_path, max_length=512)),
        train_dataset=Dataset.from_dict({"text": texts}),
    )
    with caplog.at_level(logging.INFO, logger="posttrain"):
        _train_with_report(trainer)
    said = [r for r in caplog.records if "Data preparation report" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert json.loads((tmp_path / "data_report.json").read_text())["train_dataset"]["rows_truncated"] == 0


def test_sft_bfd_packing_counts_the_tokens_it_cuts(tmp_path, tiny_model_path, tokenizer):
    texts, max_length = _texts(), 16
    lengths = _sft_lengths(tokenizer, texts)
    trainer = SFTTrainer(
        tiny_model_path,
        args=SFTConfig(**_common(tmp_path, max_length=max_length, packing=True)),
        train_dataset=Dataset.from_dict({"text": texts}),
    )
    got = _report(trainer)
    kept = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert got["tokens_cut"] == sum(lengths) - kept > 0
    assert got["rows_truncated"] == sum(n > max_length for n in lengths)


def _packed_pieces(lengths, seq_length, strategy, split):
    """Packs sequences whose tokens all carry their sequence's number; per sequence, the packed rows holding it."""
    data = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    rows = pack_sequences(data, seq_length, strategy, split)["input_ids"]
    return {i: sum(i in row for row in rows) for i in range(len(lengths))}, sum(map(len, rows))


def test_packing_notes_match_what_packing_does():
    lengths, seq_length = [5, 0, 9, 3, 12, 7, 1, 4], 6
    data = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    wrapped = DatasetReport(rows_in=len(lengths))
    note_packing(wrapped, data, seq_length, "wrapped", False)
    rows_of, _ = _packed_pieces(lengths, seq_length, "wrapped", False)
    assert list(wrapped.notes.values()) == [sum(k > 1 for k in rows_of.values())]
    bfd = DatasetReport(rows_in=len(lengths))
    note_packing(bfd, data, seq_length, "bfd", False)
    _, total = _packed_pieces(lengths, seq_length, "bfd", False)
    assert bfd.as_dict()["tokens_cut"] == sum(lengths) - total
    assert bfd.as_dict()["rows_dropped"] == 1  # the empty sequence
    split = DatasetReport(rows_in=len(lengths))
    note_packing(split, data, seq_length, "bfd", True)
    rows_of, total = _packed_pieces(lengths, seq_length, "bfd", True)
    assert total == sum(lengths) and split.as_dict()["tokens_cut"] == 0
    assert list(split.notes.values()) == [sum(k > 1 for k in rows_of.values())] == [3]


def _pairs(n=8):
    return Dataset.from_list(
        [
            {
                "prompt": "the " + " ".join(WORDS[(i + j) % 14] for j in range(1 + 2 * i)) + " is",
                "chosen": " good" + " very" * (i % 4),
                "rejected": " bad",
            }
            for i in range(n)
        ]
    )


def test_dpo_prompt_completion_and_max_length_cuts(tmp_path, tiny_model_path, tokenizer):
    data, max_prompt, max_completion, max_length = _pairs(), 6, 3, 8
    eos = [tokenizer.eos_token_id]
    prompt_over = completion_over = rows_over = tokens_over = 0
    for row in data:
        p = len(_ids(tokenizer, row["prompt"]))
        c, r = (len(_ids(tokenizer, row[k], special=False) + eos) for k in ("chosen", "rejected"))
        prompt_over += max(p - max_prompt, 0)
        completion_over += max(c - max_completion, 0) + max(r - max_completion, 0)
        p, c, r = min(p, max_prompt), min(c, max_completion), min(r, max_completion)
        cut = max(p + c - max_length, 0) + max(p + r - max_length, 0)
        rows_over, tokens_over = rows_over + (cut > 0), tokens_over + cut
    args = DPOConfig(
        **_common(tmp_path, max_prompt_length=max_prompt, max_completion_length=max_completion, max_length=max_length)
    )
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=data)
    got = _report(trainer)["truncated"]
    assert prompt_over > 0 and completion_over > 0 and tokens_over > 0
    by_reason = {" ".join(k.split(" ")[:2]): v for k, v in got.items()}
    assert by_reason["prompt longer"]["tokens"] == prompt_over
    assert by_reason["completion longer"]["tokens"] == completion_over
    assert (by_reason["prompt +"]["rows"], by_reason["prompt +"]["tokens"]) == (rows_over, tokens_over)


def test_kto_rows_whose_prompt_fills_max_length_are_counted_as_dropped(tmp_path, tiny_model_path, tokenizer):
    prompts = ["the " + " ".join(WORDS[(i + j) % 14] for j in range(1 + 2 * i)) + " is" for i in range(8)]
    data = Dataset.from_list(
        [{"prompt": p, "completion": " good" if i % 2 else " bad", "label": bool(i % 2)} for i, p in enumerate(prompts)]
    )
    max_length = 9
    dropped = sum(len(_ids(tokenizer, p)) >= max_length for p in prompts)
    assert 0 < dropped < len(prompts)
    trainer = KTOTrainer(
        tiny_model_path,
        args=KTOConfig(**_common(tmp_path, max_length=max_length, loss_type="apo_zero_unpaired")),
        train_dataset=data,
    )
    got = _report(trainer)
    assert (got["rows_in"], got["rows_dropped"], got["rows_kept"]) == (8, dropped, 8 - dropped)
    assert got["rows_kept"] == len(trainer.train_dataset)


def test_reward_rows_longer_than_max_length_are_counted_as_dropped(tmp_path, tiny_model_path, tokenizer):
    data, max_length = _pairs(), 10
    eos = [tokenizer.eos_token_id]
    dropped = sum(
        len(_ids(tokenizer, r["prompt"]))
        + max(len(_ids(tokenizer, r[k], special=False) + eos) for k in ("chosen", "rejected"))
        > max_length
        for r in data
    )
    assert 0 < dropped < len(data)
    trainer = RewardTrainer(
        tiny_model_path, args=RewardConfig(**_common(tmp_path, max_length=max_length)), train_dataset=data
    )
    got = _report(trainer)
    assert (got["rows_dropped"], got["rows_kept"], got["rows_truncated"]) == (dropped, len(data) - dropped, 0)
    assert len(trainer.train_dataset) == len(data) - dropped


def test_report_attaches_to_its_owner():
    class Owner:
        pass

    a, b = Owner(), Owner()
    assert DataReport.of(a) is DataReport.of(a) and DataReport.of(a) is not DataReport.of(b)


def test_grpo_prompts_cut_by_max_prompt_length_are_counted(tmp_path, tiny_model_path, tokenizer):
    from posttrain import GRPOConfig, GRPOTrainer

    texts, limit = _texts(8), 6
    over = [len(_ids(tokenizer, t)) - limit for t in texts if len(_ids(tokenizer, t)) > limit]
    assert 0 < len(over) < len(texts)
    args = GRPOConfig(**_common(tmp_path, max_prompt_length=limit, num_generations=2, max_completion_length=4))
    trainer = GRPOTrainer(
        tiny_model_path,
        lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts}),
    )
    got = _report(trainer)
    assert (got["rows_in"], got["rows_truncated"], got["tokens_cut"]) == (len(texts), len(over), sum(over))
    assert trainer.train_dataset["prompt_ids"][0] == _ids(tokenizer, texts[0])[-limit:]
    trainer.train()
    assert json.loads((tmp_path / "data_report.json").read_text())["train_dataset"]["tokens_cut"] == sum(over)
