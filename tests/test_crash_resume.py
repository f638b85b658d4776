"""Crash and resume, the way a preempted job or the OOM killer does it: each training script runs as a user runs it
(a subprocess, `--ckpt.every 1`), is SIGKILLed, and is started again with the same command and `--run-dir` until it
finishes. SIGKILL leaves no chance to clean up: no `finally`, no `atexit`, no flush, possibly a half-written
checkpoint folder.

Two ways to die, one after the other in the same run, which is then compared with one uninterrupted reference run
of the same command:
- at a random moment while training steps happen (the kill point is seeded);
- in the restarted run, in the middle of a checkpoint write: the checkpoint folder is polled every millisecond and
  the process group is killed the moment a `.tmp_step_*` folder appears (`core.checkpoint.save` writes there, then
  renames).
One test per script does both, in that order, so the second kill hits a resumed run: 4 invocations (the reference,
two killed, the last) where two tests of one kill each needed 6, and an RL script spends ~15 s of each invocation
starting and exiting.

After the last restart the run must look as if nothing had happened: it completed (summary written, final model
exported, no half-written checkpoint left); `metrics.jsonl` holds every step exactly once (the step-0 eval too, not
again under the resume step); every non-timing metric (losses, rewards, KL, learning rate, eval; not `perf/*`)
equals the uninterrupted run's, and so does the exported model.

Every child is started in its own session and killed as a process group, so no engine or worker process can outlive
it; each test checks that nothing it started is still alive when it ends.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--ckpt.every", "1", "--logger.quiet", "--logger.no-tensorboard"]
RL_FLAGS = "--rollout.batch-size 16 --train.micro-batch-size 64 --eval.every 2 --eval.max-samples 64"
SFT_FLAGS = "--train.batch-size 16 --train.warmup-steps 0 --eval.every 2 --eval.max-samples 64 --eval.no-generate"
# script -> (steps, flags): tiny runs (the settings of test_rl_scripts.py `_small` and test_sft.py `small_args`, as
# CLI flags); one process takes ~7 s (sft) or ~20 s (grpo: mostly startup) on 2 cores. One RL script and one
# supervised one: ppo.py, dpo.py and the rest save and resume through the same core.checkpoint calls, and each has
# an exact halt-and-resume test of its own (test_rl_scripts.py, with PPO's adaptive KL state; test_dpo.py;
# test_faults_training.py), where SIGKILL twice over added 7 minutes to the suite on a 2-core Xeon.
RECIPES = {
    "grpo": (6, RL_FLAGS.split()),
    "sft": (8, SFT_FLAGS.split()),
}
RUN_TIMEOUT_S = 300  # one invocation; a healthy one takes well under a minute


# ----------------------------------------------------------------------------------------- processes we start
_started: list[subprocess.Popen] = []


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process, from /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def _descendants(pid: int) -> set[int]:
    table, found, frontier = _proc_table(), set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pgid: int, pids: set[int] = frozenset()) -> list[int]:
    """Live (not zombie) processes in process group `pgid` or among `pids`."""
    return [p for p, (_, group, state) in _proc_table().items() if (group == pgid or p in pids) and state != "Z"]


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it leads its own session), plus any descendant that left the group,
    and wait until none of them is alive."""
    escaped = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in escaped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _alive(proc.pid, escaped) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def nothing_left_running():
    """Every process group a test started is gone when the test ends. A script still running (the test failed while
    it ran) is killed here; processes outliving a script that exited fail the test."""
    yield
    leftovers = {p.pid: _alive(p.pid) for p in _started if p.poll() is not None and _alive(p.pid)}
    for p in _started:
        if p.poll() is None or _alive(p.pid):
            _kill(p)
    _started.clear()
    assert not leftovers, f"processes still running after the test (process group: pids): {leftovers}"


