"""A run that heals itself (issue #24), and the one line when it cannot."""

from __future__ import annotations

import pytest

from trajflow.jobs.errors import trainer_state_lost
from trajflow.operators.trainer.recovery import RESUME_HINT, TrainerStateLost

LINE = f"trainer worker 0 of 1 (node abc) was restarted after its process died; the state is lost: {RESUME_HINT}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("original", [False, True], ids=["wrapped", "original"])
def test_the_lost_line_survives_ray_datas_retry_advice(ray_session, original):
    """Ray Data appends its retry advice ("To change retry attempts ... `ray.data.DataContext`")
    to the message of the exception it re-raises — with `raise_original_map_exception`, to the
    TrainerStateLost itself; the line trajflow prints is still exactly the TrainerStateLost's."""
    from ray.data import DataContext

    def lost(batch):  # nested: shipped by value (the test module is not importable in Ray's workers)
        raise TrainerStateLost(LINE)

    ctx = DataContext.get_current()
    before = ctx.raise_original_map_exception
    ctx.raise_original_map_exception = original
    try:
        with pytest.raises(Exception) as caught:
            ray_session.data.range(1).map_batches(lost).materialize()
    finally:
        ctx.raise_original_map_exception = before
    assert "To change retry attempts" in str(caught.value)  # Ray's advice is in the error's text
    assert trainer_state_lost(caught.value) == LINE


def test_the_train_step_writes_the_lost_line_for_the_driver(tmp_path):
    """Ray Data can lose the error's text on its way to the driver (its metadata path raises
    `AssertionError: Above ray.get should raise an exception.`): the train step also hands the
    line to the job, which writes it into the run dir, where `trajflow run` reads it."""
    from trajflow.jobs.recorder import RunPaths, RunRecorder

    recorder = RunRecorder(run_dir=str(tmp_path), steps=8, checkpoint_every=3, keep_checkpoints=2,
                           save_all_versions=False, trajectory_log=True)
    recorder.on_lost(LINE)
    assert RunPaths(tmp_path).trainer_lost.read_text() == LINE + "\n"


def test_no_line_for_other_errors():
    assert trainer_state_lost(RuntimeError("To change retry attempts, configure ray.data.DataContext")) is None


def test_refusal_names_the_setting(tmp_path):
    """Past the budget, without a run dir or a trajectory log, a fault is not recovered: the
    reason names the setting."""
    from trajflow.jobs.recorder import RunRecorder
    from trajflow.operators.trainer.recovery import RecoveryConfig, refusal, replay_plan

    recorder = RunRecorder(run_dir=str(tmp_path), steps=8, checkpoint_every=3, keep_checkpoints=2,
                           save_all_versions=False, trajectory_log=True)
    assert refusal(RecoveryConfig(max_restarts=2), recorder, 2) is None
    assert "recovery.max_restarts (2)" in refusal(RecoveryConfig(max_restarts=2), recorder, 3)
    assert "recovery.max_restarts (0)" in refusal(RecoveryConfig(max_restarts=0), recorder, 1)
    assert "run dir" in refusal(RecoveryConfig(), None, 1)
    off = RunRecorder(run_dir=str(tmp_path), steps=8, checkpoint_every=3, keep_checkpoints=2,
                      save_all_versions=False, trajectory_log=False)
    assert "trajectory_log" in refusal(RecoveryConfig(), off, 1)
    with pytest.raises(RuntimeError, match="checkpoint_every"):
        replay_plan(recorder, 4)  # no checkpoint written yet


# -- the must-show runs (slow): `trajflow run` as a subprocess, trainer processes SIGKILLed ------
STEPS, CHECKPOINT_EVERY = 8, 3
SYNC = ["--set", f"steps={STEPS}", "--set", f"checkpoint_every={CHECKPOINT_EVERY}", "--set", "save_all_versions=false",
        "--set", "report_to=[]", "--set", "trainer.num_workers=2", "--set", "prompts_per_step=8",
        "--set", "group_size=4", "--set", "eval_every=0", "--set", "max_staleness=0",
        "--set", "inference_dtype=float32", "--set", "seed=0", "--no-progress"]
# columns left out of the exact comparison: timings, and process-local work (the version-switch
# count of a restarted process's scorer, which loads its versions afresh) that is not training math
TIMING = ("seconds", "time", "frac", "busy", "recovery/", "bytes", "node", "checkpoint", "version_switches")


