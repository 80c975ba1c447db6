import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray instance for the whole test session (2 logical CPUs, like this machine);
    under pytest-xdist, one per worker."""
    import ray

    from trajflow.pipelines.ray.embedded import start_local_ray

    start_local_ray(num_cpus=2, log_to_driver=False)  # 127.0.0.1 only; ended with the test process
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
    from trajflow.pipelines.ray.embedded import end_sessions

    end_sessions()  # its session dir (an xdist worker may end without running atexit hooks)


@pytest.fixture(scope="session")
def chaos():
    """scripts/chaos.py (a script, not a package module): `chaos_run` kills processes of a
    `trajflow run` subprocess at chosen steps."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "chaos.py"
    spec = importlib.util.spec_from_file_location("trajflow_chaos", path)
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)  # registered first: its dataclasses look their module up
    return module


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from intra-op threads, and on a loaded 2-core machine two threads
    made each linear ~50x slower. Test-only; library code leaves threads to the caller."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny model and tokenizer, randomly initialised (seed 0)."""
    from trajflow.engines.models import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[0]


@pytest.fixture(scope="session")
def publish_inside_rollouts():
    """Make "a rollout spans two weight versions" deterministic instead of a timing race.

    Returns `apply(pipe)`, which swaps the pipeline's generate stage for a subclass that, whenever
    it runs ahead of the trainer (rollout step > resident version), waits once per rollout, after
    the first sampled token, for the trainer's next publish and then lets the normal switch logic
    take it. Safe from deadlock: the trainer's next version needs only batches the (single,
    in-order) generator has already emitted. Everything else is the real pipeline on real Ray.
    """
    import dataclasses

    from trajflow.operators.generate import Generate

    class GenerateWithPublishInsideRollout(Generate):
        def __call__(self, batch):
            self._rollout_step = int(batch["rollout_step"][0].as_py())
            self._waited_this_rollout = False
            return super().__call__(batch)

        def _switch_if_newer(self, pins, views, old_logprobs, *top_k) -> None:
            ahead = self._rollout_step > self.engine.version
            sampled = any(len(row.response_tokens) for row in views())
            if ahead and sampled and not self._waited_this_rollout:
                self._waited_this_rollout = True
                self.store.wait_for_version(self.engine.version + 1)
            super()._switch_if_newer(pins, views, old_logprobs, *top_k)

    def apply(pipe):
        generate = dataclasses.replace(pipe.stage("generate"), fn=GenerateWithPublishInsideRollout)
        return pipe.replace("generate", generate)

    return apply


@pytest.fixture(scope="session")
def bpe():
    """A byte-level BPE tokenizer with a chat template, trained here (scripts/make_byo_example.py),
    and the word problems it was trained on: (tokenizer, train rows, test rows)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import make_byo_example

    train, test = make_byo_example.make_problems(seed=3, n_train=48, n_test=8)
    return make_byo_example.train_tokenizer(train, 320), train, test


@pytest.fixture(scope="session")
def bpe_model_dir(bpe, tmp_path_factory):
    """A tiny randomly initialised Qwen2 saved with the BPE tokenizer (generation config: two eos)."""
    import make_byo_example

    from trajflow.engines.models import save_model

    path = tmp_path_factory.mktemp("bpe_model")
    save_model(make_byo_example.build_model(bpe[0], seed=0), bpe[0], path)
    return path


USER_STRATEGY_MODULE = '''
import dataclasses

from trajflow.operators.strategies import Strategy


class HalfwayOld(Strategy):
    """A strategy the package does not know: old := the log-space midpoint of mu and pi_theta."""

    name = "halfway"
    kind = "baseline"
    meaning = "old := (log mu + log pi_theta) / 2, clip 0.1"

    def correction(self, base):
        return dataclasses.replace(base, eps_low=0.1, eps_high=0.1)

    def old_logprobs(self, batch, current, trainer):
        return 0.5 * (batch.inference + current.detach())


class NotAStrategy:
    pass


class Nameless(Strategy):
    kind = "baseline"
'''


@pytest.fixture
def user_strategy_module(tmp_path):
    """Write a module defining strategies outside the package; returns (its dir, module name).
    The module is forgotten after the test (another test writes its own)."""
    import sys

    names = []

    def write(name: str = "my_corrections"):
        (tmp_path / f"{name}.py").write_text(USER_STRATEGY_MODULE)
        names.append(name)
        return tmp_path, name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def one_worker_sync_run(ray_session):
    """tests/test_trainer_dp.py's SYNC pipeline on one worker, in this process: (metrics, final
    weights), the run that data-parallel and sharded workers must reproduce (computed once)."""
    from support import SYNC, run_with_final_weights

    from trajflow.pipelines.config import PipelineConfig

    return run_with_final_weights(PipelineConfig(**SYNC))


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for pyproject's `-n auto`: two; none when the command names tests of one file
    only (a file goes to one worker whole, so workers would only add their start-up). Three were
    no faster on this 2-core machine: the suite is CPU-bound (710 s on two, 731 s on three at
    0.7% idle)."""
    files = {arg.split("::")[0] for arg in config.args}
    return 0 if len(files) == 1 and next(iter(files)).endswith(".py") else 2


# The files that take longest, longest first (measured in one serial run on this 2-core machine).
# The two pytest-xdist workers take a whole file at a time, in collection order
# (`--no-loadscope-reorder`): the long files start first and the short ones fill in at the end,
# so neither worker is left alone with a long file (measured: the suite in 767 s, both
# workers busy to within 25 s of each other; 1003 s serial).
LONGEST_FIRST = ("test_jobs_run.py", "test_pipeline.py", "test_recovery.py", "test_notebook.py",
                 "test_byo_pipeline.py", "test_trainer_fsdp.py", "test_jobs_cluster.py", "test_trainer_dp_jobs.py",
                 "test_strategies_pipeline.py", "test_weight_sync.py", "test_team.py",
                 "test_real_model.py")  # ~1 min, plus ~30 s the first time it prepares the model


def pytest_collection_modifyitems(config, items):
    for item in items:  # the session's Ray is seconds to start and its tests run pipelines: slow
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