def _env() -> dict:
    """The user's environment, minus torch.distributed variables an in-process test may have set, with this checkout
    first on the import path."""
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env | {"TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Job:
    """One invocation of a script: `python algos/<script>.py <flags> --run-dir <run>`, its output in `log`."""

    script: str
    run_dir: Path
    log: Path

    @staticmethod
    def start(script: str, run_dir: Path, tag: str) -> tuple[Job, subprocess.Popen]:
        steps, flags = RECIPES[script]
        cmd = [sys.executable, str(REPO / "algos" / f"{script}.py"), "--train.max-steps", str(steps), *flags, *COMMON,
               "--run-dir", str(run_dir)]  # fmt: skip
        job = Job(script, run_dir, run_dir.parent / f"{run_dir.name}.{tag}.log")
        with open(job.log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        _started.append(proc)
        return job, proc

    def tail(self, n: int = 3000) -> str:
        """The end of the console output, and of `<run>/run.log`, where the libraries' messages go (core/noise.py)."""
        library = self.run_dir / "run.log"
        text = library.read_text(errors="replace")[-n:] if library.is_file() else "(none)"
        return f"{self.log.read_text(errors='replace')[-n:]}\n--- {library}:\n{text}"


def _finish(job: Job, proc: subprocess.Popen) -> None:
    """Wait for an invocation to exit on its own; it must succeed and leave no process behind."""
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"{job.script}: no exit after {RUN_TIMEOUT_S} s; log tail:\n{job.tail()}")
    assert rc == 0, f"{job.script} exited with {rc}; log tail:\n{job.tail()}"
    time.sleep(0.2)
    assert not _alive(proc.pid), f"{job.script}: processes outlived the run: {_alive(proc.pid)}"


def _wait_for(proc: subprocess.Popen, ready, period_s: float, job: Job) -> bool:
    """Poll `ready()` every `period_s` until it is true (True) or the process exits (False)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None:
        if ready():
            return True
        if time.monotonic() > deadline:
            _kill(proc)
            pytest.fail(f"{job.script}: stuck; log tail:\n{job.tail()}")
        time.sleep(period_s)
    return False


# ---------------------------------------------------------------------------------------------- metrics
def _rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl, strictly: a torn or unparsable line is a failure, not something to skip."""
    rows = []
    for n, line in enumerate((run_dir / "metrics.jsonl").read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise AssertionError(f"{run_dir}/metrics.jsonl line {n} is not JSON ({e}): {line[:200]!r}") from e
    return rows


def _max_step(run_dir: Path) -> int:
    """Highest step logged so far (-1: none), tolerant of a line being written right now."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return -1
    steps = [-1]
    for line in text.splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass
    return max(steps)


def _compared(row: dict) -> dict:
    """The metrics a resumed run must reproduce: everything but wall-clock timings."""
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or b == pytest.approx(a, rel=1e-5, abs=1e-6)


def _describe_copies(step: int, copies: list[dict], reference: dict[int, dict]) -> str:
    """Why step `step` appears more than once: a replay of the step, or the step-0 eval logged again."""
    out = []
    for row in copies:
        row = _compared(row)
        if row.keys() - {"step"} and row.keys() - {"step"} == _compared(reference[0]).keys() - {"step"} and step:
            what = "the step-0 eval logged again"
        elif all(k in row and _same(v, row[k]) for k, v in _compared(reference[step]).items()):
            what = "a replay equal to the reference row"
        else:
            what = "a row unlike the reference"
        out.append(what)
    return f"step {step}: " + ", ".join(out)


@dataclass
class Reference:
    rows: list[dict]
    run_dir: Path
    wall_s: float


def _reference_run(script: str, run_dir: Path) -> Reference:
    """The uninterrupted run: one metrics row per step."""
    t0 = time.monotonic()
    job, proc = Job.start(script, run_dir, "0")
    _finish(job, proc)
    rows = _rows(job.run_dir)
    assert sorted(r["step"] for r in rows) == list(range(RECIPES[script][0] + 1)), "the uninterrupted run: a row a step"
    ref = Reference(rows, job.run_dir, time.monotonic() - t0)
    print(f"[{script}] uninterrupted run: {ref.wall_s:.1f} s")
    return ref


def _assert_resumed_like_reference(script: str, run_dir: Path, ref: Reference, story: str) -> None:
    print(f"[crash-resume] {story}")  # what happened to the run, shown with `pytest -s`
    steps = RECIPES[script][0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.get("steps") == steps and not summary.get("halted"), (story, summary)
    assert (run_dir / "hf" / "config.json").is_file(), f"{story}: no exported model"
    ckpt_dir = run_dir / "checkpoints"
    assert not list(ckpt_dir.glob(".tmp_*")), f"{story}: half-written checkpoint left: {list(ckpt_dir.glob('.tmp_*'))}"
    from core import checkpoint

    assert checkpoint.latest(ckpt_dir) == ckpt_dir / f"step_{steps - 1:08d}", (story, checkpoint.latest(ckpt_dir))

    rows = _rows(run_dir)
    expected = {r["step"]: r for r in ref.rows}
    counts = Counter(r["step"] for r in rows)
    missing = sorted(set(expected) - set(counts))
    extra = sorted(set(counts) - set(expected))
    doubled = {s: [r for r in rows if r["step"] == s] for s, c in sorted(counts.items()) if c > 1}
    assert not (missing or extra or doubled), (
        f"{story}: metrics.jsonl must hold steps 0..{steps} exactly once; missing {missing}, unexpected {extra}, "
        f"more than once: {'; '.join(_describe_copies(s, c, expected) for s, c in doubled.items()) or 'none'}"
    )
    for row in rows:
        want, got = _compared(expected[row["step"]]), _compared(row)
        assert got.keys() == want.keys(), (story, row["step"], sorted(got.keys() ^ want.keys()))
        bad = {k: (want[k], got[k]) for k in want if not _same(want[k], got[k])}
        assert not bad, f"{story}: step {row['step']} differs from the uninterrupted run (expected, got): {bad}"

    from safetensors.torch import load_file

    want, got = (load_file(str(d / "hf" / "model.safetensors")) for d in (ref.run_dir, run_dir))
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _resume_to_end(script: str, run_dir: Path, tag: str) -> None:
    job, proc = Job.start(script, run_dir, tag)
    _finish(job, proc)


def _saving(ckpt_dir: Path, first: int, seen: list[str]) -> bool:
    """Is a checkpoint of step index >= `first` being written (its `.tmp_step_*` folder present)? Names go to `seen`."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return False
    seen[:] = [n for n in names if n.startswith(".tmp_step_") and int(n.rsplit("_", 1)[1]) >= first]
    return bool(seen)


# ------------------------------------------------------------------------------------------------- the tests
def _latest_index(ckpt_dir: Path) -> int:
    """0-based step index of the checkpoint a restart resumes from (-1: none yet)."""
    from core import checkpoint

    found = checkpoint.latest(ckpt_dir) if ckpt_dir.is_dir() else None
    return int(found.name.rsplit("_", 1)[1]) if found else -1


def _leftover_index(ckpt_dir: Path) -> int:
    """Highest index of a `.tmp_step_*` folder a kill left behind (-1: none)."""
    names = os.listdir(ckpt_dir) if ckpt_dir.is_dir() else []
    return max([int(n.rsplit("_", 1)[1]) for n in names if n.startswith(".tmp_step_")], default=-1)


@pytest.mark.parametrize("script", list(RECIPES))
def test_sigkill_at_a_random_moment_then_during_a_checkpoint_write_then_resume(script, tmp_path):
    """Three invocations of the same command on one run folder:
    1. SIGKILL at a seeded random moment of training: after step t is logged (t seeded, from 2 to half the steps:
       a checkpoint exists, so the restarted run resumes), plus a random part of a step's time, at the latest when
       step t + 1 is logged;
    2. the restarted run resumes and dies the moment `<run>/checkpoints/.tmp_step_<k>` appears (k seeded, a later
       save than the one it resumed from, and later than any folder the first kill left half-written): `latest` must
       not name the half-written folder. A kill that the save outran (the folder already renamed when the process
       died) is retried at the next save;
    3. the same command once more runs to the end, and the finished run equals the uninterrupted one."""
    ref = _reference_run(script, tmp_path / "reference")
    steps = RECIPES[script][0]
    rng = random.Random(f"crash-resume/{script}")
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    story: list[str] = []

    # 1. a random moment: `u` of the time between the rows of step t - 1 and t, after the row of step t
    target, u = rng.randint(2, steps // 2), rng.uniform(0.0, 1.0)
    job, proc = Job.start(script, run_dir, "random")
    row_seen: dict[int, float] = {}  # step -> when its row was first seen

    def logged(step: int) -> bool:
        row_seen.setdefault(_max_step(run_dir), time.monotonic())
        return max(row_seen) >= step

    reached = _wait_for(proc, lambda: logged(target), 0.002, job)
    delay = 0.0
    if reached:  # sleep `delay`, but kill when the next step is logged at the latest
        at = row_seen[max(row_seen)]
        delay = u * (at - row_seen.get(target - 1, at))
        end = time.monotonic() + delay
        _wait_for(proc, lambda: time.monotonic() >= end or _max_step(run_dir) > target, 0.002, job)
    assert proc.poll() is None, f"{script}: the run ended before the kill after step {target}: {job.tail()}"
    _kill(proc)
    resumes_from, torn_before = _latest_index(ckpt_dir), _leftover_index(ckpt_dir)
    assert resumes_from >= 0, f"{script}: no checkpoint after step {target}: {job.tail()}"
    left = f", .tmp_step_{torn_before} left" if torn_before >= 0 else ""
    story.append(f"killed after step {target} + {delay:.3f} s (logged up to step {_max_step(run_dir)}, resumes from "
                 f"checkpoint {resumes_from}{left})")  # fmt: skip

    # 2. during a checkpoint write of the restarted run
    first_save = rng.randint(max(resumes_from, torn_before) + 1, steps - 2)  # 0-based step index
    for attempt in range(3):
        job, proc = Job.start(script, run_dir, f"save{attempt}")
        seen: list[str] = []
        if not _wait_for(proc, lambda seen=seen: _saving(ckpt_dir, first_save, seen), 0.001, job):
            assert proc.returncode == 0, job.tail()
            break  # finished without a save we could catch
        _kill(proc)
        landed = [n for n in seen if (ckpt_dir / n).is_dir()]
        story.append(f"killed while {seen[0]} was {'being written' if landed else 'already renamed (missed)'}")
        if landed:
            from core import checkpoint

            torn = landed[0].removeprefix(".tmp_")
            assert checkpoint.latest(ckpt_dir) != ckpt_dir / torn, f"{script}: `latest` names the half-written {torn}"
            break
    assert "being written" in story[-1], f"{script}: no kill landed inside a checkpoint write: {story}"

    # 3. to the end
    _resume_to_end(script, run_dir, "final")
    _assert_resumed_like_reference(script, run_dir, ref, f"{script}: " + "; ".join(story))
