"""ORPO and CPO (SimPO, AlphaPO): the losses against float64 references written from the papers' formulas, step-0
loss and metrics side by side with TRL 1.16's trl.experimental trainers, learning on data where the answer is
known, padding-free = padded, config checks and TRL's signatures."""

import copy
import inspect
import json
import math
import os

import pytest
import torch
from _trl import import_trl_experimental
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.experimental.cpo import CPOConfig, CPOTrainer
from posttrain.experimental.orpo import ORPOConfig, ORPOTrainer
from posttrain.losses.reference_free import alphapo_reward, cpo_loss, log1mexp, orpo_loss

# Per-token average completion log-probs (ORPO, ipo, simpo) and summed ones (sigmoid, hinge), three pairs.
AVG_CHOSEN, AVG_REJECTED = [-0.9, -2.3, -0.05], [-1.4, -0.7, -3.2]
SUM_CHOSEN, SUM_REJECTED = [-5.2, -3.1, -7.4], [-6.0, -2.5, -9.1]
BETA = 0.7


def t64(values):
    return torch.tensor(values, dtype=torch.float64)


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def close(actual, expected):
    torch.testing.assert_close(actual, t64(expected), rtol=1e-10, atol=1e-10)


# -- losses against float64 references --------------------------------------------------------------------------


def test_log1mexp_matches_the_definition_on_both_branches():
    xs = [-1e-6, -0.1, -0.6931, -0.6932, -2.0, -30.0]
    close(log1mexp(t64(xs)), [math.log(1 - math.exp(x)) for x in xs])


def test_orpo_loss_is_the_odds_ratio_term_of_the_paper():
    losses, chosen_r, rejected_r, log_sig, log_odds = orpo_loss(t64(AVG_CHOSEN), t64(AVG_REJECTED), beta=BETA)
    ref_odds, ref_losses = [], []
    for c, r in zip(AVG_CHOSEN, AVG_REJECTED):
        pc, pr = math.exp(c), math.exp(r)
        ratio = math.log((pc / (1 - pc)) / (pr / (1 - pr)))  # Eq. 4-6: odds(y) = P / (1 - P)
        ref_odds.append(ratio)
        ref_losses.append(-BETA * logsig(ratio))  # Eq. 7, weighted by lambda
    close(losses, ref_losses)
    close(log_odds, ref_odds)
    close(log_sig, [logsig(x) for x in ref_odds])
    close(chosen_r, [BETA * c for c in AVG_CHOSEN])
    close(rejected_r, [BETA * r for r in AVG_REJECTED])


def _shape(logp: float, alpha: float) -> float:
    return logp if alpha == 0 else (1 - math.exp(logp) ** (-alpha)) / alpha


@pytest.mark.parametrize("alpha", [0.0, 0.3, -0.2])
@pytest.mark.parametrize(
    "loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("hinge", 0.0), ("ipo", 0.0), ("simpo", 0.0), ("simpo", 0.1)]
)
def test_cpo_losses_match_their_papers(loss_type, eps, alpha):
    gamma = 0.8
    chosen, rejected = (AVG_CHOSEN, AVG_REJECTED) if loss_type in ("ipo", "simpo") else (SUM_CHOSEN, SUM_REJECTED)
    losses, chosen_r, rejected_r = cpo_loss(
        t64(chosen), t64(rejected), loss_type=loss_type, beta=BETA, label_smoothing=eps, simpo_gamma=gamma, alpha=alpha
    )
    expected = []
    for c, r in zip(chosen, rejected):
        h = _shape(c, alpha) - _shape(r, alpha)
        if loss_type == "sigmoid":  # CPO Eq. 3 with cDPO's label noise
            expected.append(-(1 - eps) * logsig(BETA * h) - eps * logsig(-BETA * h))
        elif loss_type == "simpo":  # SimPO Eq. 6: -log sigmoid(beta * h - gamma)
            expected.append(-(1 - eps) * logsig(BETA * h - gamma) - eps * logsig(-(BETA * h - gamma)))
        elif loss_type == "hinge":  # SLiC
            expected.append(max(0.0, 1 - BETA * h))
        else:  # IPO Eq. 17 with tau = beta
            expected.append((h - 1 / (2 * BETA)) ** 2)
    close(losses, expected)
    close(chosen_r, [BETA * _shape(c, alpha) for c in chosen])
    close(rejected_r, [BETA * _shape(r, alpha) for r in rejected])


