"""Train step: one step of the policy per rollout step (the pipeline's last operator).

Batch in: all rows of one rollout step (trajectories with rewards, advantages, filter reasons and,
for the exact strategies, old log-probs). Batch out: one metrics row.

The step, top to bottom:
1. Staleness bound where tokens are trained: lag = trainer version - token version. Tokens with
   lag > max_staleness are removed from the loss and counted (rows left with no token: reason
   `over_stale`). Admission already bounds lag; this makes the bound hold whatever Ray Data does.
2. The update (operators/trainer/replica.py `TrainerReplica.update`), on each of `num_workers`
   data-parallel workers (operators/trainer/plan.py shares the rows out; gradients are summed and
   the loss normalised over all workers, so N workers give the one-worker update; each worker a
   full replica, or 1/N of the model with `trainer.sharding: fsdp`, operators/trainer/fsdp.py).
   An update whose gradient is not finite is skipped and counted (`grad/nonfinite_skipped`).
3. The strategy's after-step hook (EWMA's reset, M2PO's metrics) on every worker with the step's
   global diagnostics; the trainer now holds version k + 1.
4. The after-step services (operators/trainer/services.py: publish, held-out evaluation, store
   statistics), then the job's `on_step` hook — all in this process.

`TrainStep` is worker 0 and a `TrainerReplica` itself; it reaches workers 1..N-1 through a
worker group (operators/trainer/group.py; `workers=`: threads of this process, or Ray actors from
the pipeline, pipelines/ray/trainer_group.py). The trainer's state lives only in these
processes: a train step that finds it was restarted (the store already registered a trainer) or
loses a worker rebuilds that state from the last checkpoint and the trajectory log
(operators/trainer/recovery.py, up to `recovery.max_restarts` times), else stops with
`TrainerStateLost` (`--resume` restores the state from the last checkpoint) rather than training
on with a fresh optimizer.

Public for the jobs layer: `version`, `strategy`, `full_weights()` (the current version's full
tensors, one at a time: every worker takes part under FSDP), `publish()`, `save_version()` (the
version as kept on disk), `save_checkpoint()` / `restore()` (weights, optimizer and strategy state
on every worker), `unsharded_policy()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.engines import checkpoint as ckpt
from trajflow.engines.models import load_model
from trajflow.operators.contracts.stage import ClassRef, loaded
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.reward import FailedRewardSteps
from trajflow.operators.trainer.accounting import apply_staleness_bound, step_metrics
from trajflow.operators.contracts.store import CRITIC, POLICY
from trajflow.operators.trainer.addresses import serving_host
from trajflow.operators.trainer.collective import Collective, this_node
from trajflow.operators.trainer.correction import (
    StepBatch,
    agent_diagnostics,
    merge_outputs,
    old_column,
    step_diagnostics,
)
from trajflow.operators.trainer.critic import critic_inputs, train_time_columns
from trajflow.operators.trainer.group import InProcessGroup, Pending, WorkerGroup
from trajflow.operators.trainer.plan import plan_shards
from trajflow.operators.trainer.recovery import (
    RECOVERY_PREFIX,
    RESUME_HINT,
    Fault,
    RecoveryConfig,
    event_metrics,
    refusal,
    replay_plan,
    TrainerStateLost,
)
from trajflow.operators.trainer.replica import ShardWork, TrainerReplica
from trajflow.operators.trainer.services import AfterStep
from trajflow.operators.trainer.spec import StepHooks, TrainStepConfig
from trajflow.operators.trainer.state import learner_dir
from trajflow.operators.trainer.weight_server import WeightServer
from trajflow.operators.trainer.weight_sync import WeightSyncConfig
from trajflow.schemas import conform
from trajflow.schemas.columns import LOSS_OLD_COLUMN, replace_column

NO_METRICS = pa.table({})  # a step that trains nothing here emits no metrics row


class TrainStep(TrainerReplica):
    """Worker 0: the pipeline's operator. Workers 1..N-1 are built from the same `spec` by a
    `workers` group (operators/trainer/group.py; the Ray pipeline passes its own)."""

    # a restart of its process is a recovery, reported as one (`recovery/event`), not as a
    # restarted stage process (pipelines/colocation.py)
    recovers_itself = True

    def __init__(self, store: PolicyStoreClient, spec: TrainStepConfig, max_staleness: int,
                 after_step: Sequence[AfterStep], hooks: StepHooks,
                 recovery: RecoveryConfig = RecoveryConfig(), failed_rewards: FailedRewardSteps | None = None,
                 weight_sync: WeightSyncConfig = WeightSyncConfig(), reader_dtypes: Sequence[str] = (),
                 workers: type[WorkerGroup] | ClassRef = InProcessGroup) -> None:
        trainer = spec.trainer
        workers = loaded(workers)  # the Ray pipeline names its group class (pipelines/ray/trainer_group.py)
        self.failed_rewards = failed_rewards
        self.workers = workers
        # One train step per store: a second one means this process replaced a trainer that died
        # (Ray Data restarts actors and retries the step), and that trainer's optimizer and
        # strategy state died with it (its published weights too). Rebuild it as it starts
        # (operators/trainer/recovery.py), or refuse to train on.
        self.node = this_node()
        self.group: WorkerGroup | None = None
        self.weight_server: WeightServer | None = None
        self.lost: TrainerStateLost | None = None
        self.recovery, self.source, self.fault, self.on_lost = recovery, hooks.source, None, hooks.on_lost
        self.recovered: dict = {}  # a recovery's metrics, for the next step trained
        self.restarts = store.claim_trainer()
        if self.restarts > 0:
            what = (f"trainer worker 0 of {trainer.num_workers} (node {self.node[:12]}) was restarted after "
                    "its process died")
            why = refusal(recovery, hooks.source, self.restarts)
            if why is not None:
                self.lost = TrainerStateLost(f"{what}; the trainer's optimizer and strategy state is lost ({why}): "
                                             f"{RESUME_HINT}")
                return
            self.fault = Fault(what, time.time())
            workers.remove_leftover(spec.group_name)  # the dead worker 0's group: its bundles are held
        super().__init__(store, spec, rebuilt=self.fault is not None)  # rebuilt: weights from the checkpoint
        self.max_staleness = max_staleness
        self.trainer = trainer
        self.after_step = list(after_step)
        self.on_step = hooks.on_step  # the job's hook (metrics file, checkpoints), after the services
        self.on_rows = hooks.on_rows  # the job's trajectory log, before them
        self.busy_seconds = 0.0
        self.started = time.perf_counter()
        if trainer.num_workers > 1:
            self.group = workers(dict(store=store, spec=spec, version=self.version), trainer,
                                 device=self.numerics.torch_device(), name=spec.group_name)
            self.join_group(self.group.collective)
        elif self.sharded:  # one worker: FSDP over a group of one (the same code path)
            self.join_group(Collective(device=self.numerics.torch_device(), default_group=True))
        if hooks.on_start is not None and self.fault is None:  # a rebuilt trainer's state is the recovery's
            hooks.on_start(self)  # e.g. a resumed job restores every worker's optimizer and strategy state here
        if weight_sync.method == "collective":  # versions go to the readers from here (operators/trainer/weight_sync.py)
            self.weight_server = WeightServer(store, weight_sync, self.policy.model.state_dict(), reader_dtypes,
                                              device=str(self.numerics.torch_device()), host=serving_host())
            # gathered once in float32 if any reader takes it (each cast from it), else in the one dtype;
            # the version it started from is the store's (readers take it there, not waiting for this process)
            self.gather_dtype = torch.float32 if "float32" in reader_dtypes else getattr(torch, reader_dtypes[0])
        if self.fault is not None:
            # Recovered now, not at the first batch: the readers may need this trainer's version
            # before any batch can reach it (weight_sync collective: only the trainer holds its
            # weights; in sync mode the generator shares this process and runs first).
            self.recovered = self._recover()

    @property
    def strategy(self):
        """The policy's correction strategy (worker 0's)."""
        return self.policy.strategy

    def publish(self) -> None:
        """Make every learner's current weights version `self.version` in the policy store (the
        after-step service `PublishWeights` calls it): the policy's full tensors (`full_weights()`,
        gathered from every worker when sharded) as one float32 copy in the object store, with
        LoRA its adapter only; the critic's in the store's `critic` stream. A version the store
        holds already was published by the process this one replaced (recovery): the same
        weights, kept.

        `weight_sync.method: collective`: the policy's full tensors are packed into the weight
        server's buckets in each reader's dtype and sent to every reader while the next step
        trains; the store registers the version (its number) once every reader has it."""
        if self.critic is not None and self.store.latest_version(learner=CRITIC) < self.version:
            self.store.publish(self.version_payload(CRITIC), self.version, learner=CRITIC)
        if self.weight_server is not None:
            self.weight_server.offer(self.version, self.full_weights(self.gather_dtype))
            return
        if self.store.latest_version() >= self.version:
            return
        self.store.publish(self.version_payload(POLICY), self.version)

    def version_payload(self, name: str = POLICY) -> dict[str, Tensor]:
        """Learner `name`'s published payload (Learner.version_payload) on worker 0, with workers
        1..N-1 gathering in step when sharded."""
        learner = self.learners[name]
        if self.group is None or not self.sharded:
            return learner.version_payload()
        return self._on_every_worker(learner.version_payload, lambda group: group.payload_of(name))[0]

    def full_weights(self, dtype: torch.dtype | None = None, name: str = POLICY) -> Iterator[tuple[str, Tensor]]:
        """Learner `name`'s full weights (Learner.full_weights) on worker 0, with workers 1..N-1
        running the same gathers meanwhile when sharded. Iterate to the end: a consumer that
        stops early still finishes the gathers (the other workers are in them), so the workers
        stay in step."""
        learner = self.learners[name]
        if self.group is None or not self.sharded:
            yield from learner.full_weights(dtype)
            return
        pending = self.group.full_weights_of(name, dtype)
        gathered = learner.full_weights(dtype)
        try:
            for item in gathered:  # not `yield from`: closing this generator must not close `gathered`
                yield item
        except Exception as e:
            raise self.group.failure(e, pending) from e
        finally:
            for _ in gathered:
                pass
        self.group.results(pending)

    def save_version(self, directory: Path) -> Path:
        """Write version `self.version` under `directory` (a run's versions/, engines/checkpoint.py):
        the policy's full weights as one file, or with LoRA its adapter in PEFT's format, the base
        weights once beside it; the critic's under `directory/critic/`. Every worker takes part
        when sharded. Returns the policy's file."""
        if self.critic is not None:
            ckpt.save_weights(self.full_weights(name=CRITIC), ckpt.version_file(learner_dir(directory, CRITIC),
                                                                                self.version))
        if self.spec.lora.enabled:
            return ckpt.save_adapter_version(directory, self.version, self.version_payload(),
                                             lambda: load_model(self.spec.model_path).state_dict().items(),
                                             self.spec.model_path)
        return ckpt.save_weights(self.full_weights(), ckpt.version_file(directory, self.version))

    def unsharded_policy(self) -> torch.nn.Module:
        """The policy as one module in this process, for work outside the workers' lockstep
        (held-out evaluation): the model itself when replicated; sharded, a full copy loaded
        from `full_weights()` (every worker takes part in the gathers)."""
        if not self.sharded and not self.spec.lora.enabled:
            return self.policy.model
        model = self.numerics.prepare(load_model(self.spec.model_path))  # LoRA: the adapter merged in
        model.load_state_dict(dict(self.full_weights()))
        return model

    def save_checkpoint(self, root: Path, meta: dict, export: bool = False) -> ckpt.Checkpoint:
        """Checkpoint version `self.version` under `root` (engines/checkpoint.py), every learner in
        its own directory (operators/trainer/state.py): replicated, this worker writes each
        learner's weights, optimizer and extra state; sharded, every worker writes its shards.
        `export`: the checkpoint is also a plain Hugging Face model directory of the policy (full
        float32 weights, the model's config and tokenizer files)."""
        dp = self.trainer
        meta = {**meta, "sharding": {"method": dp.sharding, "workers": dp.num_workers}, "learners": list(self.learners)}
        with ckpt.writing_checkpoint(root, self.version, meta) as tmp:
            for name, learner in self.learners.items():
                directory = learner_dir(tmp, name)
                directory.mkdir(exist_ok=True)
                if self.sharded:
                    self._on_every_worker(lambda: learner.save_shards(str(directory)),
                                          lambda group: group.save_shards(name, str(tmp)))
                    if learner.adapter_only:  # the adapter whole too: what a resumed run publishes first
                        ckpt.write_replica(directory, self.version_payload(name), weights_file=ckpt.ADAPTER_FILE)
                else:
                    held = learner.version_payload() if learner.adapter_only else learner.state_dict_held()
                    learner.write_checkpoint(directory, held)
            if export:
                ckpt.export_model(tmp, self.full_weights(), self.spec.model_path)
        return ckpt.Checkpoint(ckpt.checkpoint_dir(root, self.version), self.version, meta)

    def restore(self, path: Path) -> None:
        """Load checkpoint `path`'s optimizer and extra state (and, sharded, each worker's shards
        of the weights) into every learner of every worker: a resumed run's state. The weights
        also came with the store's versions, which the trainer started from."""
        checkpoint = ckpt.Checkpoint(Path(path), -1)
        if checkpoint.sharded != self.sharded:
            kind = "a sharded" if checkpoint.sharded else "a replicated"
            raise RuntimeError(f"resume: checkpoint {path} was written by {kind} trainer, and trainer.sharding is "
                               f"{self.trainer.sharding}; resume with the sharding the run used")
        for name, learner in self.learners.items():
            directory = learner_dir(path, name)
            if not directory.is_dir():
                raise RuntimeError(f"resume: checkpoint {path} holds no state of learner {name!r} (written by a run "
                                   f"without it); resume with the learners the run had")
            if self.sharded:
                self._on_every_worker(lambda: learner.load_shards(str(directory)),
                                      lambda group: group.load_shards(name, str(path)))
            else:
                saved = ckpt.Checkpoint(directory, -1)
                optimizer, extra = saved.optimizer_state(), saved.strategy_state()
                self._on_every_worker(lambda: learner.load_checkpoint_state(optimizer, extra),
                                      lambda group: group.load_checkpoint_state(name, optimizer, extra))

    def _on_every_worker(self, mine: Callable[[], object], theirs: Callable[[WorkerGroup], Pending]) -> list:
        """The same call on every worker at once (the collectives inside stay in step): on workers
        1..N-1 through the group (`theirs(group)`), then here (`mine()`); the results by rank."""
        pending = theirs(self.group) if self.group is not None else []
        try:
            result = mine()
        except Exception as e:  # with workers: name the one that died, or surface a worker's own error
            if self.group is None:
                raise
            raise self.group.failure(e, pending) from e
        return [result, *(self.group.results(pending) if pending else [])]

    @property
    def nodes(self) -> list[str]:
        """The node id of each worker, by rank."""
        return self.group.nodes if self.group is not None else [self.node]

    def close(self) -> None:
        """End the other workers and free their placement group (they also end with this process),
        and leave the process group."""
        if self.weight_server is not None:
            self.weight_server.close()
            self.weight_server = None
        self._leave_group()

    def _leave_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if getattr(self, "collective", None) is not None:
            self.collective.close()
        self.collective = Collective()

    # -- the step ----------------------------------------------------------------------------------
    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.perf_counter()
        steps = np.unique(batch["rollout_step"].to_numpy())
        if len(steps) != 1:
            raise RuntimeError(f"a train batch must hold exactly one rollout step, got steps {steps.tolist()}")
        step = int(steps[0])
        if self.failed_rewards is not None and self.failed_rewards.stop_line() is not None:
            # reward_max_failed_steps is reached: the driver stops the run at the metrics row of the
            # last failed step (RLPipeline.iter_metrics); the steps already on their way train and
            # log nothing (raising here would race the driver's one line with Ray's error report)
            return NO_METRICS
        try:
            if self.lost is not None:
                raise self.lost
            try:
                trained = self._step(batch, step)
            except TrainerStateLost as lost:  # a worker died: rebuild the group, roll back, train the step again
                self._rebuild_group(lost)
                trained = self._step(batch, step)
        except TrainerStateLost as lost:
            if self.on_lost is not None:
                self.on_lost(str(lost))
            raise
        if trained is None:  # trained and logged by the trainer this one replaced: no second metrics row
            return NO_METRICS
        batch, metrics = trained
        metrics.update(self.recovered)
        self.recovered = {}
        logged = conform(batch) if self.on_rows is not None or self.on_step is not None else None
        if self.on_rows is not None:
            self.on_rows(self, logged, step)
        metrics[f"{RECOVERY_PREFIX}restarts"] = self.restarts
        for hook in self.after_step:
            hook(self, batch, metrics)
        metrics["seconds/train"] = time.perf_counter() - started
        self.busy_seconds += metrics["seconds/train"]
        metrics["trainer/busy_frac"] = self.busy_seconds / max(time.perf_counter() - self.started, 1e-9)
        if self.on_step is not None:
            self.on_step(self, logged, metrics)
        if self.failed_rewards is not None:
            self.failed_rewards.observe(metrics)
        return pa.Table.from_pylist([metrics])

    def _step(self, batch: pa.Table, step: int) -> tuple[pa.Table, dict] | None:
        """Recover first when a fault is pending; then train the step, or None for a step the
        rebuilt trainer has already retrained from the log (a retried task's earlier steps)."""
        if self.fault is not None:
            self.recovered = self._recover(step)
        if step < self.version:
            return None
        return self._train(batch, step)

    def _train(self, batch: pa.Table, step: int) -> tuple[pa.Table, dict]:
        """Train one step's rows: the batch as trained (its pi_old column; with a critic, the
        values and GAE the trainer computed) and the step's metrics."""
        trainer_version = self.version
        batch, trained, stale_tokens = apply_staleness_bound(batch, trainer_version, self.max_staleness)
        metrics = step_metrics(batch, trainer_version, step, trained, stale_tokens)
        metrics["strategy"] = self.strategy.name
        train_policy = self.critic is None or step >= self.spec.critic.warmup_steps
        if self.critic is not None and len(trained):
            batch = self._train_time_values(batch, trained)

        diagnostics: dict = {}
        # pi_old as the loss used it, under its own name: `old_logprobs` stays what arrived (the
        # exact strategies' upstream scores, or null), so each column has one meaning; null on
        # untrained rows, present on every step so the log has one schema
        old = np.full(batch.num_rows, None, dtype=object)
        if len(trained):
            diagnostics, old_used, parallel = self._train_rows(batch.take(pa.array(trained)), trainer_version,
                                                               train_policy)
            metrics.update(diagnostics)
            metrics.update(parallel)
            if old_used is not None:
                old[trained] = old_used
        batch = replace_column(batch, LOSS_OLD_COLUMN, pa.array(old.tolist(), pa.list_(pa.float32())))
        metrics.update(self._finish_step(diagnostics, train_policy))
        metrics["version"] = self.version
        metrics["optimizer_steps"] = self.policy.optimizer_steps
        metrics["trainer/num_workers"] = self.trainer.num_workers
        metrics["trainer/nodes"] = ",".join(self.nodes)
        return batch, metrics

    def _train_time_values(self, batch: pa.Table, trained: np.ndarray) -> pa.Table:
        """The trained rows' values under the trainer's current critic, when GAE or the value
        clip takes them (`train_values`; `critic.values_at: train` also computes GAE here)."""
        settings = self.spec.critic
        if "train" not in (settings.values_at, settings.anchor):
            return batch
        rows = batch.take(pa.array(trained))
        prompts, responses = rows["prompt_tokens"].to_pylist(), rows["response_tokens"].to_pylist()
        width = max(len(r) for r in responses)
        if self.sharded:  # each forward of a sharded critic is a collective: every worker runs it
            values = self._on_every_worker(lambda: self.critic_values(prompts, responses, width),
                                           lambda group: group.critic_values(prompts, responses, width))[0]
        else:
            values = self.critic_values(prompts, responses, width)
        return train_time_columns(batch, trained, values.numpy(), settings, self.spec.advantage, self.spec.kl)

    # -- recovery (operators/trainer/recovery.py) ---------------------------------------------------------
    def _rebuild_group(self, lost: TrainerStateLost) -> None:
        """A worker of the group died: start a new group (a fault to recover at this step), or
        raise `lost` when the fault is not to be recovered. The weight server (collective) is
        worker 0's and stays: the readers keep their link."""
        self.restarts = self.store.claim_trainer()  # the store counts every trainer rebuilt
        why = refusal(self.recovery, self.source, self.restarts)
        if why is not None or self.group is None:
            raise lost
        self.fault = Fault(str(lost).split(";")[0], time.time())
        self._leave_group()
        if self.sharded:  # this worker's shards belonged to the dead group: sharded again in the new one
            self.reload_unsharded()
        ranks = dict(store=self.store, spec=self.spec, version=None, rebuilt=True)  # the checkpoint's weights next
        self.group = self.workers(ranks, self.trainer, device=self.numerics.torch_device(), name=self.spec.group_name)
        self.join_group(self.group.collective)

    def _recover(self, step: int | None = None) -> dict:
        """Roll every worker back to the last checkpoint and train the steps since it again from
        their logged rows (nothing logged: it all was), through the step at hand, or (`None`)
        through the newest logged step; the `recovery/*` metrics. Then the readers are served
        the version the run goes on from, unless they have it already."""
        fault, self.fault = self.fault, None
        try:
            directory, version, batches = replay_plan(self.source, step)
        except RuntimeError as e:
            raise TrainerStateLost(f"{fault.what}; the trainer's state cannot be rebuilt ({e}): {RESUME_HINT}") from None
        self._on_every_worker(lambda: self.load_checkpoint(directory, version),
                              lambda group: group.load_checkpoint(directory, version))
        for k, rows in enumerate(batches, start=version):
            rows, metrics = self._train(rows, k)
            if not self.source.metrics_logged(k) and self.on_step is not None:
                self.on_step(self, conform(rows), metrics)  # it died between the step's rows and its metrics
        # a trainer that died between logging a step and publishing its version: publish it now (the
        # store keeps what it holds); a rebuilt weight server has served nothing yet: serve it
        if self.weight_server is None or self.weight_server.version is None:
            self.publish()
        # `self.version`: the step the run goes on from (past `step` when it retrained later logged steps)
        return event_metrics(fault, self.version, version, len(batches), time.time() - fault.noticed, self.restarts)

    def _finish_step(self, diagnostics: dict, trained_policy: bool) -> dict:
        """Every worker's policy strategy after-step hook on the same (global) diagnostics."""
        if not diagnostics:  # nothing trained: no update, the version still advances
            self._on_every_worker(self.advance_version, WorkerGroup.advance_version)
            return {}
        return self._on_every_worker(lambda: self.finish_step(diagnostics, trained_policy),
                                     lambda group: group.finish_step(diagnostics, trained_policy))[0]

    def _train_rows(self, table: pa.Table, trainer_version: int, train_policy: bool) -> tuple[dict, list | None, dict]:
        """Plan the step's shards, train every learner on every worker, and gather the step's
        diagnostics: (diagnostics, pi_old as used per row or None without a policy update, the
        data-parallel metrics)."""
        batch = StepBatch.from_table(table, trainer_version)
        lengths = batch.lengths()
        dp = self.trainer
        plan = plan_shards(lengths, self.policy.minibatches_per_step, dp.num_workers, dp.max_tokens_per_microbatch,
                           lockstep=self.sharded)
        critic_plan = critic = None
        if self.critic is not None:
            critic = critic_inputs(table, batch.width, self.spec.critic)
            critic_plan = plan_shards(lengths, self.spec.critic.optimizer.minibatches_per_step, dp.num_workers,
                                      dp.max_tokens_per_microbatch, lockstep=self.sharded)
        work = [ShardWork(table.take(pa.array(plan.rows(rank), pa.int64())), plan.rows(rank), plan.microbatches[rank],
                          trainer_version, batch.width, critic=critic.shard(critic_plan, rank) if critic else None,
                          train_policy=train_policy) for rank in range(dp.num_workers)]
        results = self._on_every_worker(lambda: self.update(work[0]), lambda group: group.update(work[1:]))
        diagnostics: dict = {}
        old = None
        if train_policy:
            agents = table["agent"].to_pylist() if "agent" in table.column_names else []
            diagnostics, old = self._policy_diagnostics([r.policy for r in results], batch, trainer_version, agents)
        if critic is not None:
            diagnostics.update(critic.diagnostics([r.critic for r in results], trainer_version))
        parallel = self._parallel_metrics([r.policy or r.critic for r in results])
        for name in ("policy", "critic"):  # each learner's update, the slowest worker's
            done = [getattr(r, name) for r in results if getattr(r, name) is not None]
            if done:
                parallel[f"seconds/{name}_update"] = max(d.seconds for d in done)
        return diagnostics, old, parallel

    def _policy_diagnostics(self, results: list, batch: StepBatch, trainer_version: int,
                            agents: Sequence[str]) -> tuple[dict, list]:
        """The policy's step diagnostics from every worker's update (split by agent where the rows
        are several agents': `agents`, per row), and pi_old as used per row."""
        parts = [part for r in results for part in r.parts]
        merged = merge_outputs(parts, batch.loss_mask.shape, loss=float(np.mean(results[0].losses)))
        olds = torch.zeros_like(batch.inference)
        for rows, old in (o for r in results for o in r.olds):
            olds[rows] = old
        outside = sum(r.outside_support for r in results)
        diagnostics = step_diagnostics(merged, batch, trainer_version, outside, self.strategy, self.policy.correction)
        diagnostics["grad/norm"] = float(np.mean(results[0].norms)) if results[0].norms else None
        diagnostics["grad/nonfinite_skipped"] = float(results[0].skipped)
        diagnostics["optimizer/lr"] = results[0].lr
        diagnostics.update(agent_diagnostics(merged, batch, agents, trainer_version))
        return diagnostics, old_column(olds, [len(r) for r in batch.responses])

    def _parallel_metrics(self, results: list) -> dict:
        """The data-parallel metrics of the step (the policy's update; the critic's in its warm-up)."""
        return {"trainer/microbatches": sum(r.microbatches for r in results),
                "seconds/allreduce": max(r.allreduce_seconds for r in results),
                **({"trainer/dummy_passes": sum(r.dummy_passes for r in results)} if self.sharded else {}),
                **{f"trainer/{kind}_bytes": max(r.state_bytes.get(kind, 0) for r in results)
                   for kind in ("parameter", "gradient", "optimizer") if results[0].state_bytes}}
