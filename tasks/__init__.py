"""Prompt sources and verifiers: built-in synthetic tasks and the interface for external ones."""

from trajflow.tasks.addition import AdditionTask
from trajflow.tasks.base import Prompt, SyntheticTask, Task, exact_match_reward
from trajflow.tasks.environments import CalculatorEnv, EnvEpisode, Environment, EnvStep, is_environment
from trajflow.tasks.registry import get_task, register_task, registered_tasks
from trajflow.tasks.reverse import ReverseTask

__all__ = [
    "AdditionTask",
    "CalculatorEnv",
    "EnvEpisode",
    "EnvStep",
    "Environment",
    "Prompt",
    "ReverseTask",
    "SyntheticTask",
    "Task",
    "exact_match_reward",
    "get_task",
    "is_environment",
    "register_task",
    "registered_tasks",
]