def test_alphapo_reward_tends_to_the_log_prob():
    logps = t64([-0.3, -2.0])
    torch.testing.assert_close(alphapo_reward(logps, 1e-7), logps, rtol=1e-6, atol=1e-6)
    assert alphapo_reward(logps, 0.0) is logps


# -- trainers --------------------------------------------------------------------------------------------------

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
KEYS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
]


def _pairs(n=4):
    """Chosen always says ' good', rejected ' bad'; prompt and completion lengths vary so padding matters."""
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


def _step0(trainer, batch, trl_side=False):
    from posttrain.training.metric_values import as_floats

    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch)).item()
    stored = trainer._stored_metrics["train"] if trl_side else trainer._metrics["train"]
    if not trl_side:
        as_floats(stored)  # training metrics stay on the device until logged (training/metric_values.py)
    return loss, {k: v[-1] for k, v in stored.items()}


def _trl_experimental(name):
    return import_trl_experimental(name)


def _side_by_side(tmp_path, path, name, options):
    module = _trl_experimental(name)
    upper = name.upper()
    model = AutoModelForCausalLM.from_pretrained(path)
    kw = dict(COMMON, **options)
    theirs = getattr(module, f"{upper}Trainer")(
        copy.deepcopy(model),
        args=getattr(module, f"{upper}Config")(output_dir=str(tmp_path / "trl"), **kw),
        train_dataset=_pairs(),
        processing_class=AutoTokenizer.from_pretrained(path),
    )
    ours_cls, config_cls = (ORPOTrainer, ORPOConfig) if name == "orpo" else (CPOTrainer, CPOConfig)
    ours = ours_cls(
        copy.deepcopy(model),
        args=config_cls(output_dir=str(tmp_path / "ours"), **kw),
        train_dataset=_pairs(),
        processing_class=AutoTokenizer.from_pretrained(path),
    )
    cut = options.get("max_length") or 1024  # TRL cuts the completion when tokenizing, posttrain's collator
    for i in range(4):  # the same tokens: prompt, then prompt + completion (cut to max_length)
        row, trl_row = ours.train_dataset[i], theirs.train_dataset[i]
        assert row["prompt_ids"] == trl_row["prompt_input_ids"] and len(row["prompt_ids"]) < cut
        for part in ("chosen", "rejected"):
            assert (row["prompt_ids"] + row[f"{part}_ids"])[:cut] == trl_row[f"{part}_input_ids"]
    if "max_length" in options:  # the cut is in play
        assert any(
            len(ours.train_dataset[i]["prompt_ids"] + ours.train_dataset[i]["chosen_ids"]) > cut for i in range(4)
        )
    return (
        _step0(ours, ours.data_collator([ours.train_dataset[i] for i in range(4)])),
        _step0(theirs, theirs.data_collator([theirs.train_dataset[i] for i in range(4)]), trl_side=True),
    )


def _assert_same(ours, theirs, keys, rel=0.0):
    (our_loss, our_metrics), (trl_loss, trl_metrics) = ours, theirs
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=rel)
    for key in keys:
        assert our_metrics[key] == pytest.approx(trl_metrics[key], abs=1e-5, rel=rel), key


