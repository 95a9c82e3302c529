"""posttrain.experimental.harbor (TRL's `trl.experimental.harbor`): the spec's dataset from a local task tree, agent
selection, the stop before training without the `harbor` package, and the harness end to end in GRPO rollouts with
a subclass that runs tasks in a local directory instead of a Harbor sandbox."""

import asyncio
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import pytest
import tomllib
from test_tool_rollouts import ScriptedBackend, tool_tokenizer  # noqa: F401 (fixture)

from posttrain.errors import ConfigError, DataError
from posttrain.experimental.harbor import AGENTS, HarborBashEnv, HarborEnv, HarborSpec, outcome_reward, resolve_agent
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

HAS_HARBOR = importlib.util.find_spec("harbor") is not None


def _suite(root: Path, answers=("42", "7", "yes")) -> Path:
    for i, answer in enumerate(answers):
        task = root / "tasks" / f"task_{i}"
        (task / "tests").mkdir(parents=True)
        (task / "instruction.md").write_text(f"Task {i}: find the answer.")
        (task / "task.toml").write_text(f'[metadata]\ngold_answer = "{answer}"\ndifficulty_level = {i}\n')
    (root / "tasks" / "notes").mkdir()  # not a task: no task.toml
    return root


class LocalBashEnv(HarborBashEnv):
    """The bash harness on a local scratch directory: commands run in it, the verifier compares answer.txt with
    task.toml's gold answer."""

    async def _start(self, task_dir):
        self.workdir, self.task_dir = Path(tempfile.mkdtemp()), Path(task_dir)
        return (self.task_dir / "instruction.md").read_text()

    async def _run(self, command, timeout):
        done = await asyncio.to_thread(
            subprocess.run, ["bash", "-c", command], cwd=self.workdir, capture_output=True, text=True, timeout=timeout
        )
        return done.stdout, done.stderr, done.returncode

    async def _verify(self):
        gold = tomllib.loads((self.task_dir / "task.toml").read_text())["metadata"]["gold_answer"]
        answer = self.workdir / "answer.txt"
        return float(answer.exists() and answer.read_text() == gold)

    async def _stop(self):
        pass


def test_spec_reads_a_local_task_tree(tmp_path):
    root = _suite(tmp_path)
    data = HarborSpec(str(root), agent=LocalBashEnv).train_dataset
    assert data["task_dir"] == [str(root / "tasks" / f"task_{i}") for i in range(3)]
    assert data["prompt"] == [[{"role": "user", "content": ""}]] * 3 and data["task_index"] == [0, 1, 2]
    assert data["gold_answer"] == ["42", "7", "yes"] and data["difficulty_level"] == [0, 1, 2]
    assert data["kaggle_dataset"] == [None] * 3
    picked = HarborSpec(str(root / "tasks"), agent=LocalBashEnv, indices=[2, 0], include_metadata=False).train_dataset
    assert picked["task_index"] == [2, 0] and picked["task_dir"][0].endswith("task_2")
    assert picked.column_names == ["prompt", "task_dir", "task_index"]
    assert len(HarborSpec(str(root), agent=LocalBashEnv, num_tasks=2).train_dataset) == 2


def test_spec_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        HarborSpec(str(tmp_path), num_tasks=1, indices=[0])
    with pytest.raises(ConfigError, match="no task"):
        _ = HarborSpec(str(tmp_path), agent=LocalBashEnv).train_dataset
    with pytest.raises(ConfigError, match="out of range"):
        _ = HarborSpec(str(_suite(tmp_path)), agent=LocalBashEnv, indices=[5]).train_dataset
    with pytest.raises(ConfigError, match="huggingface-cli download"):  # no local tree, no Hub access here
        _ = HarborSpec("someone/no-such-suite-here", agent=LocalBashEnv).train_dataset


def test_agents_resolve_from_names_paths_and_classes(tmp_path):
    assert resolve_agent("bash") is HarborBashEnv is AGENTS["bash"]
    assert resolve_agent(LocalBashEnv) is LocalBashEnv
    assert resolve_agent("test_harbor:LocalBashEnv").__name__ == "LocalBashEnv"
    harness = tmp_path / "my_harness.py"
    harness.write_text(
        "from posttrain.experimental.harbor import HarborBashEnv\n"
        "class Mine(HarborBashEnv):\n    PROMPT_SUFFIX = ' (mine)'\n"
    )
    assert resolve_agent(f"{harness}:Mine").PROMPT_SUFFIX == " (mine)"
    with pytest.raises(ConfigError, match="unknown"):
        resolve_agent("python")
    with pytest.raises(TypeError, match="not a HarborEnv subclass"):  # TRL's error type
        resolve_agent("pathlib:Path")


