"""Overlay metrics of several runs: one panel per metric, one line per run (its folder's name).

    python docs/course/plot.py runs/course/04_beta_* --metrics eval/pass@1 loss/kl --out runs/course/04.png

Reads each run's metrics.jsonl (a row per step; evals are rows of their own). Prints the first and last value of
every metric of every run, the numbers the lesson's questions ask about.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(run: Path, metric: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of `metric` in `run/metrics.jsonl`, in logged order."""
    steps, values = [], []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if metric in row:
            steps.append(row["step"])
            values.append(row[metric])
    return steps, values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with a metrics.jsonl)")
    ap.add_argument("--metrics", nargs="+", default=["rollout/reward_mean", "eval/pass@1"])
    ap.add_argument("--out", type=Path, default=Path("plot.png"))
    opts = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in opts.runs if (r / "metrics.jsonl").is_file()]
    if not runs:
        ap.error("none of the folders has a metrics.jsonl")
    fig, axes = plt.subplots(1, len(opts.metrics), figsize=(4.5 * len(opts.metrics), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], opts.metrics):
        for i, run in enumerate(runs):  # a run keeps its colour in every panel, logged there or not
            steps, values = series(run, metric)
            if values:
                ax.plot(steps, values, marker="o" if len(values) < 8 else None, label=run.name, color=f"C{i % 10}")
                print(f"{run.name:32s} {metric:28s} {values[0]:9.4f} -> {values[-1]:9.4f}  ({len(values)} points)")
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(opts.out, dpi=110)
    print(f"written: {opts.out}")


if __name__ == "__main__":
    main()
