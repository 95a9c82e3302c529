"""DPOTrainer on the tiny model: the loss against a float64 reference, learning, reference modes, the disk
cache, LoRA without a second model, loss normalisation, TR-DPO syncing and errors before training."""

import copy
import gc
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from posttrain.data.preference import PreferenceCollator
from posttrain.errors import ConfigError, DataError
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

WORDS = ["cat", "dog", "sky", "sun", "tree", "fish", "moon", "bird"]


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        max_length=64,
        max_prompt_length=32,
        ref_cache_dir=str(tmp_path / "ref_cache"),
    )
    base.update(kw)
    return DPOConfig(**base)


def _data(n=8):
    """Chosen always ends with ' good', rejected with ' bad'; lengths vary so padding matters."""
    return Dataset.from_list(
        [
            {
                "prompt": f"the {WORDS[i % 8]} is" + " very" * (i % 3),
                "chosen": " so" * (i % 2) + " good",
                "rejected": " bad" + " bad" * (i % 3),
            }
            for i in range(n)
        ]
    )


def _model(path, seed=None):
    model = AutoModelForCausalLM.from_pretrained(path)
    if seed is not None:  # different weights, same architecture
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return model


def _batch(trainer, n=4, padding_free=False):
    rows = [trainer.train_dataset[i] for i in range(n)]
    return PreferenceCollator(trainer.processing_class.pad_token_id, padding_free)(rows)


def _completion_logps64(model, rows):
    """Float64, one unpadded sequence at a time: sum over completion tokens of log p(token | prefix)."""
    model = copy.deepcopy(model).double().eval()
    out = {"chosen": [], "rejected": [], "chosen_len": [], "rejected_len": []}
    for row in rows:
        for kind in ("chosen", "rejected"):
            ids = row["prompt_ids"] + row[f"{kind}_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
            start = len(row["prompt_ids"])
            out[kind].append(sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids))))
            out[f"{kind}_len"].append(len(ids) - start)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def _logsig(x):
    return torch.nn.functional.logsigmoid(x)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid,sft"])
def test_loss_and_metrics_match_float64_reference(tmp_path, tiny_model_path, loss_type):
    beta = 0.5
    ref = _model(tiny_model_path, seed=1)
    trainer = DPOTrainer(
        tiny_model_path,
        ref_model=ref,
        args=_args(tmp_path, beta=beta, loss_type=loss_type, loss_weights=[1.0, 0.3] if "," in loss_type else None),
        train_dataset=_data(),
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    pol, rf = _completion_logps64(trainer.model, rows), _completion_logps64(ref, rows)
    if loss_type == "ipo":  # IPO compares length-averaged log-probs
        h = (pol["chosen"] - rf["chosen"]) / pol["chosen_len"] - (pol["rejected"] - rf["rejected"]) / pol[
            "rejected_len"
        ]
        expected = ((h - 1 / (2 * beta)) ** 2).mean()
    else:
        h = (pol["chosen"] - rf["chosen"]) - (pol["rejected"] - rf["rejected"])
        expected = -_logsig(beta * h).mean()
        if loss_type == "sigmoid,sft":
            # TRL's 'sft' term: the token-mean NLL over all chosen completion tokens of the batch
            expected = expected + 0.3 * (-pol["chosen"].sum() / pol["chosen_len"].sum())

    trainer.model.eval()
    for padding_free in (False, True):
        loss = trainer.compute_loss(trainer.model, _batch(trainer, padding_free=padding_free))
        assert abs(loss.item() - expected.item()) < 1e-5 * max(1.0, abs(expected.item()))
    metrics = {k: v[0] for k, v in trainer._metrics["eval"].items()}
    chosen_rewards = beta * (pol["chosen"] - rf["chosen"])
    rejected_rewards = beta * (pol["rejected"] - rf["rejected"])
    if loss_type != "ipo":  # (ipo's rewards are per token)
        assert metrics["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-4)
        assert metrics["rewards/margins"] == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), abs=1e-4)
        assert metrics["rewards/accuracies"] == (chosen_rewards > rejected_rewards).double().mean().item()
    assert metrics["logps/chosen"] == pytest.approx(pol["chosen"].mean().item(), abs=1e-4)
    assert metrics["logps/rejected"] == pytest.approx(pol["rejected"].mean().item(), abs=1e-4)


