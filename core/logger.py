"""Run folder, metrics and progress: `metrics.jsonl` always, TensorBoard by default, W&B opt-in, a rich progress
bar while training and a summary table at the end. Only rank 0 writes; other ranks get a silent logger.

A resumed run (`resume_step` > 0) continues the same records: rows and TensorBoard events past the checkpoint's step
(written by the run that was killed) are dropped, so every step is logged once; `config.json` keeps the flags the
run started with and every flag that differs on resume is appended to `config_changes.jsonl`. A run that starts from
step 0 in a folder that already holds a run moves the old run's files into `previous_<unix time>/`.

A run folder has one writer: before anything in it is moved or written, rank 0 takes `<run>/.lock` (`lock_run_dir`),
which names its host and pid, and a second run on the folder is refused while the first runs. The lock is released
when the logger closes (or the process exits); a lock whose process is dead (killed on this host) is taken over with
a warning, so the same command resumes a killed run.

Metric names follow the house style: `rollout/*`, `loss/*`, `train/*`, `perf/*`, `eval/*`; `Meter` merges an RL
update's metrics over micro-batches, optimizer steps and ranks.
"""

from __future__ import annotations

import atexit
import dataclasses
import fnmatch
import json
import os
import socket
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from core.config import LoggerConfig, flat_keys, run_dir_problem

HARMLESS_FLAGS = (
    "exp_name", "run_dir", "export_dir", "debug", "logger.*", "ckpt.*", "train.halt_after", "ds.timeout_s", "ray.*",
    "vllm.timeout_s", "vllm.gpu_memory_utilization", "vllm.kv_cache_gib", "vllm.sync_bucket_mb", "vllm.sync_backend",
    "vllm.in_process", "reward.timeout_s", "reward.retries",
)  # fmt: skip
"""Flags (dotted config keys, fnmatch patterns) that may change on resume without `--ckpt.allow-changes`: they change
where and how a run is logged, checkpointed, halted or placed, and how long it waits, never what it computes. Every
other flag (model, data, optimizer, algorithm, batch sizes, ZeRO stage, vLLM sampling and memory mode, ...) alters the
run."""

RENAMED_FLAGS = {"train.max_tokens_per_micro_batch": "train.max_tokens_per_micro"}
"""Flags (dotted config keys) renamed since runs were saved under the old name -> the new name: a saved run's
config.json is read with the new names, so it resumes (and is compared) as if it had been saved today."""

ABSENT = "<absent>"
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "config.json", "config_changes.jsonl", "summary.json", "tb", "wandb",
             "wandb_id", "learning_curve.png", "report.html", "checkpoints", "hf", "best")  # fmt: skip
"""What the scripts write into a run folder: moved aside together when a new run starts in the folder."""


def run_name(exp_name: str, seed: int) -> str:
    return f"{exp_name}__{seed}__{int(time.time())}"


def config_dict(args) -> dict:
    """The flags as `config.json` holds them (JSON types: tuples become lists, paths strings)."""
    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(args)
    return json.loads(json.dumps(config, default=str))


def flag_name(key: str) -> str:
    """`train.halt_after` -> `--train.halt-after`."""
    return "--" + key.replace("_", "-")


def _model_path(key: str, value):
    """An embedded model's name (`cleanrlhf/tiny-sft`) as the folder it resolves to, for the model fields: a run
    launched through Ray saves the resolved folder, a one-process run the name, and both mean the same model."""
    if key.rsplit(".", 1)[-1] in ("name_or_path", "model", "tokenizer") and isinstance(value, str):
        from core import embedded

        return embedded.resolve_model(value) if value.startswith(embedded.PREFIX) else value
    return value


def config_changes(saved: dict, now: dict, defaults: dict | None = None) -> list[dict]:
    """Every flag whose value differs between two `config_dict`s: {"flag", "saved", "now", "harmless"}, with
    `<absent>` for a flag one side lacks (e.g. added to the code since the run started). Such a new flag left at its
    default (`defaults`, a `config_dict` of the script's default Args) is harmless: a new option's default keeps
    the behaviour the run started with."""
    old, new, default = flat_keys(saved), flat_keys(now), flat_keys(defaults or {})
    old = {RENAMED_FLAGS.get(k, k): v for k, v in old.items()}
    old, new = ({k: _model_path(k, v) for k, v in d.items()} for d in (old, new))
    return [{"flag": flag_name(k), "saved": old.get(k, ABSENT), "now": new.get(k, ABSENT),
             "harmless": any(fnmatch.fnmatchcase(k, pat) for pat in HARMLESS_FLAGS)
             or (k not in old and k in default and new.get(k, ABSENT) == default[k])}
            for k in sorted(old.keys() | new.keys()) if old.get(k, ABSENT) != new.get(k, ABSENT)]  # fmt: skip


