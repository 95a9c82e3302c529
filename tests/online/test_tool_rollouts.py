"""Multi-turn episodes in the online engine (posttrain/online/episodes.py): tool calls run and their results are
appended as tokens the model does not train on, the sampled ids pass through untouched, the loss is over the
model's tokens only, environments and rollout_func follow TRL's contracts, and GRPO, RLOO and PPO each train on a
tool episode.

A scripted backend stands in for sampling so that the tool calls are certain (a random tiny model makes none).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.callbacks.completion_table import completion_table, completion_text
from posttrain.errors import ConfigError, DataError
from posttrain.generation.base import Completion, GenerationBackend
from posttrain.losses.logprobs import selective_log_softmax
from posttrain.tools import use_chatml_tool_template
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer
from posttrain.training.report import write_report


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("the tool is broken")


def char_ids(tokenizer, text: str) -> list[int]:
    """`text` tokenized one character at a time: valid ids that re-encoding the decoded text would merge."""
    return [i for c in text for i in tokenizer(c, add_special_tokens=False)["input_ids"]]


class ScriptedBackend(GenerationBackend):
    """Completion k of a call is `script(prompt_ids, k)` (token ids, ending with EOS = finished)."""

    def __init__(self, script, eos: int) -> None:
        self.script, self.eos, self.calls = script, eos, []

    def generate(self, prompt_ids, n, sampling, seed=None):
        self.calls.append([list(p) for p in prompt_ids])
        out = []
        for i, prompt in enumerate(prompt_ids):
            for j in range(n):
                ids = self.script(list(prompt), i * n + j)[: sampling.max_tokens]
                out.append(Completion(i, ids, None, bool(ids) and ids[-1] == self.eos))
        return out


@pytest.fixture()
def tool_tokenizer(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return use_chatml_tool_template(tokenizer, default_system=None)


def conversations(n: int = 4) -> Dataset:
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"what is {i} plus 3"}], "answer": i + 3} for i in range(n)]
    )


def trainer_with_script(cls, config_cls, tmp_path, tiny_model_path, tokenizer, script, **kwargs):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=256,
        max_prompt_length=480,  # the tool schemas make a 582-token prompt; the tiny model's context is 512
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-2,
        seed=0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    settings.update(kwargs.pop("config", {}))
    reward_funcs = kwargs.pop("reward_funcs", lambda completion_ids, **kw: [float(len(c)) for c in completion_ids])
    trainer = cls(
        tiny_model_path,
        reward_funcs,
        args=config_cls(**settings),
        train_dataset=conversations(),
        processing_class=tokenizer,
        **kwargs,
    )
    backend = ScriptedBackend(script, tokenizer.eos_token_id)
    trainer.generation_backend = backend
    if trainer.episode_source is not None:
        trainer.episode_source.backend = backend
    return trainer, backend


def calculator_script(tokenizer):
    """Even episodes call add(2, 3) then answer in character-split ids; odd ones answer at once."""
    eos = tokenizer.eos_token_id
    call = tokenizer(
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', add_special_tokens=False
    )["input_ids"] + [eos]
    answer = char_ids(tokenizer, "the sum is 5") + [eos]
    direct = tokenizer("it is 7", add_special_tokens=False)["input_ids"] + [eos]

    def script(prompt, k):
        if tokenizer.decode(prompt).count("<tool_response>"):
            return answer
        return call if k % 2 == 0 else direct

    return script, call, answer, direct


def test_tool_episode_tokens_masks_and_messages(tmp_path, tiny_model_path, tool_tokenizer):
    script, call, answer, direct = calculator_script(tool_tokenizer)
    seen = {}

    def reward(completions, completion_ids, **kwargs):
        seen["completions"] = completions
        return [1.0] * len(completions)

    trainer, backend = trainer_with_script(
        GRPOTrainer, GRPOConfig, tmp_path, tiny_model_path, tool_tokenizer, script, tools=[add], reward_funcs=reward
    )
    rows = [trainer.train_dataset[i] for i in range(2)]
    rollout = trainer.make_rollout(rows, [0, 1], 0)
    assert "add" in tool_tokenizer.decode(rows[0]["prompt_ids"])  # the prompt shows the tools
    ids = rollout.completion_ids[0].tolist()
    mask = rollout.model_mask[0].tolist()
    suffix_len = int(rollout.completion_mask[0].sum()) - len(call) - len(answer)
    # The sampled ids come back exactly (the answer was sampled character by character: no re-encoding).
    assert ids[: len(call)] == call and ids[len(call) + suffix_len : len(call) + suffix_len + len(answer)] == answer
    assert tool_tokenizer(tool_tokenizer.decode(answer[:-1]), add_special_tokens=False)["input_ids"] != answer[:-1]
    suffix_text = tool_tokenizer.decode(ids[len(call) : len(call) + suffix_len])
    assert "<tool_response>\n5\n</tool_response>" in suffix_text and suffix_text.endswith("<|im_start|>assistant\n")
    assert mask[: len(call)] == [1] * len(call) and mask[len(call) : len(call) + suffix_len] == [0] * suffix_len
    assert mask[len(call) + suffix_len : len(call) + suffix_len + len(answer)] == [1] * len(answer)
    assert torch.equal(rollout.loss_mask, rollout.model_mask)
    # The second turn continued from the prompt + first turn + tool turn ids.
    assert backend.calls[1][0] == rows[0]["prompt_ids"] + ids[: len(call) + suffix_len]
    # A direct answer is a one-turn episode.
    assert rollout.completion_ids[1, : len(direct)].tolist() == direct and rollout.model_mask[1].sum() == len(direct)
    assert rollout.episodes[0] == {"turns": 2, "tool_calls": 1, "tool_failures": 0}
    assert rollout.episodes[1] == {"turns": 1, "tool_calls": 0, "tool_failures": 0}
    # Reward functions get the whole conversation for a tool episode, the answer message otherwise.
    conversation = seen["completions"][0]
    assert [m["role"] for m in conversation] == ["assistant", "tool", "assistant"]
    assert conversation[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert conversation[1]["content"] == "5" and conversation[2]["content"] == "the sum is 5"
    assert seen["completions"][1] == [{"role": "assistant", "content": "it is 7"}]
    metrics = trainer._metrics["train"]
    assert metrics["tools/call_frequency"] == [0.5] and metrics["tools/failure_frequency"] == [0.0]
    assert metrics["tools/mean_turns"] == [1.5]
    # Completion lengths count the model's tokens only.
    assert metrics["completions/max_length"] == [float(len(call) + len(answer))]


def test_tool_transcripts_are_logged_and_marked_in_the_table_and_report(tmp_path, tiny_model_path, tool_tokenizer):
    script = calculator_script(tool_tokenizer)[0]
    trainer, _ = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path,
        tiny_model_path,
        tool_tokenizer,
        script,
        tools=[add],
        config=dict(log_completions=True),
    )
    trainer.make_rollout([trainer.train_dataset[i] for i in range(2)], [0, 1], 0)
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 4 and [bool(r.get("transcript")) for r in records] == [True, False, True, False]
    lines = [
        '[tool call: add] {"a": 2, "b": 3}',
        "[tool result: add] 5",
        "[assistant] the sum is 5",
    ]
    assert completion_text(records[0]) == "\n".join(lines)
    assert completion_text(records[1]) == records[1]["completion"] == "it is 7"
    columns, rows = completion_table(records, trainer.reward_scorer.names)
    assert rows[0][columns.index("completion")] == "\n".join(lines)
    # The report shows the two tool episodes (before the plain ones) with each call and each result marked.
    page = write_report(tmp_path, log_history=[{"loss": 1.0, "step": 1}]).read_text()
    assert '<span class="call">[tool call: add] {&quot;a&quot;: 2, &quot;b&quot;: 3}</span>' in page
    assert '<span class="result">[tool result: add] 5</span>\n[assistant] the sum is 5' in page
    assert page.count('<span class="call">') == 2 and "it is 7" not in page


def test_loss_gradient_is_over_model_tokens_only(tmp_path, tiny_model_path, tool_tokenizer):
    """The engine's gradient on a tool rollout equals a float64 reference that sums -A * log p over the model's
    tokens only, divided by their count (loss_type dapo, one update per round: ratio 1)."""
    script, *_ = calculator_script(tool_tokenizer)
    trainer, _ = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path,
        tiny_model_path,
        tool_tokenizer,
        script,
        tools=[add],
        config=dict(loss_type="dapo", beta=0.0),
    )
    rows = [trainer.train_dataset[i] for i in range(2)]
    rollout = trainer.make_rollout(rows, [0, 1], 0)
    assert rollout.advantages.abs().sum() > 0
    batch = rollout.batch(0, len(rollout))
    batch["total_sequences"], batch["total_tokens"] = len(rollout), float(rollout.loss_mask.sum())
    model = trainer.model
    model.zero_grad()
    trainer.compute_loss(model, batch).backward()
    engine_grad = model.lm_head.weight.grad.double().clone() if model.lm_head.weight.grad is not None else None

    reference = copy.deepcopy(model).double()
    reference.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(rollout)):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
        completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()]
        logits = reference(torch.cat([prompt, completion]).unsqueeze(0)).logits[0, len(prompt) - 1 : -1]
        logps = selective_log_softmax(logits, completion)
        model_tokens = rollout.model_mask[i][: len(completion)].double()
        total = total - (rollout.advantages[i].double() * logps * model_tokens).sum()
    (total / rollout.model_mask.sum().double()).backward()
    if engine_grad is None:  # tied embeddings: the gradient is on the input embeddings
        engine_grad = model.get_input_embeddings().weight.grad.double()
        expected = reference.get_input_embeddings().weight.grad
    else:
        expected = reference.lm_head.weight.grad
    torch.testing.assert_close(engine_grad, expected, atol=1e-6, rtol=1e-4)


def test_failing_and_unknown_tools_become_messages(tmp_path, tiny_model_path, tool_tokenizer):
    eos = tool_tokenizer.eos_token_id
    calls = (
        '<tool_call>\n{"name": "broken", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    )

    def script(prompt, k):
        text = tool_tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return tool_tokenizer("ok", add_special_tokens=False)["input_ids"] + [eos]
        return tool_tokenizer(calls, add_special_tokens=False)["input_ids"] + [eos]

    trainer, backend = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path,
        tiny_model_path,
        tool_tokenizer,
        script,
        tools=[add, broken],
        config=dict(max_completion_length=512),
    )
    rollout = trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[1]], [0, 1], 0)
    second_turn_prompt = tool_tokenizer.decode(backend.calls[1][0])
    assert "the tool is broken" in second_turn_prompt and "nope" in second_turn_prompt
    assert rollout.episodes[0]["tool_failures"] == 2 and rollout.episodes[0]["turns"] == 2
    assert trainer._metrics["train"]["tools/failure_frequency"] == [1.0]


def test_max_tool_calling_iterations_and_length_budget(tmp_path, tiny_model_path, tool_tokenizer):
    eos = tool_tokenizer.eos_token_id
    call = tool_tokenizer(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>', add_special_tokens=False
    )["input_ids"] + [eos]
    trainer, backend = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path,
        tiny_model_path,
        tool_tokenizer,
        lambda prompt, k: call,
        tools=[add],
        config=dict(max_tool_calling_iterations=2, max_completion_length=200),
    )
    rollout = trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[1]], [0, 1], 0)
    assert len(backend.calls) == 3 and rollout.episodes[0]["turns"] == 3 and rollout.episodes[0]["tool_calls"] == 2
    # A budget too small for the next tool turn ends the episode as it was (TRL's rule).
    trainer, backend = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path / "b",
        tiny_model_path,
        tool_tokenizer,
        lambda prompt, k: call,
        tools=[add],
        config=dict(max_completion_length=len(call) + 3),
    )
    rollout = trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[1]], [0, 1], 0)
    assert len(backend.calls) == 1 and rollout.completion_ids.shape[1] == len(call)
    assert rollout.episodes[0]["turns"] == 1


class GuessEnv:
    """Guess the number: `guess(number)` says higher/lower; the reward is 1 when found."""

    def reset(self, answer, **kwargs):
        self.answer, self.found = answer, False
        return " Guess my number."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The guess.
        """
        self.found = number == self.answer
        return "correct" if self.found else ("higher" if number < self.answer else "lower")

    def get_reward(self) -> float:
        return float(self.found)