def test_bco_pair_has_no_running_mean_shift_as_in_trl(tmp_path, tiny_model_path):
    beta = 0.5
    ref = _model(tiny_model_path, seed=1)
    trainer = DPOTrainer(
        tiny_model_path, ref_model=ref, args=_args(tmp_path, beta=beta, loss_type="bco_pair"), train_dataset=_data()
    )
    rows = [trainer.train_dataset[i] for i in range(8)]
    pol, rf = _completion_logps64(trainer.model, rows), _completion_logps64(ref, rows)
    chosen_rewards, rejected_rewards = beta * (pol["chosen"] - rf["chosen"]), beta * (pol["rejected"] - rf["rejected"])
    trainer.model.train()
    for part in (slice(0, 3), slice(3, 8)):  # TRL 1.16's bco_pair: -logsig(r_c) - logsig(-r_r), no delta
        batch = PreferenceCollator(trainer.processing_class.pad_token_id)(rows[part])
        loss = trainer.compute_loss(trainer.model, batch)
        expected = (-_logsig(chosen_rewards[part]) - _logsig(-rejected_rewards[part])).mean()
        assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_learns_to_prefer_chosen_and_evaluates(tmp_path, tiny_model_path):
    trainer = DPOTrainer(
        tiny_model_path, args=_args(tmp_path, max_steps=8, beta=0.5), train_dataset=_data(), eval_dataset=_data(4)
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 0
    assert logs[0]["rewards/accuracies"] == 0.0
    assert logs[-1]["loss"] < 0.3 * logs[0]["loss"]
    assert logs[-1]["rewards/accuracies"] == 1.0 and logs[-1]["rewards/margins"] > 1.0
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    ):
        assert math.isfinite(logs[-1][key])
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] < 0.3 * math.log(2) and metrics["eval_rewards/accuracies"] == 1.0


def test_reference_modes_give_identical_losses(tmp_path, tiny_model_path):
    # The PEFT policy has a random (B != 0) adapter, so policy != reference; the other two modes get the
    # merged weights as their policy after their reference (the initial model) was taken.
    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_trainer = DPOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_data(), peft_config=lora)
    assert peft_trainer.ref_model is None
    merged = copy.deepcopy(peft_trainer.model).merge_and_unload().state_dict()
    copy_trainer = DPOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=_data())
    precomputed = DPOTrainer(
        tiny_model_path, args=_args(tmp_path, precompute_ref_log_probs=True), train_dataset=_data()
    )
    assert precomputed.ref_model is None and "ref_chosen_logps" in precomputed.train_dataset.column_names
    losses = []
    for trainer in (peft_trainer, copy_trainer, precomputed):
        if trainer is not peft_trainer:
            trainer.model.load_state_dict(merged)
        losses.append(trainer.compute_loss(trainer.model, _batch(trainer, 8)).item())
    assert abs(losses[0] - math.log(2)) > 1e-3  # the modes are compared away from the trivial value
    assert losses[1] == pytest.approx(losses[0], abs=1e-5) and losses[2] == pytest.approx(losses[0], abs=1e-5)


def _counting(model):
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    return calls


def test_precomputed_reference_is_cached_on_disk_and_invalidated_by_data(tmp_path, tiny_model_path):
    args = _args(tmp_path, precompute_ref_log_probs=True, precompute_ref_batch_size=3)
    first_model = _model(tiny_model_path)
    first_calls = _counting(first_model)
    first = DPOTrainer(first_model, args=args, train_dataset=_data())
    assert len(first_calls) == 3  # 8 rows in batches of 3
    second_model = _model(tiny_model_path)
    second_calls = _counting(second_model)
    second = DPOTrainer(second_model, args=args, train_dataset=_data())
    assert second_calls == []  # loaded from the cache: the reference is never run
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        assert second.train_dataset[column] == first.train_dataset[column]
    changed = _data().map(lambda row, i: {"chosen": row["chosen"] + " yes" * (i == 5)}, with_indices=True)
    third_model = _model(tiny_model_path)
    third_calls = _counting(third_model)
    DPOTrainer(third_model, args=args, train_dataset=changed)
    assert len(third_calls) == 3
    DPOTrainer(
        _model(tiny_model_path),
        args=_args(tmp_path, precompute_ref_log_probs=True, max_completion_length=2),
        train_dataset=_data(),
    )
    assert len(list((tmp_path / "ref_cache").glob("*.pt"))) == 3  # data and tokenization settings are in the key
    ref_first = torch.tensor(first.train_dataset["ref_chosen_logps"])
    assert torch.all(ref_first < 0)


