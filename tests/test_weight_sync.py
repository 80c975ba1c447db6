"""weight_sync: the config section, the bucket layout, the trainer's server and the readers' receivers
(in one process, across Ray processes with one killed mid-transfer, and in the pipeline: FSDP with 2
workers and `collective`, exact old log-probs at max_staleness 1 for snapshot, dedicated and interrupt)."""

from __future__ import annotations

import time

import pytest
import torch

from trajflow.operators.contracts.store import VersionNotHeld
from trajflow.operators.trainer.weight_receiver import WeightReceiver
from trajflow.operators.trainer.weight_server import WeightServer
from trajflow.operators.trainer.weight_sync import (
    WeightSyncConfig,
    WeightSyncError,
    backend_for,
    bucket_layout,
    link_device,
    reader_dtype,
)
from trajflow.pipelines.config import PipelineConfig
from trajflow.pipelines.policy_store import InProcessStore
from trajflow.settings import SettingError

COLLECTIVE = {"method": "collective", "timeout_seconds": 60}
NO_RESTARTS = {"max_restarts": 0}


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny transformer's state dict (real model, random init)."""
    from trajflow.engines.models import build_tiny_model

    model, _ = build_tiny_model(seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights with lm_head tied to the embedding (one tensor under two names)."""
    return {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}


def _unique_bytes(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """Bytes of the distinct tensors (tied weights once) in `dtype`."""
    from trajflow.engines.checkpoint import storage_key

    distinct = {storage_key(t): t for t in weights.values()}
    return sum(t.numel() for t in distinct.values()) * torch.empty((), dtype=dtype).element_size()


def _wait_for_readers(server: WeightServer, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(server.readers) < n:
        assert time.monotonic() < deadline, f"{len(server.readers)} of {n} readers joined"
        time.sleep(0.05)


def test_config_section_defaults_bounds_and_what_collective_refuses():
    config = PipelineConfig()
    assert config.settings.weight_sync == WeightSyncConfig()
    assert config.weight_sync.method == "object_store"
    assert PipelineConfig(weight_sync={"bucket_mb": 1}).settings.weight_sync.bucket_mb == 1.0
    # the one key is enough: recovery stays on at its default (a rebuilt trainer reads its checkpoint)
    config = PipelineConfig(weight_sync=COLLECTIVE)
    assert config.weight_sync.method == "collective" and config.recovery.max_restarts == 3
    with pytest.raises(ValueError, match="collective sends full weights; a lora adapter"):
        PipelineConfig(weight_sync=COLLECTIVE, lora={"r": 4})
    with pytest.raises(ValueError, match="bucket_mb"):
        PipelineConfig(weight_sync={"bucket_mb": 0})
    with pytest.raises(ValueError, match="method"):
        PipelineConfig(weight_sync={"method": "nixl"})
    with pytest.raises(SettingError):
        WeightSyncConfig(timeout_seconds=-1.0)


def test_each_reader_gets_the_dtype_it_computes_in():
    def dtypes(strategy: str, inference_dtype: str) -> tuple[str, ...]:
        config = PipelineConfig(strategy=strategy, inference_dtype=inference_dtype)
        return config.reader_dtypes(config.build_strategy())

    assert reader_dtype("bfloat16", exact=False) == "bfloat16" and reader_dtype("fp8", exact=False) == "bfloat16"
    assert reader_dtype("float32", exact=False) == "float32" and reader_dtype("bfloat16", exact=True) == "float32"
    assert dtypes("behavior", "bfloat16") == ("bfloat16",)            # generators only
    assert dtypes("snapshot", "bfloat16") == ("bfloat16", "float32")  # + the exact scorer's training numerics
    assert dtypes("interrupt", "bfloat16") == ("float32",)            # its generator scores prefixes
    assert dtypes("dedicated", "float32") == ("float32",)


def test_bucket_layout_respects_size_and_order():
    weights = {"a": torch.zeros(10), "b": torch.zeros(20), "c": torch.zeros(100), "d": torch.zeros(5)}
    layout = bucket_layout(weights, bucket_bytes=30 * 4, element_size=4)
    # a+b fill 120 bytes; c (400 bytes) exceeds a bucket and travels alone; d starts a new one
    assert [[t.name for t in b.tensors] for b in layout] == [["a", "b"], ["c"], ["d"]]
    assert [b.numel for b in layout] == [30, 100, 5]


@pytest.mark.timeout(180)
def test_readers_get_every_version_bitwise_in_their_dtype_and_a_late_one_the_current():
    """Trainer and readers in one process (their threads): the store numbers versions and holds
    no tensor of them; a version is registered once delivered; an exact scorer keeps the
    staleness window v-S..v in float32, a generator the newest version in bf16."""
    weights = _tied(_weights())
    store = InProcessStore(max_staleness=1, keep_history=True)
    store.publish(weights, 0)
    config = WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=60)
    scorer = WeightReceiver(store, config, "float32", history=True)  # before the trainer serves
    assert scorer.newest()[0] == 0  # the starting version: the store's
    server = WeightServer(store, config, weights, ["bfloat16", "float32"])
    late = None
    try:
        _wait_for_readers(server, 1)
        versions = {0: weights}
        for v in (1, 2, 3):
            versions[v] = {k: t + v for k, t in weights.items()}
            versions[v]["lm_head.weight"] = versions[v]["model.embed_tokens.weight"]
            server.offer(v, versions[v].items())
            server.wait()
            assert store.latest_version() == v  # registered once delivered
            with pytest.raises(VersionNotHeld, match="collective"):
                store.weights(v)  # its number only
        late = WeightReceiver(store, config, "bfloat16", history=False)
        version, got = late.newest()
        assert version == 3
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], t.to(torch.bfloat16))
                   for k, t in versions[3].items())
        for v in (2, 3):  # the window S+1 = 2, bitwise the trainer's float32
            assert all(torch.equal(scorer.weights(v)[k], t) for k, t in versions[v].items())
        assert scorer.weights(3)["lm_head.weight"] is scorer.weights(3)["model.embed_tokens.weight"]
        with pytest.raises(VersionNotHeld, match="version 1 are not held by this reader"):
            scorer.weights(1)
        # history: 2 versions in float32, the tied tensor once; per version what was sent
        assert scorer.held_bytes() == 2 * _unique_bytes(weights, torch.float32) == 2 * server.version_bytes("float32")
        assert server.moved_bytes == _unique_bytes(weights, torch.float32)  # version 3 went to the scorer only
        assert store.stats().snapshot_bytes == 0 and store.stats().counters["weight_sync_bytes"] > 0
        # a reader that ends its work (Ray Data ends a finished stage's actors) leaves; the run goes on
        late.close()
        server.offer(4, versions[3].items())
        server.wait()
        assert len(server.readers) == 1 and server.moved_bytes == _unique_bytes(weights, torch.float32)
        assert sorted(scorer.held) == [3, 4]
    finally:
        server.close()
        scorer.close()
        if late is not None:
            late.close()


class _StaleLatest:
    """A store whose newest version number lags one behind (as a reader's read of it may, racing
    the server's registration of the next); everything else is the store's."""

    def __init__(self, store: InProcessStore) -> None:
        self.store = store

    def latest_version(self) -> int:
        return self.store.latest_version() - 1

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@pytest.mark.timeout(120)
def test_a_one_version_reader_asked_for_the_newest_takes_the_newer_version_that_replaced_it():
    """A generator's receiver keeps one version: when the store names version 1 but version 2
    has replaced it by the time the receiver has any (a restarted generator joining late, seen
    in a CI run), `newest()` returns version 2 instead of failing with VersionNotHeld."""
    weights = _tied(_weights())
    store = InProcessStore(max_staleness=1, keep_history=False)
    store.publish(weights, 0)
    config = WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=60)
    server = WeightServer(store, config, weights, ["float32"])
    late = None
    try:
        for v in (1, 2):
            server.offer(v, {k: t + v for k, t in weights.items()}.items())
            server.wait()
        late = WeightReceiver(_StaleLatest(store), config, "float32", history=False)
        version, got = late.newest()  # asks for 1; the late joiner is sent the current version, 2
        assert version == 2 and sorted(late.held) == [2]
        assert torch.equal(got["model.norm.weight"], weights["model.norm.weight"] + 2)
    finally:
        server.close()
        if late is not None:
            late.close()


@pytest.mark.timeout(300)
def test_a_reader_killed_mid_transfer_is_dropped_and_its_restart_joins_again(ray_session, tmp_path):
    """A reader whose process dies in the middle of version 1 (a generator killed): the trainer
    drops it with one line and counts it, the other reader still gets version 1, the store
    registers it, and the reader's process, restarted by Ray, joins again and is sent version 1."""
    import ray

    from trajflow.pipelines.policy_store import RayStore

    # defined here, so Ray pickles it by value (the tests folder is not importable in its workers)
    class DyingReader:
        """A reader in its own Ray process that dies after the first bucket it receives, once."""

        def __init__(self, store, config: WeightSyncConfig, marker: str) -> None:
            import os
            from pathlib import Path

            from trajflow.operators.trainer import weight_sync

            unpack, calls = weight_sync.unpack, []

            def unpack_then_die(flat, bucket):  # the process dies mid-transfer, like a lost reader
                calls.append(1)
                if len(calls) > 1 and not Path(marker).exists():
                    Path(marker).touch()
                    os._exit(1)
                return unpack(flat, bucket)

            weight_sync.unpack = unpack_then_die
            self.receiver = WeightReceiver(store, config, "float32", history=False)

        def newest(self) -> tuple[int, dict]:
            version, got = self.receiver.newest()
            return version, {k: v.clone() for k, v in got.items()}

    weights = _weights()
    version_1 = {k: v + 1 for k, v in weights.items()}
    config = WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=10)
    assert len(bucket_layout(weights, int(0.05 * 2**20), 4)) > 2  # it dies between buckets
    store = RayStore.start(max_staleness=1, keep_history=False)
    server = healthy = None
    try:
        store.publish(weights, 0)
        server = WeightServer(store, config, weights, ["float32"])
        reader = ray.remote(DyingReader).options(num_cpus=0, max_restarts=1, max_task_retries=1).remote(
            store, config, str(tmp_path / "died"))
        assert ray.get(reader.newest.remote(), timeout=120)[0] == 0  # from the store
        _wait_for_readers(server, 1)
        healthy = WeightReceiver(store, config, "float32", history=False)
        _wait_for_readers(server, 2)
        started = time.monotonic()
        server.offer(1, version_1.items())  # the dying reader is reader 0: it dies first
        server.wait()
        elapsed = time.monotonic() - started
        assert (tmp_path / "died").exists()
        assert store.latest_version() == 1 and store.stats().counters["weight_sync_readers_lost"] == 1
        assert all(torch.equal(healthy.weights(1)[k], t) for k, t in version_1.items())
        version, got = ray.get(reader.newest.remote(), timeout=120)  # restarted: joined as a late joiner
        assert version == 1 and all(torch.equal(got[k], t) for k, t in version_1.items())
        assert len(server.readers) == 2
    finally:
        if healthy is not None:
            healthy.close()
        if server is not None:
            server.close()
        store.kill()
    (line,) = server.lost_readers
    print(f"\nkilled reader: dropped in {elapsed:.1f} s: {line}")
    assert line.startswith("trajflow: weight_sync (reader 0, trainer side):") and "\n" not in line
    assert elapsed < 2 * config.timeout_seconds + 5


@pytest.mark.timeout(300)
def test_a_lost_trainer_is_one_line_where_the_reader_needs_a_version(ray_session):
    import ray

    from trajflow.pipelines.policy_store import RayStore

    class Trainer:
        """A weight server in its own Ray process (the test kills it)."""

        def __init__(self, store, config: WeightSyncConfig, weights: dict) -> None:
            self.server = WeightServer(store, config, weights, ["float32"])

        def readers(self) -> int:
            return len(self.server.readers)

    weights = _weights()
    config = WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=10)
    store = RayStore.start(max_staleness=1, keep_history=False)
    receiver = None
    try:
        store.publish(weights, 0)
        trainer = ray.remote(Trainer).options(num_cpus=0).remote(store, config, weights)
        receiver = WeightReceiver(store, config, "float32", history=False)
        assert receiver.newest()[0] == 0
        deadline = time.monotonic() + 60
        while ray.get(trainer.readers.remote()) < 1:  # joined: now waiting for the next version
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ray.kill(trainer)
        store.register(1)  # the store says version 1 exists; its trainer is gone
        started = time.monotonic()
        with pytest.raises(WeightSyncError) as info:
            receiver.weights(1)
        elapsed = time.monotonic() - started
    finally:
        if receiver is not None:
            receiver.close()
        store.kill()
    message = str(info.value)
    assert message.startswith("trajflow: weight_sync (reader side): version 1 did not arrive (its trainer was lost: ")
    assert "no rebuilt trainer served it" in message and "\n" not in message
    assert elapsed <= config.timeout_seconds + 5


