"""DPO, KTO and Reward side by side with TRL 1.16 (when it imports): the same tiny model, reference and batch give
the same tokenized rows, step-0 loss and logged metrics; plus float64 references for the options TRL added
(use_weighting, ld_alpha) through the whole trainer, and the trainers' TRL-ordered signatures."""

import copy
import inspect
import math

import pytest
import torch
from _trl import trl_module
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
from posttrain.errors import ConfigError

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


def _pairs(n=4):
    return Dataset.from_list(
        [
            {
                "prompt": f"the {WORDS[i % 8]} is" + " very" * (i % 3),
                "chosen": " so" * (i % 2) + " good" * (1 + i % 2),
                "rejected": " bad" + " bad" * (i % 3),
            }
            for i in range(n)
        ]
    )


def _unpaired(n=4):
    return Dataset.from_list(
        [
            {
                "prompt": f"the {WORDS[i % 8]} is",
                "completion": (" good" if i % 2 == 0 else " bad") + " and" + f" {WORDS[(3 * i) % 8]}" * (1 + i % 3),
                "label": i % 2 == 0,
            }
            for i in range(n)
        ]
    )


def _perturbed(model, seed):
    model = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _step0(trainer, batch):
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch)).item()
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _assert_same(ours, theirs, keys):
    (our_loss, our_metrics), (trl_loss, trl_metrics) = ours, theirs
    assert our_loss == pytest.approx(trl_loss, abs=1e-5)
    for key in keys:
        assert key in trl_metrics, key
        assert our_metrics[key] == pytest.approx(trl_metrics[key], abs=1e-5), key


DPO_KEYS = [
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
        {"use_weighting": True},
        {"ld_alpha": 0.3},
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.4]},
        {"loss_type": ["ipo"], "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        {"max_length": 9, "truncation_mode": "keep_end"},
        {"max_length": 9},
    ],
)
def test_dpo_step0_matches_trl(tmp_path, tiny_model_path, options):
    trl = trl_module("trl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = _perturbed(policy, seed=1)
    kw = dict(COMMON, beta=0.5, **options)
    theirs = trl.DPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        train_dataset=_pairs(),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), **kw),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    ours = DPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        train_dataset=_pairs(),
        args=DPOConfig(output_dir=str(tmp_path / "ours"), **kw),
        processing_class=tokenizer,
    )
    for column in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ours.train_dataset[column] == theirs.train_dataset[column]
    rows = [ours.train_dataset[i] for i in range(len(ours.train_dataset))]
    trl_rows = [theirs.train_dataset[i] for i in range(len(theirs.train_dataset))]
    _assert_same(_step0(ours, ours.data_collator(rows)), _step0(theirs, theirs.data_collator(trl_rows)), DPO_KEYS)


def test_kto_step0_matches_trl(tmp_path, tiny_model_path):
    trl = trl_module("trl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = _perturbed(policy, seed=2)
    kw = dict(COMMON, beta=0.5, desirable_weight=1.3, undesirable_weight=0.8)
    theirs = trl.KTOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        train_dataset=_unpaired(),
        args=trl.KTOConfig(output_dir=str(tmp_path / "trl"), **kw),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
    )
    ours = KTOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        train_dataset=_unpaired(),
        args=KTOConfig(output_dir=str(tmp_path / "ours"), **kw),
        processing_class=tokenizer,
    )
    for i in range(4):
        theirs_row, ours_row = theirs.train_dataset[i], ours.train_dataset[i]
        assert ours_row["input_ids"] == theirs_row["prompt_ids"] + theirs_row["completion_ids"]
        assert ours_row["kl_input_ids"] == theirs_row["prompt_ids"] + theirs_row["KL_completion_ids"]
    keys = [
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "entropy",
        "num_tokens",
    ]
    ours_batch = ours.data_collator([ours.train_dataset[i] for i in range(4)])
    theirs_batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
    _assert_same(_step0(ours, ours_batch), _step0(theirs, theirs_batch), keys)
    assert _step0(ours, ours_batch)[1]["kl"] > 0  # the reference point is in play