def check_config(run_dir: str | Path, args) -> list[dict]:
    """Compare `args` (as `config_dict`) with the flags saved in `<run_dir>/config.json` when the run started and
    return the changes (`config_changes`; [] when there is no saved config). Raises ValueError listing every changed
    flag as `--section.flag-name: saved -> now` when one of them alters the run (not in `HARMLESS_FLAGS`) and
    `--ckpt.allow-changes` is off. Reads only: callable on every rank, so that all of them stop alike."""
    saved_file = Path(run_dir) / "config.json"
    if not saved_file.is_file():
        return []
    now = config_dict(args)
    try:  # the script's defaults, for flags the code gained since the run started
        defaults = config_dict(type(args)()) if dataclasses.is_dataclass(args) else None
    except TypeError:  # an Args without defaults for every field
        defaults = None
    saved = read_json(saved_file, "it holds the flags the run started with: restore it, or delete it to resume "
                      "without comparing them (the resumed run's flags are saved in its place)")  # fmt: skip
    if not isinstance(saved, dict):
        raise ValueError(f"{saved_file}: not the flags of a run (a JSON object); restore it, or delete it to resume "
                         "without comparing them")  # fmt: skip
    changes = config_changes(saved, now, defaults)
    altering = [c for c in changes if not c["harmless"]]
    if altering and not now.get("ckpt", {}).get("allow_changes", False):
        lines = [f"  {c['flag']}: {c['saved']} -> {c['now']}{'  (harmless)' if c['harmless'] else ''}" for c in changes]
        raise ValueError(f"resuming {run_dir} with flags that differ from its {saved_file.name}:\n" + "\n".join(lines)
                         + "\npass --ckpt.allow-changes to resume with them anyway (recorded in config_changes.jsonl), "
                         "or use the saved values, or another --run-dir")  # fmt: skip
    return changes


LOCK = ".lock"
"""The run folder's lock file: JSON {"host", "pid", "started", "time"} of the process that writes the folder."""
_held: dict[Path, Path] = {}  # run folder (resolved) -> its lock file, for the locks this process holds


class RunDirLocked(ValueError):
    """Another run (a live process) holds the run folder's lock."""


