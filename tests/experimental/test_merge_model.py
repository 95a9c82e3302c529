"""Weight-averaging callbacks of trl.experimental: MergeModelCallback (linear and SLERP merges against float64
references, the merged checkpoint it writes) and BEMA as the DPO reference (bema_for_ref_model)."""

import copy
import math
import types

import pytest
import torch
from _trl import import_trl, trl_module
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, Trainer, TrainerControl, TrainerState, TrainingArguments

from posttrain.errors import ConfigError
from posttrain.experimental.bema_for_ref_model import BEMACallback, DPOTrainer
from posttrain.experimental.merge_model_callback import MergeConfig, MergeModelCallback, linear_merge, slerp
from posttrain.trainers.dpo import DPOConfig


def _slerp64(t, v0, v1, threshold=0.9995):
    """SLERP from its definition, in float64: the angle from the normalised dot product, then
    sin((1-t)Ω)/sin Ω · v0 + sin(tΩ)/sin Ω · v1; nearly parallel vectors interpolate linearly."""
    a, b = v0.double().flatten().tolist(), v1.double().flatten().tolist()
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    cos = sum(x * y for x, y in zip(a, b)) / (na * nb)
    if abs(cos) > threshold:
        out = [(1 - t) * x + t * y for x, y in zip(a, b)]
    else:
        omega = math.acos(cos)
        out = [(math.sin((1 - t) * omega) * x + math.sin(t * omega) * y) / math.sin(omega) for x, y in zip(a, b)]
    return torch.tensor(out, dtype=torch.float64).reshape(v0.shape)


def test_linear_merge_matches_float64():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(5, 7, generator=gen), torch.randn(5, 7, generator=gen)
    for wp, wq in ((0.5, 0.5), (0.3, 0.9), (1.0, 0.0)):
        want = (wp * p.double() + wq * q.double()) / (wp + wq)
        torch.testing.assert_close(linear_merge(p, q, wp, wq).double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            linear_merge(p, q, wp, wq, normalize=False).double(),
            wp * p.double() + wq * q.double(),
            rtol=1e-6,
            atol=1e-6,
        )
    with pytest.raises(ConfigError, match="cancel out"):
        linear_merge(p, q, 1.0, -1.0)


