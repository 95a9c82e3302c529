"""TPO (posttrain.experimental.tpo): the loss against float64 formulas from the paper, the step-0 loss, metrics and
tokenized rows against TRL 1.16's trl.experimental.tpo, the config and signature TRL users rely on, and learning."""

import copy
import dataclasses
import inspect
import math

import pytest
import torch
from _trl import import_trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError, DataError
from posttrain.experimental.tpo import TPOConfig, TPOTrainer
from posttrain.losses.tpo import TPO_LOSS_TYPES, tpo_loss, tpo_scores

WORDS = ["cat", "dog", "sky", "sun", "tree", "fish", "moon", "bird"]
COMMON = dict(
    per_device_train_batch_size=4,
    max_steps=1,
    report_to="none",
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)


def _chat_triples(n=4):
    turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
    return Dataset.from_list(
        [
            {
                "prompt": turn("user", f"the {WORDS[i % 8]}?"),
                "chosen": turn("assistant", "good" * (1 + i % 2)),
                "rejected": turn("assistant", "bad"),
                "reference": turn("assistant", "very good"),
            }
            for i in range(n)
        ]
    )


def _triples(n=4):
    return Dataset.from_list(
        [
            {
                "prompt": f"the {WORDS[i % 8]} is" + " very" * (i % 3),
                "chosen": " so" * (i % 2) + " good" * (1 + i % 2),
                "rejected": " bad" * (1 + i % 3),
                "reference": " truly good" + " indeed" * (i % 2),
            }
            for i in range(n)
        ]
    )


# -- the loss: float64 references written from the formulas ------------------------------------------------------
CHOSEN = [-5.2, -3.1, -7.4]
REJECTED = [-6.0, -2.5, -9.1]
LENGTHS_C = [3.0, 7.0, 2.0]
LENGTHS_R = [5.0, 1.0, 4.0]


def _logsig(x):
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def _expected(loss_type, beta, eps, gamma):
    out = []
    for c, r, lc, lr in zip(CHOSEN, REJECTED, LENGTHS_C, LENGTHS_R):
        if loss_type in ("ipo", "tpo-l"):
            c, r = c / lc, r / lr
        d = c - r
        if loss_type == "sigmoid":
            out.append(-(1 - eps) * _logsig(beta * d) - eps * _logsig(-beta * d))
        elif loss_type == "hinge":
            out.append(max(0.0, 1 - beta * d))
        elif loss_type == "ipo":
            out.append((d - 1 / (2 * beta)) ** 2)
        else:  # tpo-l: the sigmoid loss of beta * d - gamma
            z = beta * d - gamma
            out.append(-(1 - eps) * _logsig(z) - eps * _logsig(-z))
    return out


@pytest.mark.parametrize("loss_type", TPO_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.1, 0.9])
def test_tpo_loss_matches_float64_formula(loss_type, beta):
    eps = 0.2 if loss_type in ("sigmoid", "tpo-l") else 0.0
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    chosen = tpo_scores(t(CHOSEN), t(LENGTHS_C), loss_type)
    rejected = tpo_scores(t(REJECTED), t(LENGTHS_R), loss_type)
    losses, chosen_rewards, rejected_rewards = tpo_loss(
        chosen, rejected, loss_type=loss_type, beta=beta, label_smoothing=eps, tpo_l_gamma=0.3
    )
    torch.testing.assert_close(losses, t(_expected(loss_type, beta, eps, 0.3)), rtol=1e-12, atol=1e-12)
    norm = loss_type in ("ipo", "tpo-l")
    torch.testing.assert_close(chosen_rewards, t([beta * c / (lc if norm else 1) for c, lc in zip(CHOSEN, LENGTHS_C)]))
    torch.testing.assert_close(
        rejected_rewards, t([beta * r / (lr if norm else 1) for r, lr in zip(REJECTED, LENGTHS_R)])
    )


def test_tpo_loss_gradient_pushes_chosen_up_and_rejected_down():
    chosen = torch.tensor([-6.0, -6.0], dtype=torch.float64, requires_grad=True)  # below every target margin
    rejected = torch.tensor([-5.0, -3.0], dtype=torch.float64, requires_grad=True)
    for loss_type in TPO_LOSS_TYPES:
        chosen.grad = rejected.grad = None
        tpo_loss(chosen, rejected, loss_type=loss_type, beta=0.5)[0].sum().backward()
        assert (chosen.grad < 0).all() and (rejected.grad > 0).all(), loss_type


# -- side by side with TRL 1.16 -------------------------------------------------------------------------------------
def _step0(trainer, rows):
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(rows))).item()
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


