"""A workload: what a run trains on — where prompts come from, how they are scored, and (for
multi-turn) the environment. One picklable object, resolved before Ray starts.

    Workload(task="addition")                                   a built-in (registered) task
    Workload(data=DataConfig(train_files=[...]), reward="math")  the user's dataset
    Workload(env="my_pkg.envs:Calc")                            the user's environment (a Task too)

Both kinds of prompt source give the pipeline the same rows, one table per train step:

    rollout_step  int32          the train step
    prompt_id     string         stable: "<task>/train/<seed>/<index>", or "<file>:<row>"
    prompt        as given       a string, or chat messages
    prompt_tokens list<int32>    engines.tokenizer.encode_prompts
    ...                          every other column (a task's `answer`; a dataset's own columns),
                                 copied onto each trajectory and passed to the reward function
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from trajflow.tasks.base import Prompt, SyntheticTask, Task
from trajflow.tasks.dataset import (
    DataConfig,
    DataError,
    PromptDataset,
    checked_dataset,
    expand_files,
    file_labels,
    fingerprint,
)
from trajflow.tasks.environments import Environment, is_environment
from trajflow.tasks.registry import get_task
from trajflow.tasks.rewards import RewardRunner, RewardSpecError, exact_match, resolve_reward
from trajflow.user_code import load_object


class PromptSource(Protocol):
    """The rows of each train step (see the module docstring)."""

    columns: list[str]  # the passthrough columns after prompt_tokens

    def step_rows(self, step: int) -> pa.Table: ...


def prompt_table(step: int, prompt_ids: list[str], prompts: list, prompt_tokens: list[list[int]],
                 columns: dict[str, list]) -> pa.Table:
    """The rows of one step in the common layout."""
    return pa.table({
        "rollout_step": pa.array(np.full(len(prompt_ids), step, np.int32)),
        "prompt_id": pa.array(prompt_ids, pa.string()),
        "prompt": prompts,
        "prompt_tokens": pa.array(prompt_tokens, pa.list_(pa.int32())),
        **columns,
    })


class TaskPrompts:
    """A task's prompt stream as step rows: step s takes the first P prompts of the stream seeded
    (seed, s), so a resumed run or a second generator rebuilds them without shared state."""

    columns = ["answer"]

    def __init__(self, task: Task, tokenizer, seed: int, prompts_per_step: int) -> None:
        self.task, self.tokenizer, self.seed, self.prompts_per_step = task, tokenizer, seed, prompts_per_step

    def prompts(self, step: int) -> list[Prompt]:
        stream = self.task.prompts("train", seed=self.seed * 1_000_003 + step)
        return [next(stream) for _ in range(self.prompts_per_step)]

    def step_rows(self, step: int) -> pa.Table:
        return rows_of_prompts(step, self.prompts(step), self.tokenizer)


def rows_of_prompts(step: int, prompts: list[Prompt], tokenizer) -> pa.Table:
    """A task's `Prompt`s as step rows (the answer is the passthrough column)."""
    from trajflow.engines.tokenizer import encode_prompts

    texts = [p.text for p in prompts]
    return prompt_table(step, [p.prompt_id for p in prompts], texts, encode_prompts(tokenizer, texts),
                        {"answer": pa.array([p.answer for p in prompts], pa.string())})


class DatasetPrompts:
    """A `PromptDataset` as step rows (per-epoch permutation from the seed)."""

    def __init__(self, dataset: PromptDataset, seed: int, prompts_per_step: int, shuffle: bool) -> None:
        self.dataset, self.seed, self.prompts_per_step, self.shuffle = dataset, seed, prompts_per_step, shuffle
        self.columns = dataset.columns

    def step_rows(self, step: int) -> pa.Table:
        return self.dataset.step_rows(step, self.prompts_per_step, self.seed, self.shuffle)


def prompt_of(row: dict) -> Prompt:
    """A prompt row as the `Prompt` an environment's `reset` takes."""
    prompt = row["prompt"]
    text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
    answer = row.get("answer")
    return Prompt(row["prompt_id"], text, "" if answer is None else str(answer))