@pytest.mark.skipif(HAS_HARBOR, reason="the `harbor` package is installed")
def test_without_harbor_the_trainer_stops_before_training(tmp_path, tiny_model_path, tool_tokenizer):  # noqa: F811
    spec = HarborSpec(str(_suite(tmp_path / "suite")))  # the default harness runs on Harbor
    with pytest.raises(ConfigError, match=r"HarborBashEnv.*`harbor` package.*pip install harbor"):
        GRPOTrainer(
            tiny_model_path,
            spec.reward_funcs,
            train_dataset=spec.train_dataset,
            environment_factory=spec.environment_factory,
            processing_class=tool_tokenizer,
            args=GRPOConfig(
                output_dir=str(tmp_path / "out"),
                per_device_train_batch_size=2,
                num_generations=2,
                max_steps=1,
                use_cpu=True,
                bf16=False,
                report_to="none",
            ),
        )
    with pytest.raises(ConfigError, match="harbor"):
        HarborEnv()


def test_environment_without_task_dir_and_before_reset():
    env = LocalBashEnv()
    assert env.reward == 0.0  # never reset: nothing to verify
    with pytest.raises(DataError, match="task_dir"):
        env.reset(prompt=[])


def test_bash_harness_in_grpo_rollouts(tmp_path, tiny_model_path, tool_tokenizer):  # noqa: F811
    """Even rollouts write the gold answer with the bash tool, odd ones answer in text only: rewards 1 / 0."""
    spec = HarborSpec(str(_suite(tmp_path / "suite", answers=("42", "42"))), agent=LocalBashEnv)
    eos = tool_tokenizer.eos_token_id
    call = tool_tokenizer(
        '<tool_call>\n{"name": "bash", "arguments": {"command": "echo -n 42 > answer.txt"}}\n</tool_call>',
        add_special_tokens=False,
    )["input_ids"] + [eos]
    text = tool_tokenizer("the answer is 42", add_special_tokens=False)["input_ids"] + [eos]

    def script(prompt, k):
        if "<tool_response>" in tool_tokenizer.decode(prompt):
            return text
        return call if k % 2 == 0 else text

    trainer = GRPOTrainer(
        tiny_model_path,
        spec.reward_funcs,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        processing_class=tool_tokenizer,
        args=GRPOConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=128,
            max_steps=1,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        ),
    )
    backend = ScriptedBackend(script, eos)
    trainer.generation_backend = backend
    if trainer.episode_source is not None:
        trainer.episode_source.backend = backend
    rollout = trainer.make_rollout([trainer.train_dataset[0], trainer.train_dataset[1]], [0, 1], 0)
    first_prompt = tool_tokenizer.decode(backend.calls[0][0])
    assert "Task 0: find the answer." + HarborBashEnv.PROMPT_SUFFIX[:40] in first_prompt and '"bash"' in first_prompt
    assert rollout.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert rollout.episodes[0]["tool_calls"] == 1 and rollout.episodes[1]["tool_calls"] == 0


def test_outcome_reward_reads_environments_or_given_rewards():
    class Done:
        reward = 0.5

    assert outcome_reward(environments=[Done(), Done()]) == [0.5, 0.5]
    assert outcome_reward(environment_reward=[1, 0]) == [1.0, 0.0]


def test_trls_private_spec_module_path_gives_the_same_helpers():
    # TRL's tests import the two helpers from trl.experimental.harbor._spec under private names.
    from posttrain.experimental.harbor._spec import _outcome_reward_func, _resolve_agent

    class Done:
        reward = 1.0

    assert _outcome_reward_func([Done()]) == [1.0]
    assert _resolve_agent("bash") is HarborBashEnv
    with pytest.raises(TypeError, match="not a HarborEnv subclass"):
        _resolve_agent("posttrain.experimental.harbor:HarborSpec")
