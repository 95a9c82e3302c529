"""BCO (posttrain.experimental.bco): the loss, the running reward shift and UDM's density-ratio classifier against
float64 references written from the paper's formulas, the trainer's step-0 loss against a float64 forward, TRL's
truncation rule, the config and signature of TRL's BCOTrainer (removed from TRL in 2026), resuming, and learning."""

import copy
import dataclasses
import inspect
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.experimental.bco import BCOConfig, BCOTrainer
from posttrain.experimental.bco.bco_trainer import truncate_bco
from posttrain.losses.bco import (
    bco_loss,
    density_ratio_weights,
    fit_density_ratio_classifier,
    prob_desirable,
    update_running_mean,
)

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


def _logsig(x):
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def _unpaired(n=8, split_prompts=False):
    """Desirable rows say 'good', undesirable 'bad'; with split_prompts the two classes also ask about different
    things (cat/dog vs sky/sun), which UDM's classifier can tell apart."""
    rows = []
    for i in range(n):
        good = i % 2 == 0
        word = WORDS[(i // 2) % 2 + (0 if good or not split_prompts else 2)]
        rows.append(
            {
                "prompt": f"the {word} is" + " very" * (i % 3),
                "completion": " good" if good else " bad" * 2,
                "label": good,
            }
        )
    return Dataset.from_list(rows)


# -- pure functions ---------------------------------------------------------------------------------------------------
def test_bco_loss_matches_float64_formula():
    policy, ref = [-5.2, -3.1, -7.4, -2.0], [-5.5, -3.3, -7.0, -2.9]
    labels, beta, delta, weights = [True, False, False, True], 0.7, 0.13, [9.0, 2.5, 0.6, 9.0]
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    losses, rewards = bco_loss(t(policy), t(ref), torch.tensor(labels), delta, beta=beta)
    weighted, _ = bco_loss(t(policy), t(ref), torch.tensor(labels), delta, beta=beta, undesirable_weights=t(weights))
    for i, (p, r, good, w) in enumerate(zip(policy, ref, labels, weights)):
        reward = beta * (p - r)
        assert rewards[i].item() == pytest.approx(reward, abs=1e-12)
        plain = -_logsig(reward - delta) if good else -_logsig(-(reward - delta))
        assert losses[i].item() == pytest.approx(plain, abs=1e-12)
        assert weighted[i].item() == pytest.approx(plain if good else w * plain, abs=1e-12)  # desirable: weight 1


def test_running_mean_is_the_mean_of_everything_seen():
    batches = [torch.tensor([0.3, -1.2, 0.5]), torch.tensor([2.0]), torch.tensor([]), torch.tensor([-0.7, 0.1])]
    mean, count, seen = 0.0, 0, []
    for batch in batches:
        mean, count = update_running_mean(mean, count, batch)
        seen += batch.tolist()
        assert count == len(seen) and mean == pytest.approx(sum(seen) / len(seen), abs=1e-12)


def test_density_ratio_weights_are_clamped_odds():
    probs = [0.01, 0.3, 0.5, 0.8, 0.97]
    out = density_ratio_weights(torch.tensor(probs, dtype=torch.float64), 0.5, 10.0)
    for value, p in zip(out.tolist(), probs):
        assert value == pytest.approx(min(max(p / (1 - p + 1e-8), 0.5), 10.0), abs=1e-12)


def test_density_ratio_classifier_minimises_the_balanced_l2_logistic_objective():
    torch.manual_seed(0)
    x = torch.randn(40, 5, dtype=torch.float64)
    desirable = torch.tensor([True] * 30 + [False] * 10)
    x[desirable, 0] += 1.0  # the classes differ along one direction
    weight, bias = fit_density_ratio_classifier(x, desirable)
    # the objective, written independently: 0.5 |w|^2 + sum_i n / (2 n_class(i)) * log(1 + exp(-y_i (w.x_i + b)))
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    total = 0.5 * (w * w).sum()
    for xi, good in zip(x, desirable.tolist()):
        y, s = (1.0, 40 / (2 * 30)) if good else (-1.0, 40 / (2 * 10))
        total = total + s * torch.log1p(torch.exp(-y * (xi @ w + b)))
    total.backward()
    assert w.grad.abs().max() < 1e-6 and b.grad.abs() < 1e-6  # the strictly convex objective's unique minimum
    prob = prob_desirable(x, weight, bias)
    expected = [1 / (1 + math.exp(-(xi @ weight + bias).item())) for xi in x]
    assert prob.tolist() == pytest.approx(expected, abs=1e-12)
    assert prob[desirable].mean() > prob[~desirable].mean() + 0.1


def test_truncation_follows_trls_bco_rule():
    prompt, completion = list(range(1, 7)), list(range(7, 11))  # 6 + 4 tokens
    joined = prompt + completion
    assert truncate_bco(prompt, completion, 20) == (prompt, completion)
    # the prompt is cut to max_prompt_length first (its start goes with keep_end, its end with keep_start) ...
    assert truncate_bco(prompt, completion, 8, 3, truncation_mode="keep_end") == ([4, 5, 6], completion)
    assert truncate_bco(prompt, completion, 8, 3, truncation_mode="keep_start") == ([1, 2, 3], completion)
    # ... then the completion to max_length - max_prompt_length
    assert truncate_bco(prompt, completion, 6, 3, truncation_mode="keep_start") == ([1, 2, 3], [7, 8, 9])
    # without max_prompt_length the joined sequence keeps its last (keep_end) or first (keep_start) tokens
    p, c = truncate_bco(prompt, completion, 5, truncation_mode="keep_end")
    assert p + c == joined[-5:] and c == completion
    p, c = truncate_bco(prompt, completion, 8, truncation_mode="keep_start")
    assert p + c == joined[:8] and p == prompt
    assert truncate_bco(prompt, completion, None, max_completion_length=2) == (prompt, [7, 8])


# -- the trainer -------------------------------------------------------------------------------------------------------
def _perturbed(model, seed):
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _completion_logp64(model, ids, start):
    with torch.no_grad():
        logp = torch.log_softmax(copy.deepcopy(model).double().eval()(torch.tensor([ids])).logits[0], -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids)))