def test_slerp_matches_float64_on_both_branches():
    gen = torch.Generator().manual_seed(1)
    v0, v1 = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    for t in (0.0, 0.25, 0.5, 0.9, 1.0):
        torch.testing.assert_close(slerp(t, v0, v1).double(), _slerp64(t, v0, v1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(slerp(0.0, v0, v1), v0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(slerp(1.0, v0, v1), v1, rtol=1e-5, atol=1e-5)
    # unit vectors stay on the sphere (a linear mix would shrink)
    u0, u1 = v0 / v0.norm(), v1 / v1.norm()
    assert slerp(0.5, u0, u1).norm().item() == pytest.approx(1.0, abs=1e-5)
    assert (0.5 * u0 + 0.5 * u1).norm().item() < 0.99
    # nearly parallel: the linear fallback
    w1 = v0 + 1e-3 * v1
    torch.testing.assert_close(slerp(0.3, v0, w1).double(), 0.7 * v0.double() + 0.3 * w1.double(), rtol=1e-5, atol=1e-6)


def test_slerp_matches_mergekit_where_installed():
    """Side by side with mergekit (TRL's merge backend; not a posttrain dependency, skipped when absent)."""
    mergekit_slerp = pytest.importorskip("mergekit.merge_methods.slerp").slerp
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 5, generator=gen), torch.randn(8, 5, generator=gen)
    for t in (0.0, 0.3, 0.5, 1.0):
        torch.testing.assert_close(
            slerp(t, a, b), mergekit_slerp(torch.tensor([t]), a[None], b[None])[0], rtol=1e-5, atol=1e-6
        )


def test_merge_config_names_defaults_and_refusals():
    linear = MergeConfig()
    assert (linear.method, linear.policy_model_weight, linear.target_model_weight, linear.dtype) == (
        "linear",
        0.5,
        0.5,
        "float16",
    )
    assert MergeConfig("slerp").t_values == 0.5
    for method in ("ties", "dare_ties"):
        with pytest.raises(ConfigError, match="TIES and DARE-TIES are not built in"):
            MergeConfig(method)
    with pytest.raises(ConfigError, match="Unsupported merge method"):
        MergeConfig("average")


def _lm_trainer(tmp_path, tiny_model_path, tokenizer, callbacks, **kw):
    rows = [tokenizer(t)["input_ids"][:3] for t in ("the sky is blue", "one two three", "a cat is good", "hi there")]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=0.1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        **kw,
    )
    return Trainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=args,
        train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


@pytest.mark.parametrize("method", ["linear", "slerp"])
def test_merge_callback_writes_the_merged_model(tmp_path, tiny_model_path, fresh_tokenizer, method):
    config = MergeConfig(method)
    config.dtype = "float32"
    if method == "linear":
        config.policy_model_weight, config.target_model_weight = 0.75, 0.25
    else:
        config.t_values = 0.4
    trainer = _lm_trainer(tmp_path, tiny_model_path, fresh_tokenizer, [MergeModelCallback(config)], save_strategy="no")
    trainer.train()
    merged_path = tmp_path / "out" / "checkpoint-2" / "merged"
    merged = AutoModelForCausalLM.from_pretrained(merged_path)
    assert (merged_path / "tokenizer_config.json").exists()
    assert config.target_model_path == tiny_model_path  # the checkpoint the policy was loaded from
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    policy = dict(trainer.model.named_parameters())
    moved = 0
    for name, param in merged.named_parameters():
        p, q = policy[name].detach().double(), initial[name].detach().double()
        want = 0.75 * p + 0.25 * q if method == "linear" else _slerp64(0.4, p, q)
        torch.testing.assert_close(param.double(), want, rtol=1e-5, atol=1e-6)
        moved += not torch.allclose(p, q)
    assert moved > 0  # training moved the policy away from the target


def test_merge_at_every_checkpoint_and_saved_dtype(tmp_path, tiny_model_path, fresh_tokenizer):
    callback = MergeModelCallback(merge_at_every_checkpoint=True)
    trainer = _lm_trainer(tmp_path, tiny_model_path, fresh_tokenizer, [callback], save_strategy="steps", save_steps=1)
    trainer.train()
    assert [p.split("/")[-2] for p in callback.merged_paths] == ["checkpoint-1", "checkpoint-2"]
    merged = AutoModelForCausalLM.from_pretrained(callback.merged_paths[-1], dtype="auto")
    assert next(merged.parameters()).dtype == torch.float16  # TRL's default MergeConfig.dtype


# -- BEMA as the DPO reference ----------------------------------------------------------------------------------
def _dpo(tmp_path, tiny_model_path, callbacks, **kw):
    rows = [{"prompt": f"the {w} is", "chosen": " good", "rejected": " bad"} for w in ("cat", "dog", "sky", "sun")]
    args = DPOConfig(
        output_dir=str(tmp_path / "dpo"),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=5e-2,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        **kw,
    )
    return DPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=args,
        train_dataset=Dataset.from_list(rows),
        callbacks=callbacks,
    )


BEMA_REF = dict(
    update_freq=1, update_after=1, lag=2, update_ref_model=True, ref_model_update_freq=2, ref_model_update_after=0
)


def test_bema_updates_the_separate_reference(tmp_path, tiny_model_path):
    callback = BEMACallback(**BEMA_REF)
    trainer = _dpo(tmp_path, tiny_model_path, [callback])
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    snapshots = {}
    original = callback.load_into_reference

    def spy(model, ref_model):
        original(model, ref_model)
        snapshots[len(snapshots)] = {n: p.detach().clone() for n, p in callback.running_model.named_parameters()}

    callback.load_into_reference = spy
    trainer.train()
    assert len(snapshots) == 1  # steps 1..3 with freq 2 from 0: step 2 only
    ref = dict(trainer.ref_model.named_parameters())
    for name, value in snapshots[0].items():
        torch.testing.assert_close(ref[name].detach(), value)  # the BEMA weights of step 2
    assert any(not torch.equal(initial[n], ref[n]) for n in initial)
    # the reference no longer equals the BEMA weights of step 3 (it was last refreshed at step 2)
    assert any(not torch.equal(p.detach(), ref[n]) for n, p in callback.running_model.named_parameters())


