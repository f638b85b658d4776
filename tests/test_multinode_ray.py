"""Two Ray nodes on this machine without SLURM (a head on 127.0.0.4, a worker on 127.0.0.5, each `ray start
--block` started and stopped by PID here): GRPO joins the cluster with `--ray.address`, its two ZeRO-3 ranks and two
engines placed STRICT_SPREAD (one bundle per node, or Ray refuses), so rank 0 syncs weights to an engine on the
other node, checked by `--debug` after every sync."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ray_nodes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_nodes():
    from core.engine import free_port

    # addresses and a port of its own: the SLURM tests' nodes are 127.0.0.2 and .3, and the suite runs on two workers
    with ray_nodes(["127.0.0.4", "127.0.0.5"], free_port(), 4, 200000000) as address:
        yield address


def test_grpo_ranks_and_engines_on_two_ray_nodes(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "algos/grpo.py", "--ray.address", two_nodes, "--train.ranks", "2", "--ray.strategy",
           "STRICT_SPREAD", "--vllm.num-engines", "2", "--ds.zero-stage", "3", "--train.max-steps", "3",
           "--rollout.batch-size", "16", "--eval.every", "0", "--debug", "--logger.quiet", "--run-dir", str(run_dir)]  # fmt: skip
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}  # the nodes' Ray auth mode included
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # actors ran on the second node: Ray prefixes their lines with it (library lines: in the run's log, core/noise.py)
    assert "ip=127.0.0.5" in out + (run_dir / "run.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