def _embedding_func(model):
    table = copy.deepcopy(model.get_input_embeddings()).requires_grad_(False)

    def embed(input_ids, attention_mask):
        vectors = table(input_ids) * attention_mask[..., None]
        return 15 * vectors.sum(1) / attention_mask.sum(1, keepdim=True)  # the tiny model's are near 0

    return embed


def _step0(trainer, rows):
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(rows))).item()
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("udm", [False, True])
def test_bco_trainer_loss_and_running_delta_against_float64(tmp_path, tiny_model_path, udm):
    beta = 0.5
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = _perturbed(policy, seed=3)
    extra = dict(embedding_func=_embedding_func(policy), embedding_tokenizer=tokenizer) if udm else {}
    trainer = BCOTrainer(
        copy.deepcopy(policy),
        ref_model=ref,
        train_dataset=_unpaired(split_prompts=udm),
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), beta=beta, min_density_ratio=0.8, max_density_ratio=1.5, **COMMON),
        **extra,
    )
    rows = [trainer.train_dataset[i] for i in range(8)]
    rewards, weights = [], []
    for row in rows:
        start = row["completion_mask"].index(1)
        rewards.append(
            beta
            * (_completion_logp64(policy, row["input_ids"], start) - _completion_logp64(ref, row["input_ids"], start))
        )
        if udm:  # P(desirable | prompt) from the fitted classifier, on the test's own prompt embedding
            ids = torch.tensor([row["embedding_input_ids"]])
            emb = extra["embedding_func"](ids, torch.ones_like(ids))[0].double()
            p = 1 / (1 + math.exp(-(emb @ trainer._udm[0] + trainer._udm[1]).item()))
            weights.append(min(max(p / (1 - p + 1e-8), 0.8), 1.5))
    for part, seen in ((slice(0, 4), rewards[:4]), (slice(4, 8), rewards)):  # delta: the mean of all rewards so far
        delta = sum(seen) / len(seen)
        expected = []
        for i in range(part.start, part.stop):
            good = rows[i]["label"]
            loss = -_logsig(rewards[i] - delta) if good else -_logsig(-(rewards[i] - delta))
            expected.append(loss if good or not udm else weights[i] * loss)
        loss, metrics = _step0(trainer, rows[part])
        assert loss == pytest.approx(sum(expected) / 4, rel=1e-5)
        assert metrics["delta"] == pytest.approx(delta, abs=1e-6)
        assert "kl" not in metrics
    if udm:  # the weights matter: some undesirable prompts are reweighted, and differently
        undesirable = [w for w, row in zip(weights, rows) if not row["label"]]
        assert len({round(w, 6) for w in undesirable}) > 1 and any(abs(w - 1) > 0.05 for w in undesirable)
    trainer.model.eval()  # evaluation reads delta without moving it
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(rows[:4])))
    assert trainer._delta[1] == 8 and trainer._metrics["eval"]["delta"][-1] == pytest.approx(sum(rewards) / 8, abs=1e-6)


