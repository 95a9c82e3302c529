"""SDFT and SDPO (posttrain.experimental.sdft / .sdpo): the self-distillation losses against float64 references,
the step-0 loss equal to TRL 1.16's SDFTTrainer / SDPOTrainer on the same tiny model, batch and completions, TRL's
defaults and signatures, bad settings stopped before training, and learning on tiny models."""

import dataclasses
import inspect
import math

import pytest
import torch
from _trl import import_trl_experimental as _trl_experimental
from datasets import Dataset

from posttrain.errors import ConfigError, DataError
from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer
from posttrain.experimental.sdpo import SDPOConfig, SDPOTrainer
from posttrain.generation import Completion
from posttrain.losses.self_distillation import self_distillation_token_losses, successful_demonstrations
from posttrain.models.tiny import build_tiny_model


# -- float64 references ------------------------------------------------------------------------------------------
def _softmax(row, temperature=1.0):
    z = [math.exp(x / temperature) for x in row]
    return [x / sum(z) for x in z]


def _divergence(p_s, p_t, alpha):
    """alpha=0: KL(T‖S); alpha=1: KL(S‖T); else alpha*KL(T‖m) + (1-alpha)*KL(S‖m), m = alpha*T + (1-alpha)*S."""
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)  # noqa: E731
    if alpha == 0:
        return kl(p_t, p_s)
    if alpha == 1:
        return kl(p_s, p_t)
    m = [alpha * t + (1 - alpha) * s for s, t in zip(p_s, p_t)]
    return alpha * kl(p_t, m) + (1 - alpha) * kl(p_s, m)


@pytest.mark.parametrize("alpha,temperature", [(0.0, 1.0), (0.3, 0.7), (0.5, 1.0), (1.0, 2.0)])
def test_full_logits_divergence_matches_a_float64_reference(alpha, temperature):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    t = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    got = self_distillation_token_losses(
        s, t, torch.zeros(2, 3, dtype=torch.long), "full_logits", alpha, temperature=temperature
    )
    for b in range(2):
        for i in range(3):
            ref = _divergence(_softmax(s[b, i].tolist(), temperature), _softmax(t[b, i].tolist(), temperature), alpha)
            assert got[b, i].item() == pytest.approx(ref, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("alpha,add_tail,k", [(0.5, False, 3), (0.5, True, 3), (0.0, True, 2), (1.0, False, 4)])
def test_topk_divergence_on_the_students_top_k(alpha, add_tail, k):
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 9, generator=g, dtype=torch.float64), torch.randn(4, 9, generator=g, dtype=torch.float64)
    got = self_distillation_token_losses(
        s, t, torch.zeros(4, dtype=torch.long), "topk_logits", alpha, topk=k, add_tail=add_tail, temperature=0.8
    )
    for n in range(4):
        p_s, p_t = _softmax(s[n].tolist(), 0.8), _softmax(t[n].tolist(), 0.8)
        top = sorted(range(9), key=lambda j: -p_s[j])[:k]
        a, b = [p_s[j] for j in top], [p_t[j] for j in top]
        if add_tail:
            a, b = a + [1 - sum(a)], b + [1 - sum(b)]
        else:
            a, b = [x / sum(a) for x in a], [x / sum(b) for x in b]
        assert got[n].item() == pytest.approx(_divergence(a, b, alpha), rel=1e-9, abs=1e-12)


def test_sampled_token_is_a_reverse_kl_estimate_with_a_stopped_ratio():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 6, generator=g, dtype=torch.float64)
    tokens = torch.tensor([0, 3, 5, 1, 1])
    got = self_distillation_token_losses(s, t, tokens, "sampled_token", 1.0, temperature=0.5)
    got.sum().backward()
    for n in range(5):
        p_s, p_t = _softmax(s[n].tolist(), 0.5), _softmax(t[n].tolist(), 0.5)
        x = int(tokens[n])
        ratio = math.log(p_s[x]) - math.log(p_t[x])
        assert got[n].item() == pytest.approx(ratio * math.log(p_s[x]), rel=1e-9)
        # d/ds_j [ratio * log p_s(x)] with the ratio held constant: ratio * (1[j=x] - p_s(j)) / temperature
        for j in range(6):
            assert s.grad[n, j].item() == pytest.approx(ratio * ((j == x) - p_s[j]) / 0.5, rel=1e-9, abs=1e-12)
    with pytest.raises(ConfigError, match="alpha"):
        self_distillation_token_losses(s, t, tokens, "sampled_token", 0.5)


