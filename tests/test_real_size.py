"""A Qwen2-0.5B-shaped model (hidden 896, MLP 4864, 14 heads; 2 of its 24 layers here, the full depth in
tests/benchmarks/bench_real_size.py) through algos/grpo.py: two ZeRO-3 bf16 trainer ranks, a vLLM engine as a Ray
actor, the `--debug` check after every weight sync, a halt after step 1 and a resume to step 2, the export loaded in
vLLM."""

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))


def test_a_05b_shaped_model_runs_grpo_end_to_end_with_two_zero3_ranks_halt_and_resume(tmp_path, monkeypatch):
    from bench_real_size import main

    from core.embedded import reproducible_cpu_env

    # No learning threshold here, so the runs may use the CPU's own kernels: under the suite's AVX2 pin vLLM's bf16
    # kernels lose AMX, and generating with this model took minutes instead of seconds on a Xeon with AMX.
    for key in reproducible_cpu_env():
        monkeypatch.delenv(key, raising=False)

    # two steps: the halted run logs step 1, the resumed one step 2 (each bf16 step of this shape takes ~17 s of both
    # cores on an AVX2 machine); the bounds are the benchmark's numbers
    result = main(["--layers", "2", "--steps", "2", "--out", str(tmp_path), "--no-bounds"])
    assert result["steps"] == [1, 2]  # each step once
    assert result["sync_senders"] == 2  # each ZeRO-3 rank sent its own partitions (no gather), checked by --debug
    assert result["sync_mb"] == pytest.approx(result["params_m"] * 1e6 * 2 / 2**20, rel=0.01)  # the whole bf16 model
    assert {"driver", "trainer rank", "vLLM engine actor"} <= set(result["peak_rss_gib"])
    assert len(result["export_generates"]) == 4  # vLLM loaded the export and generated
    assert 0 < result["sync_share"] < 1