def _exactness_gap(run_dir, first_step: int, steps: int) -> float:
    """max |old - inference log-prob| over the rows trained in steps first_step..steps-1."""
    import numpy as np
    import polars as pl

    rows = pl.concat([pl.read_parquet(run_dir / "trajectories" / f"step={s:06d}" / "part-0.parquet")
                      for s in range(first_step, steps)], how="diagonal_relaxed")
    rows = rows.filter(pl.col("filter_reason").is_null())
    assert rows.height > 0
    return max(float(np.abs(np.array(o) - np.array(i)).max(initial=0.0))
               for o, i in zip(rows["old_logprobs"].to_list(), rows["inference_logprobs"].to_list()))


def _recoveries(run_dir) -> list[dict]:
    """The recoveries `run.json` records for the run's last session, in order."""
    import json

    return json.loads((run_dir / "run.json").read_text())["sessions"][-1]["recoveries"]


def _recovered_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("trajflow: recovered: ")]


COMPARED_AT_LEAST = {"loss", "grad/norm", "reward/mean", "optimizer_steps", "version"}


def _assert_same_metrics(base, healed, at_least: set[str] = COMPARED_AT_LEAST) -> None:
    """Every numeric metric but the timings of the uninterrupted run `base` within 1e-6 in `healed`."""
    import numpy as np
    import polars as pl

    compared = [c for c in base.columns if base[c].dtype.is_numeric() and not any(t in c for t in TIMING)]
    assert at_least <= set(compared)
    for c in compared:
        np.testing.assert_allclose(healed[c].cast(pl.Float64).to_numpy(), base[c].cast(pl.Float64).to_numpy(),
                                   atol=1e-6, rtol=0, err_msg=c)


def _weights_gap(checkpoints) -> float:
    """max |a - b| over the weights of two checkpoints."""
    a, b = (c.model_state() for c in checkpoints)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_matches_uninterrupted(uninterrupted, run_dir) -> None:
    """The healed run's metrics (1e-6) and last checkpoint's weights (1e-5) are the uninterrupted run's."""
    import polars as pl

    from trajflow.engines import checkpoint as ckpt

    _assert_same_metrics(*(pl.read_parquet(d / "metrics.parquet") for d in (uninterrupted, run_dir)))
    assert _weights_gap([ckpt.latest_checkpoint(d / "checkpoints") for d in (uninterrupted, run_dir)]) <= 1e-5


def _checkpoint_before(step: int, recovery: dict) -> int:
    """The checkpoint a recovery at `step` rebuilt from: the last one at or before the step, or,
    for a kill at a checkpoint's own step, possibly the one before it (the checkpoint of version
    k is written as step k - 1 ends and may not be complete when the kill lands)."""
    import re

    last = step // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    used = int(re.search(r"rebuilt from checkpoint (\d+),", recovery["event"]).group(1))
    assert used == last or (step == last and used == last - CHECKPOINT_EVERY), recovery
    return used