def test_successful_demonstrations_pick_the_first_other_success_of_the_group():
    rewards = [0.0, 1.0, 1.0, 0.2, float("nan"), 0.0, 0.0, 1.5]
    # groups of 4: {0..3} successes 1, 2; {4..7} success 7
    assert successful_demonstrations(rewards, 4, 1.0) == [1, 2, 1, 1, 7, 7, 7, None]
    assert successful_demonstrations(rewards, 4, 1.0, exclude_self=False) == [1, 1, 1, 1, 7, 7, 7, 7]
    assert successful_demonstrations(rewards, 2, 0.1) == [1, None, 3, 2, None, None, 7, None]


# -- side by side with TRL 1.16 ----------------------------------------------------------------------------------
def _kw(tmp_path, **kw):
    return {
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=2,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            seed=0,
            max_completion_length=8,
        ),
        **kw,
    }


WORDS = ["red", "cat", "dog", "sun"]  # equal token counts with the tiny tokenizer


def _sdft_data(n=4):
    return Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"Name {w}."}], "privileged_context": f"The answer is {w}."}
            for w in (WORDS * n)[:n]
        ]
    )


class _FixedSampler:
    """A generation backend that returns given completions, so both trainers score the same tokens."""

    def __init__(self, completions):
        self.completions = completions

    def generate(self, prompt_ids, n, sampling, seed=None):
        return [Completion(i, list(c), None, False) for i, c in enumerate(self.completions)]


def _completions(tokenizer, rows):
    g = torch.Generator().manual_seed(3)
    # Similar lengths: TRL left-pads prompts, and a shifted RoPE position changes float32 rounding slightly.
    lengths = [5, 3, 4, 5][:rows]
    return [torch.randint(10, len(tokenizer) - 1, (n,), generator=g).tolist() for n in lengths]


def _our_loss(trainer, rows, completions):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(rows)])
    batch = trainer._student_batch(batch, 0, "train", sampler=_FixedSampler(completions))
    trainer._attach_teacher_inputs([batch], "train")
    trainer.model.eval()
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item()


