"""posttrain.experimental.openreward (TRL's `trl.experimental.openreward`): without the `openreward` SDK the spec
stops before any trainer is built; with an SDK stand-in (the SDK's objects as TRL uses them, served from memory)
the dataset, the tools bound from the server's JSON schemas, sessions and rewards work end to end in GRPO."""

import importlib.util
import sys
import types
from dataclasses import dataclass

import pytest
from test_tool_rollouts import ScriptedBackend, tool_tokenizer  # noqa: F401 (fixture)

from posttrain.errors import ConfigError
from posttrain.experimental.openreward import OpenRewardSpec, outcome_only_reward, tool_method
from posttrain.tools.schema import tool_schema
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

GOLD = {0: "4", 1: "9", 2: "16"}
SHARED = [
    {
        "name": "run",
        "description": "Run a shell command.",
        "input_schema": {
            "properties": {
                "command": {"type": "string", "description": "The command."},
                "timeout": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 30, "description": "Seconds."},
            },
            "required": ["command"],
        },
    }
]
SUBMIT = {
    "name": "submit",
    "description": "Submit the final answer.",
    "input_schema": {
        "properties": {"answer": {"type": "string", "description": "The answer."}},
        "required": ["answer"],
    },
}


@dataclass
class ToolOutput:
    blocks: list
    reward: float | None = None
    metadata: dict | None = None
    finished: bool = False


class Session:
    def __init__(self, server, index):
        self.server, self.index = server, index

    def get_prompt(self):
        return [{"type": "text", "text": f"What is task {self.index} squared?"}, {"type": "image", "url": "x"}]

    def list_tools(self):
        return SHARED + [SUBMIT]

    def call_tool(self, name, arguments):
        self.server.calls.append((self.index, name, arguments))
        if name == "submit":
            right = arguments["answer"] == GOLD[self.index]
            return ToolOutput([{"type": "text", "text": "right" if right else "wrong"}], float(right), {"i": 1}, True)
        return ToolOutput([{"type": "text", "text": f"ran {arguments['command']} ({arguments['timeout']}s)"}])


class SessionContext:
    def __init__(self, server, index):
        self.server, self.index = server, index

    def __enter__(self):
        self.server.open.add(self.index)
        return Session(self.server, self.index)

    def __exit__(self, *exc):
        self.server.open.discard(self.index)


class Environment:
    def __init__(self):
        self.calls, self.open, self.sessions = [], set(), []

    def list_tools(self):
        return SHARED

    def num_tasks(self, split):
        return len(GOLD)

    def get_task(self, split, index):
        return types.SimpleNamespace(task_spec={"id": f"t{index}", "difficulty": index, "prompt": "not a column"})

    def list_tasks(self, split):
        return [self.get_task(split, i) for i in GOLD]

    def session(self, split=None, index=None, secrets=None, task=None):
        self.sessions.append((split, index, secrets))
        return SessionContext(self, index)


@pytest.fixture()
def server(monkeypatch):
    environment, clients = Environment(), []

    class OpenReward:
        def __init__(self, **kwargs):
            clients.append(kwargs)
            self.environments = types.SimpleNamespace(get=lambda name: clients.append(name) or environment)

    monkeypatch.setitem(sys.modules, "openreward", types.SimpleNamespace(OpenReward=OpenReward))
    environment.clients = clients
    return environment


@pytest.mark.skipif(importlib.util.find_spec("openreward") is not None, reason="the openreward SDK is installed")
def test_without_the_sdk_the_spec_stops_before_training():
    spec = OpenRewardSpec("Eigent/SETA", num_tasks=4)  # building the spec itself needs nothing
    with pytest.raises(ConfigError, match=r"`openreward` SDK.*pip install openreward"):
        _ = spec.train_dataset
    with pytest.raises(ConfigError, match="pip install openreward"):
        _ = spec.environment_factory
    with pytest.raises(ConfigError, match="not both"):
        OpenRewardSpec("x", num_tasks=1, indices=[0])


