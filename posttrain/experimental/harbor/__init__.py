"""Harbor agentic task suites as GRPO environments, with TRL's `trl.experimental.harbor` API.

A Harbor task is a directory (`instruction.md`, `task.toml`, `environment/` with its Dockerfile, `tests/` with the
verifier); a suite is a tree of them. `HarborSpec(dataset, agent="bash")` gives the three things a GRPO run needs:
`.train_dataset` (one row per task: an empty user prompt, the task's directory and `task.toml` metadata),
`.environment_factory` (a new harness environment per rollout, posttrain's `environment_factory=` contract:
posttrain/tools/environment.py) and `.reward_funcs` (the verifier's score of each rollout).

The harness (`HarborEnv` subclass, the "agent") decides the tools the model gets: `HarborBashEnv` offers one
`bash` tool and counts an answer written to /workdir/answer.txt. Each environment drives its task's sandbox
through four async hooks run on its own event loop: `_start` (build and start the sandbox, return the
instruction; it calls the `_setup` hook of harnesses that prepare the sandbox further), `_run` (run a shell
command), `_verify` (run the task's verifier, return its reward) and `_stop`.
The base class implements them with the `harbor` package in this interpreter (`pip install harbor`; Harbor
needs Python >= 3.12 and a sandbox backend such as Docker). Without it, building a `HarborEnv` whose hooks are
Harbor's stops with a ConfigError (when the trainer builds its first environment, before training); a subclass
that overrides all four hooks (e.g. running tasks in a local directory) needs no Harbor.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import tomllib

from posttrain.errors import ConfigError, DataError

LIFECYCLE_HOOKS = ("_start", "_run", "_verify", "_stop")
INSTALL_HINT = (
    "Install it with `pip install harbor` (Harbor needs Python >= 3.12; this is Python "
    f"{sys.version_info.major}.{sys.version_info.minor}) together with a sandbox backend (e.g. Docker)"
)
METADATA_KEYS = {
    "gold_answer": "gold_answer",
    "reward_mode": "reward_mode_initial",
    "difficulty_level": "difficulty_level",
    "kaggle_dataset": "kaggle_dataset_name",
}


def require_harbor(what: str) -> None:
    """Raises ConfigError naming `what` unless the `harbor` package can be imported."""
    if importlib.util.find_spec("harbor") is None:
        raise ConfigError(
            f"{what} runs Harbor sandboxes and verifiers, which needs the `harbor` package, not "
            f"installed here. {INSTALL_HINT}, or subclass HarborEnv and override "
            f"{', '.join(LIFECYCLE_HOOKS)} to run tasks without Harbor."
        )


class HarborEnv:
    """One rollout's Harbor task: `reset(task_dir=...)` starts its sandbox and returns the instruction (+ the
    harness's PROMPT_SUFFIX); the subclass's public methods are the tools; `reward` runs the verifier once, after
    the rollout. `environment_type` is Harbor's sandbox backend ('docker', 'e2b', 'daytona', ...)."""

    PROMPT_SUFFIX: str = ""
    OUTPUT_LIMIT = 8000  # characters of a command's output shown to the model

    def __init__(self, environment_type: str = "docker"):
        harbors = [name for name in LIFECYCLE_HOOKS if getattr(type(self), name) is getattr(HarborEnv, name)]
        if harbors:
            require_harbor(f"{type(self).__name__} (its {', '.join(harbors)})")
        self.environment_type = environment_type
        # Harbor's sandbox clients are bound to the loop that made them: one loop per environment, on a thread, so
        # the synchronous tool calls can wait on it from any thread (or from inside another running loop). `_env`
        # is the task's Harbor sandbox (TRL's name, which harness subclasses use).
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._env = self._task = self._paths = None
        self._started = False
        self._reward: float | None = None

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def reset(self, task_dir: str | None = None, **row: Any) -> str:
        if task_dir is None:
            raise DataError(
                "A Harbor environment is reset with the row's `task_dir` (the task's directory), but the "
                f"row has only {sorted(row)}. Train on HarborSpec(...).train_dataset."
            )
        instruction = self._wait(self._start(task_dir))
        self._started, self._reward = True, None
        return instruction + self.PROMPT_SUFFIX

    def _exec(self, command: str, timeout: int = 180) -> str:
        """A command's stdout + stderr (cut to OUTPUT_LIMIT characters), or its exit code when it printed nothing."""
        stdout, stderr, code = self._wait(self._run(command, timeout))
        output = (stdout or "") + (stderr or "")
        if len(output) > self.OUTPUT_LIMIT:
            output = output[: self.OUTPUT_LIMIT] + "\n... [truncated]"
        return output or f"(empty output, rc={code})"

    @property
    def reward(self) -> float:
        """The verifier's score of this rollout (run on first read); 0.0 for an environment never reset."""
        if not self._started:
            return 0.0
        if self._reward is None:
            self._reward = float(self._wait(self._verify()))
        return self._reward

    # -- Harbor's lifecycle (async, on the environment's loop) ---------------------------------------------------
    async def _start(self, task_dir: str) -> str:
        from harbor.environments.factory import EnvironmentFactory
        from harbor.models.task.task import Task
        from harbor.models.trial.config import EnvironmentConfig
        from harbor.models.trial.paths import TrialPaths

        await self._stop()  # the previous rollout's sandbox
        self._task = Task(task_dir=Path(task_dir))
        self._paths = TrialPaths(trial_dir=Path(tempfile.mkdtemp(prefix="posttrain_harbor_")))
        self._env = EnvironmentFactory.create_environment_from_config(
            config=EnvironmentConfig(type=self.environment_type),
            environment_dir=self._task.paths.environment_dir,
            environment_name=self._task.short_name,
            session_id=uuid.uuid4().hex,
            trial_paths=self._paths,
            task_env_config=self._task.config.environment,
        )
        await self._env.start(force_build=False)
        await self._copy_build_files()
        await self._env.run_healthcheck()
        await self._env.exec("mkdir -p /workdir /home/user/input")
        await self._setup()
        return self._task.instruction

    async def _setup(self) -> None:
        """Hook (TRL's): a harness's own preparation of a started sandbox (upload helpers with
        `self._env.upload_file`, start a server, ...); nothing for the bash harness."""

    async def _copy_build_files(self) -> None:
        """Re-creates the files the task's Dockerfile COPYs (`COPY src... dst`), which some remote builds (E2B)
        leave out; uploaded as the sandbox user, then moved into place as root."""
        dockerfile = self._task.paths.environment_dir / "Dockerfile"
        lines = dockerfile.read_text().splitlines() if dockerfile.exists() else []
        for line in lines:
            words = line.split()
            if not words or words[0].upper() != "COPY" or "--from" in line:
                continue
            *sources, target = [w for w in words[1:] if not w.startswith("--")] or [""]
            for source in sources:
                local = self._task.paths.environment_dir / source
                if not local.is_file():
                    continue
                into_dir = len(sources) > 1 or target.endswith("/")
                remote = target.rstrip("/") + "/" + Path(source).name if into_dir else target
                staged = "/tmp/" + uuid.uuid4().hex
                await self._env.upload_file(local, staged)
                await self._env.exec(f"mkdir -p {os.path.dirname(remote) or '/'} && mv {staged} {remote}", user="root")

    async def _run(self, command: str, timeout: int) -> tuple[str, str, int]:
        result = await self._env.exec(command, timeout_sec=timeout)
        return result.stdout, result.stderr, result.return_code

    async def _verify(self) -> float:
        from harbor.models.trial.config import VerifierConfig
        from harbor.models.trial.paths import EnvironmentPaths
        from harbor.verifier.factory import VerifierFactory

        await self._env.empty_dirs([EnvironmentPaths.for_os(self._env.os).verifier_dir], chmod=True)
        verifier = VerifierFactory.create_verifier_from_config(
            VerifierConfig(),
            task=self._task,
            trial_paths=self._paths,
            environment=self._env,
            override_env=self._task.config.verifier.env or None,
        )
        rewards = (await verifier.verify()).rewards or {}
        return float(rewards.get("reward", next(iter(rewards.values()), 0.0)))

    async def _stop(self) -> None:
        if self._env is not None:
            try:
                await self._env.stop(delete=True)
            finally:
                self._env = None

    def __del__(self):
        loop = getattr(self, "_loop", None)
        if loop is None:
            return
        try:
            self._wait(self._stop())
        except Exception:  # noqa: BLE001 - best-effort teardown of a sandbox at interpreter exit
            pass
        finally:
            loop.call_soon_threadsafe(loop.stop)