def test_bema_updates_the_reference_adapter_of_a_peft_policy(tmp_path, tiny_model_path):
    callback = BEMACallback(**{**BEMA_REF, "ref_model_update_freq": 3})
    trainer = DPOTrainer(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        args=_dpo(tmp_path, tiny_model_path, []).args,
        train_dataset=Dataset.from_list([{"prompt": "the cat is", "chosen": " good", "rejected": " bad"}] * 4),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        callbacks=[callback],
    )
    assert trainer.ref_model is None
    trainer.train()
    params = dict(trainer.model.named_parameters())
    running = dict(callback.running_model.named_parameters())
    ref_names = [n for n in params if ".ref." in n]
    assert ref_names and not any(params[n].requires_grad for n in ref_names)
    assert all(p.requires_grad for n, p in params.items() if ".default." in n)  # the adapter still trains
    for name in ref_names:
        torch.testing.assert_close(params[name].detach(), running[name.replace(".ref.", ".default.")].detach())
    lora_b = [n for n in ref_names if "lora_B" in n]
    assert any(params[n].abs().sum() > 0 for n in lora_b)  # the trained (BEMA-averaged) adapter, not B = 0


def test_bema_reference_update_refuses_precomputed_reference(tmp_path, tiny_model_path):
    with pytest.raises(ConfigError, match="precompute_ref_log_probs=False"):
        _dpo(
            tmp_path,
            tiny_model_path,
            [BEMACallback(update_ref_model=True)],
            precompute_ref_log_probs=True,
            ref_cache_dir=str(tmp_path / "cache"),
        )


def test_bema_reference_updates_match_trl(tiny_model_path):
    """Side by side with TRL 1.16's trl.experimental.bema_for_ref_model.BEMACallback: both driven through the same
    weight trajectory, each updating its own reference copy; the references agree after every step."""
    import_trl()
    trl_bema = trl_module("trl.experimental.bema_for_ref_model")
    kw = dict(
        update_freq=1, update_after=1, lag=2, update_ref_model=True, ref_model_update_freq=2, ref_model_update_after=1
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ours, theirs = BEMACallback(**kw), trl_bema.BEMACallback(**kw)
    refs = [copy.deepcopy(model), copy.deepcopy(model)]
    args, control, state = types.SimpleNamespace(output_dir="unused"), TrainerControl(), TrainerState()
    for cb in (ours, theirs):
        cb.on_train_begin(args, state, control, model=model)
    gen = torch.Generator().manual_seed(0)
    initial = {n: p.detach().clone() for n, p in refs[0].named_parameters()}
    for step in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        state.global_step = step
        for cb, ref in zip((ours, theirs), refs):
            cb.on_step_end(args, state, control, model=model, ref_model=ref)
        for (name, a), b in zip(refs[0].named_parameters(), refs[1].parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=f"step {step}: {name}")
    assert any(not torch.equal(initial[n], p) for n, p in refs[0].named_parameters())


def test_merge_folds_a_peft_adapter_and_can_push(tmp_path, tiny_model_path, fresh_tokenizer, monkeypatch):
    """A LoRA policy merges as base + (alpha / r) B A: with equal weights the merged q_proj is W + delta / 2. With
    push_to_hub the merged folder goes to the Hub repo named as in TRL (the Hub client is a stand-in here)."""
    from peft import get_peft_model

    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    uploads = []

    class Api:
        def create_repo(self, repo_id, repo_type, exist_ok):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, folder_path, repo_id, repo_type):
            uploads.append((folder_path, repo_id))

    monkeypatch.setattr("huggingface_hub.HfApi", Api)
    config = MergeConfig()
    config.dtype = "float32"
    callback = MergeModelCallback(config, push_to_hub=True)
    args = types.SimpleNamespace(output_dir=str(tmp_path / "run"))
    state = TrainerState(global_step=7)
    callback.on_train_end(args, state, TrainerControl(), model=policy, processing_class=fresh_tokenizer)
    merged = dict(AutoModelForCausalLM.from_pretrained(callback.merged_paths[0]).named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    params = dict(policy.named_parameters())
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        delta = (
            params[f"{prefix}.lora_B.default.weight"].double()
            @ params[f"{prefix}.lora_A.default.weight"].double()
            * (8 / 4)
        )
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        torch.testing.assert_close(merged[name].double(), base[name].double() + 0.5 * delta, rtol=1e-5, atol=1e-5)
        assert delta.abs().max() > 1e-2
    torch.testing.assert_close(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert uploads == [(callback.merged_paths[0], f"{tmp_path / 'run'}_checkpoint-7_merged")]