# sync: a trainer worker killed while step 4 trains, then the train step's process at step 6 (not
# the last step: under load a kill may land one step late, and the run must still be running)
SYNC_KILLS = [("trainer_worker", 4), ("train_step", 6)]
# for runs killed more than once: a step here trains in 0.2 s, and under load a kill sent after
# step k - 1's metrics could land two steps late, two kills then healing as one event; 0.1 s of
# sleep per decode step (~0.6 s per step, no CPU, the same numbers) keeps each kill inside its step
SLOW_DECODE = ["--set", "simulate_decode_seconds=0.1"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", ["quickstart", "ppo"])
def test_killed_trainer_worker_and_train_step_are_rebuilt_and_the_run_matches_an_uninterrupted_one(
        tmp_path, chaos, config):
    """Sync mode, 2 trainer workers: a trainer worker SIGKILLed at step 4, then the (fused) train
    step's process at step 6; each heals (the last checkpoint, 3 then 6, + the steps since it
    retrained from the log) and the run ends with the uninterrupted run's per-step metrics (1e-6)
    and final weights (1e-5); every step trained once, no trajectory twice. The uninterrupted run
    goes alongside (its own Ray; the two share no state). `ppo`: the workers hold a critic too
    (a second learner), rebuilt from its own checkpoint the same way: its metrics and final
    weights match as well."""
    from concurrent.futures import ThreadPoolExecutor

    import polars as pl

    from trajflow.engines import checkpoint as ckpt

    run_dir, uninterrupted = tmp_path / "run", tmp_path / "base"
    args = [config, *SYNC, *SLOW_DECODE]
    with ThreadPoolExecutor(1) as pool:
        base_run = pool.submit(chaos.chaos_run, args, uninterrupted, [], tmp_path / "base.log")
        result = chaos.chaos_run(args, run_dir, SYNC_KILLS, tmp_path / "log")
        assert base_run.result().status == 0, base_run.result().output[-3000:]
    out = result.output
    assert result.status == 0 and result.killed == len(SYNC_KILLS), out[-3000:]
    # the step a kill lands in: k, or k - 1 when its metrics row had not yet left the killed
    # process (Ray Data then retries step k - 1 itself: nothing to retrain past its checkpoint),
    # or k + 1 when step k (a fraction of a second here) ended between the scan and the SIGKILL
    recoveries, lines = _recoveries(run_dir), _recovered_lines(out)
    assert len(recoveries) == len(SYNC_KILLS) and len(lines) == len(SYNC_KILLS), (recoveries, lines)
    steps = []
    for n, ((_, kill_at), recovery, line) in enumerate(zip(SYNC_KILLS, recoveries, lines), start=1):
        step = recovery["step"]
        assert kill_at - 1 <= step <= kill_at + 1, recoveries
        checkpoint = _checkpoint_before(step, recovery)
        assert (recovery["replayed_steps"], recovery["restarts"]) == (step - checkpoint, n), recoveries
        retrained = f"retrained steps {checkpoint}-{step - 1}" if step > checkpoint else "retrained no steps"
        assert f"at step {step}; rebuilt from checkpoint {checkpoint}, {retrained}" in line, lines
        steps.append(step)

    base, healed_metrics = (pl.read_parquet(d / "metrics.parquet") for d in (uninterrupted, run_dir))
    assert healed_metrics["step"].to_list() == list(range(STEPS))  # none repeated or skipped
    first, second = steps
    restarts = [0] * first + [1] * (second - first) + [2] * (STEPS - second)
    assert healed_metrics["recovery/restarts"].to_list() == restarts
    assert (base["recovery/restarts"] == 0).all()
    _assert_same_metrics(base, healed_metrics)
    final = [ckpt.latest_checkpoint(d / "checkpoints") for d in (uninterrupted, run_dir)]
    assert [c.version for c in final] == [STEPS, STEPS]
    assert _weights_gap(final) <= 1e-5
    if config == "ppo":
        assert {"critic/value_loss", "critic/explained_variance"} <= set(base.columns)
        assert _weights_gap([ckpt.Checkpoint(c.path / "critic", c.version) for c in final]) <= 1e-5
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}
    for kill in result.kills:
        print(f"{kill.kind}: {kill.seconds:.1f} s from the kill to step {kill.step}'s metrics")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_fsdp_worker_and_train_step_are_rebuilt_and_the_run_matches_an_uninterrupted_one(tmp_path, chaos):
    """The sharded case of the test above: FSDP x 2 (each worker holds half of the parameters,
    gradients and Adam moments), a trainer worker SIGKILLed at step 4, then the train step's
    process at step 6. Worker 0 leaves the dead group, reloads an unsharded model, shards it again
    in a new group with a new worker 1, and both load their shards of checkpoint 3 and retrain
    the steps since; the run ends with the uninterrupted sharded run's per-step metrics (1e-6)
    and final weights (1e-5)."""
    from concurrent.futures import ThreadPoolExecutor

    import polars as pl

    from trajflow.engines import checkpoint as ckpt

    args = ["quickstart", *SYNC, *SLOW_DECODE, "--set", "trainer.sharding=fsdp"]
    run_dir, uninterrupted = tmp_path / "run", tmp_path / "base"
    with ThreadPoolExecutor(1) as pool:
        base_run = pool.submit(chaos.chaos_run, args, uninterrupted, [], tmp_path / "base.log")
        result = chaos.chaos_run(args, run_dir, SYNC_KILLS, tmp_path / "log")
        assert base_run.result().status == 0, base_run.result().output[-3000:]
    assert result.status == 0 and result.killed == len(SYNC_KILLS), result.output[-3000:]
    recoveries, lines = _recoveries(run_dir), _recovered_lines(result.output)
    assert len(recoveries) == len(SYNC_KILLS) and len(lines) == len(SYNC_KILLS), (recoveries, lines)
    assert recoveries[0]["event"].startswith("trainer worker 1 of 2 (node "), recoveries
    for (_, kill_at), recovery in zip(SYNC_KILLS, recoveries):
        assert kill_at - 1 <= recovery["step"] <= kill_at + 1, recoveries
        checkpoint = _checkpoint_before(recovery["step"], recovery)
        assert f"rebuilt from checkpoint {checkpoint}," in recovery["event"], recoveries
    base, healed = (pl.read_parquet(d / "metrics.parquet") for d in (uninterrupted, run_dir))
    assert healed["step"].to_list() == list(range(STEPS))
    assert (healed["trainer/num_workers"] == 2).all()
    _assert_same_metrics(base, healed, COMPARED_AT_LEAST | {"trainer/dummy_passes"})
    final = [ckpt.latest_checkpoint(d / "checkpoints") for d in (uninterrupted, run_dir)]
    assert [c.version for c in final] == [STEPS, STEPS] and all(c.sharded for c in final)
    gap = _weights_gap(final)
    print(f"\nFSDP x 2 healed twice: final weights differ from the uninterrupted run's by {gap:.1e}")
    assert gap <= 1e-5
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}