@pytest.mark.parametrize("options", [{"beta": 0.3}, {"beta": 0.3, "max_length": 16}])
def test_orpo_step0_matches_trl(tmp_path, tiny_model_path, options):
    ours, theirs = _side_by_side(tmp_path, tiny_model_path, "orpo", options)
    _assert_same(ours, theirs, KEYS + ["log_odds_ratio", "log_odds_chosen"])
    assert ours[1]["nll_loss"] > 1.0 and ours[1]["log_odds_chosen"] != 0.0  # both terms in play


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": "sigmoid", "label_smoothing": 0.2},
        {"loss_type": "hinge"},
        {"loss_type": "ipo"},
        {"loss_type": "simpo", "simpo_gamma": 0.3},
        {"loss_type": "alphapo", "alpha": 0.4},
        {"loss_type": "ipo", "alpha": -0.3, "cpo_alpha": 0.5},
        {"loss_type": "sigmoid", "cpo_alpha": 0.0},
        {"loss_type": "simpo", "max_length": 16},
    ],
)
def test_cpo_step0_matches_trl(tmp_path, tiny_model_path, options):
    ours, theirs = _side_by_side(tmp_path, tiny_model_path, "cpo", dict(beta=0.3, **options))
    _assert_same(ours, theirs, KEYS)


def test_cpo_alphapo_on_summed_log_probs_matches_trl(tmp_path, tiny_model_path):
    # p^-alpha of a whole sequence is ~1e7 here: float32 agrees to its precision, not to 1e-5 absolute.
    ours, theirs = _side_by_side(tmp_path, tiny_model_path, "cpo", dict(beta=0.3, loss_type="sigmoid", alpha=0.4))
    assert abs(theirs[0]) > 1e5
    _assert_same(ours, theirs, KEYS, rel=1e-5)


def _learn(tmp_path, path, trainer_cls, config_cls, steps=20, **options):
    args = config_cls(
        output_dir=str(tmp_path),
        learning_rate=2e-3,
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        **options,
    )
    trainer = trainer_cls(path, args=args, train_dataset=_pairs(8))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(
    "name,options",
    [("orpo", {}), ("cpo", {}), ("cpo", {"loss_type": "simpo"}), ("cpo", {"loss_type": "alphapo", "alpha": 0.25})],
)
def test_learns_to_prefer_chosen(tmp_path, tiny_model_path, name, options):
    classes = (ORPOTrainer, ORPOConfig) if name == "orpo" else (CPOTrainer, CPOConfig)
    logs = _learn(tmp_path, tiny_model_path, *classes, beta=1.0, **options)
    first, last = logs[0], logs[-1]
    print(
        f"{name} {options}: margin {first['rewards/margins']:.3f} -> {last['rewards/margins']:.3f}, loss "
        f"{first['loss']:.3f} -> {last['loss']:.3f}, accuracy {last['rewards/accuracies']:.2f} in {len(logs)} steps"
    )
    assert last["loss"] < first["loss"] - 0.5
    assert last["rewards/margins"] > max(first["rewards/margins"], 0.0) + 0.5
    # Summed log-probs (sigmoid) still misrank the odd pair whose chosen completion is longer.
    assert sum(h["rewards/accuracies"] for h in logs[-4:]) / 4 >= 0.85
    if name == "orpo":
        assert last["log_odds_chosen"] > first["log_odds_chosen"] + 1.0 and last["nll_loss"] < first["nll_loss"]
        assert last["log_odds_ratio"] > 0.5 * first["log_odds_ratio"]  # -log sigmoid(odds ratio) at least halves


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_padding_free_computes_what_padding_computes(tmp_path, tiny_model_path, name):
    classes = (ORPOTrainer, ORPOConfig) if name == "orpo" else (CPOTrainer, CPOConfig)
    results = []
    for padding_free in (False, True):
        trainer = classes[0](
            tiny_model_path,
            train_dataset=_pairs(),
            args=classes[1](output_dir=str(tmp_path), padding_free=padding_free, **COMMON),
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        assert ("attention_mask" in batch) != padding_free
        results.append(_step0(trainer, batch))
    _assert_same(results[0], results[1], KEYS + ["logits/chosen", "entropy"] + (["log_odds_chosen"] * (name == "orpo")))


def test_orpo_nll_covers_the_prompt_and_cpo_nll_only_the_completion(tmp_path, tiny_model_path):
    # One pair, float64 reference of both NLLs from the model's own log-probs.
    data = Dataset.from_list([{"prompt": "the cat is very", "chosen": " good", "rejected": " bad bad"}])
    kw = dict(COMMON, per_device_train_batch_size=1)
    orpo = ORPOTrainer(tiny_model_path, train_dataset=data, args=ORPOConfig(output_dir=str(tmp_path), **kw))
    cpo = CPOTrainer(tiny_model_path, train_dataset=data, args=CPOConfig(output_dir=str(tmp_path), **kw))
    row = orpo.train_dataset[0]
    ids = torch.tensor([row["prompt_ids"] + row["chosen_ids"]])
    with torch.no_grad():
        logps = orpo.model(input_ids=ids).logits.double().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    start = len(row["prompt_ids"]) - 1  # logps[t] predicts token t + 1
    _, orpo_metrics = _step0(orpo, orpo.data_collator([row]))
    _, cpo_metrics = _step0(cpo, cpo.data_collator([row]))
    assert orpo_metrics["nll_loss"] == pytest.approx(-logps.mean().item(), abs=1e-5)
    assert cpo_metrics["nll_loss"] == pytest.approx(-logps[start:].mean().item(), abs=1e-5)


def test_evaluate_logs_games_and_gives_trl_predictions(tmp_path, tiny_model_path):
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction.predictions)
        return {"n": float(len(prediction.predictions))}

    trainer = ORPOTrainer(
        tiny_model_path,
        train_dataset=_pairs(),
        eval_dataset=_pairs(),
        compute_metrics=compute_metrics,
        args=ORPOConfig(
            output_dir=str(tmp_path), generate_during_eval=True, max_length=24, per_device_eval_batch_size=2, **COMMON
        ),
    )
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_nll_loss", "eval_log_odds_ratio", "eval_rewards/margins"} <= set(metrics)
    assert seen[0].shape == (4,)  # two batches of (mean chosen logits, mean rejected logits), as TRL
    with open(os.path.join(tmp_path, "game_log.jsonl")) as f:
        games = [json.loads(line) for line in f]
    assert len(games) == 2 and all(g["prompt"].startswith("the ") for g in games)


