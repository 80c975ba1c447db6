"""One data-parallel worker of the train step: `TrainerReplica`, every learner of the run on this
worker (the policy, and the critic when there is one: operators/trainer/learner.py), and
`TrainerRank` (workers 1..N-1, started through a worker group, operators/trainer/group.py).
Worker 0, the train step itself (operators/train_step.py), is a replica too, so every worker runs
the same update code.

A step on one worker: the critic's update of its rows (when the run has a critic), then the
policy's (unless the critic is still warming up: `critic.warmup_steps`); each learner per
minibatch forwards its micro-batches, backwards its loss in sum form, reduces over the workers,
divides once by the global count, clips and steps (Learner.update). Every learner holds the
worker's version: after a step every one of them is one version further.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from trajflow.operators.contracts.store import CRITIC, POLICY, PolicyStoreClient
from trajflow.operators.trainer.collective import Collective, this_node
from trajflow.operators.trainer.correction import StepBatch
from trajflow.operators.trainer.critic import CriticLearner, CriticResult, CriticWork
from trajflow.operators.trainer.learner import Learner
from trajflow.operators.trainer.policy import PolicyLearner, PolicyResult
from trajflow.operators.trainer.spec import TrainStepConfig
from trajflow.operators.trainer.state import learner_dir


@dataclass
class ShardWork:
    """One worker's share of a step: its `rows` (at `positions` in the step's trained rows), cut
    into `microbatches` per minibatch of the policy (lists of step positions; an empty one: a
    dummy pass), trained at `trainer_version`, padded to the step's `width`. `critic`: the
    critic's share (its own minibatches; None: no critic); `train_policy` False: the critic's
    warm-up, the policy keeps its weights."""

    rows: pa.Table
    positions: list[int]
    microbatches: list[list[list[int]]]
    trainer_version: int
    width: int
    critic: CriticWork | None = None
    train_policy: bool = True


@dataclass
class ShardResult:
    """One worker's step: each learner's update (None: it did not train)."""

    policy: PolicyResult | None
    critic: CriticResult | None = None


class TrainerReplica:
    """One data-parallel worker: every learner of the run (module docstring)."""

    def __init__(self, store: PolicyStoreClient, spec: TrainStepConfig, version: int | None = None,
                 rebuilt: bool = False) -> None:
        torch.set_num_threads(spec.trainer.torch_threads)
        self.store = store
        self.spec = spec
        self.numerics = spec.numerics
        self.sharded = spec.trainer.sharding == "fsdp"
        self.collective = Collective()  # world size 1 until a group is joined
        # The store's newest weights (version 0 on a fresh run, the resumed one later), or the
        # version worker 0 started from. A worker `rebuilt` after a fault loads its checkpoint next
        # (operators/trainer/recovery.py): the model directories' weights until then, since the
        # store may hold no tensors of its versions (weight_sync collective).
        self.version, weights = (store.latest_version(), {}) if rebuilt else store.weights(version)
        self.policy = PolicyLearner(spec, weights)
        self.critic: CriticLearner | None = None
        if spec.critic is not None:
            critic_weights = {} if rebuilt else store.weights(self.version, learner=CRITIC)[1]
            self.critic = CriticLearner(spec, critic_weights)
        for learner in self.learners.values():
            learner.version = self.version

    @property
    def learners(self) -> dict[str, Learner]:
        """Every learner of this worker, by name (the policy first)."""
        return {POLICY: self.policy, **({CRITIC: self.critic} if self.critic is not None else {})}

    def join_group(self, collective: Collective) -> None:
        """Train in `collective`'s group from now on, every learner (sharded: each shards its
        model over the group, then builds its optimizer)."""
        self.collective = collective
        for learner in self.learners.values():
            learner.join_group(collective)

    def reload_unsharded(self) -> None:
        """A sharded worker whose group is gone: every learner afresh and unsharded
        (Learner.reload_unsharded), to join a new group and load a checkpoint into."""
        for learner in self.learners.values():
            learner.reload_unsharded()

    # -- the step ---------------------------------------------------------------------------------
    def update(self, work: ShardWork) -> ShardResult:
        """Train this worker's share of a step: the critic's update, then the policy's (module
        docstring). Every worker calls this once per step with the same minibatches."""
        critic = None
        if self.critic is not None and work.critic is not None:
            started = time.perf_counter()
            critic = self.critic.update(work.critic.minibatches(self.critic.dummy(work.width)), CriticResult())
            critic.seconds = time.perf_counter() - started
        policy = None
        if work.train_policy:
            started = time.perf_counter()
            batch = self._step_batch(work)
            self.policy.before_step(batch, self.policy.dummy(work.width, work.trainer_version))
            policy = self.policy.update(self._minibatches(work, batch), PolicyResult())
            policy.seconds = time.perf_counter() - started
        return ShardResult(policy, critic)

    def _step_batch(self, work: ShardWork) -> StepBatch | None:
        if not work.positions:
            return None
        return StepBatch.from_table(work.rows, work.trainer_version, width=work.width, rows=np.asarray(work.positions))

    def _minibatches(self, work: ShardWork, batch: StepBatch | None) -> list[list[StepBatch]]:
        """The policy's micro-batches per minibatch (an empty one: a dummy batch)."""
        local = {position: i for i, position in enumerate(work.positions)}
        return [[batch.select(torch.tensor([local[p] for p in micro])) if micro
                 else self.policy.dummy(work.width, work.trainer_version) for micro in minibatch]
                for minibatch in work.microbatches]

    def critic_values(self, prompts: list, responses: list, width: int) -> Tensor:
        """The current critic's values of these rows (every worker in step when sharded: each
        forward is a collective)."""
        return self.critic.values(prompts, responses, width)

    def finish_step(self, diagnostics: dict, trained_policy: bool = True) -> dict:
        """The policy strategy's after-step hook with the step's (global) diagnostics (when the
        policy trained); every learner then holds the next version."""
        out = self.policy.finish_step(diagnostics) if trained_policy else {}
        self.advance_version()
        return out

    def advance_version(self) -> None:
        """A step with nothing to train: no update, the next version all the same."""
        self.version += 1
        for learner in self.learners.values():
            learner.version = self.version

    # -- the learners' state, by name (worker 0 drives these on every worker) ---------------------
    def save_shards(self, name: str, directory: str) -> None:
        self.learners[name].save_shards(str(learner_dir(directory, name)))

    def load_shards(self, name: str, directory: str) -> None:
        self.learners[name].load_shards(str(learner_dir(directory, name)))

    def load_checkpoint_state(self, name: str, optimizer: dict | None, extra: dict | None) -> None:
        self.learners[name].load_checkpoint_state(optimizer, extra)

    def load_checkpoint(self, directory: str, version: int) -> None:
        """Roll every learner back to checkpoint `directory` of `version` (recovery)."""
        for name, learner in self.learners.items():
            learner.load_checkpoint(str(learner_dir(directory, name)), version)
        self.version = version

    def full_weights_of(self, name: str, dtype: torch.dtype | None) -> None:
        """Take part in worker 0's gathers of learner `name`'s full weights (tensors dropped)."""
        for _ in self.learners[name].full_weights(dtype):
            pass

    def payload_of(self, name: str) -> None:
        """Take part in worker 0's gathers of learner `name`'s version payload (dropped)."""
        self.learners[name].version_payload()


class TrainerRank(TrainerReplica):
    """Worker `rank` (1..N-1) of a data-parallel train step: a Ray actor started by worker 0 from
    the same spec and version; worker 0 restores its checkpoint state when resuming."""

    def __init__(self, rank: int, world_size: int, store: PolicyStoreClient, spec: TrainStepConfig, version: int | None,
                 rebuilt: bool = False) -> None:
        super().__init__(store, spec, version, rebuilt)
        self.rank, self.world_size = rank, world_size

    def node_id(self) -> str:
        return this_node()

    def join(self, host: str, port: int, timeout_seconds: float) -> None:
        self.join_group(Collective(self.rank, self.world_size, host=host, port=port, device=self.numerics.torch_device(),
                                   timeout_seconds=timeout_seconds, default_group=self.sharded))
