"""The project's own `slurm/*.sbatch` scripts, submitted unchanged to a real two-node SLURM cluster started on this
machine (tests/slurm_cluster.py: munged, slurmctld and two slurmd nodes on 127.0.0.2 and 127.0.0.3). Configuration
goes only through sbatch flags and environment variables, as a user's would: `--gpus-per-node 0` and
GPUS_PER_NODE=0 for a CPU cluster, one trainer process per node."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from core import checkpoint, models
from core.config import ModelConfig

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    from slurm_cluster import SlurmCluster

    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def job_env(**extra) -> dict:
    """This process's environment for a job, without the torch.distributed variables in-process tests may set."""
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    return {**env, "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled", **extra}


def leftovers(marker: str) -> list[str]:
    """Command lines of processes that mention `marker` (a run folder, a Ray port), this test process excluded."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and " Z " not in f" {line.split()[1]} "
            and int(line.split()[0]) != os.getpid()]  # fmt: skip


def wait_for_no_leftovers(marker: str, timeout_s: float = 30) -> list[str]:
    deadline = time.time() + timeout_s
    while (left := leftovers(marker)) and time.time() < deadline:
        time.sleep(1)
    return left


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def grpo_job(slurm, tmp_path: Path, run_dir: Path, port: int, *flags: str) -> int:
    return slurm.sbatch(["--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/grpo-%j.out",
                         "slurm/grpo_ray.sbatch", "--ray.strategy", "STRICT_SPREAD", "--vllm.num-engines", "2",
                         "--ds.zero-stage", "3", "--logger.quiet", "--run-dir", str(run_dir), *flags],
                        cwd=ROOT, env=job_env(GPUS_PER_NODE="0", RANKS_PER_NODE="1", RAY_PORT=str(port)))  # fmt: skip


def test_sft_sbatch_runs_torchrun_on_two_nodes_with_zero3(slurm, tmp_path):
    run_dir = tmp_path / "sft"
    job = slurm.sbatch(["--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/sft.out", "slurm/sft.sbatch",
                        "--ds.zero-stage", "3", "--train.max-steps", "12", "--train.batch-size", "32",
                        "--train.warmup-steps", "0", "--eval.every", "12", "--eval.no-generate", "--eval.max-samples",
                        "64", "--run-dir", str(run_dir)],
                       cwd=ROOT, env=job_env(PROCS_PER_NODE="1", MASTER_PORT="29531"))  # fmt: skip
    state = slurm.wait(job, timeout_s=600)
    log = (tmp_path / "sft.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss_last"] < summary["eval_loss_first"] - 0.3, summary
    assert "ds" in config and config["ds"]["zero_stage"] == 3
    assert "world size 2" in log  # one torchrun per node, one rendezvous
    model = models.load_causal_lm(ModelConfig(name_or_path=summary["export_dir"]))  # the gathered ZeRO-3 export
    assert sum(p.numel() for p in model.parameters()) > 1e6
    assert not wait_for_no_leftovers(str(run_dir))


def rollout_rows(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum("rollout/" in line for line in path.read_text().splitlines()) if path.exists() else 0


def wait_for_rows(slurm, job: int, run_dir: Path, out: Path, n: int, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while rollout_rows(run_dir) < n:
        assert time.time() < deadline, f"no {n} logged steps within {timeout_s} s: {out.read_text()[-3000:]}"
        assert slurm.state(job) in ("PENDING", "RUNNING"), out.read_text()[-3000:]
        time.sleep(1)


def test_grpo_over_two_nodes_survives_a_cancel_and_a_lost_node_resumes_and_learns(slurm, tmp_path):
    """slurm/grpo_ray.sbatch: a Ray head and worker started by the script, two ZeRO-3 trainer ranks placed
    STRICT_SPREAD (one per node: Ray refuses the group otherwise) and two vLLM engines colocated with them, so rank 0
    syncs weights to an engine on the other node; `--debug` checks the engines' log-probs against the trainer's after
    every sync. One run folder, three submissions of the same command (12 steps, a checkpoint every second step,
    eval pass@1 at steps 0 and 12):
    1. cancelled with `scancel` after two checkpointed steps: the batch file stops Ray on both nodes on its way out
       and no process of the job is left;
    2. resubmitted, it resumes; one step later the second node vanishes (its slurmd, the Ray worker node and the
       trainer rank, engine on it SIGKILLed): the run ends within a minute with the lost actor named and the step it
       stopped in, the batch script fails instead of hanging, nothing of the job is left on the first node, and the
       run folder holds a checkpoint. The node is restored afterwards;
    3. resubmitted once more, it runs to the end: every step was logged once across the three jobs, actors ran on
       the second node, no Ray process outlived the job, and the policy learned (pass@1 up by 0.1 from step 0, whose
       eval the checkpoints carried over)."""
    # 12 steps: this test's run reached pass@1 0.734 from 0.48 (2026-11-30; 0.790 with 20 steps, whose rewards matched
    # the same command's in one process step for step)
    run_dir, port, steps = tmp_path / "grpo", 6393, 12
    flags = ("--train.max-steps", str(steps), "--rollout.batch-size", "16", "--eval.every", str(steps), "--eval.k",
             "1", "--ckpt.every", "2", "--debug")  # fmt: skip  (greedy pass@1 only: the sampled pass@k is not asserted)

    # 1. scancel
    job = grpo_job(slurm, tmp_path, run_dir, port, *flags)
    wait_for_rows(slurm, job, run_dir, tmp_path / f"grpo-{job}.out", 3)
    slurm.run(["scancel", str(job)])
    assert slurm.wait(job, timeout_s=120) == "CANCELLED"
    assert not wait_for_no_leftovers(f"127.0.0.2:{port}"), "Ray processes outlived the cancelled job"
    assert not wait_for_no_leftovers(str(run_dir)), "trainer processes outlived the cancelled job"
    done_before = {m["step"] for m in metrics(run_dir) if "rollout/reward_mean" in m}
    assert 2 <= len(done_before) < steps, done_before

    # 2. resumed, then the second node is lost
    job = grpo_job(slurm, tmp_path, run_dir, port, *flags)
    out = tmp_path / f"grpo-{job}.out"
    wait_for_rows(slurm, job, run_dir, out, rollout_rows(run_dir) + 1)
    try:
        assert slurm.lose_node("n2") >= 3  # slurmd, its job step and the Ray node under it
        lost = time.time()
        while "the run stopped during step" not in out.read_text() and time.time() < lost + 120:
            time.sleep(1)
        log = out.read_text()
        assert "the run stopped during step" in log, log[-3000:]
        assert time.time() - lost < 60, f"the run took {time.time() - lost:.0f} s to end"
        # the rank on the lost node (127.0.0.3) is named; which rank that is depends on where Ray put the bundles
        errors = "\n".join(line for line in log.splitlines() if "Error" in line or "stopped" in line)[-3000:]
        assert re.search(r"group 'actor' rank \d died during \S+ on node 127\.0\.0\.3|engine .* died", log), errors
        assert re.search(r"--run-dir \S+ resumes from step_\d+", log), log[-3000:]
        state = slurm.wait(job, timeout_s=120, until=("FAILED", "NODE_FAIL", "COMPLETING", "COMPLETED"))
        assert state != "COMPLETED", log[-3000:]
        assert not wait_for_no_leftovers(str(run_dir)), "trainer processes outlived the failed job"
        assert not wait_for_no_leftovers(f"127.0.0.2:{port}"), "Ray processes outlived the failed job"
        assert checkpoint.latest(run_dir / "checkpoints") is not None
    finally:
        slurm.restore_node("n2")

    # 3. to the end
    job = grpo_job(slurm, tmp_path, run_dir, port, *flags)  # the same command
    state = slurm.wait(job, timeout_s=900)
    log = (tmp_path / f"grpo-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    rows = [m["step"] for m in metrics(run_dir) if "rollout/reward_mean" in m]
    assert sorted(set(rows)) == list(range(1, steps + 1)) and len(rows) == len(set(rows)), rows  # each step once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    # actors ran on the second node (Ray tags their output with its address; library lines are in the run's log)
    assert "ip=127.0.0.3" in log + (run_dir / "run.log").read_text()
    assert not wait_for_no_leftovers(f"127.0.0.2:{port}"), "Ray processes outlived the job"
    assert not wait_for_no_leftovers(str(run_dir))
    address_file = Path("/tmp/ray/ray_current_cluster")  # the job's Ray kept to its own temp folder
    assert not (address_file.exists() and f":{port}" in address_file.read_text())