def test_config_checks_and_alphapo_shorthand(tmp_path):
    out = dict(output_dir=str(tmp_path))
    config = CPOConfig(loss_type="alphapo", cpo_alpha=0.7, **out)
    assert (config.loss_type, config.cpo_alpha) == ("simpo", 0.0)  # as TRL
    for bad, match in [
        (dict(loss_type="kto_pair"), "loss_type"),
        (dict(beta=0.0), "beta"),
        (dict(loss_type="hinge", label_smoothing=0.1), "no effect"),
        (dict(label_smoothing=0.7), r"\[0, 0.5\]"),
        (dict(cpo_alpha=-1.0), "cpo_alpha"),
        (dict(is_encoder_decoder=True), "decoder-only"),
        (dict(max_length=0), "max_length"),
    ]:
        with pytest.raises(ConfigError, match=match):
            CPOConfig(**bad, **out)
    with pytest.raises(ConfigError, match="beta"):
        ORPOConfig(beta=-0.1, **out)
    with pytest.raises(ConfigError, match="train_dataset"):
        ORPOTrainer(AutoModelForCausalLM.from_config(_tiny_config()), args=ORPOConfig(**out))


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_signature_and_config_fields_follow_trl(name):
    module = _trl_experimental(name)
    upper = name.upper()
    ours = CPOTrainer if name == "cpo" else ORPOTrainer
    trl_params = list(inspect.signature(getattr(module, f"{upper}Trainer").__init__).parameters)[1:]
    our_params = list(inspect.signature(ours.__init__).parameters)[1:]
    assert our_params[: len(trl_params)] == trl_params
    import dataclasses

    our_config = CPOConfig if name == "cpo" else ORPOConfig
    our_fields = {f.name: f for f in dataclasses.fields(our_config)}
    # posttrain-wide defaults (docs/trl_parity.md): auto checkpointing; collators keep their columns.
    project_wide = {"gradient_checkpointing", "remove_unused_columns"}
    differing = []
    for f in dataclasses.fields(getattr(module, f"{upper}Config")):
        assert f.name in our_fields, f.name
        if f.default is not dataclasses.MISSING and our_fields[f.name].default != f.default:
            differing.append(f.name)
    assert set(differing) <= project_wide, differing


