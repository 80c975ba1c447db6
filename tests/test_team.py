"""Team episodes: several agents, each its own policy (tasks/team.py, operators/generate_team.py,
pipelines/team.py, pipelines/team_ray.py), on the warm start of addition and the relay
environment: in one process, and on Ray (the tests that say so)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pytest

from trajflow.operators.old_logprobs import OldLogprobsAtBehaviorVersion
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.pipelines.team import TeamPipeline, iter_team_in_process, new_store
from trajflow.schemas import SchemaError, validate
from trajflow.tasks.addition import AdditionTask
from trajflow.tasks.base import Prompt
from trajflow.tasks.team import RelayEnv, is_team_environment

pytestmark = pytest.mark.timeout(300)

BASE = dict(task="addition", steps=6, prompts_per_step=8, group_size=4, seed=1, max_staleness=2,
            inference_dtype="float32", strategy="snapshot", old_logprob_forward="always",
            drop_zero_variance_groups=False, sampling=dict(max_new_tokens=6))
LAGS = {"lead": 2, "finish": 1}


def relay() -> RelayEnv:
    return RelayEnv(AdditionTask())


def own_gap(batch: pa.Table) -> float:
    """max |old - inference| over the rows' loss tokens (the agent's own)."""
    gaps = [abs(o - i) for olds, infs, mask in zip(batch["old_logprobs"].to_pylist(),
                                                 batch["inference_logprobs"].to_pylist(),
                                                 batch["loss_mask"].to_pylist())
            for o, i, m in zip(olds, infs, mask) if m]
    return max(gaps)


def test_relay_turns_and_team_reward():
    env = relay()
    assert is_team_environment(env) and env.agents == ("lead", "finish")
    episode = env.reset(Prompt("p0", "12+34=", "46"))
    assert episode.next_agent() == "lead"
    step = episode.step("lead", "4", stopped=False)
    assert not step.done and step.rewards == {"lead": 0.0, "finish": 0.0}
    assert episode.next_agent() == "finish"
    step = episode.step("finish", "6", stopped=True)
    assert step.done and step.rewards == {"lead": 1.0, "finish": 1.0}
    silent = env.reset(Prompt("p2", "3+4=", "7"))
    silent.step("lead", "", stopped=False)  # a lead token that decodes to nothing: still one turn each
    assert silent.next_agent() == "finish"
    short = env.reset(Prompt("p1", "3+4=", "7"))
    step = short.step("lead", "7", stopped=True)  # the lead's turn ends the answer: no finisher turn
    assert step.done and step.rewards["finish"] == 1.0


def test_schema_refuses_a_loss_token_of_another_agent():
    row = dict(trajectory_id="t/lead", group_id="g/lead", prompt_id="p", prompt_tokens=[1], response_tokens=[5, 6],
               loss_mask=[True, True], inference_logprobs=[-0.1, -0.2], versions=[0, 0], old_logprobs=None,
               finish_reason="stop", reward=1.0, advantage=None, agent="lead", token_agents=["lead", "finish"])
    from trajflow.schemas import conform

    table = conform(pa.Table.from_pylist([row]))
    with pytest.raises(SchemaError, match="token_agents.*produced by 'finish'"):
        validate(table)
    validate(conform(pa.Table.from_pylist([{**row, "loss_mask": [True, False]}])))


@pytest.fixture(scope="module")
def independent():
    """Two independent policies, lead at lag 2 and finish at lag 1 with a larger lr (policies
    moving at different rates), float32: each step's batches, rows, and finish's weights by version."""
    config = PipelineConfig(**BASE)
    team = TeamPipeline.of(config, relay(), agent_configs={"finish": PipelineConfig(**BASE, optimizer={"lr": 6e-4})})
    stores = {name: new_store(pipe) for name, pipe in team.learners.items()}
    steps, finish_weights = [], {}
    for batches, row in iter_team_in_process(team, LAGS, stores=stores):
        steps.append((batches, row))
        version, weights = stores["finish"].weights()
        finish_weights[version] = {k: t.clone() for k, t in weights.items()}
    return team, steps, finish_weights


def test_exact_old_logprobs_per_agent_at_held_staleness(independent):
    team, steps, _ = independent
    assert [row["step"] for _, row in steps] == list(range(BASE["steps"]))
    for batches, row in steps:
        k = row["step"]
        for agent in ("lead", "finish"):
            batch = batches[agent]
            validate(batch)
            assert set(batch["agent"].to_pylist()) == {agent}
            assert batch.num_rows == BASE["prompts_per_step"] * BASE["group_size"]
            assert own_gap(batch) < 1e-5, (k, agent)  # pi_old with its own agent's weights, own version
            assert row[f"{agent}/staleness/max"] == min(k, LAGS[agent]), (k, agent)
            assert row[f"{agent}/version"] == k
            # another agent's tokens and the environment's are context: never a loss token
            for producers, mask in zip(batch["token_agents"].to_pylist(), batch["loss_mask"].to_pylist()):
                assert all(p == agent for p, m in zip(producers, mask) if m)
        lead, finish = (batches[a]["response_tokens"].to_pylist() for a in ("lead", "finish"))
        assert lead == finish  # one row per agent of the same episodes
    assert "lead/loss" in steps[-1][1] and "finish/loss" in steps[-1][1]


def test_scoring_with_the_other_agents_weights_is_detected(independent):
    """The same invariant fails when a lead's tokens are scored with the finisher's weights at the
    same version numbers: what an old log-prob at the wrong agent's weights looks like."""
    team, steps, finish_weights = independent
    batch = steps[-1][0]["lead"]  # lead's tokens of version 3 (lag 2 at step 5)
    versions = sorted({v for vs, m in zip(batch["versions"].to_pylist(), batch["loss_mask"].to_pylist())
                       for v, keep in zip(vs, m) if keep})
    assert versions == [BASE["steps"] - 1 - LAGS["lead"]]
    wrong = InProcessStore(2, keep_history=True)
    wrong.publish(finish_weights[versions[0]], versions[0])
    lead = team.learners["lead"]
    s = lead.settings
    scorer = OldLogprobsAtBehaviorVersion(wrong, lead.model_path, lead.sampling, skip_filtered=False,
                                          numerics=s.numerics, torch_threads=1, weight_sync=s.weight_sync)
    assert own_gap(batch) < 1e-5
    assert own_gap(scorer(batch)) > 1e-3


