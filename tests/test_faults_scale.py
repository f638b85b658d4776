"""A Ray actor killed mid-run (a trainer rank, a vLLM engine, a rank of the reference's own group) ends
`--train.ranks 2` GRPO within seconds with one error naming the actor and the step, never a hang, and the same
command resumes from the newest checkpoint."""

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


def command(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "algos/grpo.py", "--train.ranks", "2", "--ds.zero-stage", "3", "--ray.num-cpus", "4",
            "--train.max-steps", "6", "--rollout.batch-size", "16", "--eval.every", "0", "--ckpt.every", "1",
            "--ray.timeout-s", "120", "--logger.quiet", "--run-dir", str(run_dir), *extra]  # fmt: skip


VICTIMS = {  # what to kill: (process title, the group it must belong to, the flags that start it, its name in errors)
    "trainer rank": ("ray::Worker", "", (), "group 'actor' rank"),
    "engine": ("ray::VLLMEngine", "", (), "vLLM engine 'vllm-engine-0'"),
    "reference group": ("ray::Worker", "ref", ("--algo.kl-coef", "0.01", "--ref.ranks", "1"), "group 'ref' rank 0"),
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


@pytest.mark.parametrize("victim", list(VICTIMS))
def test_a_killed_actor_ends_the_run_with_its_name_and_step_and_the_command_resumes(tmp_path, victim):
    title, group, flags, name = VICTIMS[victim]
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = subprocess.Popen(command(run_dir, *flags), cwd=ROOT, env=env(), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 400
        while len(logged_steps(run_dir)) < 2:  # two steps done (and checkpointed)
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        actors = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if title in " ".join(p.cmdline()) and in_group(p, group)]  # fmt: skip
        assert actors, f"no {victim} process under the run"
        os.kill(actors[-1].pid, signal.SIGKILL)
        killed_at = time.time()
        rc = proc.wait(timeout=180)  # never a hang
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc != 0 and time.time() - killed_at < 180
    assert name in text and "died" in text, text[-3000:]
    assert "the run stopped during step" in text and f"--run-dir {run_dir} resumes from step_" in text, text[-3000:]
    before = logged_steps(run_dir)

    done = subprocess.run(command(run_dir, *flags), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    steps = logged_steps(run_dir)
    assert sorted(steps) == list(range(1, 7)) and len(steps) == 6, (before, steps)  # every step once, resumed
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