def test_dataset_rows_and_task_metadata(server, monkeypatch):
    monkeypatch.setenv("OPENREWARD_API_KEY", "k-1")
    spec = OpenRewardSpec("Eigent/SETA", num_tasks=2)
    data = spec.train_dataset
    assert data.column_names == ["prompt", "task_index", "difficulty", "id"]  # the spec's `prompt` is not a column
    assert data["task_index"] == [0, 1] and data["id"] == ["t0", "t1"]
    assert data["prompt"] == [[{"role": "user", "content": ""}]] * 2
    assert server.clients[0] == {"api_key": "k-1"} and server.clients[1] == "Eigent/SETA"
    assert spec.session_secrets() == {"api_key": "k-1"}  # forwarded to the catalog's sessions
    assert OpenRewardSpec("Eigent/SETA", indices=[2]).train_dataset["id"] == ["t2"]
    everything = OpenRewardSpec("http://localhost:8080", include_metadata=False)
    assert everything.train_dataset.column_names == ["prompt", "task_index"] and len(everything.train_dataset) == 3
    assert server.clients[-2] == {"base_url": "http://localhost:8080"} and server.clients[-1] == "env"
    assert everything.session_secrets() is None


def test_tools_are_typed_methods_with_the_servers_schemas(server):
    env = OpenRewardSpec("http://ors", indices=[1]).environment_factory()
    assert server.sessions[0] == ("train", 1, None)  # tool discovery probed the chosen task
    run = tool_schema(env.run)["function"]
    assert run["name"] == "run" and run["description"] == "Run a shell command."
    assert run["parameters"]["properties"]["command"] == {"type": "string", "description": "The command."}
    assert run["parameters"]["properties"]["timeout"]["type"] == "integer"
    assert run["parameters"]["required"] == ["command"]
    assert tool_schema(env.submit)["function"]["parameters"]["required"] == ["answer"]
    shared_only = OpenRewardSpec("http://ors", discover_task_tools=False).environment_factory()
    assert hasattr(shared_only, "run") and not hasattr(shared_only, "submit")
    assert tool_method({"name": "bad-name", "input_schema": {}}) is None
    assert tool_method({"name": "ok", "input_schema": {"properties": {"a b": {"type": "string"}}}}) is None


def test_sessions_rewards_and_state(server):
    env = OpenRewardSpec("http://ors").environment_factory()
    assert env.reset(task_index=2) == "What is task 2 squared?"
    assert env.run("ls") == "ran ls (30s)" and env.reward is None and env.rewards == [None]
    assert env.submit(answer="16") == "right" and env.reward == 1.0 and env.finished
    assert env.metadata == [None, {"i": 1}]
    env.reset(task_index=0)
    assert server.open == {0} and env.reward is None and env.rewards == []  # the previous session was closed
    assert outcome_only_reward([env]) == [None]  # unscored is not zero


def test_rollouts_in_grpo(server, tmp_path, tiny_model_path, tool_tokenizer):  # noqa: F811
    """Even rollouts submit the right answer, odd ones a wrong one: rewards 1 / 0, from the server's sessions."""
    spec = OpenRewardSpec("http://ors", num_tasks=2)
    eos = tool_tokenizer.eos_token_id

    def submit(answer):
        return tool_tokenizer(
            f'<tool_call>\n{{"name": "submit", "arguments": {{"answer": "{answer}"}}}}\n</tool_call>',
            add_special_tokens=False,
        )["input_ids"] + [eos]

    def script(prompt, k):
        text = tool_tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return tool_tokenizer("done", add_special_tokens=False)["input_ids"] + [eos]
        task = 0 if "task 0" in text else 1
        return submit(GOLD[task] if k % 2 == 0 else "no")

    trainer = GRPOTrainer(
        tiny_model_path,
        spec.reward_funcs,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        processing_class=tool_tokenizer,
        args=GRPOConfig(
            output_dir=str(tmp_path),
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
    assert "What is task 0 squared?" in tool_tokenizer.decode(backend.calls[0][0])
    assert rollout.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert sorted(call[:2] for call in server.calls) == [(0, "submit")] * 2 + [(1, "submit")] * 2