def test_bco_conversational_and_paired_data_with_udm(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    paired = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"the {w}?"}],
                "chosen": [{"role": "assistant", "content": "good"}],
                "rejected": [{"role": "assistant", "content": "bad"}],
            }
            for w in WORDS[:4]
        ]
    )
    trainer = BCOTrainer(
        policy,
        train_dataset=paired,
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), **COMMON),
        embedding_func=_embedding_func(policy),
        embedding_tokenizer=tokenizer,
    )
    assert trainer.train_dataset["label"] == [True, False] * 4
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat?"}], tokenize=False, add_generation_prompt=True
    )
    assert trainer.train_dataset[0]["embedding_input_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert math.isfinite(_step0(trainer, [trainer.train_dataset[i] for i in range(4)])[0])


def test_bco_resume_restores_delta_and_classifier(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    kw = dict(COMMON, save_strategy="steps", save_steps=2, learning_rate=1e-3, prompt_sample_size=2)
    extra = dict(embedding_func=_embedding_func(policy), embedding_tokenizer=tokenizer)
    first = BCOTrainer(
        copy.deepcopy(policy),
        train_dataset=_unpaired(split_prompts=True),
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), **dict(kw, max_steps=2)),
        **extra,
    )
    first.train()
    assert first._delta[1] == 8 and first._delta[0] != 0.0
    second = BCOTrainer(
        copy.deepcopy(policy),
        train_dataset=_unpaired(split_prompts=True),
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), **dict(kw, max_steps=2, seed=1)),
        **extra,
    )
    assert not torch.equal(second._udm[0], first._udm[0])  # another seed samples another classifier
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert second._delta == pytest.approx(first._delta)
    assert torch.equal(second._udm[0].cpu(), first._udm[0].cpu()) and torch.equal(second._udm[1], first._udm[1])