@pytest.mark.timeout(300)
def test_a_reader_keeps_its_versions_and_joins_the_server_of_a_rebuilt_trainer(ray_session):
    """Recovery under collective: the trainer's process is killed between versions; the reader
    (an exact scorer: the window v-1..v) keeps what it holds, and joins the server the rebuilt
    trainer starts, which serves the recovered version again (the store numbers it already: no
    change) and then the next ones, bitwise."""
    import ray

    from trajflow.pipelines.policy_store import RayStore

    class ServingTrainer:
        """A trainer's weight server in a Ray process of its own (the test kills it)."""

        def __init__(self, store, config: WeightSyncConfig, weights: dict) -> None:
            self.server = WeightServer(store, config, weights, ["float32"])

        def readers(self) -> int:
            return len(self.server.readers)

        def serve(self, version: int, weights: dict) -> None:
            self.server.offer(version, weights.items())
            self.server.wait()

    weights = _weights()
    versions = {v: {k: t + v for k, t in weights.items()} for v in range(4)}
    config = WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=60)
    store = RayStore.start(max_staleness=1, keep_history=True)
    remote = ray.remote(ServingTrainer).options(num_cpus=0)
    receiver = None
    try:
        store.publish(weights, 0)
        first = remote.remote(store, config, weights)
        receiver = WeightReceiver(store, config, "float32", history=True)
        deadline = time.monotonic() + 60
        while ray.get(first.readers.remote()) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for v in (1, 2):
            ray.get(first.serve.remote(v, versions[v]))
        assert store.weight_server().generation == 1 and store.latest_version() == 2
        ray.kill(first)
        deadline = time.monotonic() + 60
        while receiver.lost is None:  # it noticed: its server is gone
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for v in (1, 2):  # kept while no trainer serves
            assert all(torch.equal(receiver.weights(v)[k], t) for k, t in versions[v].items())
        rebuilt = remote.remote(store, config, weights)
        ray.get(rebuilt.serve.remote(2, versions[2]))  # the version it recovered: every joined reader gets it
        ray.get(rebuilt.serve.remote(3, versions[3]))
        assert store.weight_server().generation == 2 and store.latest_version() == 3
        assert all(torch.equal(receiver.weights(3)[k], t) for k, t in versions[3].items())
        assert sorted(receiver.held) == [2, 3] and receiver.joins == 2 and receiver.lost is None
    finally:
        if receiver is not None:
            receiver.close()
        store.kill()