def _process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: clock ticks after boot, /proc/<pid>/stat field 22), so that a pid reused by
    another process is not taken for the lock's holder; None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(holder: dict) -> bool:
    """Whether the lock's holder (a process of this host) still runs: its pid exists, is not a zombie and, where the
    start time is known, started when the holder did."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    started = _process_start(pid)
    return holder.get("started") is None or started is None or started == holder["started"]


def _read_lock(lock: Path) -> tuple[str | None, dict | None]:
    """The lock file's text (None: it is gone) and its holder (None: not a lock's JSON, e.g. still being written, or
    not text: bytes that are not UTF-8 are read as U+FFFD)."""
    try:
        text = lock.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None, None
    try:
        holder = json.loads(text)
    except ValueError:
        return text, None
    return text, holder if isinstance(holder, dict) and "host" in holder and "pid" in holder else None


def lock_run_dir(run_dir: str | Path, enabled: bool = True) -> Path | None:
    """Take the run folder's lock `<run_dir>/.lock` (created with O_CREAT | O_EXCL, holding this host and pid) before
    anything in the folder is moved or written; the scripts call it on rank 0 (`enabled`) before they resume, and
    `RunLogger` takes it too. Held by this process already: nothing to do. Held by a running process, or by one on
    another host (whose liveness cannot be checked): `RunDirLocked` naming the folder, the holder's host and pid. Left
    by a process of this host that is no longer running (a killed run): taken over with a warning, by one run at a
    time (`_takeover`), so of several runs started at once exactly one gets it. A `run_dir` that cannot be a folder
    (a file): ValueError naming `--run-dir` (`make_run_dir`). Released by `release_run_dir` (`RunLogger.close`) or
    at exit. Returns the lock file (None when not `enabled`)."""
    if not enabled:
        return None
    run_dir = make_run_dir(run_dir)
    lock, key = run_dir / LOCK, run_dir.resolve()
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid())}
    for _ in range(50):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            text, holder = _read_lock(lock)
            if text is None:  # released (or taken over) meanwhile: try again
                continue
            if holder is None:  # created by another run a moment ago and not written yet, or not a lock
                deadline = time.monotonic() + 2.0
                while _read_lock(lock)[0] == text and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _read_lock(lock)[0] == text:
                    raise RunDirLocked(f"{run_dir} is locked by {lock}, which does not name its run ({text[:200]!r}); "
                                       f"if no run uses the folder, delete {lock}") from None  # fmt: skip
                continue
            if holder["host"] == me["host"] and holder["pid"] == me["pid"]:  # this process: an earlier open
                _hold(key, lock)
                return lock
            if holder["host"] != me["host"] or _running(holder):
                since = f" since {holder['time']}" if holder.get("time") else ""
                raise RunDirLocked(
                    f"{run_dir} is in use by another run (host {holder['host']}, pid {holder['pid']}{since}): a run "
                    f"folder has one writer. Wait for that run to end or give this run another --run-dir; if that run "
                    f"is gone (its host lost), delete {lock}"
                ) from None  # fmt: skip
            with _takeover(lock):  # a dead holder: its lock is removed by one run at a time, and only while it is
                if _read_lock(lock)[0] != text:  # still the dead run's (another run took it over meanwhile)
                    continue
                lock.unlink()
            print(f"[logger] warning: {lock} was left by pid {holder['pid']} on {holder['host']}, which is no longer "
                  "running (a killed run?): taken over", file=sys.stderr, flush=True)  # fmt: skip
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({**me, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
            f.flush()
            os.fsync(f.fileno())
        _hold(key, lock)
        return lock
    raise RunDirLocked(f"{run_dir}: could not take {lock} (other runs keep taking and releasing it)")


@contextmanager
def _takeover(lock: Path):
    """Hold `<run>/.lock.takeover` exclusively (flock; released by the kernel if this process dies, so it is never
    stale). Removing a dead run's lock under it makes the takeover exclusive: a run that read the dead lock and
    removed it after another run had already taken it over (and made a new one) would remove the new lock, and a
    third run would then hold the folder beside the second (seen once in 25 trials of 3 simultaneous starts)."""
    import fcntl

    fd = os.open(lock.with_name(LOCK + ".takeover"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def check_run_dir(run_dir: str | Path, flag: str = "--run-dir") -> Path:
    """ValueError naming `flag` when `run_dir`, or a folder above it, is a file (it cannot be a run folder); creates
    nothing, so a script can call it before anything loads (`core.config.run_dir_problem`)."""
    problem = run_dir_problem(run_dir, flag)
    if problem:
        raise ValueError(problem)
    return Path(run_dir)


def make_run_dir(run_dir: str | Path, flag: str = "--run-dir") -> Path:
    """Create the run folder (and the folders above it) if needed; ValueError naming `flag` when it cannot be one:
    it, or a folder above it, is a file (`check_run_dir`), or it cannot be created."""
    run_dir = check_run_dir(run_dir, flag)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {run_dir}: cannot create the run folder ({e.strerror or e})") from None
    return run_dir


def write_json(path: str | Path, value, **dumps) -> None:
    """Write `path` as JSON by rename (a temporary file of this process beside it, then `os.replace`): a kill
    mid-write leaves the old file or none, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(value, **dumps))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | Path, what: str = "") -> object:
    """`path` parsed as JSON; ValueError naming the file when it is not (a file torn by a kill mid-write, by runs
    before files were written by rename, or edited). `what`: a sentence saying what to do about it."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable, not JSON ({e}; torn by a kill mid-write, or edited?)"
                         + (f"; {what}" if what else "")) from None  # fmt: skip


def _hold(key: Path, lock: Path) -> None:
    if not _held:
        atexit.register(_release_all)
    _held[key] = lock


def release_run_dir(run_dir: str | Path) -> None:
    """Release the run folder's lock if this process holds it (the file is removed only while it names this
    process)."""
    lock = _held.pop(Path(run_dir).resolve(), None)
    if lock is None:
        return
    holder = _read_lock(lock)[1]
    if holder is not None and holder["host"] == socket.gethostname() and holder["pid"] == os.getpid():
        lock.unlink(missing_ok=True)


def _release_all() -> None:
    for run_dir in list(_held):
        release_run_dir(run_dir)


def _read_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line torn by a kill mid-write
            continue
    return rows


def _truncate_rows(path: Path, last_step: int) -> list[dict]:
    """Keep the rows of `path` (JSON lines) up to step `last_step`, dropping torn lines; returns them."""
    rows = [r for r in _read_rows(path) if r.get("step", 0) <= last_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return rows


class RunLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: str | Path, args, total_steps: int, enabled: bool = True,
                 resume_step: int = 0):  # fmt: skip
        """`resume_step`: the step (optimizer updates done) of the checkpoint the run resumed from; 0 for a new run."""
        self.cfg, self.enabled, self.run_dir = cfg, enabled, Path(run_dir)
        self.history: list[dict] = []
        self.tb = self.wandb = self.progress = None
        self.start = time.time()
        if not enabled:
            return
        lock_run_dir(self.run_dir)  # before anything in the folder is moved or written; RunDirLocked if in use
        config = config_dict(args)
        metrics_file = self.run_dir / "metrics.jsonl"
        if resume_step > 0:
            self._record_changes(check_config(self.run_dir, args), resume_step)
            if metrics_file.exists():  # keep what the checkpoint covers; the killed run's later rows are redone
                self.history = _truncate_rows(metrics_file, resume_step)
            if (self.run_dir / "samples.jsonl").exists():  # likewise the samples of those steps
                _truncate_rows(self.run_dir / "samples.jsonl", resume_step)
        else:
            self._move_previous_run()
        if not (self.run_dir / "config.json").exists():  # never overwritten: it holds the flags the run started with
            write_json(self.run_dir / "config.json", config, indent=2)
        self.file = open(metrics_file, "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the killed run's events from this step on
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)
        if cfg.wandb:  # not covered by the tests: the run id is kept in the run folder so a resume continues the run
            import wandb

            id_file = self.run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=cfg.wandb_project, name=self.run_dir.name, config=config, id=run_id,
                                    resume="allow", dir=str(self.run_dir), mode=cfg.wandb_mode)  # fmt: skip
        if not cfg.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[shown]}"),
            )  # fmt: skip
            self.task = self.progress.add_task(self.run_dir.name.split("__")[0], total=total_steps, shown="",
                                               completed=resume_step)  # fmt: skip
            self.progress.start()

    def _record_changes(self, changes: list[dict], resume_step: int) -> None:
        if changes:
            stamp = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resume_step": resume_step}
            with open(self.run_dir / "config_changes.jsonl", "a") as f:
                f.writelines(json.dumps({**stamp, **c}, default=str) + "\n" for c in changes)

    def _move_previous_run(self) -> None:
        """A new run (step 0) in a folder that holds another run's records: move that run's files aside rather than
        append to its metrics."""
        if not any((self.run_dir / name).exists() for name in ("metrics.jsonl", "config.json")):
            return
        aside = self.run_dir / f"previous_{int(time.time())}"
        while aside.exists():
            aside = aside.with_name(aside.name + "_")
        aside.mkdir()
        for name in RUN_FILES:
            if (self.run_dir / name).exists():
                os.replace(self.run_dir / name, aside / name)
        print(f"[logger] warning: {self.run_dir} held a run that is not resumed (no checkpoint, or --ckpt.no-resume); "
              f"its files were moved to {aside}", file=sys.stderr, flush=True)  # fmt: skip

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

    def log_samples(self, rows: list[dict], step: int) -> None:
        """Append samples (core/samples.py rows) to samples.jsonl, and show them in TensorBoard (text, a markdown
        table per kind) and W&B (a Table per kind) when those are on."""
        if not self.enabled or not rows:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        columns = ("index", "prompt", "response", "reward", "advantage", "kept", "truncated", "correct")
        for kind in sorted({r["kind"] for r in rows}):
            table = [[r.get(c) for c in columns] for r in rows if r["kind"] == kind]
            if self.tb:
                cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")[:300]  # noqa: E731
                lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table]
                self.tb.add_text(f"samples/{kind}", "\n".join(lines), step)
            if self.wandb:
                import wandb

                self.wandb.log({f"samples/{kind}": wandb.Table(columns=list(columns), data=table)}, step=step)

    def print(self, *msg) -> None:
        """Print above the progress bar (rank 0, not `--logger.quiet`). Text is printed as it is: a `[grpo]` prefix or
        a bracket in a sample is not read as rich markup (which would drop it)."""
        if self.enabled and not self.cfg.quiet:
            from rich.console import Console

            (self.progress.console if self.progress else Console()).print(*msg, markup=False)

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

    def write_report(self) -> None:
        """<run>/report.html (core/report.py: the curves, the config and summary, the sample browser), written when
        the run ends or halts. A fault in it is printed, not raised: the run's results are already saved."""
        try:
            from core import report

            report.write_report(self.run_dir)
        except Exception as e:  # noqa: BLE001
            print(f"[logger] warning: the run report was not written: {type(e).__name__}: {e}; "
                  f"`python -m core.report {self.run_dir}` tries again", file=sys.stderr, flush=True)  # fmt: skip

    def close(self, summary: dict | None = None) -> None:
        """Stop the progress bar and print (and save to `summary.json`) the end-of-run summary."""
        if not self.enabled:
            return
        if self.progress:
            self.progress.stop()
        summary = {"wall_s": round(time.time() - self.start, 1), **(summary or {})}
        write_json(self.run_dir / "summary.json", summary, indent=2, default=str)
        self.write_report()
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
        release_run_dir(self.run_dir)