def test_environment_factory_tools_observation_and_reward(tmp_path, tiny_model_path, tool_tokenizer):
    eos = tool_tokenizer.eos_token_id

    def script(prompt, k):
        text = tool_tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return tool_tokenizer("done", add_special_tokens=False)["input_ids"] + [eos]
        return tool_tokenizer(
            '<tool_call>\n{"name": "guess", "arguments": {"number": 4}}\n</tool_call>', add_special_tokens=False
        )["input_ids"] + [eos]

    trainer, backend = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path,
        tiny_model_path,
        tool_tokenizer,
        script,
        reward_funcs=None,
        environment_factory=GuessEnv,
    )
    rows = [trainer.train_dataset[i] for i in range(2)]  # answers 3 and 4
    rollout = trainer.make_rollout(rows, [0, 1], 0)
    first_prompt = tool_tokenizer.decode(backend.calls[0][0])
    assert "what is 0 plus 3 Guess my number." in first_prompt and '"guess"' in first_prompt
    assert rollout.rewards.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert "lower" in tool_tokenizer.decode(backend.calls[1][0])
    assert trainer.reward_scorer.names == ["GuessEnv"]


def test_reward_funcs_may_be_left_out_with_an_environment(tmp_path, tiny_model_path, tool_tokenizer):
    """TRL's signature: GRPOTrainer(model, args=..., train_dataset=..., environment_factory=Env), no reward_funcs,
    when the environment's get_reward() is the reward; without a get_reward() there is no reward source."""
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        tiny_model_path,
        args=args,
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        environment_factory=GuessEnv,
    )
    assert trainer.reward_scorer.names == ["GuessEnv"]

    class NoReward(GuessEnv):
        get_reward = None

    with pytest.raises(ConfigError, match="No reward source"):
        GRPOTrainer(
            tiny_model_path,
            args=args,
            train_dataset=conversations(),
            processing_class=tool_tokenizer,
            environment_factory=NoReward,
        )