@pytest.mark.timeout(120)
def test_a_killed_policy_store_is_one_line_naming_resume(ray_session):
    """A store that the run does not rebuild (recovery.max_restarts 0): the ActorDiedError a
    caller gets (wrapped, as Ray Data re-raises it) becomes one line."""
    import ray

    from trajflow.jobs.errors import store_lost
    from trajflow.pipelines.policy_store import RayStore

    store = RayStore.start(max_staleness=1, keep_history=True)
    assert store.latest_version() == -1
    store.kill()
    store.wait_until_dead()  # ray.kill returns before the actor is gone
    with pytest.raises(ray.exceptions.ActorDiedError) as caught:
        store.latest_version()
    try:
        raise RuntimeError("UDF failed to process a data block.") from caught.value
    except RuntimeError as wrapped:
        assert store_lost(wrapped) == f"the policy store's process died; the run stops: {RESUME_HINT}"
    assert store_lost(RuntimeError("some other actor died")) is None


# async: every version kept (a rebuilt store reads its window back); a trainer worker killed at
# step 2, before the first periodic checkpoint (3), the policy store at 4, the train step at 6
ASYNC = [{"max_staleness=0": "max_staleness=2", "save_all_versions=false": "save_all_versions=true"}.get(a, a)
         for a in SYNC] + ["--set", "strategy=snapshot", *SLOW_DECODE,
                           "--set", "old_logprob_forward=always"]  # the snapshots the store rebuild restores
ASYNC_KILLS = [("trainer_worker", 2), ("store", 4), ("train_step", 6)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_run_heals_a_killed_worker_store_and_train_step_and_snapshot_stays_exact(tmp_path, chaos):
    """max_staleness 2, snapshot, float32 inference, save_all_versions true; a trainer worker
    SIGKILLed at step 2 (rebuilt from the start checkpoint), the policy store at step 4 (rebuilt
    with the versions of its window, read back from disk), the train step's process at step 6:
    the run completes with every step once, no trajectory twice, each recovery recorded (one
    `recovered` line each), and old log-probs equal to the inference ones (the exactness
    invariant) on every row trained after each recovery."""
    run_dir = tmp_path / "run"
    result = chaos.chaos_run(["quickstart", *ASYNC], run_dir, ASYNC_KILLS, tmp_path / "log")
    assert result.status == 0 and result.killed == len(ASYNC_KILLS), result.output[-3000:]
    recoveries, lines = _recoveries(run_dir), _recovered_lines(result.output)
    assert [r["restarts"] for r in recoveries] == [1, 2, 3] and len(lines) == 3, (recoveries, lines)
    store = recoveries[1]
    assert store["event"].startswith("the policy store died; rebuilt with versions "), recoveries
    assert [line for line in lines if line.startswith("trajflow: recovered: the policy store")] == [lines[1]], lines
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}
    # every row trained after each recovery: the first recovery's range holds the others'
    gap = _exactness_gap(run_dir, min(r["step"] for r in recoveries), STEPS)
    assert gap <= 1e-5, (recoveries, gap)


