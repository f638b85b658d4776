"""tests/benchmarks/bench_agents.py at a tiny size: it runs to the end and reports finite, positive numbers for its
measurements (the timings themselves are the script's business, not the suite's)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))


@pytest.mark.slow
def test_bench_agents_runs_at_a_tiny_size(one_thread, capsys):
    from bench_agents import main

    result = main(["--episodes", "8", "--concurrency", "1", "4", "--repeats", "1"])
    assert set(result["throughput"]) == set(result["overhead"]) == {1, 4}
    assert result["throughput"][1]["speedup"] == 1.0 and result["calls_example_agent"] >= 8
    for r in result["throughput"].values():
        assert math.isfinite(r["episodes_per_s"]) and r["episodes_per_s"] > 0
    for r in result["overhead"].values():
        assert r["server_ms_per_call"] > 0 and r["direct_ms_per_call"] > 0 and math.isfinite(r["overhead"])
        assert r["client_ms_per_call"] > 0 and math.isfinite(r["floor"])  # the canned server answered every call
    assert '"bench": "agents"' in capsys.readouterr().out.splitlines()[-1]
