"""Two Ray nodes on this machine without SLURM (a head on 127.0.0.2, a worker on 127.0.0.3, each `ray start
--block` started and stopped by PID here): GRPO joins the cluster with `--ray.address`, its two ZeRO-3 ranks and two
engines placed STRICT_SPREAD (one bundle per node, or Ray refuses), so rank 0 syncs weights to an engine on the
other node, checked by `--debug` after every sync."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PORT = 6395
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def two_nodes():
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay under 107 characters
    common = ["--num-cpus", "4", "--num-gpus", "0", "--disable-usage-stats", "--block", "--temp-dir",
              temp, "--object-store-memory", "200000000"]  # fmt: skip
    head = subprocess.Popen([RAY, "start", "--head", "--node-ip-address", "127.0.0.2", "--port", str(PORT), *common],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    procs = [head]
    try:
        deadline = time.time() + 120
        while subprocess.run([RAY, "status", "--address", f"127.0.0.2:{PORT}"], env=env,
                             capture_output=True).returncode != 0:  # fmt: skip
            assert time.time() < deadline and head.poll() is None, "the Ray head did not start"
            time.sleep(1)
        procs.append(subprocess.Popen([RAY, "start", "--address", f"127.0.0.2:{PORT}", "--node-ip-address",
                                       "127.0.0.3", *common], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))  # fmt: skip
        while True:
            out = subprocess.run([RAY, "status", "--address", f"127.0.0.2:{PORT}"], env=env, capture_output=True,
                                 text=True).stdout  # fmt: skip
            if out.count(" node_") >= 2:
                break
            assert time.time() < deadline and procs[-1].poll() is None, "the Ray worker did not join"
            time.sleep(1)
        yield f"127.0.0.2:{PORT}"
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_grpo_ranks_and_engines_on_two_ray_nodes(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "algos/grpo.py", "--ray.address", two_nodes, "--train.ranks", "2", "--ray.strategy",
           "STRICT_SPREAD", "--vllm.num-engines", "2", "--ds.zero-stage", "3", "--train.max-steps", "3",
           "--rollout.batch-size", "16", "--eval.every", "0", "--debug", "--logger.quiet", "--run-dir", str(run_dir)]  # fmt: skip
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {**{k: v for k, v in os.environ.items() if k not in dist_vars}, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "ip=127.0.0.3" in out  # actors ran on the second node
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
