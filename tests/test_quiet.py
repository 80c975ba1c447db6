"""pipelines/ray/quiet.py: Ray's C++ notices filtered from fd 2 (in a terminal and where Python's
stderr is not fd 2, as in a notebook kernel), and quiet_run's settings put back at its end.
(tests/test_notebook.py checks a real kernel: no cell of the notebook writes to stderr.)"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

NOISY = textwrap.dedent("""
    import io, os, sys
    from trajflow.pipelines.ray.quiet import filtered_stderr
    noise = (b"[2026-11-22 21:09:21,418 E 17036 17036] core_worker.cc:2465: Actor with class name: "
             b"'MapWorker(MapBatches(Generate))' and ID: 'ab' has constructor arguments in the object "
             b"store and max_restarts > 0. If the arguments ...\\n")
    if sys.argv[2] == "kernel":  # Python's stderr is an object of its own, fd 2 a pipe it does not read
        sys.stderr = io.StringIO()
    quiet = sys.argv[1] == "quiet"
    with filtered_stderr(enabled=quiet):
        with filtered_stderr(enabled=quiet):  # an inner block adds nothing
            os.write(2, b"a real problem\\n" + noise + b"partial ")
        os.write(2, b"line\\n")
        print("python's own stderr", file=sys.stderr)
    os.write(2, b"after\\n")
    if sys.argv[2] == "kernel":
        os.write(1, sys.stderr.getvalue().encode())
""")


def _run(script, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("where", ["terminal", "kernel"])
def test_rays_c_notices_are_filtered_from_fd_2_unless_verbose(tmp_path, where):
    script = tmp_path / "noisy.py"
    script.write_text(NOISY)
    quiet = _run(script, "quiet", where)
    assert quiet.returncode == 0, quiet.stderr
    assert "core_worker" not in quiet.stderr
    fd2 = ["a real problem", "partial line", "after"]
    if where == "terminal":  # Python's own writes reach the same terminal, straight
        assert sorted(quiet.stderr.splitlines()) == sorted(fd2 + ["python's own stderr"])
    else:
        assert quiet.stderr.splitlines() == fd2 and quiet.stdout == "python's own stderr\n"
    verbose = _run(script, "verbose", where)
    assert "max_restarts > 0" in verbose.stderr and "a real problem" in verbose.stderr


def test_a_child_started_in_the_block_neither_delays_its_end_nor_escapes_the_filter(tmp_path):
    """Ray's processes started inside the block inherit its fd 2 (the pipe): the block still ends
    at once, and what they write later is still filtered."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys, time
        from trajflow.pipelines.ray.quiet import filtered_stderr
        late = ("import os, time; time.sleep(1.5); "
                "os.write(2, b'child late\\\\n[E] core_worker.cc:1: Actor with class name: x max_restarts > 0\\\\n')")
        with filtered_stderr():
            child = subprocess.Popen([sys.executable, "-c", late])
            os.write(2, b"in the block\\n")
            started = time.monotonic()
        print(f"{time.monotonic() - started:.2f}")
        child.wait()
        time.sleep(0.3)  # the pump passes the child's lines on
    """))
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 1.0  # not the 2 s the block waited for the pipe to close
    assert proc.stderr.splitlines() == ["in the block", "child late"]


def test_quiet_run_sets_ray_data_and_transformers_quiet_and_puts_them_back():
    import transformers.utils.logging as hf_logging
    from ray.data import DataContext

    from trajflow.pipelines.ray.quiet import RAY_DATA_LOGGERS, quiet_run

    context = DataContext.get_current()
    before = (context.enable_progress_bars, list(context.issue_detectors_config.detectors),
              [logging.getLogger(n).level for n in RAY_DATA_LOGGERS], hf_logging.is_progress_bar_enabled())
    context.enable_progress_bars = True
    logging.getLogger("ray.data").setLevel(logging.INFO)
    hf_logging.enable_progress_bar()
    detectors = list(context.issue_detectors_config.detectors)
    assert detectors, "Ray Data 2.60 ships issue detectors"
    try:
        with quiet_run(verbose=True):
            assert context.enable_progress_bars and hf_logging.is_progress_bar_enabled()
            assert logging.getLogger("ray.data").level == logging.INFO
        with quiet_run():
            assert not context.enable_progress_bars and not hf_logging.is_progress_bar_enabled()
            assert [logging.getLogger(n).level for n in RAY_DATA_LOGGERS] == [logging.WARNING] * 2
            assert context.issue_detectors_config.detectors == []
            with quiet_run():  # nested (a job around RLPipeline.run): still quiet after the inner block
                pass
            assert not context.enable_progress_bars and not hf_logging.is_progress_bar_enabled()
            assert logging.getLogger("ray.data").level == logging.WARNING
        assert context.enable_progress_bars and hf_logging.is_progress_bar_enabled()
        assert logging.getLogger("ray.data").level == logging.INFO
        assert context.issue_detectors_config.detectors == detectors
    finally:
        bars, kept, levels, hf_bars = before
        context.enable_progress_bars = bars
        context.issue_detectors_config.detectors = kept
        for name, level in zip(RAY_DATA_LOGGERS, levels):
            logging.getLogger(name).setLevel(level)
        (hf_logging.enable_progress_bar if hf_bars else hf_logging.disable_progress_bar)()