@contextmanager
def timer(out: dict, key: str):
    """`with timer(perf, "perf/train_s"):` adds the block's wall time to out[key]."""
    t0 = time.perf_counter()
    yield
    out[key] = out.get(key, 0.0) + time.perf_counter() - t0


class Meter:
    """A step's update metrics, merged over micro-batches, optimizer steps and ranks, one meaning per name in every
    script: `add(m, tokens)` for per-token means (loss/clipfrac, loss/kl, loss/entropy: token-weighted over every
    trained token of the step); `add_loss(name, value, steps)` for a micro-batch's share of its minibatch's loss
    (summed over a minibatch's micro-batches and ranks, averaged over the optimizer steps, which the per-step metric
    named `steps` counts: the actor's `train/grad_norm` by default, a second model's own grad norm for its loss);
    `add_step(name, value)` for one value per optimizer step (gradient norms, the same on every rank), averaged."""

    def __init__(self):
        self.sums, self.weights = defaultdict(float), defaultdict(float)
        self.losses, self.per_step = defaultdict(float), defaultdict(list)
        self.steps_of = {}  # loss name -> the per-step metric counting its optimizer steps

    def add(self, metrics: dict, tokens: float) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v.detach() if isinstance(v, torch.Tensor) else v) * tokens
            self.weights[k] += tokens

    def add_loss(self, name: str, value: float, steps: str = "train/grad_norm") -> None:
        self.losses[name] += value
        self.steps_of[name] = steps

    def add_step(self, name: str, value: float) -> None:
        self.per_step[name].append(float(value))

    def result(self, world: int) -> dict:
        """The merged metrics, the same on every rank (collective when world > 1)."""
        keys, loss_keys = sorted(self.sums), sorted(self.losses)
        flat = torch.tensor([self.sums[k] for k in keys] + [self.weights[k] for k in keys]
                            + [self.losses[k] for k in loss_keys], dtype=torch.float64)  # fmt: skip
        if world > 1:
            torch.distributed.all_reduce(flat)
        out = {k: flat[i].item() / max(flat[len(keys) + i].item(), 1e-12) for i, k in enumerate(keys)}
        for i, k in enumerate(loss_keys):
            out[k] = flat[2 * len(keys) + i].item() / max(1, len(self.per_step.get(self.steps_of[k], [1])))
        out.update({k: float(np.mean(v)) for k, v in self.per_step.items()})
        return out

