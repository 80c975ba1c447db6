"""Run the benchmarks side by side and write benchmarks/RESULTS.md.

    python -m benchmarks.run_all                    # all of them, full settings (~2 h on 2 cores)
    python -m benchmarks.run_all --only overhead    # refresh one section
    python -m benchmarks.run_all --quick            # a smoke pass with tiny settings
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import (  # noqa: E402
    async_vs_sync,
    compute_bound,
    data_plane,
    end_to_end,
    evidence,
    hops,
    orchestration,
    publish,
    startup,
    store_calls,
    strategy_overhead,
    strategy_quality,
    trainer_dp,
    trainer_fsdp,
    trl_compare,
    weight_sync,
)
from benchmarks.common import machine, table  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
SECTIONS = HERE / "results"  # one file per benchmark, so each can be refreshed on its own
ORDER = ["quality", "async_vs_sync", "overhead", "data_plane", "hops", "store_calls", "orchestration", "compute_bound", "publish",
         "trainer_dp", "trainer_fsdp", "weight_sync", "startup", "end_to_end", "trl", "evidence_regime"]


def run_section(name: str, quick: bool, strategies: list[str] | None = None) -> tuple[str, str]:
    """(title, markdown table) of one benchmark."""
    q = quick
    if name == "data_plane":
        return "4. Data plane: reward + advantage + filter on one core", table([data_plane.run(rows=512 if q else 4096)])
    if name == "async_vs_sync":
        return ("2. Async vs sync (snapshot, same steps and samples; async max_staleness 2)",
                table([async_vs_sync.run(steps=12 if q else 40)]))
    if name == "overhead":
        return ("3. Strategy overhead relative to `behavior` (max_staleness 2, bf16 inference)",
                table(strategy_overhead.run(steps=12 if q else 30)))
    if name == "quality":
        steps, seeds = (6, 1) if q else (strategy_quality.STEPS, 3)
        rows = strategy_quality.run(steps=steps, seeds=seeds, staleness=[0, 2, 4])
        return (f"1. Strategy quality (bf16 inference, {steps} steps x {strategy_quality.SAMPLES} samples, "
                f"{seeds} seeds, lr {strategy_quality.LR}; held-out greedy accuracy on "
                f"{strategy_quality.EVAL_PROMPTS} prompts; warm start {strategy_quality.WARM_START_ACCURACY})",
                table(rows))
    if name == "hops":
        return ("5. One operator hop while a long task is active (4 one-actor stages x 20 ms, synchronous chain)",
                table(hops.run(items=20 if q else 40)))
    if name == "store_calls":
        return ("5b. The policy store's per-step calls, from an actor", table(store_calls.run(calls=50 if q else 200)))
    if name == "orchestration":
        return ("6. The pipeline's own cost per step (quickstart size: 16 prompts x 8 samples, 6 tokens, snapshot)",
                table(orchestration.run(steps=10 if q else 40)))
    if name == "compute_bound":
        return ("7. Compute-bound point (25 M-parameter Llama, random init, 2 prompts x 8 samples, 64 tokens)",
                table(compute_bound.run(steps=6 if q else 12, strategies=strategies or (
                    ["behavior", "snapshot"] if q else compute_bound.STRATEGIES))))
    if name == "publish":
        return ("8. Publishing a weight version, per model size (trainer -> policy store -> a reader)",
                table(publish.run(sizes=("0.6M", "25M") if q else tuple(publish.SIZES), repeats=2 if q else 5)))
    if name == "trainer_dp":
        return ("8b. Data-parallel training: the gradient all-reduce per update vs compute and publishing "
                "(2 gloo workers on one node)",
                table(trainer_dp.run(sizes=("0.6M", "25M") if q else tuple(trainer_dp.SIZES), repeats=2 if q else 5)))
    if name == "trainer_fsdp":
        return ("8c. Sharded training (`trainer.sharding: fsdp`): what each worker holds of parameters, gradients and "
                "AdamW state, vs the replica (gloo workers on one node, one step of 16 x 64 tokens)",
                table(trainer_fsdp.run(sizes=("0.6M", "25M") if q else trainer_fsdp.SIZES)))
    if name == "weight_sync":
        return ("8d. One weight version from the trainer to a reader: object store vs collective (gloo, one node), "
                f"float32 vs bf16 transfer (reader decodes {weight_sync.BUSY_SECONDS:g} s per version meanwhile)",
                table(weight_sync.run(sizes=("25M",) if q else weight_sync.SIZES, versions=2 if q else 3)))
    if name == "startup":
        return ("9. Start-up of `trajflow run quickstart` to the end of its first step, and its process tree "
                "(cold process, CPU seconds per process)", startup.run(steps=5 if q else 20))
    if name == "end_to_end":
        return ("9b. `trajflow run quickstart` from enter to exit, beside its start-up plus its steps' compute "
                "(the quickstart as shipped; cold process)", end_to_end.run(steps=5 if q else None))
    if name == "trl":
        return ("10. Side by side with TRL's GRPOTrainer (quickstart size: 16 prompts x 8 samples, 6 tokens)",
                table(trl_compare.run(steps=12 if q else 60, repeats=1 if q else 3)))
    if name == "evidence_regime":
        return ("11. Evidence, the mechanism: each proxy's gradient against exact old log-probs on the same batch, "
                "by replay at staleness S (benchmarks/evidence.py)", evidence.run_regime(quick=q))
    raise ValueError(f"unknown benchmark {name!r}; choose from {ORDER}")


def assemble() -> str:
    parts = ["# Benchmarks\n\nGenerated by `python -m benchmarks.run_all` from `benchmarks/results/*.md` "
             "(each section says the command, machine and date it ran on; refresh one with `--only NAME`)."]
    parts += [(SECTIONS / f"{name}.md").read_text().strip() for name in ORDER if (SECTIONS / f"{name}.md").exists()]
    reading = SECTIONS / "reading.md"
    if reading.exists():
        parts.append(reading.read_text().strip())
    return "\n\n".join(parts) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="tiny settings: a smoke pass, not numbers to quote")
    p.add_argument("--only", nargs="*", default=ORDER, choices=ORDER)
    p.add_argument("--strategies", nargs="*", help="compute_bound: these strategies (behavior first) instead of all")
    a = p.parse_args()
    SECTIONS.mkdir(exist_ok=True)
    for name in a.only:
        started = time.time()
        title, body = run_section(name, a.quick, a.strategies)
        command = f"python -m benchmarks.run_all --only {name}{' --quick' if a.quick else ''}"
        if a.strategies and name == "compute_bound":
            command += " --strategies " + " ".join(a.strategies)
        load = os.getloadavg()
        text = (f"## {title}\n\nCommand: `{command}`  \nMachine: {machine()}  \n"
                f"Date: {datetime.date.today()}; wall time {time.time() - started:.0f} s; load average at the end "
                f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min; above 2 the numbers are inflated "
                f"by other work)\n\n{body}\n")
        (SECTIONS / f"{name}.md").write_text(text)
        print(text, flush=True)
    RESULTS.write_text(assemble())
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