def test_shared_policy_trains_both_agents_rows_in_one_learner():
    config = PipelineConfig(**{**BASE, "steps": 3})
    team = TeamPipeline.of(config, relay(), share_policy=True)
    assert list(team.learners) == ["shared"] and set(team.learner_of.values()) == {"shared"}
    rows = []
    for batches, row in iter_team_in_process(team, {"shared": 1}, eval_every=3, eval_prompts=32):
        batch = batches["shared"]
        assert set(batch["agent"].to_pylist()) == {"lead", "finish"}
        assert own_gap(batch) < 1e-5
        rows.append(row)
    last = rows[-1]
    assert last["lead/staleness/max"] == last["finish/staleness/max"] == 1  # one learner, one lag
    assert last["lead/version"] == last["finish/version"] == 2
    assert last["shared/rows"] == 2 * BASE["prompts_per_step"] * BASE["group_size"]
    # the shared learner's mask, clip and mismatch split by agent: the step's own are their mix
    for row in rows:
        tokens = {a: row[f"{a}/loss_tokens"] for a in ("lead", "finish")}
        for key in ("clip/frac", "mask/token_kept_frac", "mismatch/k1"):
            mixed = sum(row[f"{a}/{key}"] * n for a, n in tokens.items()) / sum(tokens.values())
            assert mixed == pytest.approx(row[f"shared/{key}"], abs=1e-6), key
        assert max(row["lead/mismatch/max_abs_log_rd"], row["finish/mismatch/max_abs_log_rd"]) == \
            row["shared/mismatch/max_abs_log_rd"]
    assert any(row["lead/clip/frac"] != row["finish/clip/frac"] for row in rows[1:])
    assert 0.0 <= last["heldout/lead"] <= 1.0 and last["heldout/lead"] == last["heldout/finish"]  # a team reward