def test_backend_choice_nccl_between_gpus_gloo_otherwise_no_gpu_needed():
    assert backend_for("cuda:0") == "nccl" and backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
    # both ends on a GPU: NCCL on device buffers; one end on the host: gloo through host memory
    assert link_device("cuda:1", "cuda:0") == "cuda:1" and backend_for(link_device("cuda:0", "cuda")) == "nccl"
    assert link_device("cuda", "cpu") == "cpu" and link_device("cpu", "cuda") == "cpu"
    assert backend_for(link_device("cpu", "cpu")) == "gloo"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs GPUs: one per rank (trainer, reader)")
@pytest.mark.timeout(180)
def test_nccl_transfer_between_two_gpus():
    weights = {k: t.to("cuda:0") for k, t in _weights().items()}
    store = InProcessStore(max_staleness=0, keep_history=False)
    store.publish(weights, 0)
    config = WeightSyncConfig(method="collective", bucket_mb=0.05, timeout_seconds=60)
    server = WeightServer(store, config, weights, ["bfloat16"], device="cuda:0")
    receiver = WeightReceiver(store, config, "bfloat16", history=False, device="cuda:1")
    try:
        _wait_for_readers(server, 1)
        server.offer(1, weights.items())
        server.wait()
        version, got = receiver.newest()
        assert version == 1 and all(t.device == torch.device("cuda:1") for t in got.values())
        assert all(torch.equal(got[k].cpu(), t.bfloat16().cpu()) for k, t in weights.items())
    finally:
        server.close()
        receiver.close()


