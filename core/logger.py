"""Run folder, metrics and progress: `metrics.jsonl` always, TensorBoard by default, W&B opt-in, a rich progress
bar while training and a summary table at the end. Only rank 0 writes; other ranks get a silent logger.

Metric names follow the house style: `rollout/*`, `loss/*`, `train/*`, `perf/*`, `eval/*`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from pathlib import Path

from core.config import LoggerConfig


def run_name(exp_name: str, seed: int) -> str:
    return f"{exp_name}__{seed}__{int(time.time())}"


class RunLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: str | Path, args, total_steps: int, enabled: bool = True):
        self.cfg, self.enabled, self.run_dir = cfg, enabled, Path(run_dir)
        self.history: list[dict] = []
        self.tb = self.wandb = self.progress = None
        self.start = time.time()
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(args)
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.file = open(self.run_dir / "metrics.jsonl", "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"))
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, name=self.run_dir.name, config=config,
                                    dir=str(self.run_dir), mode=cfg.wandb_mode)  # fmt: skip
        if not cfg.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[shown]}"),
            )  # fmt: skip
            self.task = self.progress.add_task(self.run_dir.name.split("__")[0], total=total_steps, shown="")
            self.progress.start()

    def log(self, metrics: dict, step: int, shown: tuple[str, ...] = ()) -> None:
        """Record metrics for `step`; `shown` names the metrics to display next to the progress bar."""
        if not self.enabled:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self.history.append({"step": step, **metrics})
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.progress:
            text = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in shown if k in metrics)
            self.progress.update(self.task, completed=step, **({"shown": text} if text else {}))

    def print(self, *msg) -> None:
        if self.enabled and not self.cfg.quiet:
            from rich import print as rprint

            (self.progress.console.print if self.progress else rprint)(*msg)

    def latest(self, key: str, default=float("nan")) -> float:
        """Most recent value logged under `key`."""
        for row in reversed(self.history):
            if key in row:
                return row[key]
        return default

    def plot(self, path: str | Path, keys: tuple[str, ...]) -> None:
        """A PNG of the logged `keys` against step (e.g. the RL scripts' learning curve: reward and eval pass@1)."""
        if not self.enabled:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            pts = [(h["step"], h[key]) for h in self.history if key in h]
            if pts:
                ax.plot(*zip(*pts), marker="." if key.startswith("eval") else None, label=key)
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def close(self, summary: dict | None = None) -> None:
        """Stop the progress bar and print (and save to `summary.json`) the end-of-run summary."""
        if not self.enabled:
            return
        if self.progress:
            self.progress.stop()
        summary = {"wall_s": round(time.time() - self.start, 1), **(summary or {})}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        if not self.cfg.quiet:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=f"summary: {self.run_dir}")
            table.add_column("metric")
            table.add_column("value", justify="right")
            for k, v in summary.items():
                table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
            Console().print(table)
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


@contextmanager
def timer(out: dict, key: str):
    """`with timer(perf, "perf/train_s"):` adds the block's wall time to out[key]."""
    t0 = time.perf_counter()
    yield
    out[key] = out.get(key, 0.0) + time.perf_counter() - t0