# -- weight_sync collective with recovery at its default (issue #35) ------------------------------
# the trainer's process killed while step 4 trains; only weight_sync.method is set (recovery on)
COLLECTIVE_KILLS = [("train_step", 4)]


def _one_worker(mode: list[str]) -> list[str]:
    return [a.replace("trainer.num_workers=2", "trainer.num_workers=1") for a in mode]


ONLY_COLLECTIVE = ["--set", "weight_sync.method=collective"]
# one worker, sync, every version kept: the uninterrupted run two tests compare with (keeping the
# versions changes no number of the run)
ONE_WORKER_KEPT = ["quickstart", *[{"save_all_versions=false": "save_all_versions=true"}.get(a, a)
                                   for a in _one_worker(SYNC)]]


@pytest.fixture(scope="module")
def one_worker_uninterrupted(tmp_path_factory, chaos):
    """The run dir of an uninterrupted ONE_WORKER_KEPT run (one per module: its start-up is most of a test's time)."""
    path = tmp_path_factory.mktemp("one_worker_base")
    result = chaos.chaos_run(ONE_WORKER_KEPT, path / "run", [], path / "log")
    assert result.status == 0, result.output[-3000:]
    return path / "run"


def _healed_once(result, run_dir, kills: int = 1, ahead: int = 0) -> dict:
    """The run completed after its kills: one trainer recovery in run.json and one `recovered`
    line, from checkpoint 3 (the kill at step k lands in k or, when k - 1's metrics row had not yet
    left the killed process, k - 1; `ahead` 1: an asynchronous train step, its next batch queued,
    may also have finished k between the scan of the process tree and the SIGKILL); the
    recovery's entry."""
    assert result.status == 0 and result.killed == kills, result.output[-3000:]
    recoveries, lines = _recoveries(run_dir), _recovered_lines(result.output)
    assert len(recoveries) == 1 and len(lines) == 1, (recoveries, lines)
    (recovery,) = recoveries
    kill_at = result.kills[-1].step
    assert kill_at - 1 <= recovery["step"] <= kill_at + ahead, recovery
    assert "rebuilt from checkpoint 3" in recovery["event"], recovery
    return recovery


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_collective_sync_heals_a_killed_trainer_and_matches_an_uninterrupted_object_store_run(
        tmp_path, chaos, one_worker_uninterrupted):
    """Sync mode (every stage in the trainer's process, the readers too), only
    `weight_sync.method: collective` set: the train step's process SIGKILLed at step 4 is rebuilt
    from checkpoint 3 (its weights from the checkpoint: the store holds no tensors of a version)
    and serves its recovered version before the restarted generator's first batch; the run ends
    with old = inference (<= 1.5e-5) on every row trained after the recovery, and with the metrics
    and final weights of an uninterrupted object_store run (float32 readers: the same numbers)."""
    run_dir = tmp_path / "run"
    result = chaos.chaos_run(["quickstart", *_one_worker(SYNC), *ONLY_COLLECTIVE], run_dir, COLLECTIVE_KILLS,
                             tmp_path / "log")
    recovery = _healed_once(result, run_dir)
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}
    gap = _exactness_gap(run_dir, recovery["step"], STEPS)
    print(f"\ncollective sync, trainer killed at step 4: max |old - inference| {gap:.2e} after the recovery")
    assert gap <= 1.5e-5
    _assert_matches_uninterrupted(one_worker_uninterrupted, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_collective_async_heals_a_killed_generator_and_trainer_and_stays_exact(tmp_path, chaos):
    """max_staleness 1, `colocate: split` (generator, scorer and trainer in three processes), only
    `weight_sync.method: collective` set besides. The generator's process SIGKILLed at step 2: the trainer
    drops the lost reader, Ray restarts the process (one `restarted` line, an entry under the
    session's `restarts` in run.json) and its new receiver joins as a late joiner. The train
    step's process SIGKILLed at step 5: the generator's and the snapshot scorer's receivers keep
    the versions they hold and join the rebuilt trainer's server. The run completes with every
    step once and old = inference (<= 1.5e-5) on every row trained after the recovery."""
    import json

    run_dir = tmp_path / "run"
    args = [{"max_staleness=0": "max_staleness=1"}.get(a, a) for a in _one_worker(SYNC)]
    kills = [("generator", 2), ("train_step", 5)]
    result = chaos.chaos_run(["quickstart", *args, *ONLY_COLLECTIVE, "--set", "colocate=split"], run_dir, kills,
                             tmp_path / "log")
    recovery = _healed_once(result, run_dir, kills=2, ahead=1)
    restarted = [line for line in result.output.splitlines() if line.startswith("trajflow: restarted: ")]
    assert len(restarted) == 1 and restarted[0].startswith(
        "trajflow: restarted: the Generate process died; Ray restarted it"), result.output[-3000:]
    (entry,) = json.loads((run_dir / "run.json").read_text())["sessions"][-1]["restarts"]
    assert entry["process"] == "Generate" and entry["count"] == 1 and entry["step"] in (2, 3, 4), entry
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}
    gap = _exactness_gap(run_dir, recovery["step"], STEPS)
    print(f"\ncollective async, generator killed at step 2, trainer at 5: max |old - inference| {gap:.2e} "
          "after the recovery")
    assert gap <= 1.5e-5