# -- the pipeline: FSDP with 2 workers, versions over gloo ----------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["snapshot", "dedicated", "interrupt"])
def test_exact_old_logprobs_with_fsdp_and_collective_sync_on_ray_data(ray_session, publish_inside_rollouts, strategy):
    """Async on Ray Data at max_staleness 1, float32 inference: every reader's version came over
    the collective, and pi_old (scored from it) equals the inference log-probs within 1e-5. The
    generator waits once per rollout for the next version (conftest.py), so `interrupt` switches
    weights mid-rollout and scores the prefix at the switch. The sharded train step is a Ray Data
    actor holding the default group (the sharded trainer's only async run)."""
    import ray

    from trajflow.engines.models import WARM_START_DIR, load_model
    from trajflow.pipelines.rl_loop import RLPipeline

    config = PipelineConfig(steps=4, prompts_per_step=4, group_size=4, drop_zero_variance_groups=False, seed=1,
                            strategy=strategy, max_staleness=1, trainer={"sharding": "fsdp", "num_workers": 2},
                            weight_sync=COLLECTIVE, recovery=NO_RESTARTS,
                            old_logprob_forward="always")  # the scorers' forward on the collective's weights
    m = publish_inside_rollouts(RLPipeline(config)).run(progress=False)
    print(f"\n{strategy} S=1, fsdp x2, collective: max|log old - log inference| "
          f"{m['mismatch/max_abs_log_rd'].max():.2e}, rows spanning versions {m['rows_spanning_versions'].sum()}, "
          f"bytes sent per step {m['weight_sync_bytes'].to_list()}")
    assert m["step"].to_list() == list(range(4))
    assert m["mismatch/max_abs_log_rd"].max() < 1e-5
    assert (m["trainer/num_workers"] == 2).all() and (m["optimizer_steps"] > 0).all()
    # Ray Data ended the train step: its FSDP workers and their placement group ended with the run
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    assert m["staleness/max"].max() == 1  # tokens one version behind the trainer were trained
    assert m["staleness/over_stale_tokens"].sum() == 0
    if strategy == "interrupt":
        assert m["rows_spanning_versions"].sum() > 0, "no trajectory spanned two versions"
    # each version went to every reader still at work: all of them by step 1. A version is sent while
    # the next step trains and counted when its delivery ends, so a step's row holds 0, 1 or 2
    # versions' bytes (the offer at step k+1 returns once step k's version is delivered): the running total through step k is between k and k+1 versions to every reader,
    # fewer at the end, when Ray Data ends a finished generator and the trainer stops sending to it
    readers = 1 if strategy == "interrupt" else 2
    version_bytes = _unique_bytes(load_model(WARM_START_DIR).state_dict(), torch.float32)
    sent = m["weight_sync_bytes"].fill_null(0).to_list()
    total = [sum(sent[:k + 1]) for k in range(len(sent))]
    assert all(x % version_bytes == 0 for x in sent), sent
    assert total[1] in (readers * version_bytes, 2 * readers * version_bytes), sent  # v1 (and maybe v2), all
    assert all(total[k] <= (k + 1) * readers * version_bytes for k in range(len(sent))), sent
    if "snapshot/bytes" in m.columns:  # the store keeps numbers, not tensors (the initial version aside)
        assert (m["snapshot/bytes"][1:] == 0).all()


