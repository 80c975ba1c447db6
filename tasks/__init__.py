"""Workloads: prompt sources (built-in tasks, the user's datasets), reward functions, environments."""

from trajflow.tasks.addition import AdditionTask
from trajflow.tasks.base import Prompt, SyntheticTask, Task, exact_match_reward
from trajflow.tasks.environments import CalculatorEnv, EnvEpisode, Environment, EnvStep, is_environment
from trajflow.tasks.registry import get_task, register_task, registered_tasks
from trajflow.tasks.reverse import ReverseTask
from trajflow.tasks.dataset import DataConfig
from trajflow.tasks.workload import PromptSource, Workload

__all__ = [
    "AdditionTask",
    "CalculatorEnv",
    "DataConfig",
    "EnvEpisode",
    "EnvStep",
    "Environment",
    "Prompt",
    "PromptSource",
    "ReverseTask",
    "SyntheticTask",
    "Task",
    "Workload",
    "exact_match_reward",
    "get_task",
    "is_environment",
    "register_task",
    "registered_tasks",
]
