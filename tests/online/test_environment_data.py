"""Environments that own the data or the reward (posttrain/online/environment_data.py), TRL's contract: without a
train_dataset the prompts come from reset(), a dict of environments routes rows by an `environment` column that
may be the only column, and get_reward() is one more reward source of weight 1 after the user's own."""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from posttrain.errors import ConfigError, DataError
from posttrain.generation.base import Completion, GenerationBackend
from posttrain.tools import use_chatml_tool_template
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


class EchoBackend(GenerationBackend):
    """Every completion is `answer` then EOS; the prompts it was called with are kept."""

    def __init__(self, answer: list[int], eos: int) -> None:
        self.answer, self.eos, self.calls = answer, eos, []

    def generate(self, prompt_ids, n, sampling, seed=None):
        self.calls.append([list(p) for p in prompt_ids])
        return [Completion(i, self.answer + [self.eos], None, True) for i in range(len(prompt_ids)) for _ in range(n)]


@pytest.fixture()
def tool_tokenizer(tiny_model_path):
    return use_chatml_tool_template(AutoTokenizer.from_pretrained(tiny_model_path), default_system=None)


def config(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=16,
        max_steps=1,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    return GRPOConfig(**{**settings, **overrides})


def scripted(trainer, tokenizer, text: str = "done") -> EchoBackend:
    backend = EchoBackend(tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)
    trainer.generation_backend = backend
    trainer.episode_source.backend = backend
    return backend


class WordGame:
    """Owns its data: reset() returns the prompt; the reward is whether the last answer held the word."""

    seen: list[dict] = []

    def reset(self, **kwargs):
        WordGame.seen.append(kwargs)
        return "Guess the 5-letter word."

    def submit(self, word: str) -> str:
        """Submit a guess.

        Args:
            word: The guessed word.
        """
        return "nope"

    def get_reward(self) -> float:
        return 0.25


def test_environment_owns_the_data(tmp_path, tiny_model_path, tool_tokenizer):
    WordGame.seen = []
    trainer = GRPOTrainer(
        tiny_model_path, args=config(tmp_path), processing_class=tool_tokenizer, environment_factory=WordGame
    )
    # one round of empty user messages (generation_batch_size 4 / num_generations 2), cycled by max_steps
    assert trainer.train_dataset["prompt"] == [[{"role": "user", "content": ""}]] * 2
    backend = scripted(trainer, tool_tokenizer)
    rollout = trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[1]], [0, 1], 0)
    prompt = tool_tokenizer.decode(backend.calls[0][0])
    assert "<|im_start|>user\nGuess the 5-letter word.<|im_end|>" in prompt and '"submit"' in prompt
    assert len(WordGame.seen) == 4 and all(
        "prompt" not in kwargs for kwargs in WordGame.seen
    )  # the engine's, not a column
    assert rollout.rewards.tolist() == [0.25] * 4
    trainer.train()
    assert trainer.state.global_step == 1


def test_environment_owned_data_needs_max_steps_and_a_single_factory(tmp_path, tiny_model_path, tool_tokenizer):
    with pytest.raises(ConfigError, match="max_steps"):
        GRPOTrainer(
            tiny_model_path,
            args=config(tmp_path, max_steps=-1),
            processing_class=tool_tokenizer,
            environment_factory=WordGame,
        )
    with pytest.raises(ConfigError, match="requires a `train_dataset`"):
        GRPOTrainer(
            tiny_model_path,
            args=config(tmp_path),
            processing_class=tool_tokenizer,
            environment_factory={"a": WordGame, "b": WordGame},
        )
    with pytest.raises(DataError, match="`train_dataset` is required unless an `environment_factory`"):
        GRPOTrainer(tiny_model_path, lambda completions, **kw: [0.0] * len(completions), args=config(tmp_path))


class Plain:
    """No get_reward(): scored by the trainer's reward functions only."""

    seen: list[dict] = []

    def reset(self, **kwargs):
        Plain.seen.append(kwargs)

    def act(self, x: int) -> int:
        """Act.

        Args:
            x: A value.
        """
        return x


class Scored(Plain):
    def get_reward(self) -> float:
        return 1.0


def test_dict_factory_routes_a_dataset_of_environment_names(tmp_path, tiny_model_path, tool_tokenizer):
    Plain.seen = []

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    rows = Dataset.from_dict({"environment": ["scored", "scored2", "plain", "plain"], "level": [1, 2, 3, 4]})
    trainer = GRPOTrainer(
        tiny_model_path,
        zero,
        args=config(tmp_path, reward_weights=[0.5]),
        train_dataset=rows,
        processing_class=tool_tokenizer,
        environment_factory={"scored": Scored, "scored2": Scored, "plain": Plain},
    )
    # one reward column per class that owns a reward (two names of one class share it), weight 1 after the user's
    assert trainer.reward_func_names == ["zero", "Scored"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert [tool.__name__ for tool in trainer.tools] == ["act"]  # Scored inherits Plain.act: offered once
    assert trainer.reward_funcs[-1](environments=[Scored(), Plain()]) == [1.0, None]
    scripted(trainer, tool_tokenizer)
    rollout = trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[2]], [0, 2], 0)
    # reset gets the row's own columns: neither the routing column nor the engine's placeholder prompt
    assert Plain.seen == [{"level": 1}] * 2 + [{"level": 3}] * 2
    assert rollout.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_an_unknown_environment_name_stops_the_round(tmp_path, tiny_model_path, tool_tokenizer):
    rows = Dataset.from_dict({"environment": ["chess"] * 2})
    trainer = GRPOTrainer(
        tiny_model_path,
        lambda completions, **kwargs: [0.0] * len(completions),
        args=config(tmp_path),
        train_dataset=rows,
        processing_class=tool_tokenizer,
        environment_factory={"go": Plain},
    )
    scripted(trainer, tool_tokenizer)
    with pytest.raises(DataError, match="'chess', which is not among the environments"):
        trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[1]], [0, 1], 0)