def test_role_prompts_tell_a_shared_policy_which_agent_it_acts_as(tiny):
    """Each agent's turns are sampled after its own role prompt and its rows' prompt ends with it:
    the old log-probs scored on those rows equal the inference ones, and scored without the role
    prompt (the context the turns were not sampled in) they do not."""
    _, tokenizer = tiny
    roles = {"lead": " lead:", "finish": " finish:"}
    config = PipelineConfig(**{**BASE, "steps": 2})
    team = TeamPipeline.of(config, relay(), share_policy=True, role_prompts=roles)
    steps = list(iter_team_in_process(team, {"shared": 1}))
    for batches, _ in steps:
        batch = batches["shared"]
        # float32, but the role prompts are text the warm start never saw: its tokens' log-probs
        # are larger in magnitude, and so is float32's rounding (up to 2.3e-5 seen, 8e-6 without)
        assert own_gap(batch) < 1e-4
        rows = {a: batch.filter(pa.compute.equal(batch["agent"], a)) for a in roles}
        for agent, text in roles.items():
            role = tokenizer.encode(text, add_special_tokens=False)
            assert all(p[-len(role):] == role for p in rows[agent]["prompt_tokens"].to_pylist())
        assert rows["lead"]["response_tokens"].to_pylist() == rows["finish"]["response_tokens"].to_pylist()
    finish = steps[0][0]["shared"].filter(pa.compute.equal(steps[0][0]["shared"]["agent"], "finish"))
    n = len(tokenizer.encode(roles["finish"], add_special_tokens=False))
    stripped = finish.set_column(finish.schema.get_field_index("prompt_tokens"), "prompt_tokens",
                                 pa.array([p[:-n] for p in finish["prompt_tokens"].to_pylist()], pa.list_(pa.int32())))
    shared = team.learners["shared"]
    # a new store: version 0, the weights step 0 was sampled with (lag 1)
    scorer = OldLogprobsAtBehaviorVersion(new_store(shared), shared.model_path, shared.sampling, skip_filtered=False,
                                          numerics=shared.settings.numerics, torch_threads=1,
                                          weight_sync=shared.settings.weight_sync)
    assert own_gap(scorer(stripped)) > 1e-2
    with pytest.raises(ValueError, match="team.role_prompts: \\['judge'\\] are not agents"):
        TeamPipeline.of(config, relay(), role_prompts={"judge": "?"})


def test_team_pipeline_refuses_what_it_cannot_run():
    config = PipelineConfig(**BASE)
    with pytest.raises(ValueError, match="lags: lead's 3 must be in"):
        next(iter_team_in_process(TeamPipeline.of(config, relay()), {"lead": 3}))
    with pytest.raises(ValueError, match="eval_every"):
        TeamPipeline.of(PipelineConfig(**BASE, eval_every=2), relay())


def test_team_job_writes_a_run_dir_per_learner(tmp_path, capsys):
    """`trajflow run relay`: the team's rows, and per learner a single-agent run dir (its config
    with its agent's keys, trajectories with the team columns, checkpoints)."""
    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.recorder import RunPaths, read_metrics
    from trajflow.jobs.run import resume_job, run_job
    from trajflow.pipelines.replay import load_trajectories

    config = load_job_config("relay", [f"run_dir={tmp_path / 'run'}", "steps=2", "prompts_per_step=8", "group_size=4",
                                       "eval_every=2", "eval_prompts=32", "team.agents.finish.optimizer.lr=6.0e-4"])
    root = run_job(config, progress=True)
    out = capsys.readouterr().out
    assert "team: relay, agents lead, finish" in out and "held-out" in out
    metrics = read_metrics(RunPaths(root))
    assert metrics["step"].to_list() == [0, 1]
    assert metrics["lead/staleness/max"].to_list() == [0, 1] and metrics["finish/version"].to_list() == [0, 1]
    assert {"lead/loss", "finish/loss", "heldout/lead", "heldout/lead_start"} <= set(metrics.columns)
    for agent, lr in (("lead", 3.0e-4), ("finish", 6.0e-4)):
        own = root / "agents" / agent
        learner = load_job_config(own / "config.yaml")
        assert learner.team is None and learner.optimizer.lr == lr
        logged = load_trajectories(own / "trajectories")
        assert sorted(logged) == [0, 1]
        for table in logged.values():
            validate(table.drop_columns(["trainer_version"]))
            assert set(table["agent"].to_pylist()) == {agent}
        assert any((own / "checkpoints").iterdir())
    from trajflow.jobs.report import comparison_table, load_runs

    runs = load_runs([root])  # a team's report: split by agent, each learner's run
    assert sorted(runs) == ["finish", "lead"] and comparison_table(runs)["run"].to_list() == ["finish", "lead"]
    resume_job(root)  # a finished run: nothing to do
    assert "already finished" in capsys.readouterr().out


@pytest.mark.parametrize("change, key", [
    ({"partial_rollout": True}, "partial_rollout"),
    ({"team": {"lags": {"lead": 3}}}, "team.lags.lead"),
    ({"team": {"share_policy": True, "agents": {"lead": {"seed": 2}}}}, "agents"),
    ({"team": {"environment": "nowhere"}}, "team.environment"),
    ({"team": {"share_policy": True, "lags": {"lead": 1}}}, "team.lags"),
    ({"team": {"role_prompts": {"lead": 3}}}, "role_prompts"),
])
def test_team_config_refuses_by_key(change, key):
    from trajflow.jobs.config import JobConfigError, build_job_config, load_job_config, resolve_config_path, safe_yaml

    data, change = safe_yaml(resolve_config_path("relay").read_text()), dict(change)
    data = {**data, "team": {**data["team"], **change.pop("team", {})}, **change}
    with pytest.raises(JobConfigError, match=key.replace(".", r"\.")):
        build_job_config(data)
    assert load_job_config("relay").team is not None