def test_rollout_func_contract(tmp_path, tiny_model_path, tool_tokenizer):
    eos = tool_tokenizer.eos_token_id
    received = {}

    def rollout_func(prompts, trainer):
        received["prompts"] = prompts
        return {
            "prompt_ids": [[5, 6, 7]] * len(prompts),
            "completion_ids": [[8, 9, eos]] * len(prompts),
            "logprobs": [[-0.5, -0.25, -1.0]] * len(prompts),
            "env_mask": [[1, 0, 1]] * len(prompts),
            "tag": list(range(len(prompts))),
        }

    def reward(tag, **kwargs):
        return [float(t) for t in tag]

    trainer, _ = trainer_with_script(
        GRPOTrainer,
        GRPOConfig,
        tmp_path,
        tiny_model_path,
        tool_tokenizer,
        None,
        rollout_func=rollout_func,
        reward_funcs=reward,
    )
    rows = [trainer.train_dataset[i] for i in range(2)]
    rollout = trainer.make_rollout(rows, [0, 1], 0)
    assert received["prompts"] == [rows[0]["prompt"]] * 2 + [rows[1]["prompt"]] * 2
    assert rollout.prompt_ids[0].tolist() == [5, 6, 7] and rollout.completion_ids[0].tolist() == [8, 9, eos]
    assert rollout.loss_mask[0].tolist() == [1, 0, 1] and rollout.finished.all()
    assert rollout.sampler_logps[0].tolist() == [-0.5, -0.25, -1.0]
    assert rollout.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]

    def bad(prompts, trainer):
        return {"prompt_ids": [[1]] * len(prompts)}

    trainer, _ = trainer_with_script(
        GRPOTrainer, GRPOConfig, tmp_path / "b", tiny_model_path, tool_tokenizer, None, rollout_func=bad
    )
    with pytest.raises(DataError, match="completion_ids"):
        trainer.make_rollout(rows, [0, 1], 0)