def _trl_inputs(theirs, prompts, completions, pad_id):
    """TRL's training batch for given completions, built with TRL's own tokenization and padding."""
    from trl.trainer.utils import pad as trl_pad

    prompt_ids = [torch.tensor(x) for x in theirs._tokenize_prompts(prompts)]
    assert len({len(x) for x in prompt_ids}) == 1  # equal lengths: left padding would shift TRL's positions
    completion_ids = trl_pad([torch.tensor(c) for c in completions], padding_value=pad_id, padding_side="right")
    completion_mask = trl_pad(
        [torch.ones(len(c), dtype=torch.long) for c in completions], padding_value=0, padding_side="right"
    )
    return {
        "prompt_ids": torch.stack(prompt_ids),
        "prompt_mask": torch.ones(len(prompts), len(prompt_ids[0]), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


@pytest.fixture(scope="module")
def sharp_model_path(tmp_path_factory, tokenizer):
    """A saved tiny model with larger weights, so that its distributions (and the student-teacher gap) are far from
    uniform; loaded by name by both trainers."""
    model = build_tiny_model(tokenizer, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    path = tmp_path_factory.mktemp("sharp") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        # a temperature that leaves mass outside the top k: a tail of ~1e-7 is float32 rounding in both trainers
        dict(distillation_topk=3, distillation_add_tail=True, distillation_alpha=0.0, temperature=3.0),
        dict(distillation_mode="full_logits", distillation_alpha=0.3, num_loss_tokens_to_skip=2),
        dict(distillation_mode="sampled_token", distillation_alpha=1.0, teacher_model_kind="live"),
    ],
)
def test_sdft_step0_loss_equals_trls(tmp_path, tokenizer, sharp_model_path, settings):
    sdft = _trl_experimental("sdft")
    data = _sdft_data()
    completions = _completions(tokenizer, 4)
    theirs = sdft.SDFTTrainer(
        model=sharp_model_path,
        train_dataset=data,
        processing_class=tokenizer,
        args=sdft.SDFTConfig(**_kw(tmp_path / "trl", bf16=False, gradient_checkpointing=False, **settings)),
    )
    prompts, contexts = list(data["prompt"]), list(data["privileged_context"])
    inputs = _trl_inputs(theirs, prompts, completions, tokenizer.pad_token_id)
    inputs.update(
        theirs.teacher_context_builder.build(prompts, contexts, inputs["completion_ids"], inputs["completion_mask"])
    )
    theirs.model.eval()
    with torch.no_grad():
        trl_loss = theirs.compute_loss(theirs.model, inputs).item()
    ours = SDFTTrainer(
        sharp_model_path,
        args=SDFTConfig(**_kw(tmp_path / "ours", **settings)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    our_loss = _our_loss(ours, 4, completions)
    assert abs(our_loss) > 1e-2
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("name,config,trainer", [("sdft", SDFTConfig, SDFTTrainer), ("sdpo", SDPOConfig, SDPOTrainer)])
def test_config_defaults_and_signature_are_trls(name, config, trainer):
    module = _trl_experimental(name)
    theirs_config, theirs_trainer = getattr(module, config.__name__), getattr(module, trainer.__name__)
    ours = {f.name: _default(f) for f in dataclasses.fields(config)}
    for f in dataclasses.fields(theirs_config):
        if f.name != "gradient_checkpointing":  # a posttrain-wide difference (auto: on with an accelerator)
            assert f.name in ours, f.name
            assert ours[f.name] == _default(f), f.name
    params = list(inspect.signature(trainer.__init__).parameters)[1:]
    theirs = list(inspect.signature(theirs_trainer.__init__).parameters)[1:]
    assert params[: len(theirs)] == theirs


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(distillation_mode="sampled_token"), "distillation_alpha"),
        (dict(teacher_model_kind="frozen"), "teacher_model_kind"),
        (dict(num_iterations=2), "num_iterations"),
        (dict(use_teacher_server=True), "use_teacher_server"),
        (dict(teacher_prompt_template="{prompt} only"), "privileged_context"),
        (dict(num_generations=3), "num_generations"),
        (dict(lmbda=0.5), "lmbda"),
    ],
)
def test_sdft_bad_settings_stop_before_training(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        SDFTConfig(**_kw(tmp_path, **settings))


REWARDS = [1.0, 0.0, 0.0, 1.0]  # per completion: rows 1 and 2 get a sibling's demonstration, rows 0 and 3 none


def _reward_for(tokenizer, completions):
    by_text = {tokenizer.decode(c, skip_special_tokens=True): r for c, r in zip(completions, REWARDS)}

    def exact_reward(completions, **kwargs):
        return [by_text[c[0]["content"]] for c in completions]

    return exact_reward


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(
            distillation_mode="full_logits",
            distillation_alpha=0.5,
            distillation_weight=0.5,
            teacher_model_kind="live",
            include_environment_feedback=True,
        ),
        dict(distillation_weight=0.0),
        dict(
            distillation_mode="topk_logits",
            distillation_topk=4,
            distillation_alpha=0.2,
            distillation_weight=0.7,
            loss_type="grpo",
            scale_rewards="batch",
            teacher_model_kind="base",
        ),
    ],
)
def test_sdpo_step0_loss_equals_trls(tmp_path, tokenizer, sharp_model_path, settings):
    sdpo = _trl_experimental("sdpo")
    data = _sdft_data()
    completions = _completions(tokenizer, 4)
    reward = _reward_for(tokenizer, completions)
    theirs = sdpo.SDPOTrainer(
        model=sharp_model_path,
        reward_funcs=reward,
        train_dataset=data,
        processing_class=tokenizer,
        args=sdpo.SDPOConfig(**_kw(tmp_path / "trl", bf16=False, gradient_checkpointing=False, **settings)),
    )
    prompts, feedback = list(data["prompt"]), list(data["privileged_context"])
    inputs = _trl_inputs(theirs, prompts, completions, tokenizer.pad_token_id)
    theirs.model.eval()
    rewards = torch.tensor(REWARDS)
    inputs.update(theirs.teacher_context_builder.build(inputs, prompts, rewards, feedbacks=feedback))
    groups = rewards.view(-1, 2)
    std = groups.std(dim=1, keepdim=True) if theirs.args.scale_rewards == "group" else rewards.std()
    inputs["advantages"] = ((groups - groups.mean(dim=1, keepdim=True)) / (std + 1e-4)).flatten()
    with torch.no_grad():
        trl_loss = theirs.compute_loss(theirs.model, inputs).item()
    ours = SDPOTrainer(
        sharp_model_path,
        reward,
        args=SDPOConfig(**_kw(tmp_path / "ours", **settings)),
        train_dataset=data,
        processing_class=tokenizer,
    )
    our_loss = _our_loss(ours, 4, completions)
    assert abs(our_loss) > 1e-2
    assert our_loss == pytest.approx(trl_loss, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(beta=0.04), "beta"),
        (dict(distillation_weight=1.5), "distillation_weight"),
        (dict(loss_type="cispo"), "loss_type"),
        (dict(scale_rewards="mean"), "scale_rewards"),
        (dict(distillation_mode="topk_logits"), "distillation_topk"),
    ],
)
def test_sdpo_bad_settings_stop_before_training(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        SDPOConfig(**_kw(tmp_path, **settings))


def test_sdpo_needs_reward_functions_and_ema_refuses_peft(tmp_path, tokenizer):
    from peft import LoraConfig

    with pytest.raises(ConfigError, match="reward_funcs"):
        SDPOTrainer(
            build_tiny_model(tokenizer),
            None,
            args=SDPOConfig(**_kw(tmp_path)),
            train_dataset=_sdft_data(),
            processing_class=tokenizer,
        )
    with pytest.raises(ConfigError, match="ema"):
        SDPOTrainer(
            build_tiny_model(tokenizer),
            lambda completions, **k: [0.0] * len(completions),
            args=SDPOConfig(**_kw(tmp_path)),
            train_dataset=_sdft_data(),
            processing_class=tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )


def test_sdpo_warns_in_trls_words_when_rewards_are_flat_or_nothing_is_distilled(tmp_path, tokenizer, caplog):
    trainer = SDPOTrainer(
        build_tiny_model(tokenizer),
        lambda completions, **kw: [0.0] * len(completions),
        args=SDPOConfig(**_kw(tmp_path, max_steps=4, diagnostics_warning_interval=2)),
        train_dataset=_sdft_data(),
        processing_class=tokenizer,
    )
    flat, varied = torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 0.5])
    flat_text, inactive_text = "Observed flat SDPO rewards", "SDPO self-distillation is inactive because no reprompted"
    with caplog.at_level("WARNING"):
        for step, rewards in enumerate([flat, flat, varied, flat, flat]):
            caplog.clear()
            trainer._record_rewards("train", rewards, rewards[:, None], 2, [None] * 4, [False] * 4, 0, 0)
            # flat rewards: steps 0-1 (2 in a row) and 3-4 (2 again after the varied one); nothing distilled: 5 steps
            assert (flat_text in caplog.text) == (step in (1, 4)), step
            assert (inactive_text in caplog.text) == (step == 1 or step == 3), step