def test_bco_learns_to_prefer_desirable_completions(tmp_path, tiny_model_path):
    args = BCOConfig(output_dir=str(tmp_path), **dict(COMMON, max_steps=20, learning_rate=1e-3, beta=0.5))
    trainer = BCOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        train_dataset=_unpaired(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
        args=args,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rewards/margins" in entry]
    assert len(logs) == 20
    assert logs[-1]["rewards/margins"] > logs[0]["rewards/margins"] + 1.0
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert trainer.evaluate(_unpaired())["eval_rewards/margins"] > 1.0  # a raw dataset is tokenized first


# -- TRL's surface -----------------------------------------------------------------------------------------------------
# TRL's BCOConfig (trl.experimental.bco, 2025) fields and defaults, and BCOTrainer's keyword arguments in order.
TRL_BCO_DEFAULTS = dict(
    max_length=1024,
    max_prompt_length=None,
    max_completion_length=None,
    beta=0.1,
    label_pad_token_id=-100,
    padding_value=None,
    truncation_mode="keep_end",
    disable_dropout=True,
    generate_during_eval=False,
    is_encoder_decoder=None,
    precompute_ref_log_probs=False,
    model_init_kwargs=None,
    ref_model_init_kwargs=None,
    dataset_num_proc=None,
    prompt_sample_size=1024,
    min_density_ratio=0.5,
    max_density_ratio=10.0,
    logging_steps=10,
    learning_rate=5e-5,
)
TRL_BCO_ARGS = [
    "self",
    "model",
    "ref_model",
    "args",
    "train_dataset",
    "eval_dataset",
    "processing_class",
    "data_collator",
    "model_init",
    "callbacks",
    "optimizers",
    "preprocess_logits_for_metrics",
    "peft_config",
    "compute_metrics",
    "model_adapter_name",
    "ref_adapter_name",
    "embedding_func",
    "embedding_tokenizer",
]


def test_bco_config_and_signature_follow_trl():
    defaults = {f.name: f.default for f in dataclasses.fields(BCOConfig)}
    for name, value in TRL_BCO_DEFAULTS.items():
        assert defaults[name] == value, name
    assert list(inspect.signature(BCOTrainer.__init__).parameters)[: len(TRL_BCO_ARGS)] == TRL_BCO_ARGS


@pytest.mark.parametrize(
    "bad, word",
    [
        ({"generate_during_eval": True}, "generate_during_eval"),
        ({"is_encoder_decoder": True}, "is_encoder_decoder"),
        ({"beta": 0}, "beta"),
        ({"max_prompt_length": 2000}, "max_prompt_length"),
        ({"min_density_ratio": 3.0, "max_density_ratio": 2.0}, "density_ratio"),
    ],
)
def test_bco_config_rejects_bad_values(tmp_path, bad, word):
    with pytest.raises(ConfigError, match=word):
        BCOConfig(output_dir=str(tmp_path), **bad)


def test_bco_trainer_rejects_what_it_cannot_do(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    args = BCOConfig(output_dir=str(tmp_path), **COMMON)
    with pytest.raises(ConfigError, match="model_init"):
        BCOTrainer(model, args=args, train_dataset=_unpaired(), processing_class=tokenizer, model_init=lambda: model)
    with pytest.raises(ConfigError, match="embedding_tokenizer"):
        BCOTrainer(
            model,
            args=args,
            train_dataset=_unpaired(),
            processing_class=tokenizer,
            embedding_func=_embedding_func(model),
        )
    with pytest.raises(ConfigError, match="ref_adapter_name"):
        BCOTrainer(model, args=args, train_dataset=_unpaired(), processing_class=tokenizer, ref_adapter_name="ref")


def test_bco_named_reference_adapter(tmp_path, tiny_model_path):
    """ref_adapter_name: the reference is that adapter of the PEFT policy; only model_adapter_name trains."""
    from peft import LoraConfig, get_peft_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), lora, adapter_name="policy")
    model.add_adapter("frozen", lora)  # randomly initialised: differs from "policy" and from no adapter
    trainer = BCOTrainer(
        model,
        train_dataset=_unpaired(4),
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), **dict(COMMON, learning_rate=1e-2)),
        model_adapter_name="policy",
        ref_adapter_name="frozen",
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    model.set_adapter("frozen")
    expected = [_completion_logp64(model, r["input_ids"], r["completion_mask"].index(1)) for r in rows]
    model.set_adapter("policy")
    batch = trainer._prepare_inputs(trainer.data_collator(rows))
    with trainer.reference_module(trainer.model) as reference:
        got = trainer.reference_columns(reference, batch)["ref_logps"]
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    assert model.active_adapter == "policy"
    frozen = {n: p.clone() for n, p in model.named_parameters() if ".frozen." in n}
    trained = {n: p.clone() for n, p in model.named_parameters() if ".policy." in n}
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if ".frozen." in n)
    assert any(not torch.equal(p, trained[n]) for n, p in model.named_parameters() if ".policy." in n)


def test_bco_precomputed_reference_gives_the_live_loss(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = _perturbed(policy, seed=4)
    kw = dict(COMMON, ref_cache_dir=str(tmp_path / "cache"), padding_value=7)
    live = BCOTrainer(
        copy.deepcopy(policy),
        ref_model=ref,
        train_dataset=_unpaired(4),
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), **kw),
    )
    pre = BCOTrainer(
        copy.deepcopy(policy),
        ref_model=ref,
        train_dataset=_unpaired(4),
        processing_class=tokenizer,
        args=BCOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, **kw),
    )
    assert pre.ref_model is None and "ref_logps" in pre.train_dataset.column_names
    batch = pre.data_collator([pre.train_dataset[i] for i in range(4)])
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 7).all()  # padding_value pads the inputs
    live_loss = _step0(live, [live.train_dataset[i] for i in range(4)])[0]
    assert _step0(pre, [pre.train_dataset[i] for i in range(4)])[0] == pytest.approx(live_loss, rel=1e-5)