@dataclass(frozen=True)
class Workload:
    """What to train on; see the module docstring. `repo_root` resolves relative data paths that
    do not exist under the working directory (the bundled examples)."""

    task: str | None = "addition"
    data: DataConfig | None = None
    env: str | None = None
    reward: str | None = None
    reward_timeout_seconds: float = 30.0
    repo_root: Path | None = None

    # -- resolution (driver, before Ray; raises ValueError subclasses with one line) -------------
    def task_object(self) -> Task | None:
        """The task whose prompts/verifier/episodes are used: the environment if `env` is set, the
        registered task, or None for a dataset without an environment."""
        if self.env is not None:
            cls = load_object(self.env, "env")
            try:
                env = cls() if inspect.isclass(cls) else cls
            except Exception as e:  # noqa: BLE001
                raise RewardSpecError(f"env: {self.env}() failed ({type(e).__name__}: {e})") from None
            if not is_environment(env):
                raise RewardSpecError(f"env: {self.env} is not an Environment (needs name, prompts, heldout, reward, "
                                      "reset, max_turns, max_response_tokens)")
            return env
        if self.data is not None:
            return None
        return get_task(self.task)

    def environment(self) -> Environment | None:
        task = self.task_object()
        return task if is_environment(task) else None

    def train_files(self) -> list[Path]:
        return expand_files(self.data.train_files, "data.train_files", self.repo_root) if self.data else []

    def test_files(self) -> list[Path]:
        return expand_files(self.data.test_files, "data.test_files", self.repo_root) if self.data else []

    def columns(self) -> list[str]:
        """The passthrough columns (what the reward function receives beside prompts/completions)."""
        if self.data is None:
            return list(TaskPrompts.columns)
        from trajflow.tasks.dataset import check_files

        columns = check_files(self.train_files(), self.data.prompt_key, "data.train_files")
        if self.data.test_files:
            test = check_files(self.test_files(), self.data.prompt_key, "data.test_files")
            if set(test) != set(columns):
                raise DataError(f"data.test_files: columns {sorted(test)} differ from data.train_files' "
                                f"{sorted(columns)}")
        return columns

    def check(self) -> None:
        """Resolve every name (files, columns, reward, environment) without starting Ray."""
        task = self.task_object()
        columns = self.columns()
        if is_environment(task):
            if self.reward is not None:
                raise RewardSpecError("reward: an environment scores its own episodes; remove reward (or env)")
            return
        if task is None and self.reward is None:
            raise RewardSpecError("reward: a dataset needs a reward: exact, math, package.module:function or "
                                  "path/to/file.py:function")
        if self.reward is not None:
            from trajflow.tasks.rewards import BUILTIN_REWARDS, check_reward_signature

            fn = resolve_reward(self.reward)
            if self.reward in BUILTIN_REWARDS:
                if "answer" not in columns:
                    raise DataError(f"reward: {self.reward} compares with the column 'answer', which the data "
                                    f"does not have (columns: {', '.join(columns) or 'none'})")
            else:
                check_reward_signature(fn, self.reward, columns)

    # -- what the pipeline's processes build from it ----------------------------------------------
    def prompt_source(self, tokenizer, seed: int, prompts_per_step: int) -> PromptSource:
        """The step rows (on the driver; a dataset's rows and tokens as the config's validation
        left them in this process, else read now)."""
        if self.data is None:
            return TaskPrompts(self.task_object(), tokenizer, seed, prompts_per_step)
        dataset = checked_dataset(self.data, self.train_files(), tokenizer)
        return DatasetPrompts(dataset, seed, prompts_per_step, self.data.shuffle)

    def heldout_rows(self, tokenizer, n: int | None) -> pa.Table:
        """The first n held-out prompt rows (a task's test split, or data.test_files in file order;
        n None: every row of data.test_files)."""
        if self.data is None:
            return rows_of_prompts(0, self.task_object().heldout(n), tokenizer)
        if not self.data.test_files:
            raise DataError("eval_every: held-out evaluation of a dataset needs data.test_files")
        dataset = checked_dataset(self.data, self.test_files(), tokenizer, key="data.test_files")
        rows = dataset.table.slice(0, n)
        return rows.add_column(0, "rollout_step", pa.array(np.zeros(rows.num_rows, np.int32)))

    def reward_runner(self) -> RewardRunner | None:
        """The reward of a non-environment workload (None: the environment scores episodes)."""
        task = self.task_object()
        if is_environment(task):
            return None
        if self.reward is None:
            return task_reward_runner(task, self.reward_timeout_seconds)
        return RewardRunner(resolve_reward(self.reward), self.reward_timeout_seconds)

    def reward_name(self) -> str:
        """What scores the rows, as the user named it (for messages)."""
        if self.reward is not None:
            return f"reward {self.reward}"
        task = self.task_object()
        return f"the {task.name} task's verifier" if task is not None else "the reward"

    def fingerprint(self, model_dir: str | Path | None, seed: int, prompts_per_step: int) -> str | None:
        """What a resume checks: the dataset's bytes, tokenizer and mapping settings (None: no dataset)."""
        if self.data is None:
            return None
        files = self.train_files()
        data = {k: v for k, v in dataclasses.asdict(self.data).items() if k not in ("test_files", "epochs")}
        settings = {"data": data, "seed": seed,
                    "prompts_per_step": prompts_per_step}
        return fingerprint(files, file_labels(files), settings, Path(model_dir) if model_dir else None)


def task_reward_runner(task: Task, timeout: float = 30.0) -> RewardRunner:
    """A task's own verifier as a batched reward: the vectorised exact match for the built-in
    tasks (which use it), else the task's `reward` item by item."""
    if type(task).reward is SyntheticTask.reward:
        return RewardRunner(exact_match, timeout)
    return RewardRunner(TaskVerifier(task), timeout)


class TaskVerifier:
    """A task's own `reward(prompt_text, answer, response)` as a batched reward function."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self, prompts, completions, answer, **_) -> list[float]:
        return [float(self.task.reward(p, a, c)) for p, a, c in zip(prompts, answer, completions)]