# -- learning ----------------------------------------------------------------------------------------------------
def _train_kw(tmp_path, **kw):
    return _kw(
        tmp_path,
        **{
            **dict(
                max_steps=20,
                learning_rate=1e-3,
                lr_scheduler_type="constant",
                per_device_train_batch_size=8,
                max_completion_length=6,
                logging_steps=1,
            ),
            **kw,
        },
    )


def test_sdft_student_moves_towards_the_context_conditioned_teacher(tmp_path, tokenizer, sharp_model_path):
    """The frozen initial model given the demonstration is the target: on completions the student itself sampled
    at the start (what SDFT trains on), the reverse KL to that teacher falls."""
    trainer = SDFTTrainer(
        sharp_model_path,
        args=SDFTConfig(
            **_train_kw(
                tmp_path, distillation_mode="full_logits", distillation_alpha=1.0, learning_rate=2e-3, max_steps=30
            )
        ),
        train_dataset=_sdft_data(8),
        processing_class=tokenizer,
    )
    prompts = [trainer.train_dataset[i]["input_ids"] for i in range(4)]
    completions = [c.token_ids for c in trainer._sampler.generate(prompts, 1, trainer.args.sampling_params(), seed=7)]
    before = _our_loss(trainer, 4, completions)
    trainer.train()
    after = _our_loss(trainer, 4, completions)
    losses = [h["sdft/distillation_loss"] for h in trainer.state.log_history if "sdft/distillation_loss" in h]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"SDFT held reverse KL {before:.3f} -> {after:.3f}, training loss {first:.2f} -> {last:.2f} in 30 steps")
    # The sampled trajectory depends on float rounding (thread count, fused layers): over 4 such variants the held
    # KL fell 9-25% and the training loss 27-40%.
    assert after < 0.95 * before
    assert last < 0.85 * first