def test_lora_trains_without_a_second_model(tmp_path, tiny_model_path):
    gc.collect()
    before = sum(isinstance(o, LlamaForCausalLM) for o in gc.get_objects())
    trainer = DPOTrainer(
        tiny_model_path,
        args=_args(tmp_path, max_steps=2),
        train_dataset=_data(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    gc.collect()
    assert sum(isinstance(o, LlamaForCausalLM) for o in gc.get_objects()) == before + 1
    assert trainer.ref_model is None
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, start[name]) != ("lora_" in name), name  # only the adapter moves


def _one_sgd_step(tmp_path, tiny_model_path, **kw):
    trainer = DPOTrainer(
        tiny_model_path,
        args=_args(tmp_path, optim="sgd", lr_scheduler_type="constant", learning_rate=0.5, **kw),
        train_dataset=_data(3),
    )
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return start, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_batch_times_accumulation_equivalence(tmp_path, tiny_model_path):
    # 3 pairs as one batch, or as micro-batches of 2 and 1: the loss divides by the 3 pairs either way.
    start, one = _one_sgd_step(tmp_path, tiny_model_path, per_device_train_batch_size=3)
    _, accumulated = _one_sgd_step(
        tmp_path, tiny_model_path, per_device_train_batch_size=2, gradient_accumulation_steps=2
    )
    assert any(not torch.equal(start[n], one[n]) for n in one)
    for name in one:
        torch.testing.assert_close(accumulated[name], one[name], rtol=0, atol=1e-6)


def test_sync_ref_model_mixes_policy_into_reference(tmp_path, tiny_model_path):
    trainer = DPOTrainer(
        tiny_model_path,
        args=_args(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.25),
        train_dataset=_data(),
    )
    initial = {n: p.detach().clone().double() for n, p in trainer.model.named_parameters()}
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    for name, ref_param in trainer.ref_model.named_parameters():
        expected = 0.25 * policy[name].detach().double() + 0.75 * initial[name]
        torch.testing.assert_close(ref_param.double(), expected, rtol=0, atol=1e-6)
    assert any(not torch.equal(policy[n].double(), initial[n]) for n in initial)


def test_missing_rejected_column(tmp_path, tiny_model_path):
    with pytest.raises(DataError, match=r"DPOTrainer does not train on prompt-completion data \(columns found"):
        DPOTrainer(
            tiny_model_path, args=_args(tmp_path), train_dataset=Dataset.from_list([{"prompt": "a", "completion": "b"}])
        )


def test_conversational_prompt_with_string_chosen(tmp_path, tiny_model_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "chosen": "yes", "rejected": "no"}]
    with pytest.raises(DataError, match="Row 0: column 'chosen' is a string but the other columns are conversations"):
        DPOTrainer(tiny_model_path, args=_args(tmp_path), train_dataset=Dataset.from_list(rows))


def test_empty_dataset(tmp_path, tiny_model_path):
    with pytest.raises(DataError, match="DPOTrainer: train_dataset is empty"):
        DPOTrainer(
            tiny_model_path,
            args=_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []}),
        )


def test_prompt_filling_max_length(tmp_path, tiny_model_path):
    # As in TRL, keep_start drops rows whose prompt fills max_length; when none is left the run stops.
    with pytest.raises(DataError, match="Every row of train_dataset is dropped because their prompt alone fills"):
        DPOTrainer(tiny_model_path, args=_args(tmp_path, max_length=4, max_prompt_length=None), train_dataset=_data())