class HarborBashEnv(HarborEnv):
    """The one-tool harness: `bash`; the answer is what the model writes to /workdir/answer.txt."""

    PROMPT_SUFFIX = (
        "\n\nYou have one tool, `bash`: it runs a shell command in the task's sandbox and returns its output (no "
        "state is kept between calls). The task's files are in /home/user/input/. Submit your final answer by "
        'writing it to /workdir/answer.txt with the tool, e.g. `echo -n "<answer>" > /workdir/answer.txt`: an answer '
        "only stated in text is not submitted. Keep it short, and submit before you end your turn."
    )

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox and return its stdout and stderr. Use it to look at files, run
        Python, and submit the answer by writing it to /workdir/answer.txt.

        Args:
            command: The shell command to run.

        Returns:
            The command's output.
        """
        return self._exec(command)


AGENTS: dict[str, type[HarborEnv]] = {"bash": HarborBashEnv}


def outcome_reward(environments=None, environment_reward=None, **_) -> list[float]:
    """The verifier's score per rollout: read from each environment, or given per rollout (`environment_reward`,
    from trainers that run the environments elsewhere)."""
    if environment_reward is not None:
        return [float(r) for r in environment_reward]
    return [float(env.reward) for env in environments]


def resolve_agent(agent: str | type) -> type[HarborEnv]:
    """A HarborEnv subclass from a class, a built-in name (AGENTS), 'package.module:Class' or 'path/file.py:Class'."""
    if isinstance(agent, type):
        cls = agent
    elif agent in AGENTS:
        cls = AGENTS[agent]
    elif isinstance(agent, str) and ":" in agent:
        target, _, name = agent.rpartition(":")
        if target.endswith(".py") or os.path.sep in target:
            spec = importlib.util.spec_from_file_location(Path(target).stem, target)
            if spec is None or spec.loader is None:
                raise ConfigError(f"agent={agent!r}: {target} is not a Python file that can be loaded.")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        cls = getattr(module, name, None)
    else:
        raise ConfigError(
            f"agent={agent!r} is unknown: give a built-in name {sorted(AGENTS)}, 'package.module:Class', "
            "'path/to/file.py:Class' or a HarborEnv subclass."
        )
    if not (isinstance(cls, type) and issubclass(cls, HarborEnv)):
        raise TypeError(f"agent={agent!r} gives {cls!r}, which is not a HarborEnv subclass.")  # TRL's type
    return cls


def _task_metadata(task_dir: Path) -> dict[str, Any]:
    try:
        metadata = tomllib.loads((task_dir / "task.toml").read_text()).get("metadata", {})
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return {column: metadata.get(key) for column, key in METADATA_KEYS.items()}


class HarborSpec:
    """Wires a Harbor suite into `GRPOTrainer(train_dataset=spec.train_dataset, environment_factory=
    spec.environment_factory, reward_funcs=spec.reward_funcs)`.

    `dataset`: a local directory holding task directories (or a `tasks/` folder of them), or a Hugging Face
    dataset repo id whose `tasks/` tree is downloaded. `agent`: the harness (see `resolve_agent`).
    `environment_type`: Harbor's sandbox backend. `num_tasks` (the first n) or `indices` select tasks of the
    sorted suite; `include_metadata` adds task.toml's gold_answer, reward_mode, difficulty_level and
    kaggle_dataset columns.
    """

    def __init__(
        self,
        dataset: str,
        *,
        agent: str | type = "bash",
        environment_type: str = "docker",
        num_tasks: int | None = None,
        indices: list[int] | None = None,
        include_metadata: bool = True,
    ):
        if num_tasks is not None and indices is not None:
            raise ConfigError("HarborSpec takes num_tasks (the first n tasks) or indices (chosen tasks), not both.")
        self.dataset, self.environment_type = dataset, environment_type
        self.num_tasks, self.indices, self.include_metadata = num_tasks, indices, include_metadata
        self.agent = resolve_agent(agent)

    @cached_property
    def task_dirs(self) -> list[Path]:
        local = Path(self.dataset)
        if (local / "tasks").is_dir():
            root = local / "tasks"
        elif local.is_dir():
            root = local
        else:
            root = self._download() / "tasks"
        dirs = sorted(path.parent for path in root.glob("*/task.toml"))
        if not dirs:
            raise ConfigError(f"HarborSpec({self.dataset!r}): no task (a directory with task.toml) under {root}.")
        if self.indices is not None:
            bad = [i for i in self.indices if not -len(dirs) <= i < len(dirs)]
            if bad:
                raise ConfigError(f"indices {bad} are out of range: the suite has {len(dirs)} tasks.")
            return [dirs[i] for i in self.indices]
        return dirs[: self.num_tasks] if self.num_tasks is not None else dirs

    def _download(self) -> Path:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(self.dataset, repo_type="dataset", allow_patterns=["tasks/**"]))
        except Exception as error:  # noqa: BLE001 - offline, unknown repo, no access: one message with the fix
            raise ConfigError(
                f"HarborSpec({self.dataset!r}) is not a local directory and downloading it as a Hub "
                f"dataset failed ({type(error).__name__}: {error}). Give the path of a local task tree, "
                f"or download it first: `huggingface-cli download {self.dataset} --repo-type dataset "
                "--include 'tasks/**' --local-dir DIR`."
            ) from None

    @cached_property
    def train_dataset(self):
        """One row per task: `prompt` (an empty user message; reset appends the instruction), `task_dir`,
        `task_index`, and with include_metadata the task.toml columns."""
        from datasets import Dataset

        dirs = self.task_dirs
        indices = list(self.indices) if self.indices is not None else list(range(len(dirs)))
        rows: dict[str, list] = {
            "prompt": [[{"role": "user", "content": ""}] for _ in dirs],
            "task_dir": [str(d) for d in dirs],
            "task_index": indices,
        }
        if self.include_metadata:
            metadata = [_task_metadata(d) for d in dirs]
            for column in METADATA_KEYS:
                rows[column] = [m.get(column) for m in metadata]
        return Dataset.from_dict(rows)

    @cached_property
    def environment_factory(self) -> Callable[[], HarborEnv]:
        """A new harness environment per call (a picklable partial, for trainers that run rollouts in another
        process)."""
        return partial(self.agent, environment_type=self.environment_type)

    @property
    def reward_funcs(self) -> Callable[..., list[float]]:
        return outcome_reward


__all__ = ["AGENTS", "HarborBashEnv", "HarborEnv", "HarborSpec", "outcome_reward", "require_harbor", "resolve_agent"]
