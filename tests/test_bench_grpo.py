"""tests/benchmarks/bench_grpo.py's one-process GPU side, `ours-hf` (grpo.py with `--vllm.engine hf`, the engine
`--device cuda` runs), checked on the CPU at a tiny size: it runs to the end through the real command line and
reports finite, positive timings and 64 forced tokens per sample (the timings themselves are the script's business)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_grpo_runs_its_hf_engine_side_on_the_cpu(tmp_path):
    cmd = [sys.executable, "tests/benchmarks/bench_grpo.py", "--sides", "ours-hf", "--steps", "1", "--warmup", "1",
           "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    log = tmp_path / "ours-hf.log"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:] + (log.read_text()[-3000:] if log.exists() else "")
    res = json.loads((tmp_path / "ours-hf.json").read_text())
    assert res["tokens"] == 64 and all(math.isfinite(res[k]) and res[k] > 0 for k in ("step_s", "gen_s", "train_s"))
    assert "grpo.py --vllm.engine hf" in proc.stdout and "fp32 on cpu" in proc.stdout, proc.stdout