def test_reward_step0_matches_trl(tmp_path, tiny_model_path):
    trl = trl_module("trl")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # rewards far enough apart to compare
    kw = dict(COMMON, center_rewards_coefficient=0.01)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    theirs = trl.RewardTrainer(
        copy.deepcopy(model),
        train_dataset=_pairs(),
        processing_class=tok,
        args=trl.RewardConfig(output_dir=str(tmp_path / "trl"), **kw),
    )
    ours = RewardTrainer(
        copy.deepcopy(model),
        train_dataset=_pairs(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
        args=RewardConfig(output_dir=str(tmp_path / "ours"), **kw),
    )
    for i in range(4):
        row = ours.train_dataset[i]
        assert row["prompt_ids"] + row["chosen_ids"] == theirs.train_dataset[i]["chosen_ids"]
    keys = ["accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"]
    _assert_same(
        _step0(ours, ours.data_collator([ours.train_dataset[i] for i in range(4)])),
        _step0(theirs, theirs.data_collator([theirs.train_dataset[i] for i in range(4)])),
        keys,
    )


# -- float64 references through the whole trainer ------------------------------------------------------------
def _token_logps64(model, ids):
    """Per-token float64 log-probs (entry t: log p(ids[t] | ids[:t])) and log sum_v p_v^2 at each position."""
    with torch.no_grad():
        logp = torch.log_softmax(copy.deepcopy(model).double().eval()(torch.tensor([ids])).logits[0], -1)
    token = [0.0] + [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]
    sum_sq = [0.0] + [torch.logsumexp(2 * logp[t - 1], -1).item() for t in range(1, len(ids))]
    return token, sum_sq


@pytest.mark.parametrize("ld_alpha, use_weighting", [(0.25, False), (None, True), (0.0, True)])
def test_dpo_ld_alpha_and_wpo_against_float64_reference(tmp_path, tiny_model_path, ld_alpha, use_weighting):
    beta = 0.5
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = _perturbed(policy, seed=1)
    trainer = DPOTrainer(
        copy.deepcopy(policy),
        ref_model=ref,
        train_dataset=_pairs(),
        args=DPOConfig(output_dir=str(tmp_path), beta=beta, ld_alpha=ld_alpha, use_weighting=use_weighting, **COMMON),
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    expected = []
    for row in rows:
        start = len(row["prompt_ids"])
        shared = min(len(row["chosen_ids"]), len(row["rejected_ids"]))
        logratio, weight = {}, 1.0
        for kind in ("chosen", "rejected"):
            ids = row["prompt_ids"] + row[f"{kind}_ids"]
            pol, sum_sq = _token_logps64(policy, ids)
            rf, _ = _token_logps64(ref, ids)
            a = 1.0 if ld_alpha is None else ld_alpha  # LD-DPO: tokens past the shared length weigh ld_alpha
            weights = [1.0 if k < shared else a for k in range(len(ids) - start)]
            logratio[kind] = sum(w * (pol[t] - rf[t]) for w, t in zip(weights, range(start, len(ids))))
            n = len(ids) - start
            weight *= math.exp(sum(pol[t] - sum_sq[t] for t in range(start, len(ids))) / n)  # WPO
        loss = math.log1p(math.exp(-beta * (logratio["chosen"] - logratio["rejected"])))
        expected.append(loss * (weight if use_weighting else 1.0))
    assert any(len(r["chosen_ids"]) != len(r["rejected_ids"]) for r in rows)  # LD-DPO has a tail to weigh
    loss, _ = _step0(trainer, trainer.data_collator(rows))
    assert loss == pytest.approx(sum(expected) / 4, rel=1e-5, abs=1e-7)
    if ld_alpha is not None or use_weighting:  # the option changes the loss
        plain = DPOTrainer(
            copy.deepcopy(policy),
            ref_model=ref,
            train_dataset=_pairs(),
            args=DPOConfig(output_dir=str(tmp_path / "p"), beta=beta, **COMMON),
        )
        assert abs(_step0(plain, plain.data_collator(rows))[0] - loss) > 1e-4


def test_dpo_precomputed_reference_uses_its_own_batch_size_and_ld_alpha(tmp_path, tiny_model_path):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    kw = dict(COMMON, ref_cache_dir=str(tmp_path / "cache"), precompute_ref_log_probs=True)
    calls = []
    model = copy.deepcopy(policy)
    model.register_forward_hook(lambda *a: calls.append(1))
    plain = DPOTrainer(
        model, train_dataset=_pairs(5), args=DPOConfig(output_dir=str(tmp_path), **kw, precompute_ref_batch_size=2)
    )
    assert len(calls) == 3  # 5 rows in batches of 2
    ld = DPOTrainer(
        copy.deepcopy(policy), train_dataset=_pairs(5), args=DPOConfig(output_dir=str(tmp_path), ld_alpha=0.0, **kw)
    )
    assert ld.train_dataset["ref_chosen_logps"] != plain.train_dataset["ref_chosen_logps"]  # not a stale cache hit


def test_kto_precomputed_reference_and_sync(tmp_path, tiny_model_path):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ref = _perturbed(policy, seed=2)
    kw = dict(COMMON, ref_cache_dir=str(tmp_path / "cache"))
    live = KTOTrainer(
        copy.deepcopy(policy), ref_model=ref, train_dataset=_unpaired(), args=KTOConfig(output_dir=str(tmp_path), **kw)
    )
    pre = KTOTrainer(
        copy.deepcopy(policy),
        ref_model=ref,
        train_dataset=_unpaired(),
        args=KTOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, **kw),
    )
    assert pre.ref_model is None and "ref_kl_logps" in pre.train_dataset.column_names
    rows = [pre.train_dataset[i] for i in range(4)]
    live_rows = [live.train_dataset[i] for i in range(4)]
    assert _step0(pre, pre.data_collator(rows))[0] == pytest.approx(
        _step0(live, live.data_collator(live_rows))[0], abs=1e-6
    )
    synced = KTOTrainer(
        copy.deepcopy(policy),
        train_dataset=_unpaired(),
        args=KTOConfig(
            output_dir=str(tmp_path),
            sync_ref_model=True,
            ref_model_sync_steps=1,
            ref_model_mixup_alpha=0.5,
            learning_rate=1e-2,
            **kw,
        ),
    )
    before = {n: p.detach().clone() for n, p in synced.ref_model.named_parameters()}
    synced.train()
    policy_now = dict(synced.model.named_parameters())
    for name, p in synced.ref_model.named_parameters():
        torch.testing.assert_close(p, 0.5 * policy_now[name].detach() + 0.5 * before[name], rtol=0, atol=1e-6)


def test_options_rejected_when_the_config_is_built(tmp_path):
    with pytest.raises(ConfigError, match="train_sampling_strategy='sequential'"):
        KTOConfig(output_dir=str(tmp_path), use_cpu=True, train_sampling_strategy="random")
    with pytest.raises(ConfigError, match="per_device_train_batch_size to 2 or more"):
        KTOConfig(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=1)
    with pytest.raises(ConfigError, match="truncation_mode='middle'"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, truncation_mode="middle")
    with pytest.raises(ConfigError, match="pad_to_multiple_of=0"):
        RewardConfig(output_dir=str(tmp_path), use_cpu=True, pad_to_multiple_of=0)
    assert DPOConfig(output_dir=str(tmp_path), use_cpu=True, pad_to_multiple_of="8").pad_to_multiple_of == 8
    assert DPOConfig(output_dir=str(tmp_path), use_cpu=True).pad_to_multiple_of is None  # 'auto' off Neuron
    assert DPOConfig(output_dir=str(tmp_path), use_cpu=True, max_length=128).max_prompt_length is None


def test_router_aux_loss_coef_needs_a_mixture_of_experts_model(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.1"):
        DPOTrainer(
            tiny_model_path,
            train_dataset=_pairs(),
            args=DPOConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.1, **COMMON),
        )


def test_pad_token_option_and_padding_to_a_multiple(tmp_path, tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trainer = DPOTrainer(
        tiny_model_path,
        train_dataset=_pairs(),
        processing_class=tokenizer,
        args=DPOConfig(output_dir=str(tmp_path), pad_token="<|im_start|>", pad_to_multiple_of=16, **COMMON),
    )
    pad_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    longest = int(batch["attention_mask"].sum(-1).max())
    assert batch["input_ids"].shape[1] == -(-longest // 16) * 16 > longest
    assert batch["input_ids"][0, -1].item() == pad_id
    assert trainer.model.config.pad_token_id == pad_id
    with pytest.raises(ConfigError, match="pad_token='<nope>'"):
        DPOTrainer(
            tiny_model_path,
            train_dataset=_pairs(),
            args=DPOConfig(output_dir=str(tmp_path), pad_token="<nope>", **COMMON),
        )


@pytest.mark.parametrize(
    "cls, expected",
    [
        (
            DPOTrainer,
            [
                "model",
                "ref_model",
                "args",
                "data_collator",
                "train_dataset",
                "eval_dataset",
                "processing_class",
                "compute_metrics",
                "callbacks",
                "optimizers",
                "quantization_config",
                "peft_config",
            ],
        ),
        (
            KTOTrainer,
            [
                "model",
                "ref_model",
                "args",
                "data_collator",
                "train_dataset",
                "eval_dataset",
                "processing_class",
                "compute_metrics",
                "callbacks",
                "optimizers",
                "quantization_config",
                "peft_config",
            ],
        ),
        (
            RewardTrainer,
            [
                "model",
                "args",
                "data_collator",
                "train_dataset",
                "eval_dataset",
                "processing_class",
                "compute_metrics",
                "callbacks",
                "optimizers",
                "optimizer_cls_and_kwargs",
                "preprocess_logits_for_metrics",
                "quantization_config",
                "peft_config",
            ],
        ),
    ],
)
def test_constructor_takes_trls_arguments_in_trls_order(cls, expected):
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
    assert params[: len(expected)] == expected


def test_compute_metrics_receives_the_policy_logits(tmp_path, tiny_model_path):
    seen = []

    def compute_metrics(prediction):
        seen.append((prediction.predictions.shape, prediction.label_ids.shape))
        return {"rows": float(prediction.label_ids.shape[0])}

    dpo = DPOTrainer(
        tiny_model_path,
        train_dataset=_pairs(),
        eval_dataset=_pairs(),
        compute_metrics=compute_metrics,
        args=DPOConfig(output_dir=str(tmp_path), per_device_eval_batch_size=4, **COMMON),
    )
    assert dpo.evaluate()["eval_rows"] == 8  # chosen and rejected sequences of 4 pairs, as TRL passes them
    kto = KTOTrainer(
        tiny_model_path,
        train_dataset=_unpaired(),
        eval_dataset=_unpaired(),
        compute_metrics=compute_metrics,
        args=KTOConfig(output_dir=str(tmp_path), per_device_eval_batch_size=4, **COMMON),
    )
    assert kto.evaluate()["eval_rows"] == 4  # the examples, not their KL pairs
    assert seen[0][0][:2] == seen[0][1] and seen[0][0][2] == dpo.model.config.vocab_size


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_joins_the_loss_with_its_coefficient(tmp_path, tiny_model_path, family):
    from posttrain.models.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    moe = build_tiny_model(tokenizer, num_layers=1, tie=False, family=family, router_aux_loss_coef=0.02)
    ref = _perturbed(moe, seed=3)
    losses, metrics = {}, {}
    for coef in (None, 0.0, 0.5):
        trainer = DPOTrainer(
            copy.deepcopy(moe),
            ref_model=copy.deepcopy(ref),
            train_dataset=_pairs(),
            processing_class=tokenizer,
            args=DPOConfig(output_dir=str(tmp_path), router_aux_loss_coef=coef, **COMMON),
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        losses[coef], metrics[coef] = _step0(trainer, batch)
    with torch.no_grad():
        aux = moe(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
        ).aux_loss.item()
    assert aux > 0 and "aux_loss" not in metrics[0.0]
    assert losses[0.5] - losses[0.0] == pytest.approx(0.5 * aux, rel=1e-4)
    assert losses[None] - losses[0.0] == pytest.approx(0.02 * aux, rel=1e-3)  # the model config's coefficient
    assert metrics[0.5]["aux_loss"] == pytest.approx(aux, rel=1e-4)


def test_conversational_rows_tokenize_as_in_trl(tmp_path, tiny_model_path):
    trl = trl_module("trl")
    user = [{"role": "user", "content": "say red"}]
    pairs = Dataset.from_list(
        [
            {
                "prompt": user,
                "chosen": [{"role": "assistant", "content": "red"}],
                "rejected": [{"role": "assistant", "content": "no red"}],
            }
        ]
        * 2
    )
    unpaired = Dataset.from_list(
        [
            {"prompt": user, "completion": [{"role": "assistant", "content": c}], "label": c == "red"}
            for c in ("red", "blue")
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    trainers = {}
    for name, data in (("DPO", pairs), ("KTO", unpaired)):
        for lib in (trl, __import__("posttrain")):
            trainers[name, lib.__name__] = getattr(lib, f"{name}Trainer")(
                copy.deepcopy(model),
                train_dataset=data,
                processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
                args=getattr(lib, f"{name}Config")(output_dir=str(tmp_path), **COMMON),
            )
    theirs, ours = trainers["DPO", "trl"].train_dataset[0], trainers["DPO", "posttrain"].train_dataset[0]
    assert [ours[c] for c in ("prompt_ids", "chosen_ids", "rejected_ids")] == [
        theirs[c] for c in ("prompt_ids", "chosen_ids", "rejected_ids")
    ]
    theirs, ours = trainers["KTO", "trl"].train_dataset[0], trainers["KTO", "posttrain"].train_dataset[0]
    start = len(theirs["prompt_ids"])
    assert ours["input_ids"] == theirs["prompt_ids"] + theirs["completion_ids"]
    assert ours["completion_mask"] == [0] * start + [1] * len(theirs["completion_ids"])


def test_reward_compute_metrics_receives_the_scores(tmp_path, tiny_model_path):
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction.predictions)
        return {"best": float(prediction.predictions.max())}

    trainer = RewardTrainer(
        tiny_model_path,
        train_dataset=_pairs(),
        eval_dataset=_pairs(),
        compute_metrics=compute_metrics,
        args=RewardConfig(output_dir=str(tmp_path), per_device_eval_batch_size=4, **COMMON),
    )
    metrics = trainer.evaluate()
    assert seen[0].shape == (8, 1)  # chosen rows, then rejected rows, as TRL passes them
    assert metrics["eval_best"] == pytest.approx(metrics["eval_max_reward"], abs=1e-6)


def test_evaluate_prepares_a_raw_dataset_as_trl_does(tmp_path, tiny_model_path):
    kw = dict(COMMON, per_device_eval_batch_size=4, ref_cache_dir=str(tmp_path / "cache"))
    dpo = DPOTrainer(tiny_model_path, train_dataset=_pairs(), args=DPOConfig(output_dir=str(tmp_path), **kw))
    assert "eval_rewards/accuracies" in dpo.evaluate(_pairs())
    split = dpo.evaluate({"test": _pairs()})
    assert "eval_test_loss" in split and "eval_rewards/accuracies" in split  # TRL's log names it so too
    kto = KTOTrainer(tiny_model_path, train_dataset=_unpaired(), args=KTOConfig(output_dir=str(tmp_path), **kw))
    assert "eval_kl" in kto.evaluate(_unpaired())
    reward = RewardTrainer(
        tiny_model_path,
        train_dataset=_pairs(),
        args=RewardConfig(output_dir=str(tmp_path), per_device_eval_batch_size=4, **COMMON),
    )
    assert "eval_accuracy" in reward.evaluate(_pairs())
    pre = DPOTrainer(
        tiny_model_path,
        train_dataset=_pairs(),
        args=DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, **kw),
    )
    before = pre.evaluate(_pairs())
    assert before["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # reference = untrained policy
    pre.train()
    with pytest.raises(ConfigError, match="after training began"):
        pre.evaluate(_pairs(2))


@pytest.mark.parametrize("trainer_name", ["DPO", "KTO"])
def test_policy_with_a_trained_adapter_is_its_own_reference(tmp_path, tiny_model_path, trainer_name):
    # As in TRL: a PeftModel passed without peft_config keeps a frozen copy of its adapter as the reference, so at
    # step 0 every implicit reward is 0; the bare base model would not be the starting point.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    data, cls = (_pairs(), DPOTrainer) if trainer_name == "DPO" else (_unpaired(), KTOTrainer)
    config = DPOConfig if trainer_name == "DPO" else KTOConfig
    trainer = cls(model, train_dataset=data, args=config(output_dir=str(tmp_path), learning_rate=1e-2, **COMMON))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    _, metrics = _step0(trainer, batch)
    assert metrics["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rewards/rejected"] == pytest.approx(0.0, abs=1e-6)
    ref_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".ref." in n}
    assert ref_before and not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".ref." in n)
    trainer.train()
    for name, param in trainer.model.named_parameters():
        if ".ref." in name:
            assert torch.equal(param, ref_before[name]) and not param.requires_grad
    _, after = _step0(trainer, batch)
    assert after["rewards/chosen"] != pytest.approx(0.0, abs=1e-6)  # the policy moved, its reference did not