def test_model_init_and_lora_train_only_the_adapter(tmp_path, tiny_model_path):
    from peft import LoraConfig

    trainer = CPOTrainer(
        model_init=lambda: AutoModelForCausalLM.from_pretrained(tiny_model_path),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_path),
        train_dataset=_pairs(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        args=CPOConfig(output_dir=str(tmp_path), learning_rate=1e-2, **dict(COMMON, max_steps=2)),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    with pytest.raises(ConfigError, match="either model or model_init"):
        CPOTrainer(
            tiny_model_path,
            model_init=lambda: None,
            train_dataset=_pairs(),
            args=CPOConfig(output_dir=str(tmp_path), **COMMON),
        )


def test_router_aux_loss_joins_when_the_model_asks_for_router_logits(tmp_path, tiny_model_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    losses = {}
    for output_router_logits in (False, True):  # TRL's rule: the model config's flag and coefficient
        torch.manual_seed(0)
        moe = MixtralForCausalLM(
            MixtralConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                num_local_experts=4,
                num_experts_per_tok=2,
                router_aux_loss_coef=0.5,
                output_router_logits=output_router_logits,
            )
        )
        trainer = ORPOTrainer(
            moe, train_dataset=_pairs(), processing_class=tokenizer, args=ORPOConfig(output_dir=str(tmp_path), **COMMON)
        )
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
        losses[output_router_logits], metrics = _step0(trainer, batch)
    with torch.no_grad():
        aux = moe(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True
        ).aux_loss.item()
    assert aux > 0 and metrics["aux_loss"] == pytest.approx(aux, rel=1e-4)
    assert losses[True] - losses[False] == pytest.approx(0.5 * aux, rel=1e-4)


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_model_path, name):
    from test_resume import _logged, _StopAfter

    trainer_cls, config_cls = (ORPOTrainer, ORPOConfig) if name == "orpo" else (CPOTrainer, CPOConfig)

    def make(out, callbacks):
        args = config_cls(
            output_dir=str(out),
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            logging_steps=1,
            learning_rate=1e-2,
            seed=0,
            use_cpu=True,
            bf16=False,
            report_to="none",
            disable_tqdm=True,
            write_report=False,
            per_device_train_batch_size=2,
        )
        return trainer_cls(tiny_model_path, args=args, train_dataset=_pairs(8), callbacks=callbacks)

    straight = make(tmp_path / "straight", None)
    straight.train()
    make(tmp_path / "run", [_StopAfter(2)]).train()
    resumed = make(tmp_path / "run", None)
    resumed.train(resume_from_checkpoint=True)
    expected = dict(straight.model.named_parameters())
    for key, value in resumed.model.named_parameters():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=0)
    want, got = _logged(straight, range(3, 5)), _logged(resumed, range(3, 5))
    assert sorted(got) == sorted(want) == [3, 4]
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)  # num_tokens included


@pytest.mark.parametrize("config_class", [CPOConfig, ORPOConfig])
def test_trl_command_line_switches_off_what_posttrain_has_off_already(config_class, tmp_path):
    """TRL's documented cpo.py / orpo.py commands pass --no_remove_unused_columns (TRL's default is True, posttrain's
    False): every on/off flag takes its --no_ spelling, so the command parses, and the value is False as TRL's."""
    from posttrain import ModelConfig, ScriptArguments, TrlParser

    parser = TrlParser((ScriptArguments, config_class, ModelConfig))
    argv = ["--dataset_name", "d", "--output_dir", str(tmp_path), "--no_remove_unused_columns", "--no_bf16"]
    _, args, _ = parser.parse_args_and_config(argv)
    assert args.remove_unused_columns is False and args.bf16 is False