TPO_KEYS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss_type": "ipo"},
        {"loss_type": "tpo-l", "label_smoothing": 0.1, "tpo_l_gamma": 0.2},
        {"loss_type": "hinge", "tpo_alpha": 0.0},
        {"tpo_alpha": 0.3, "label_smoothing": 0.2},
        {"max_length": 9, "truncation_mode": "keep_end"},
        {"max_length": 17, "loss_type": "ipo"},
        {"chat": True},
    ],
)
def test_tpo_step0_matches_trl(tmp_path, tiny_model_path, options):
    import_trl()
    from trl.experimental.tpo import TPOConfig as TRLConfig
    from trl.experimental.tpo import TPOTrainer as TRLTrainer

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():  # a less uniform model, so that accuracies and margins are not all ties
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = _chat_triples if options.get("chat") else _triples
    kw = dict(COMMON, beta=0.5, **{k: v for k, v in options.items() if k != "chat"})
    theirs = TRLTrainer(
        copy.deepcopy(policy),
        args=TRLConfig(output_dir=str(tmp_path / "trl"), **kw),
        train_dataset=data(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    ours = TPOTrainer(
        copy.deepcopy(policy),
        args=TPOConfig(output_dir=str(tmp_path / "ours"), **kw),
        train_dataset=data(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    for column in ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"):
        assert ours.train_dataset[column] == theirs.train_dataset[column], column
    our_loss, our_metrics = _step0(ours, [ours.train_dataset[i] for i in range(4)])
    trl_loss, trl_metrics = _step0(theirs, [theirs.train_dataset[i] for i in range(4)])
    assert our_loss == pytest.approx(trl_loss, abs=1e-5)
    for key in TPO_KEYS:
        assert our_metrics[key] == pytest.approx(trl_metrics[key], abs=1e-5), key


def test_tpo_nll_term_against_float64_reference(tmp_path, tiny_model_path):
    """The gold term: tpo_alpha times the token-mean NLL of the micro-batch's gold completions, added per pair."""
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    kw = dict(COMMON, beta=0.5)
    full = TPOTrainer(
        copy.deepcopy(policy),
        args=TPOConfig(output_dir=str(tmp_path / "a"), tpo_alpha=0.7, **kw),
        train_dataset=_triples(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    rows = [full.train_dataset[i] for i in range(4)]
    with torch.no_grad():
        model64 = copy.deepcopy(policy).double().eval()
        logps = []
        for row in rows:
            ids = row["prompt_ids"] + row["reference_ids"]
            logp = torch.log_softmax(model64(torch.tensor([ids])).logits[0], -1)
            logps += [logp[t - 1, ids[t]].item() for t in range(len(row["prompt_ids"]), len(ids))]
    nll = -sum(logps) / len(logps)
    without = TPOTrainer(
        copy.deepcopy(policy),
        args=TPOConfig(output_dir=str(tmp_path / "b"), tpo_alpha=0.0, **kw),
        train_dataset=_triples(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    assert _step0(full, rows)[0] - _step0(without, rows)[0] == pytest.approx(0.7 * nll, rel=1e-5)


def test_tpo_config_and_signature_follow_trl(tmp_path):
    import_trl()
    from trl.experimental.tpo import TPOConfig as TRLConfig
    from trl.experimental.tpo import TPOTrainer as TRLTrainer

    ours = {f.name: f for f in dataclasses.fields(TPOConfig)}
    # auto (on with an accelerator) as in every posttrain config
    deliberate = {"gradient_checkpointing"}
    for f in dataclasses.fields(TRLConfig):
        assert f.name in ours, f.name
        if f.name not in deliberate and f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, f.name
    trl_params = list(inspect.signature(TRLTrainer.__init__).parameters)
    assert list(inspect.signature(TPOTrainer.__init__).parameters)[: len(trl_params)] == trl_params


@pytest.mark.parametrize(
    "bad, word",
    [
        ({"loss_type": "dpo"}, "loss_type"),
        ({"beta": 0.0}, "beta"),
        ({"loss_type": "hinge", "label_smoothing": 0.1}, "label_smoothing"),
        ({"tpo_alpha": -1.0}, "tpo_alpha"),
        ({"truncation_mode": "middle"}, "trunc"),
    ],
)
def test_tpo_config_rejects_bad_values(tmp_path, bad, word):
    with pytest.raises(ConfigError, match=word):
        TPOConfig(output_dir=str(tmp_path), **bad)


def test_tpo_data_errors_and_implicit_prompt(tmp_path, tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    args = TPOConfig(output_dir=str(tmp_path), **COMMON)
    no_gold = _triples().remove_columns("reference")
    with pytest.raises(DataError, match="reference"):
        TPOTrainer(model, args=args, train_dataset=no_gold, processing_class=tok)
    implicit = Dataset.from_list(
        [{"chosen": "the cat is good", "rejected": "the cat is bad", "reference": "the cat is very good"}]
    )
    trainer = TPOTrainer(model, args=args, train_dataset=implicit, processing_class=tok)
    explicit = TPOTrainer(
        model,
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_list(
            [{"prompt": "the cat is ", "chosen": "good", "rejected": "bad", "reference": "very good"}]
        ),
    )
    assert trainer.train_dataset[0] == explicit.train_dataset[0]
    mismatched = Dataset.from_list(
        [{"chosen": "the cat is good", "rejected": "the cat is bad", "reference": "a dog is very good"}]
    )
    with pytest.raises(DataError, match="'reference' does not start with the implicit prompt"):  # TRL's words
        TPOTrainer(model, args=args, train_dataset=mismatched, processing_class=tok)


def test_tpo_learns_the_preferred_completion(tmp_path, tiny_model_path):
    data = Dataset.from_list(
        [
            {"prompt": f"the {WORDS[i % 8]} is", "chosen": " good", "rejected": " bad", "reference": " good"}
            for i in range(8)
        ]
    )
    args = TPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=20,
        learning_rate=1e-3,
        beta=0.5,
        remove_unused_columns=True,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = TPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rewards/margins" in entry]
    assert len(logs) == 20
    assert logs[-1]["rewards/margins"] > logs[0]["rewards/margins"] + 1.0
    assert logs[-1]["loss"] < logs[0]["loss"]
    metrics = trainer.evaluate(data)  # a raw dataset is tokenized first, as in TRL
    assert metrics["eval_rewards/accuracies"] == 1.0 and metrics["eval_rewards/margins"] > 1.0


@pytest.mark.parametrize("truncation_mode,tpo_alpha", [("keep_start", 1.0), ("keep_end", 0.0)])
def test_tpo_data_report_counts_drops_and_the_collators_cuts(tmp_path, tiny_model_path, truncation_mode, tpo_alpha):
    from posttrain.data.report import DataReport

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    full = TPOTrainer(
        model,
        args=TPOConfig(output_dir=str(tmp_path / "full"), **dict(COMMON, max_length=None)),
        train_dataset=_triples(6),
        processing_class=tok,
    ).train_dataset
    prompts = sorted(len(p) for p in full["prompt_ids"])
    limit = prompts[-1]  # the longest prompts fill max_length
    assert prompts[0] < limit
    trainer = TPOTrainer(
        model,
        args=TPOConfig(
            output_dir=str(tmp_path / "cut"),
            **dict(COMMON, max_length=limit, truncation_mode=truncation_mode, tpo_alpha=tpo_alpha),
        ),
        train_dataset=_triples(6),
        processing_class=tok,
    )
    report = DataReport.of(trainer).as_dict()["train_dataset"]
    dropped = sum(n >= limit for n in prompts) if truncation_mode == "keep_start" else 0
    assert report["rows_in"] == 6 and report["rows_kept"] == 6 - dropped == len(trainer.train_dataset)
    assert sum(report["dropped"].values()) == dropped
    # the report's cut tokens are exactly those the collator leaves out of the batch
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    columns = ("chosen_ids", "rejected_ids") + (("reference_ids",) if tpo_alpha else ())
    lengths = [len(r["prompt_ids"]) + len(r[c]) for c in columns for r in rows]
    batch = trainer.data_collator(rows)
    assert batch["attention_mask"].sum().item() == sum(lengths) - report["tokens_cut"]
    assert (
        report["rows_truncated"]
        == sum(any(len(r["prompt_ids"]) + len(r[c]) > limit for c in columns) for r in rows)
        > 0
    )


@pytest.mark.parametrize("include_reference", [True, False])
def test_tpo_collator_at_trls_module_path_lays_out_trls_batch(include_reference):
    from posttrain.experimental.tpo.tpo_trainer import DataCollatorForTriplePreference

    rows = [
        {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "reference_ids": [7, 8]},
        {"prompt_ids": [9, 10], "chosen_ids": [11], "rejected_ids": [12, 13], "reference_ids": [14]},
    ]
    batch = DataCollatorForTriplePreference(pad_token_id=0, include_reference=include_reference)(rows)
    ids = [[1, 2, 3, 4, 5], [9, 10, 11, 0, 0], [1, 2, 3, 6, 0], [9, 10, 12, 13, 0], [1, 2, 3, 7, 8], [9, 10, 14, 0, 0]]
    completion = [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    n = 6 if include_reference else 4
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask"}
    assert batch["input_ids"].tolist() == ids[:n]
    assert batch["completion_mask"].tolist() == completion[:n]
    assert batch["attention_mask"].tolist() == [[int(t != 0) for t in row] for row in ids[:n]]
