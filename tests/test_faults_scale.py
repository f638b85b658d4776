"""A Ray actor killed mid-run (a trainer rank, a vLLM engine) ends `--train.ranks 2` GRPO within seconds with one
error naming the actor and the step, never a hang, and the same command resumes from the newest checkpoint.

One run takes both deaths in turn, the second in the run resumed from the first (3 invocations where a run per
victim needed 4: on a 2-core Xeon each start of two ranks and an engine costs about a minute). A rank of a model
group of its own dies the same way a trainer rank does (both are `core.placement.ModelGroup` ranks: the death of a
group's rank is named by tests/test_placement.py, and tests/test_model_groups.py runs the reference in a group)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


STEPS = 5  # two deaths, each after a step of its own run (steps 2, 3), and two steps left for the last run


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "algos/grpo.py", "--train.ranks", "2", "--ds.zero-stage", "3", "--ray.num-cpus", "4",
            "--train.max-steps", str(STEPS), "--rollout.batch-size", "16", "--eval.every", "0", "--ckpt.every", "1",
            "--ray.timeout-s", "120", "--logger.quiet", "--run-dir", str(run_dir), *extra]  # fmt: skip


VICTIMS = {  # what to kill: (process title, the group it must belong to, its name in errors)
    "trainer rank": ("ray::Worker", "", "group 'actor' rank"),
    "engine": ("ray::VLLMEngine", "", "vLLM engine 'vllm-engine-0'"),
}


def in_group(proc: psutil.Process, group: str) -> bool:
    """Whether a Ray worker belongs to the model group `group` ("" : to none, e.g. a trainer rank)."""
    try:
        return proc.environ().get("CLEANRLHF_GROUP", "") == group
    except psutil.Error:
        return False


def env() -> dict:
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in dist_vars}, "TOKENIZERS_PARALLELISM": "false"}


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "rollout/reward_mean" in r]


def kill_when(proc: subprocess.Popen, run_dir: Path, log: Path, steps: int, victim: str) -> float:
    """Once `steps` steps are logged (and checkpointed), SIGKILL the newest process of `victim`; returns the time."""
    title, group, _ = VICTIMS[victim]
    deadline = time.time() + 400
    while len(logged_steps(run_dir)) < steps:
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    actors = [p for p in psutil.Process(proc.pid).children(recursive=True)
              if title in " ".join(p.cmdline()) and in_group(p, group)]  # fmt: skip
    assert actors, f"no {victim} process under the run"
    os.kill(actors[-1].pid, signal.SIGKILL)
    return time.time()


def test_a_killed_actor_ends_the_run_with_its_name_and_step_and_the_command_resumes(tmp_path):
    run_dir, flags = tmp_path / "run", ()
    for n, victim in enumerate(VICTIMS, 1):  # each run is killed after a step of its own (the first after two)
        log, target = tmp_path / f"run{n}.log", max(2, len(logged_steps(run_dir)) + 1)
        proc = subprocess.Popen(command(run_dir, *flags), cwd=ROOT, env=env(), stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            killed_at = kill_when(proc, run_dir, log, target, victim)
            rc = proc.wait(timeout=180)  # never a hang
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text, name = log.read_text(), VICTIMS[victim][2]
        assert rc != 0 and time.time() - killed_at < 180, victim
        assert name in text and "died" in text, (victim, text[-3000:])
        assert "the run stopped during step" in text and f"--run-dir {run_dir} resumes from step_" in text, text[-3000:]
    before = logged_steps(run_dir)

    done = subprocess.run(command(run_dir, *flags), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    steps = logged_steps(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1)) and len(steps) == STEPS, (before, steps)  # each step once
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