def test_sdpo_student_moves_towards_the_reprompted_teacher(tmp_path, tokenizer, sharp_model_path):
    """Rollouts with a successful sibling are distilled from the model shown that sibling: their held reverse KL
    falls; the logged reprompt fraction shows the teacher context was active."""
    completions = _completions(tokenizer, 4)
    held = _reward_for(tokenizer, completions)

    def reward(completions, **kwargs):  # the held completions' fixed rewards; sampled ones: even length succeeds
        try:
            return held(completions)
        except KeyError:
            return [float(len(c[0]["content"]) % 2 == 0) for c in completions]

    trainer = SDPOTrainer(
        sharp_model_path,
        reward,
        args=SDPOConfig(**_train_kw(tmp_path, distillation_mode="full_logits", teacher_model_kind="base")),
        train_dataset=_sdft_data(8),
        processing_class=tokenizer,
    )
    before = _our_loss(trainer, 4, completions)
    trainer.train()
    after = _our_loss(trainer, 4, completions)
    fractions = [
        h["self_distillation/reprompt_sample_fraction"]
        for h in trainer.state.log_history
        if "self_distillation/reprompt_sample_fraction" in h
    ]
    share = sum(fractions) / len(fractions)
    print(f"SDPO held reverse KL {before:.3f} -> {after:.3f} in 20 steps, reprompted {share:.2f}")
    assert min(fractions) > 0
    assert after < 0.85 * before


def test_ema_teacher_follows_the_student_and_evaluation_samples(tmp_path, tokenizer):
    """teacher_update_rate=1.0 makes the EMA teacher a copy of the student after each step; generate_from_teacher
    samples from the teacher's prompt; evaluation samples prompt-only rows and logs TRL's keys."""
    data = _sdft_data(4)
    trainer = SDFTTrainer(
        build_tiny_model(tokenizer),
        args=SDFTConfig(
            **_kw(
                tmp_path,
                max_steps=1,
                learning_rate=1e-2,
                teacher_model_kind="ema",
                teacher_update_rate=1.0,
                generate_from_teacher=True,
                per_device_eval_batch_size=4,
            )
        ),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer,
    )
    initial = {n: p.detach().clone() for n, p in trainer.teacher_model.named_parameters()}
    trainer.train()
    student = dict(trainer.model.named_parameters())
    for name, param in trainer.teacher_model.named_parameters():
        assert torch.equal(param, student[name].detach()), name
    assert any(not torch.equal(initial[n], p) for n, p in trainer.teacher_model.named_parameters())
    sampled = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    assert sampled
    metrics = trainer.evaluate()
    assert "eval_sdft/distillation_loss" in metrics and math.isfinite(metrics["eval_loss"])


def test_teacher_prompt_for_conversations_and_missing_context(tmp_path, tokenizer):
    from posttrain.trainers.self_distillation_data import privileged_text, with_user_text

    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name red."}]
    assert with_user_text(prompt, "{prompt} | {privileged_context}", privileged_context="ctx") == [
        prompt[0],
        {"role": "user", "content": "Name red. | ctx"},
    ]
    assert (
        privileged_text(
            [{"role": "assistant", "content": "a"}, {"role": "user", "content": ""}, {"role": "user", "content": "b"}]
        )
        == "a\nb"
    )
    with pytest.raises(DataError, match="user"):
        with_user_text(prompt[:1] + [{"role": "assistant", "content": "x"}], "{prompt}")
    with pytest.raises(DataError, match="`privileged_context` must not be None"):  # TRL's text
        privileged_text(None)


@pytest.mark.parametrize("trainer_cls,config_cls", [(SDFTTrainer, SDFTConfig), (SDPOTrainer, SDPOConfig)])
def test_data_report_counts_prompt_tokens_cut_by_max_prompt_length(
    tmp_path, tokenizer, tiny_model_path, trainer_cls, config_cls
):
    from posttrain.data.report import CUT_REASONS, DataReport

    data = Dataset.from_list(
        [{"prompt": "Name " + "the red cat " * (i + 1) + ".", "privileged_context": "cat"} for i in range(4)]
    )
    if trainer_cls is SDPOTrainer:
        data = data.remove_columns("privileged_context")
        extra = dict(reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])
    else:
        extra = {}
    full = [len(tokenizer(row["prompt"])["input_ids"]) for row in data]  # text prompts: the tokenizer's own ids
    keep = sorted(full)[1]
    trainer = trainer_cls(
        tiny_model_path,
        args=config_cls(**_kw(tmp_path, max_prompt_length=keep)),
        train_dataset=data,
        processing_class=tokenizer,
        **extra,
    )
    assert [len(ids) for ids in trainer.train_dataset["input_ids"]] == [min(n, keep) for n in full]
    report = DataReport.of(trainer).as_dict()["train_dataset"]
    cut = [n - keep for n in full if n > keep]
    assert report["rows_in"] == report["rows_kept"] == 4 and len(cut) == 2
    assert report["truncated"] == {CUT_REASONS["max_prompt_length"]: {"rows": 2, "tokens": sum(cut)}}