def test_the_gpu_config_shards_the_trainer_and_syncs_by_collective():
    """jobs/configs/gpu_qwen_fsdp.yaml validates (its checkpoint swapped for the warm start: no GPU
    or Qwen download here) and asks for FSDP over GPU workers and NCCL-capable collective sync."""
    import yaml

    from trajflow.engines.models import WARM_START_DIR
    from trajflow.jobs.config import CONFIGS_DIR, build_job_config

    data = yaml.safe_load((CONFIGS_DIR / "gpu_qwen_fsdp.yaml").read_text())
    assert data.pop("engine") == "vllm" and data.pop("vllm")  # vllm is not installed here (.ci/vllm-tests has it)
    config = build_job_config(data, [f"model={WARM_START_DIR}"]).pipeline_config()
    assert (config.trainer.sharding, config.trainer.num_workers, config.trainer.num_gpus) == ("fsdp", 2, 1)
    assert config.weight_sync.method == "collective"
    assert config.generator.num_gpus == 1 and config.scorer.num_gpus == 1  # every end on a GPU: NCCL links
    assert config.reader_dtypes(config.build_strategy()) == ("bfloat16", "float32")


def test_trajflow_run_ends_a_lost_transfer_with_its_one_line():
    """Ray Data hands the driver the train step's error wrapped, Ray's advice appended: the run
    prints the WeightSyncError's own line (jobs/run.py, as for a lost trainer worker)."""
    from trajflow.jobs.errors import stop_line

    line = ("trajflow: weight_sync (reader 1, trainer side): bucket 2 of version 5: peer lost "
            "(Connection closed by peer) (weight_sync.timeout_seconds=120)")
    try:
        try:
            raise WeightSyncError(line)
        except WeightSyncError as cause:
            raise RuntimeError("UserCodeException: ... To change retry attempts, configure ray.data.DataContext") \
                from cause
    except RuntimeError as wrapped:
        assert stop_line(wrapped, WeightSyncError) == line
    text = RuntimeError(f"ray::MapWorker failed\nWeightSyncError: {line}\nTo change retry attempts ...")
    assert stop_line(text, WeightSyncError) == line  # only the text crossed the process boundary
    assert stop_line(RuntimeError("something else"), WeightSyncError) is None
