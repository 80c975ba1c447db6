"""The team's settings (the `team:` section): several agents, each its own policy, playing the
episodes of a team environment (tasks/team.py; the loop: pipelines/team.py). Torch-free: a job
config is validated before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trajflow.settings import SettingError, check_settings, setting

SHARED = "shared"  # the learner's name when every agent shares one policy


@dataclass(frozen=True)
class TeamConfig:
    """A team of agents: which environment they play, whether each has its own policy, the
    staleness each learner is held at and what differs in an agent's learner. The rest of the
    config is every learner's (and the rollout's: group size, sampling, numerics, seed, steps)."""

    environment: str = setting(
        "relay", "the team environment: relay (two agents, lead and finish, write one answer of the run's task: "
        "lead its first token, finish the rest; both get the task's reward) or module:Class / file.py:Class of a "
        "TeamEnvironment, constructed with the run's task")
    share_policy: bool = setting(
        False, "one policy for every agent (parameter sharing: one learner, `shared`, trains every agent's rows) "
        "instead of one learner per agent")
    lags: dict[str, int] = setting(
        doc="per learner (an agent's name, or `shared`), how many steps its rollouts run ahead of its trainer: "
        "the staleness held exactly, at most max_staleness (e.g. {lead: 2, finish: 1}); a learner left out: 0",
        default_factory=dict)
    run_on: Literal["process", "ray"] = setting(
        "process", "process: every learner in this process, step after step, staleness held exactly at `lags` "
        "(studies that repeat; `--resume` exact); ray: each learner's engine and train step an actor with its "
        "own resources (its generator and trainer sections' num_cpus, num_gpus), asynchronous, staleness bounded by each "
        "learner's max_staleness, a learner whose process dies rebuilt while the others run on "
        "(pipelines/team_ray.py)")
    agents: dict[str, dict[str, Any]] = setting(
        doc="per agent, the keys of this config that differ for its learner (e.g. {finish: {optimizer: {lr: "
        "6.0e-4}}}); not with share_policy", default_factory=dict)
    role_prompts: dict[str, str] = setting(
        doc="per agent, text appended to the prompt in that agent's view only: its turns are sampled after it "
        "and its rows' prompt ends with it, so a shared policy is told which agent it acts as (e.g. {lead: ' lead:', "
        "finish: ' finish:'}); an agent left out: none", default_factory=dict)

    def __post_init__(self) -> None:
        check_settings(self)
        for name, lag in self.lags.items():
            if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
                raise SettingError("lags", f"TeamConfig.lags.{name}: expected an integer >= 0, got {lag!r}")
        if self.run_on == "ray" and self.lags:
            raise SettingError("lags", "TeamConfig.lags: staleness is held in one process (run_on: process); on Ray "
                                       "it is bounded by each learner's max_staleness")
        if self.share_policy and self.agents:
            raise SettingError("agents", "TeamConfig.agents: per-agent keys need a policy per agent "
                                         "(share_policy: false)")
        bad = {name: keys for name, keys in self.agents.items() if not isinstance(keys, dict)}
        if bad:
            raise SettingError("agents", f"TeamConfig.agents: each agent's keys are a mapping, got {bad}")
        bad = {name: text for name, text in self.role_prompts.items() if not isinstance(text, str)}
        if bad:
            raise SettingError("role_prompts", f"TeamConfig.role_prompts: each agent's role prompt is text, got {bad}")

    def learner_names(self, agents: tuple[str, ...]) -> list[str]:
        """The learners of a team of `agents`: one per agent, or `shared`."""
        return [SHARED] if self.share_policy else list(agents)