# -- the data report ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["drop_and_cut_completions", "cut_prompts"])
def test_bco_data_report_counts_what_truncation_removed(tmp_path, tiny_model_path, case):
    from posttrain.data.report import DataReport
    from posttrain.experimental.bco.bco_trainer import COMPLETION_CUT, NO_COMPLETION_LEFT, PROMPT_CUT

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    full = BCOTrainer(
        model,
        args=BCOConfig(output_dir=str(tmp_path / "full"), **dict(COMMON, max_length=None)),
        train_dataset=_unpaired(),
        processing_class=tokenizer,
    ).train_dataset
    parts = [(m.index(1), len(m) - m.index(1)) for m in full["completion_mask"]]  # (prompt, completion) lengths
    prompts = sorted(p for p, _ in parts)
    if case == "drop_and_cut_completions":  # keep_start, no prompt limit: the prompt fills max_length -> dropped
        limit = prompts[len(prompts) // 2]
        assert prompts[0] < limit  # some rows survive, some do not
        settings = dict(max_length=limit, truncation_mode="keep_start")
        dropped = sum(p >= limit for p, _ in parts)
        kept = [(p, c) for p, c in parts if p < limit]
        prompt_cut = [0] * len(kept)
        completion_cut = [max(p + c - limit, 0) for p, c in kept]
    else:  # TRL's rule with max_prompt_length=2: an over-long row keeps the prompt's last 2 tokens, then the
        # completion's first max_length - 2
        limit = 3
        assert prompts[0] > 2
        settings = dict(max_length=limit, max_prompt_length=2, truncation_mode="keep_end")
        dropped = 0
        prompt_cut = [p - 2 for p, _ in parts]
        completion_cut = [max(c - 1, 0) for _, c in parts]
    trainer = BCOTrainer(
        model,
        args=BCOConfig(output_dir=str(tmp_path / "cut"), **dict(COMMON, **settings)),
        train_dataset=_unpaired(),
        processing_class=tokenizer,
    )
    report = DataReport.of(trainer).as_dict()["train_dataset"]
    assert report["rows_in"] == 8 and report["rows_kept"] == 8 - dropped == len(trainer.train_dataset)
    assert report["dropped"] == ({NO_COMPLETION_LEFT: dropped} if dropped else {})
    expected = {}
    for why, cuts in ((PROMPT_CUT, prompt_cut), (COMPLETION_CUT, completion_cut)):
        if any(cuts):
            expected[why] = {"rows": sum(n > 0 for n in cuts), "tokens": sum(cuts)}
    assert expected and report["truncated"] == expected
    # the tokens the report says were cut are the tokens missing from the prepared rows
    assert (
        sum(len(ids) for ids in trainer.train_dataset["input_ids"])
        == sum(p + c for p, c in (parts if not dropped else [pc for pc in parts if pc[0] < limit]))
        - report["tokens_cut"]
    )


def test_trls_bco_command_line_parses_with_transformers_parser(tmp_path):
    """TRL's examples/scripts/bco.py parses its documented command (with --no_remove_unused_columns) with transformers'
    own HfArgumentParser, which has a --no_ flag only for a field whose default is True (as in TRL's BCOConfig)."""
    from transformers import HfArgumentParser

    from posttrain import ModelConfig, ScriptArguments
    from posttrain.experimental.bco import BCOConfig

    parser = HfArgumentParser((ScriptArguments, BCOConfig, ModelConfig))
    argv = ["--dataset_name", "d", "--output_dir", str(tmp_path), "--no_remove_unused_columns", "--max_length", "64"]
    _, args, _ = parser.parse_args_into_dataclasses(argv)
    assert args.remove_unused_columns is False and args.max_length == 64
    _, default, _ = parser.parse_args_into_dataclasses(argv[:4])
    assert default.remove_unused_columns is True