def test_template_that_cannot_render_tools_is_refused(tmp_path, tiny_model_path, tokenizer):
    with pytest.raises(ConfigError, match="tool"):
        GRPOTrainer(
            tiny_model_path,
            lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(
                output_dir=str(tmp_path),
                per_device_train_batch_size=4,
                num_generations=2,
                use_cpu=True,
                bf16=False,
                report_to="none",
            ),
            train_dataset=conversations(),
            processing_class=copy.deepcopy(tokenizer),
            tools=[add],
        )


@pytest.mark.parametrize("method", ["grpo", "rloo", "ppo"])
def test_each_method_trains_on_tool_episodes(method, tmp_path, tiny_model_path, tool_tokenizer):
    script, *_ = calculator_script(tool_tokenizer)
    if method == "ppo":
        from posttrain.trainers.ppo import PPOConfig, PPOTrainer

        cls, config_cls, config = PPOTrainer, PPOConfig, dict(num_ppo_epochs=1, num_mini_batches=1)
    else:
        cls, config_cls = (GRPOTrainer, GRPOConfig) if method == "grpo" else (RLOOTrainer, RLOOConfig)
        config = dict(beta=0.04)
    trainer, backend = trainer_with_script(
        cls, config_cls, tmp_path, tiny_model_path, tool_tokenizer, script, tools=[add], config=config
    )
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert len(backend.calls) >= 2  # a tool turn was sampled
    assert trainer.rollout.model_mask.sum() < trainer.rollout.completion_mask.sum()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    json.dumps(trainer.rollout.episodes)  # episode facts stay plain data (they go into checkpoints)