def test_sync_ref_model_with_peft_policy(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="sync_ref_model needs a separate reference model"):
        DPOTrainer(
            tiny_model_path,
            args=_args(tmp_path, sync_ref_model=True),
            train_dataset=_data(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(loss_type="sigmoidd"), r"loss_type \['sigmoidd'\] is not supported"),
        (dict(loss_type="sigmoid,ipo", loss_weights=[1.0]), "loss_weights has 1 entries but loss_type has 2"),
        (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing=0.1 has no effect"),
        (dict(max_length=16, max_prompt_length=16), "max_prompt_length=16 leaves no room"),
        (dict(precompute_ref_log_probs=True, sync_ref_model=True), "its log-probs cannot be precomputed"),
        (dict(ref_model_mixup_alpha=0.0), r"ref_model_mixup_alpha=0.0 must lie in \(0, 1\]"),
    ],
)
def test_bad_settings_fail_at_config_time(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        _args(tmp_path, **settings)


def test_loss_type_from_the_command_line(tmp_path):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(DPOConfig)
    (parsed,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--loss_type", "sigmoid,sft", "--loss_weights", "1", "0.5"]
    )
    assert parsed.loss_type == ["sigmoid", "sft"] and parsed.loss_weights == [1.0, 0.5]
    assert _args(tmp_path, loss_type="ipo").loss_type == ["ipo"]  # a list, as TRL makes it


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_sequence_logps_shares_prompts_packs_and_matches_float64_per_sequence(tiny_model_path, monkeypatch, attention):
    """Rows of very different lengths: the padded batch runs as fewer rows, each prompt once for its chosen and
    rejected completions, through the hidden-state path (no [tokens x vocab] logits); each sequence's log-prob,
    metric sums and gradient equal float64 computed on it alone. A left-padded batch (left as it is) agrees."""
    from posttrain.models import layouts as sequence_layouts
    from posttrain.training import preference as preference_common

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=attention)
    rows = [
        {
            "prompt_ids": list(range(5, 5 + p)),
            "chosen_ids": [40 + i for i in range(c)],
            "rejected_ids": [80 + i for i in range(r)],
        }
        for p, c, r in ((30, 6, 9), (3, 2, 4), (12, 5, 1), (40, 7, 3))
    ]
    batch = PreferenceCollator(0)(rows)
    layouts = []
    monkeypatch.setattr(
        sequence_layouts,
        "shared_layout",
        lambda *args, f=sequence_layouts.shared_layout: layouts.append(f(*args)) or layouts[-1],
    )
    got = preference_common.sequence_logps(model, batch)
    # Fewer positions than the prompts and completions hold when each is computed once per sequence.
    assert layouts[0][0]["input_ids"].numel() < sum(
        2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows
    )
    got.logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model64 = copy.deepcopy(model).double()
    model64.zero_grad()
    expected, entropy, tokens = [], [], []
    for kind in ("chosen", "rejected"):
        for row in rows:
            ids = row["prompt_ids"] + row[f"{kind}_ids"]
            logp = torch.log_softmax(model64(torch.tensor([ids])).logits[0], -1)
            steps = range(len(row["prompt_ids"]), len(ids))
            expected.append(sum(logp[t - 1, ids[t]] for t in steps))
            entropy.append(sum(-(logp[t - 1].exp() * logp[t - 1]).sum() for t in steps).item())
            tokens.append(len(steps))
    torch.stack(expected).sum().backward()
    torch.testing.assert_close(got.logps.double(), torch.stack(expected).detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(
        got.stats["entropy"].double(), torch.tensor(entropy, dtype=torch.float64), atol=1e-4, rtol=1e-5
    )
    assert got.token_counts.tolist() == tokens
    for name, param in model64.named_parameters():
        torch.testing.assert_close(grads[name].double(), param.grad, atol=1e-4, rtol=1e-4)
    pads = (batch["attention_mask"] == 0).sum(-1).tolist()  # RoPE: shifting a whole sequence changes nothing
    left = {k: torch.stack([row.roll(pad) for row, pad in zip(v, pads)]) for k, v in batch.items()}
    layouts.clear()
    with torch.no_grad():
        torch.testing.assert_close(
            preference_common.sequence_logps(model, left).logps, got.logps.detach(), atol=1e-4, rtol=1e-5
        )
    assert layouts == []