def test_rlpipeline_refuses_a_team_config():
    from trajflow.pipelines.rl_loop import RLPipeline

    with pytest.raises(ValueError, match="team: a team of agents runs with"):
        RLPipeline(PipelineConfig(**BASE, team={"environment": "relay"}))


def test_a_killed_team_run_resumes_every_agent_exactly(tmp_path):
    """SIGKILL a team run (lead at lag 2, finish at lag 1) after step 3; `--resume` continues every
    learner from its checkpoint at version 4, the rollouts in flight sampled with the versions they
    had: every step's numbers and both learners' final weights and optimizer state equal the
    uninterrupted run's."""
    import os
    import signal
    import subprocess
    import sys

    import polars as pl
    from safetensors.torch import load_file

    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.run import resume_job, run_job

    sets = ["steps=6", "prompts_per_step=8", "group_size=4", "eval_every=0", "checkpoint_every=2",
            "max_staleness=2", "team.lags.lead=2", "team.lags.finish=1"]
    base = run_job(load_job_config("relay", [*sets, f"run_dir={tmp_path / 'base'}"]), progress=False)
    command = [sys.executable, "-m", "trajflow.jobs.cli", "run", "relay", "--run-dir", str(tmp_path / "killed"),
               *(arg for s in sets for arg in ("--set", s))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in process.stdout:
            if line.startswith("step 3"):
                os.killpg(process.pid, signal.SIGKILL)
                break
    finally:
        process.wait(timeout=120)
    assert process.returncode == -signal.SIGKILL
    killed = resume_job(tmp_path / "killed", progress=False)
    a, b = (pl.read_parquet(root / "metrics.parquet") for root in (base, killed))
    assert b["step"].to_list() == list(range(6))
    for key in ("lead/loss", "finish/loss", "lead/reward/mean", "finish/clip/frac", "lead/staleness/max"):
        assert a[key].to_list() == b[key].to_list(), key
    for agent in ("lead", "finish"):
        for name in ("model.safetensors", "optimizer.safetensors"):
            x, y = (load_file(root / "agents" / agent / "checkpoints" / "step-000006" / name) for root in (base, killed))
            assert x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x), (agent, name)


def test_team_on_ray_bounds_each_agents_staleness_and_stays_exact(ray_session, tmp_path):
    """`team.run_on: ray`: the generator and each learner an actor, asynchronous; each agent's
    realized staleness within its own max_staleness (lead 2, finish 1) and every loss token's old
    log-prob its own agent's, at its own version (float32: within 1e-5 of the inference one)."""
    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.recorder import RunPaths, read_metrics
    from trajflow.jobs.run import run_job

    sets = ["steps=5", "prompts_per_step=8", "group_size=4", "eval_every=0", "max_staleness=2",
            "inference_dtype=float32", "old_logprob_forward=always", "save_all_versions=false",
            "team.run_on=ray", "team.lags={}", "team.agents.finish.max_staleness=1",
            "team.agents.finish.generator.num_cpus=0.25", f"run_dir={tmp_path / 'run'}"]
    root = run_job(load_job_config("relay", sets), progress=False)
    metrics = read_metrics(RunPaths(root))
    assert metrics["step"].to_list() == list(range(5))
    for agent, bound in (("lead", 2), ("finish", 1)):
        staleness = metrics[f"{agent}/staleness/max"].to_list()
        assert max(staleness) <= bound and staleness[0] == 0, (agent, staleness)
        assert metrics[f"{agent}/mismatch/max_abs_log_rd"].max() < 1e-5, agent
        assert metrics[f"{agent}/version"].to_list() == list(range(5))
        assert (root / "agents" / agent / "trajectories").is_dir()


# a team on Ray with every bound 0 samples rollout r with version r of every learner, as the
# one-process loop at lag 0 does: the same numbers, so a healed or resumed Ray run is compared
# with one uninterrupted run in this process
BOUND_0 = ["steps=6", "prompts_per_step=8", "group_size=4", "eval_every=0", "checkpoint_every=2", "max_staleness=0",
           "team.lags={}"]
