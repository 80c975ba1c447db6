"""Does the two-agent relay learn, and do independent policies differ from one shared policy?

The relay (tasks/team.py `RelayEnv`) on addition: `lead` writes the answer's first token,
`finish` the rest; both get the team reward (exact match of the whole answer). Both agents start
from the committed warm start of addition. Per seed, two runs from the same start and prompts:
independent policies (two learners) and one shared policy (one learner training both agents'
rows), each at staleness 1 held exactly (pipelines/team.py `lags`), quickstart's settings
otherwise (snapshot, bf16 inference, lr 3e-4, 128 prompts x 8 per step). The measure is the
team's greedy held-out reward (= accuracy: the relay's reward is 0/1) at versions 0, 10, 20, 30.

    python -m benchmarks.multi_agent --seeds 0 1 2 --out benchmarks/results/multi_agent.json

Results: benchmarks/results/multi_agent.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

BASE = dict(task="addition", steps=30, prompts_per_step=128, group_size=8, max_staleness=1, strategy="snapshot",
            inference_dtype="bfloat16", sampling=dict(temperature=1.0, max_new_tokens=6),
            optimizer=dict(lr=3.0e-4), trainer=dict(max_tokens_per_microbatch=4096))
SETUPS = {"independent": False, "shared": True}


def run(seed: int, share_policy: bool, steps: int, eval_every: int, eval_prompts: int) -> dict:
    """One run: its held-out curve, per-step rewards and staleness, and its wall time."""
    from trajflow.pipelines.config import PipelineConfig
    from trajflow.pipelines.team import TeamPipeline, heldout, iter_team_in_process, new_store
    from trajflow.tasks.addition import AdditionTask
    from trajflow.tasks.team import RelayEnv

    started = time.perf_counter()
    team = TeamPipeline.of(PipelineConfig(**{**BASE, "steps": steps, "seed": seed}), RelayEnv(AdditionTask()),
                           share_policy=share_policy)
    stores = {name: new_store(pipe) for name, pipe in team.learners.items()}
    curve = {0: heldout(team, stores, eval_prompts)["heldout/lead"]}
    rows = []
    for _, row in iter_team_in_process(team, {name: 1 for name in team.learners}, eval_every, eval_prompts,
                                       stores=stores):
        rows.append(row)
        if "heldout/lead" in row:
            curve[row["step"] + 1] = row["heldout/lead"]
        print(f"  step {row['step']:2d}  lead reward {row['lead/reward/mean']:.3f}  finish reward "
              f"{row['finish/reward/mean']:.3f}  staleness {row['lead/staleness/max']}/"
              f"{row['finish/staleness/max']}", flush=True)
    return dict(seed=seed, share_policy=share_policy, heldout=curve, seconds=time.perf_counter() - started,
                reward={a: [r[f"{a}/reward/mean"] for r in rows] for a in ("lead", "finish")},
                staleness={a: [r[f"{a}/staleness/max"] for r in rows] for a in ("lead", "finish")},
                loss_tokens={a: [r[f"{a}/loss_tokens"] for r in rows] for a in ("lead", "finish")})


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        versions = sorted(int(v) for v in r["heldout"])
        style, marker = ("--", "s") if r["share_policy"] else ("-", "o")
        color = f"C{r['seed']}"
        ax.plot(versions, [r["heldout"][v] for v in versions], style, color=color, marker=marker,
                label=f"{'shared' if r['share_policy'] else 'independent'}, seed {r['seed']}")
    ax.set_xlabel("train step (each learner's version)")
    ax.set_ylabel("held-out team accuracy (greedy, 1,000 prompts)")
    ax.set_title("Two-agent relay on addition: independent vs shared policy")
    ax.legend(fontsize=7, handlelength=4)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=1000)
    p.add_argument("--out", type=Path, required=True, help="the results (JSON); the plot beside it (.png)")
    args = p.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else []
    done = {(r["seed"], r["share_policy"]) for r in results}
    for seed in args.seeds:
        for name, shared in SETUPS.items():
            if (seed, shared) in done:
                continue
            print(f"[multi_agent] seed {seed}, {name}", flush=True)
            results.append(run(seed, shared, args.steps, args.eval_every, args.eval_prompts))
            args.out.write_text(json.dumps(results, indent=1))  # resumable: each run saved as it ends
    for r in results:
        r["heldout"] = {int(k): v for k, v in r["heldout"].items()}
    plot(results, args.out.with_suffix(".png"))
    for name, shared in SETUPS.items():
        runs = [r for r in results if r["share_policy"] == shared]
        gains = [r["heldout"][max(r["heldout"])] - r["heldout"][0] for r in runs]
        print(f"{name}: held-out gain {np.mean(gains):+.3f} (per seed {', '.join(f'{g:+.3f}' for g in gains)}), "
              f"{np.mean([r['seconds'] for r in runs]):.0f} s per run")


if __name__ == "__main__":
    main()