# -- a policy store killed in sync mode; a LoRA run's store rebuilt from its adapters (issue #35) --
STORE_KILLS = [("store", 3)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_store_killed_in_sync_mode_is_rebuilt_and_the_run_matches_an_uninterrupted_one(
        tmp_path, chaos, one_worker_uninterrupted):
    """Sync mode (max_staleness 0: every stage in one process, the store holds the newest
    version only), every version kept: the store SIGKILLed at step 3 is rebuilt with the newest
    version read back from versions/; the run completes with the uninterrupted run's metrics
    (1e-6) and final weights (1e-5)."""
    run_dir = tmp_path / "run"
    result = chaos.chaos_run(ONE_WORKER_KEPT, run_dir, STORE_KILLS, tmp_path / "log")
    assert result.status == 0 and result.killed == 1, result.output[-3000:]
    (recovery,) = _recoveries(run_dir)
    assert recovery["event"].startswith("the policy store died; rebuilt with version "), recovery
    assert _recovered_lines(result.output) == [f"trajflow: recovered: {recovery['event']}"]
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}
    _assert_matches_uninterrupted(one_worker_uninterrupted, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lora_runs_store_is_rebuilt_from_its_adapters_and_snapshot_stays_exact(tmp_path, chaos):
    """A LoRA run (r 8, snapshot, max_staleness 2, every version kept: versions/ holds each
    version's PEFT adapter and the base once): the store SIGKILLed at step 3 is rebuilt with the
    versions of its window, adapters read back from disk; the run completes with every step once
    and old = inference (1e-5) on every row trained after the recovery."""
    run_dir = tmp_path / "run"
    args = ["quickstart", *_one_worker(ASYNC), "--set", "lora.r=8"]
    result = chaos.chaos_run(args, run_dir, STORE_KILLS, tmp_path / "log")
    assert result.status == 0 and result.killed == 1, result.output[-3000:]
    (recovery,) = _recoveries(run_dir)
    assert recovery["event"].startswith("the policy store died; rebuilt with versions "), recovery
    assert chaos.check_log(run_dir) == {"steps": list(range(STEPS)), "rows": STEPS * 32, "duplicate_ids": 0}
    assert (run_dir / "versions" / "base").is_dir() and not list((run_dir / "versions").glob("*.safetensors"))
    gap = _exactness_gap(run_dir, recovery["step"], STEPS)
    print(f"\nLoRA store killed at step 3: {recovery['event']}; max |old - inference| {gap:.2e} after it")
    assert gap <= 1e-5


# -- a policy store killed without its versions (a small run: 5 steps x 16 rows) ----------------
SMALL = 5
STORE = ["--set", f"steps={SMALL}", "--set", "checkpoint_every=3", "--set", "report_to=[]",
         "--set", "prompts_per_step=4", "--set", "group_size=4", "--set", "eval_every=0",
         "--set", "max_staleness=2", "--set", "inference_dtype=float32", "--set", "seed=0", "--no-progress",
         "--set", "strategy=snapshot", "--set", "save_all_versions=false"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_policy_store_without_its_versions_stops_naming_the_setting(tmp_path, chaos):
    """Versions not kept (save_all_versions false): the store killed at step 2 needs versions
    past checkpoint 0, so the run stops with one line naming save_all_versions (exit 1). (A
    killed dedicated scorer, restarted by Ray Data: tests/test_trainer_dp_jobs.py.)"""
    result = chaos.chaos_run(["quickstart", *STORE], tmp_path / "run", [("store", 2)], tmp_path / "log")
    assert result.killed == 1 and result.status == 1, result.output[-3000:]
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("trajflow: the policy store's process died and is not rebuilt (version"), last
    assert "save_all_versions: true keeps them" in last and "--resume" in last, last
    assert "will now abort" not in result.output, result.output[-3000:]  # Ray Data's own error line


def test_a_restarted_train_step_with_recovery_off_refuses_to_train_on_fresh_state(tmp_path):
    """`recovery.max_restarts: 0`: a train step that finds a trainer already registered in the
    store (Ray Data restarted its process) raises the one line naming `--resume` at its first
    step, instead of training on with a fresh optimizer. In one process, on the in-process store
    (the run-level kill with recovery off: tests/test_trainer_dp_jobs.py)."""
    import pyarrow as pa

    from trajflow.engines.models import load_model
    from trajflow.operators.trainer.recovery import RecoveryConfig
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.policy_store import InProcessStore
    from trajflow.pipelines.rl_loop import RLPipeline

    pipe = RLPipeline(PipelineConfig(steps=2, prompts_per_step=2, group_size=2, recovery={"max_restarts": 0}))
    store = InProcessStore(pipe.config.max_staleness, pipe.strategy.keep_history)
    store.publish(load_model(pipe.model_path).state_dict(), 0)
    assert store.claim_trainer() == 0  # the train step whose process died
    (train,) = [s for s in pipe.stages if s.name == "train"]
    assert train.kwargs["recovery"] == RecoveryConfig(max_restarts=0)
    step = train.fn(store=store, **train.kwargs)
    with pytest.raises(TrainerStateLost) as caught:
        step(pa.table({"rollout_step": pa.array([0, 0], pa.int64())}))
    line = str(caught.value)
    assert line.startswith("trainer worker 0 of 1 (node ") and " was restarted after its process died; " in line
    assert "recovery.max_restarts (0) is spent" in line and line.endswith(RESUME_HINT)


class _Disk:
    """A VersionArchive over a made-up run dir: the versions kept and the newest logged step."""

    def __init__(self, kept: list[int], logged: int) -> None:
        self.kept, self.logged = kept, logged

    def kept_versions(self, adapters: bool = False) -> list[int]:
        return self.kept

    def version_weights(self, version: int):
        raise AssertionError("not read by the plan")

    def last_logged_step(self) -> int:
        return self.logged


def test_a_dead_store_needs_the_window_and_names_the_setting_without_it():
    """The newest published version is the newest on disk or the one after the newest logged
    step; with history kept the window is it and the max_staleness before it."""
    from trajflow.pipelines.store_recovery import StoreConfig, needed_versions, refusal

    snapshot, newest_only = StoreConfig(2, True, max_restarts=3), StoreConfig(2, False, max_restarts=3)
    every = _Disk(kept=[0, 1, 2, 3, 4, 5], logged=4)  # version 5 written before it was published
    assert needed_versions(every, snapshot) == ([3, 4, 5], [])
    assert needed_versions(every, newest_only) == ([5], [])
    assert refusal(every, snapshot, 1) is None
    assert refusal(every, snapshot, 4) == "recovery.max_restarts (3) is spent"
    checkpoints = _Disk(kept=[0, 3], logged=3)  # save_all_versions off: checkpoints 0 and 3
    assert needed_versions(checkpoints, snapshot) == ([2, 3, 4], [2, 4])
    assert refusal(checkpoints, snapshot, 1) == "versions 2, 4 not on disk (save_all_versions: true keeps them)"
    assert refusal(_Disk(kept=[0, 3], logged=2), newest_only, 1) is None  # version 3 is a checkpoint


def test_a_rebuilt_store_keeps_its_restored_versions_until_they_leave_the_window():
    """Restored versions lost their pins with the old store: kept while in the staleness window
    (a fresh unpinned old version is freed at once), and the trainer count carries on."""
    from trajflow.pipelines.policy_store import PolicyStore

    store = PolicyStore(max_staleness=2, keep_history=True)
    for v in (3, 4, 5):
        store.put(f"w{v}", 1, v, restored=True)
    store.trainers_started = 2
    assert store.claim_trainer() == 2
    store.put("w6", 1, 6)
    assert sorted(store.versions) == [4, 5, 6]  # 3 < 6 - 2 left the window
    store.put("w7", 1, 7)
    assert sorted(store.versions) == [5, 7]  # 6, neither restored nor pinned, is freed as before


def test_a_restarted_stage_process_is_one_line_and_an_entry_in_run_json(tmp_path):
    """A metrics row carrying `recovery/restarted/<process>` (a generator's process restarted by
    Ray, counted by its stage group in the store) gives one console line per process and an
    entry under the session's `restarts` in run.json; a row without one, nothing."""
    import json

    from trajflow.jobs.recorder import RunPaths, write_state
    from trajflow.jobs.run import record_restarts

    paths = RunPaths(tmp_path)
    write_state(paths, sessions=[{"first_step": 0, "state": "running"}])
    assert record_restarts(paths, {"step": 2, "recovery/restarted/Generate": 0.0}) == []
    lines = record_restarts(paths, {"step": 3, "recovery/restarted/Generate": 1.0,
                                    "recovery/restarted/Reward+Advantage+Filter+OldLogprobs": 2.0})
    assert lines == ["the Generate process died; Ray restarted it and Ray Data retried the batch it held "
                     "(noticed at step 3)",
                     "the Reward+Advantage+Filter+OldLogprobs process died (2 times); Ray restarted it and Ray "
                     "Data retried the batch it held (noticed at step 3)"]
    restarts = json.loads(paths.state.read_text())["sessions"][-1]["restarts"]
    assert [(r["process"], r["count"], r["step"]) for r in restarts] == [
        ("Generate", 1, 3), ("Reward+Advantage+Filter+OldLogprobs", 2, 3)]


@pytest.mark.timeout(300)
def test_a_lora_store_is_rebuilt_from_checkpoints_holding_adapters(ray_session, tmp_path):
    """A LoRA run keeps only checkpoints (save_all_versions off): a store that dies is rebuilt
    from the checkpoints' adapters, the window of a snapshot run (versions 2 and 3 at
    max_staleness 1); a reader's client of the dead store finds the new one and reads each
    version's adapter bitwise (every reader merges it into the base, as live)."""
    import torch

    from trajflow.engines import checkpoint as ckpt
    from trajflow.engines import lora
    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.jobs.recorder import RunPaths, RunRecorder
    from trajflow.pipelines.policy_store import RayStore
    from trajflow.pipelines.store_recovery import RECONNECT_SECONDS, StoreConfig, needed_versions, rebuild, refusal

    settings = lora.LoraConfig(r=8)
    model = lora.wrap(load_model(WARM_START_DIR), settings)
    adapters = {}
    for version in (1, 2, 3):  # checkpoints of versions 1..3, each its own adapter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.fill_(0.01 * version)
        adapters[version] = {k: v.clone() for k, v in lora.adapter_payload(model, settings.scaling).items()}
        with ckpt.writing_checkpoint(RunPaths(tmp_path).checkpoints, version) as tmp:
            ckpt.write_replica(tmp, adapters[version], weights_file=ckpt.ADAPTER_FILE)
    recorder = RunRecorder(run_dir=str(tmp_path), steps=4, checkpoint_every=1, keep_checkpoints=5,
                           save_all_versions=False, trajectory_log=True)
    spec = StoreConfig(max_staleness=1, keep_history=True, max_restarts=3, adapters=True)
    assert recorder.kept_versions(adapters=True) == [1, 2, 3] and recorder.kept_versions() == [1, 2, 3]
    assert needed_versions(recorder, spec) == ([2, 3], []) and refusal(recorder, spec, 1) is None

    store = RayStore.start(1, True, reconnect_seconds=RECONNECT_SECONDS)
    reader = RayStore(store.actor, store.name, store.reconnect_seconds)  # what a generator holds
    for version in (1, 2, 3):
        store.publish(adapters[version], version)
    store.kill()
    store.wait_until_dead()
    rebuilt, held = rebuild(store, recorder, spec, restarts=1)
    try:
        assert held == [2, 3] and rebuilt.generation == 1
        for version in (2, 3):  # the old client reconnects to the next generation
            got_version, got = reader.weights(version)
            assert got_version == version and lora.is_adapter(got)
            assert all(torch.equal(got[k], adapters[version][k]) for k in adapters[version])
        assert reader.generation == 1 and rebuilt.stats().counters["recovery/store_rebuilds"] == 1
    finally:
        rebuilt.kill()