# what may differ between the runs: timings, memory accounting (each store's own), where it ran,
# the recovery's own entries
# what the processes did, not what the run computed: timings, bytes, and the old log-prob scorer's
# version loads (a store counter: a step a killed learner had scored is scored again by its
# replacement, as test_recovery.py's TIMING also leaves out)
NOT_COMPARED = ("seconds", "busy", "bytes", "recovery/", "trainer_node", "time", "version_switches")


@pytest.fixture(scope="module")
def bound_0_in_process(tmp_path_factory):
    from trajflow.jobs.config import load_job_config
    from trajflow.jobs.run import run_job

    return run_job(load_job_config("relay", [*BOUND_0, f"run_dir={tmp_path_factory.mktemp('base') / 'run'}"]),
                   progress=False)


def assert_same_team_run(base, other) -> None:
    """Every step's numbers (but NOT_COMPARED) and both learners' final weights and optimizer state
    equal, bit for bit."""
    import polars as pl
    from safetensors.torch import load_file

    a, b = (pl.read_parquet(root / "metrics.parquet") for root in (base, other))
    assert b["step"].to_list() == list(range(6))
    keys = [k for k in a.columns if a[k].dtype.is_numeric() and not any(n in k for n in NOT_COMPARED)]
    assert {"lead/loss", "finish/loss", "lead/reward/mean", "finish/clip/frac"} <= set(keys) <= set(b.columns)
    for key in keys:
        assert a[key].to_list() == b[key].to_list(), key
    for agent in ("lead", "finish"):
        for name in ("model.safetensors", "optimizer.safetensors"):
            x, y = (load_file(root / "agents" / agent / "checkpoints" / "step-000006" / name) for root in (base, other))
            assert x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x), (agent, name)


def test_on_ray_a_killed_learner_heals_and_a_run_stopped_by_a_killed_engine_resumes(ray_session, tmp_path,
                                                                                     bound_0_in_process):
    """A team run on Ray: one learner's actor SIGKILLed after step 1 heals while the other runs on
    (a new actor rebuilds that learner from its last checkpoint and trajectory log); an engine
    actor SIGKILLed after step 3 ends the run with one line, and `--resume` starts every learner
    from its checkpoint (store, weights, optimizer and strategy state). Every step's numbers and
    both learners' final state equal the uninterrupted run's."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from trajflow.jobs.recorder import RunPaths, read_metrics
    from trajflow.jobs.run import resume_job

    command = [sys.executable, "-m", "trajflow.jobs.cli", "run", "relay", "--run-dir", str(tmp_path / "run"),
               *(arg for s in [*BOUND_0, "team.run_on=ray"] for arg in ("--set", s))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)

    def kill(title: str) -> None:
        found = [p for p in psutil.Process(process.pid).children(recursive=True) if title in " ".join(p.cmdline())]
        assert len(found) == 2, title  # one per learner
        found[0].kill()

    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if line.startswith("step 1"):
                kill("LearnerActor")
            if line.startswith("step 3"):
                kill("EngineActor")
        process.wait(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = "".join(output)
    assert process.returncode == 1, text
    assert any(line.startswith("trajflow: recovered learner") for line in output), text
    assert "process of the team's rollout (an engine or the episodes' actor) died by step" in output[-1], text
    assert "Traceback" not in text and "A worker died" not in text  # Ray's notices: in RUN/workers.log
    healed = read_metrics(RunPaths(tmp_path / "run"))
    restarts = (healed["lead/recovery/restarts"] + healed["finish/recovery/restarts"]).to_list()
    assert restarts[:2] == [0, 0] and restarts[-1] == 1  # one learner rebuilt, once
    assert_same_team_run(bound_0_in_process, resume_job(tmp_path / "run", progress=False))


def test_team_on_ray_refuses_more_cpus_than_the_cluster_has():
    from trajflow.pipelines.team_ray import check_resources

    config = PipelineConfig(**BASE)
    finish = PipelineConfig(**BASE, trainer={"num_cpus": 2}, generator={"num_cpus": 1})
    team = TeamPipeline.of(config, relay(), agent_configs={"finish": finish})
    check_resources(TeamPipeline.of(config, relay()), {"CPU": 2.0})  # each agent's engine and trainer: 0.5
    with pytest.raises(ValueError, match=r"num_cpus: the team's actors need 4 \(lead's generator 0.5, lead's "
                                         r"trainer 0.5, finish's generator 1, finish's trainer 2\) and Ray has 2"):
        check_resources(team, {"CPU": 2.0})
