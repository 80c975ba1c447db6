"""Generate: the rollout of one train step per call (Ray Data actor).

Batch in: the prompt rows of one train step (`rollout_step`, `prompt_id`, `prompt`,
`prompt_tokens` and the passthrough columns, as tasks.workload.PromptSource emits them). Batch
out: `len(rows) * group_size` trajectory rows (schema v1, then `prompt`, the passthrough columns
and `rollout_step`), a group's samples contiguous, each repeating its prompt row's columns.

For an environment workload (`tasks.environments.Environment`) each row is a multi-turn episode
(tasks/rollout.py): `response_tokens` hold policy turns and environment observations,
`loss_mask` is false on the observation tokens, `reward` is already filled in by the environment,
and the extra column `turns` counts policy turns. Before every turn the generator takes the
newest weights, so the turns of one episode may come from different versions.

Before sampling, the actor takes an admission permit from the policy store: the rollout of
step b starts only once version b - max_staleness exists, which bounds policy lag. The weights
come from the store, or under `weight_sync.method: collective` straight from the trainer, in
the dtype this generator samples in (operators/trainer/weight_sync.py). With
`partial_rollout` it also takes newer weights between decode steps, so one trajectory can
span versions; for a strategy that scores at a switch (`interrupt`: `scores_at_switch`) it first
scores the prefix generated so far with the still-resident weights under the training numerics
(`numerics`, the trainer's) — the exact old log-probs — then switches. The prefix is scored with
its full context (for episodes: prompt, earlier turns and observations).
Sampling stops at the tokenizer's eos (and the model's generation-config eos ids) and at the
`sampling.stop` strings.

With `top_k_logprobs` K > 0 the rows also carry each token's top-K of the distribution it was
sampled from (`top_k_ids`, `top_k_inference_logprobs`; schema metadata `trajflow.top_k`), and a
strategy that scores at a switch scores pi_old on those ids too (`top_k_old_logprobs`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from trajflow.engines.factory import ENGINES, make_engine
from trajflow.engines.lora import VersionWeights, is_adapter
from trajflow.engines.models import load_model, load_tokenizer
from trajflow.engines.tokenizer import TokenIds
from trajflow.engines.torch_engine import Generation, TorchEngine
from trajflow.engines.training_numerics import TrainingNumerics
from trajflow.operators.contracts.rollout import EngineConfig, RolloutConfig
from trajflow.operators.contracts.store import PolicyStoreClient
from trajflow.operators.trainer.weight_receiver import weight_source
from trajflow.operators.trainer.weight_sync import WeightSyncConfig, reader_dtype
from trajflow.schemas import SamplingSemantics, TopKSemantics, conform
from trajflow.schemas.columns import nested_array
from trajflow.tasks.rollout import Episode, EpisodeBatch, EpisodeView, run_episodes
from trajflow.tasks.workload import Workload, prompt_of

# Columns of a prompt row that generation replaces with per-trajectory values.
PROMPT_ROW_COLUMNS = ("rollout_step", "prompt_id", "prompt_tokens")


def rollout_step_of(batch: pa.Table) -> int:
    """The one train step a batch of prompt rows belongs to."""
    steps = np.unique(batch["rollout_step"].to_numpy())
    if len(steps) != 1:
        raise ValueError(f"Generate takes the prompt rows of one step per call, got steps {steps.tolist()}")
    return int(steps[0])


class Generate:
    """The rollout of one train step per call (see the module docstring)."""

    def __init__(self, store: PolicyStoreClient, model_path: str | Path, workload: Workload, rollout: RolloutConfig,
                 engine: EngineConfig, numerics: TrainingNumerics, weight_sync: WeightSyncConfig,
                 torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)
        self.top_k_logprobs = rollout.top_k_logprobs
        self.store = store
        scores_at_switch = rollout.scores_at_switch
        # the newest version only, in the dtype it samples in (float32 to score prefixes at a switch)
        self.source = weight_source(store, weight_sync, reader_dtype(engine.inference_dtype, exact=scores_at_switch),
                                    history=False, device=str(numerics.torch_device()))
        self.environment = workload.environment()
        # The tokenizer only to decode (stop strings, an environment's turns): eos, pad and the
        # stop ids come from the driver's (`engine.token_ids`), which had it loaded already
        decodes = bool(rollout.sampling.stop) or self.environment is not None or engine.token_ids is None
        self.tokenizer = load_tokenizer(model_path) if decodes else None
        token_ids = engine.token_ids or TokenIds.of(self.tokenizer, model_path)
        self.group_size = rollout.group_size
        self.sampling = rollout.sampling
        self.seed = rollout.seed
        # a strategy that scores at a switch takes new weights mid-generation by definition
        self.partial_rollout = rollout.partial_rollout or scores_at_switch
        self.scores_at_switch = scores_at_switch
        self.simulate_decode_seconds = rollout.simulate_decode_seconds
        # The torch engine copies an in-memory model; vLLM loads the directory itself. The float32
        # model is also the scorer of prefixes at a switch (interrupt).
        # on this process's device: the GPU it was given (Ray hides the others), else the CPU
        kind = ENGINES.resolve(engine.name)
        model = numerics.prepare(load_model(model_path)) if (kind.takes_model or scores_at_switch) else None
        # vLLM applies a LoRA version's adapter itself (the window's adapters resident); the torch
        # engine gets the adapter merged into full weights
        self.lora_slots = engine.lora_slots if kind.serves_adapters else 0
        adapters = dict(lora_slots=engine.lora_slots, lora_rank=engine.lora_rank) if self.lora_slots else {}
        self.engine = make_engine(
            engine.name,
            model if kind.takes_model else model_path,
            settings=engine.settings,
            eos_id=token_ids.eos_id,
            pad_id=token_ids.pad_id,
            stop_token_ids=list(token_ids.stop_ids),
            tokenizer=self.tokenizer,
            sampling=rollout.sampling,
            inference_dtype=engine.inference_dtype,
            seed=rollout.seed,
            version=-1,
            top_k_logprobs=rollout.top_k_logprobs,
            **adapters,
        )
        # Training numerics of the resident version, for scoring prefixes at a switch (interrupt).
        self.numerics = numerics
        self.scoring_model = numerics.prepare(model) if scores_at_switch else None
        self.versions = VersionWeights(model_path)
        self.semantics = SamplingSemantics(rollout.sampling.temperature, rollout.sampling.top_p, rollout.sampling.top_k)
        self.top_k_semantics = None
        if rollout.top_k_logprobs:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model_path, local_files_only=True).vocab_size
            self.top_k_semantics = TopKSemantics(rollout.top_k_logprobs, vocab)
        self.weight_load_seconds = 0.0  # of the current call

    def load_newest(self, pins: set[int]) -> None:
        """Load the store's newest version into the engine (if it is not resident); its pin is
        added to `pins` (the caller releases those no generated token carries)."""
        started = time.perf_counter()
        version, payload = self.source.newest()
        if version in pins:
            self.store.release(version)  # this call already holds a pin on it
        pins.add(version)
        if version != self.engine.version:
            in_engine = bool(self.lora_slots) and is_adapter(payload)
            weights = None if in_engine else self.versions.full(payload)  # LoRA: merged
            if in_engine:
                self.engine.load_adapter(payload, version)
            else:
                self.engine.load_weights(weights, version)
            if self.scoring_model is not None:  # training numerics score the full weights
                self.scoring_model.load_state_dict(weights if weights is not None else self.versions.full(payload))
        self.weight_load_seconds += time.perf_counter() - started

    def _switch_if_newer(self, pins: set[int], views, old_logprobs, supports=None, old_top_k=None) -> None:
        """Take the newest weights if a newer version exists; for `interrupt`, first score every
        token sampled under the resident version (`views()` gives the responses so far,
        `supports()` their tokens' top-k ids when they are recorded)."""
        if self.store.latest_version() > self.engine.version:
            if old_logprobs is not None:
                self._score_resident(views(), old_logprobs, supports() if supports else None, old_top_k)
            self.load_newest(pins)

    def __call__(self, batch: pa.Table) -> pa.Table:
        step = rollout_step_of(batch)
        started = time.perf_counter()
        self.store.admit(step)
        waited = time.perf_counter() - started
        pins: set[int] = set()
        # the generator's idle time on new versions: waiting for, fetching and loading weights
        self.weight_load_seconds = 0.0
        self.load_newest(pins)

        prompt_tokens = batch["prompt_tokens"].to_pylist()
        self.engine.generator.manual_seed(self.seed * 1_000_003 + step)
        old_logprobs: list[list[float]] | None = None
        old_top_k: list[list[list[float]]] | None = None  # pi_old on each token's top-k ids (interrupt)
        if self.partial_rollout and self.scores_at_switch:
            old_logprobs = [[] for _ in range(len(prompt_tokens) * self.group_size)]
            if self.top_k_logprobs:
                old_top_k = [[] for _ in old_logprobs]

        if self.environment is not None:
            if self.scores_at_switch and old_logprobs is None:  # switches happen between turns too
                old_logprobs = [[] for _ in range(len(prompt_tokens) * self.group_size)]

            def before_turn(engine: TorchEngine, episodes: EpisodeBatch) -> None:
                self._switch_if_newer(pins, episodes.current, old_logprobs)

            def episode_hook(engine: TorchEngine, episodes: EpisodeBatch) -> None:
                if self.simulate_decode_seconds:
                    time.sleep(self.simulate_decode_seconds)
                if self.partial_rollout:
                    self._switch_if_newer(pins, episodes.current, old_logprobs)

            prompts = [prompt_of(row) for row in batch.to_pylist()]
            episodes = run_episodes(self.engine, self.environment, self.tokenizer, prompts, self.group_size,
                                    prompt_tokens=prompt_tokens, before_turn=before_turn,
                                    between_steps=episode_hook)
            rows = [EpisodeView(e.prompt_tokens, e.response_tokens, e.versions, e.loss_mask) for e in episodes]
        else:
            def views() -> list[EpisodeView]:
                return [EpisodeView(prompt_tokens[g.prompt_index], g.response_tokens, g.versions,
                                    [True] * len(g.response_tokens)) for g in gens_seen]

            def supports() -> list[list[list[int]]]:
                return [g.top_k_ids for g in gens_seen]

            gens_seen: list[Generation] = []

            def hook(engine: TorchEngine, gens: list[Generation]) -> None:
                gens_seen[:] = gens
                if self.simulate_decode_seconds:
                    time.sleep(self.simulate_decode_seconds)
                if self.partial_rollout:  # the top-k ids only where they are scored (K > 0)
                    self._switch_if_newer(pins, views, old_logprobs, None if old_top_k is None else supports, old_top_k)

            episodes = self.engine.generate(prompt_tokens, n=self.group_size, between_steps=hook)
            gens_seen[:] = episodes
            rows = views()
        if old_logprobs is not None:
            self._score_resident(rows, old_logprobs, None if old_top_k is None else supports(), old_top_k)

        # Release pins of versions that no generated token carries (all sequences had finished).
        used = {v for r in rows for v in r.versions}
        for version in pins - used:
            self.store.release(version)
        self.store.add_counters(
            {"generate_seconds": time.perf_counter() - started - waited, "admission_wait_seconds": waited,
             "weight_load_seconds": self.weight_load_seconds}
        )
        return self._to_table(step, batch, prompt_tokens, episodes, old_logprobs, old_top_k)

    def _score_resident(self, rows: list[EpisodeView], old_logprobs: list[list[float]],
                        supports: list[list[list[int]]] | None = None,
                        old_top_k: list[list[list[float]]] | None = None) -> None:
        """Fill old log-probs of every token appended under the resident version, with training
        numerics (the float32 copy of the same weights): exact pi_v^train before v is replaced;
        with `supports` (each row's top-k ids per token), pi_old on them into `old_top_k`.

        Each row is scored teacher-forced on its whole response so far (prompt, earlier turns and
        observations as context). Environment tokens (loss_mask false) get 0.0, like their
        inference log-probs: they are never trained or counted.
        """
        version = self.engine.version
        todo = [i for i, r in enumerate(rows) if len(old_logprobs[i]) < len(r.response_tokens)]
        if not todo:
            return
        t0 = time.perf_counter()
        needs_scoring = [i for i in todo if any(rows[i].loss_mask[len(old_logprobs[i]):])]
        tops: list[np.ndarray] = []
        scored = dict(zip(needs_scoring, self.numerics.score(
            self.scoring_model,
            [rows[i].prompt_tokens for i in needs_scoring],
            [rows[i].response_tokens for i in needs_scoring],
            self.sampling,
            top_k_ids=None if supports is None else [np.asarray(supports[i]) for i in needs_scoring],
            top_k=tops,
        ))) if needs_scoring else {}
        top_of = dict(zip(needs_scoring, tops))
        for i in todo:
            row, lp = rows[i], scored.get(i)
            for t in range(len(old_logprobs[i]), len(row.response_tokens)):
                assert row.versions[t] == version, "a token of an older version was left unscored"
                old_logprobs[i].append(float(lp[t]) if row.loss_mask[t] else 0.0)
                if old_top_k is not None:
                    old_top_k[i].append(top_of[i][t].tolist())
        self.store.add_counters({"interrupt_scoring_seconds": time.perf_counter() - t0})

    def _to_table(self, step, rows: pa.Table, prompt_tokens, gens, old_logprobs, old_top_k=None) -> pa.Table:
        n = self.group_size
        prompt_idx = np.repeat(np.arange(rows.num_rows), n)
        sample_idx = np.tile(np.arange(n), rows.num_rows)
        int_list, float_list = pa.list_(pa.int32()), pa.list_(pa.float32())
        multi_turn = bool(gens) and isinstance(gens[0], Episode)
        if multi_turn:
            loss_mask = [g.loss_mask for g in gens]
            reward = pa.array([g.reward for g in gens], pa.float32())
        else:
            loss_mask = [[True] * len(g.response_tokens) for g in gens]
            reward = pa.nulls(len(gens), pa.float32())
        prompt_ids = rows["prompt_id"].to_pylist()
        columns = {
            "trajectory_id": [f"s{step:06d}-p{p:03d}-n{j:03d}" for p, j in zip(prompt_idx, sample_idx)],
            "group_id": [f"s{step:06d}-p{p:03d}" for p in prompt_idx],
            "prompt_id": [prompt_ids[p] for p in prompt_idx],
            "prompt_tokens": pa.array([prompt_tokens[p] for p in prompt_idx], int_list),
            "response_tokens": pa.array([g.response_tokens for g in gens], int_list),
            "loss_mask": pa.array(loss_mask, pa.list_(pa.bool_())),
            "inference_logprobs": pa.array([g.logprobs for g in gens], float_list),
            "versions": pa.array([g.versions for g in gens], int_list),
            "old_logprobs": pa.array(old_logprobs if old_logprobs is not None else [None] * len(gens), float_list),
            "finish_reason": [g.finish_reason for g in gens],
            "reward": reward,
            "advantage": pa.nulls(len(gens), pa.float32()),
        }
        # the prompt and every passthrough column, repeated onto each sample of its group
        passthrough = rows.drop_columns(list(PROMPT_ROW_COLUMNS)).take(pa.array(prompt_idx))
        for name in passthrough.column_names:
            columns[name] = passthrough[name]
        columns["rollout_step"] = pa.array(np.full(len(gens), step, dtype=np.int32))
        if multi_turn:
            columns["turns"] = pa.array([g.turns for g in gens], pa.int32())
        if self.top_k_logprobs:  # the distributions (schemas/trajectory.py); env rows are refused by the config
            k = self.top_k_logprobs
            columns["top_k_ids"] = nested_array([np.asarray(g.top_k_ids, np.int32) for g in gens], pa.int32(), k)
            columns["top_k_inference_logprobs"] = nested_array(
                [np.asarray(g.top_k_logprobs, np.float32) for g in gens], pa.float32(), k)
            if old_top_k is not None:
                columns["top_k_old_logprobs"] = nested_array([np.asarray(r, np.float32) for r in old_top_k],
                                                             pa.float32(), k)
        return conform(pa.table(columns), self.semantics, self.top_k_semantics)