def test_sft_renders_each_rows_tools_like_trl(tmp_path, tiny_model_path, tool_tokenizer):
    """A tool-calling SFT dataset with a per-row `tools` column (a list or its JSON text) shows the tools in the
    rendered prompt, as TRL's SFT does."""
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.tools import tool_schemas

    schemas = tool_schemas([add])
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [
        {"role": "user", "content": "2 plus 3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    rows = [{"messages": messages, "tools": json.dumps(schemas)}, {"messages": messages, "tools": None}]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none", save_strategy="no")
    trainer = SFTTrainer(
        tiny_model_path, args=args, train_dataset=Dataset.from_list(rows), processing_class=tool_tokenizer
    )
    with_tools, without = (tool_tokenizer.decode(trainer.train_dataset[i]["input_ids"]) for i in range(2))
    assert with_tools == tool_tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
    assert "<tools>" in with_tools and "<tools>" not in without


def test_resume_inside_a_round_of_tool_episodes_is_exact(tmp_path, tiny_model_path, tool_tokenizer):
    """steps_per_generation=2: the checkpoint of step 1 falls inside a round of tool episodes; the resumed run
    trains step 2 on the saved episodes (not new ones) and ends with the straight run's weights."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 1

    script, *_ = calculator_script(tool_tokenizer)
    config = dict(steps_per_generation=2, max_steps=2, save_strategy="steps", save_steps=1, beta=0.0)

    def make(out, callbacks=None):
        trainer, backend = trainer_with_script(
            GRPOTrainer,
            GRPOConfig,
            out,
            tiny_model_path,
            tool_tokenizer,
            script,
            tools=[add],
            config=config,
            callbacks=callbacks,
        )
        return trainer, backend

    straight, _ = make(tmp_path / "straight")
    straight.train()
    interrupted, _ = make(tmp_path / "run", [StopAfter()])
    interrupted.train()
    assert interrupted.state.global_step == 1
    resumed, backend = make(tmp_path / "run")
    resumed.train(resume_from_checkpoint=True)
    assert backend.calls == []  # the round's episodes came from the checkpoint
    assert resumed.rollout.episodes == straight.rollout.episodes
    expected = dict(straight.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0, msg=name)
