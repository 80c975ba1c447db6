"""trajflow: asynchronous RL post-training for language models as a streaming Ray Data pipeline.

The public API, for a notebook or a script (each name loads on first use, so `import trajflow`
and `trajflow --help` import neither torch nor Ray):

    from trajflow import PipelineConfig, RLPipeline, Stage
    pipe = RLPipeline(PipelineConfig(strategy="snapshot", steps=20))
    pipe.insert_after("advantage", Stage("clip_rewards", MyOp()))
    metrics = pipe.run()                      # polars, one row per train step (Ray, embedded)
    metrics = run_in_process(pipe)            # the same operators in this process, synchronously

    Strategy                 subclass it for a correction of your own (operators/strategies/base.py)
    decoupled_loss, CorrectionConfig, ...     the loss as one pure function (algorithms/objective.py);
                                              WholeUpdate, ReferenceKL: its optional groups of arguments
    Replay                   a logged run again under other strategies (pipelines/replay.py)
    TeamPipeline, run_team_in_process, RelayEnv   a team of agents, each its own policy
                                              (pipelines/team.py, tasks/team.py; in this process)
    load_job_config, run_job                  what `trajflow run` does (jobs/)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trajflow.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "RLPipeline": "trajflow.pipelines.rl_loop",
    "Stage": "trajflow.operators.contracts.stage",
    "Placement": "trajflow.operators.contracts.stage",
    "run_in_process": "trajflow.pipelines.local",
    "PipelineConfig": "trajflow.pipelines.config",
    "Replay": "trajflow.pipelines.replay",
    "TeamPipeline": "trajflow.pipelines.team",
    "run_team_in_process": "trajflow.pipelines.team",
    "RelayEnv": "trajflow.tasks.team",
    "InProcessStore": "trajflow.pipelines.policy_store",
    "Strategy": "trajflow.operators.strategies.base",
    "resolve_strategy": "trajflow.operators.strategies.registry",
    "decoupled_loss": "trajflow.algorithms.objective",
    "LossOutput": "trajflow.algorithms.objective",
    "WholeUpdate": "trajflow.algorithms.objective",
    "ReferenceKL": "trajflow.algorithms.kl",
    "CorrectionConfig": "trajflow.algorithms.config",
    "AdvantageConfig": "trajflow.algorithms.config",
    "KLConfig": "trajflow.algorithms.config",
    "OptimizerConfig": "trajflow.algorithms.config",
    "JobConfig": "trajflow.jobs.config",
    "load_job_config": "trajflow.jobs.config",
    "run_job": "trajflow.jobs.run",
    "resume_job": "trajflow.jobs.run",
}
__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from trajflow.algorithms.config import AdvantageConfig, CorrectionConfig, KLConfig, OptimizerConfig
    from trajflow.algorithms.kl import ReferenceKL
    from trajflow.algorithms.objective import LossOutput, WholeUpdate, decoupled_loss
    from trajflow.jobs.config import JobConfig, load_job_config
    from trajflow.jobs.run import resume_job, run_job
    from trajflow.operators.contracts.stage import Placement, Stage
    from trajflow.operators.strategies.base import Strategy
    from trajflow.operators.strategies.registry import resolve_strategy
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.local import run_in_process
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.replay import Replay
    from trajflow.pipelines.rl_loop import RLPipeline
    from trajflow.pipelines.team import TeamPipeline, run_team_in_process
    from trajflow.tasks.team import RelayEnv


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
