"""algos/grpo_async.py: the producer/trainer hand-off of core/producer.py (which weights sample which step), errors
crossing the thread, lag 0 equal to grpo.py, and learning with lag 1 (exact resume is in test_rl_scripts.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_first_step_agrees, ranks_2_vs_1, short_rl_run, zero3_other_reference

from algos.grpo_async import Args
from core.producer import Pipeline

REPO = Path(__file__).resolve().parent.parent


def drive(lag: int, first: int = 0, last: int = 8, carried: dict | None = None, fail_at: int | None = None):
    """The training loop's side of a Pipeline, with random delays on both sides. Returns what was trained on and, per
    produced step, (weights version seen, whether a sync overlapped the generation)."""
    rng, syncing, producing, seen, clash = random.Random(lag), threading.Event(), threading.Event(), {}, set()

    def produce(step: int, version: int):
        producing.set()
        clash.discard(step)
        if syncing.is_set():
            clash.add(step)
        time.sleep(rng.random() * 0.004)
        if syncing.is_set():
            clash.add(step)
        producing.clear()
        seen[step] = version
        if step == fail_at:
            raise ValueError(f"reward file broke at step {step}")
        return ("rollout", step, version)

    pipe = Pipeline(produce, first, last, lag, carried or {})
    pipe.thread.start()
    trained = []
    try:
        for step in range(first, last):
            trained.append(pipe.take(step))
            time.sleep(rng.random() * 0.004)  # training
            pipe.engines_idle_for(step)
            syncing.set()
            if producing.is_set():
                clash.add(step)
            time.sleep(rng.random() * 0.002)  # the weight sync: the engines must be idle
            syncing.clear()
            pipe.synced_update(step)
    finally:
        pipe.stop()
    return trained, {t: (v, t in clash) for t, v in seen.items()}


@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_step_t_is_sampled_by_the_weights_of_update_t_minus_lag(lag):
    for _ in range(5):  # different thread interleavings, same versions
        trained, seen = drive(lag)
        assert [t for _, t, _ in trained] == list(range(8))
        assert [v for _, _, v in trained] == [max(0, t - lag) for t in range(8)]
        assert not any(during_sync for _, during_sync in seen.values())


def test_a_resumed_pipeline_trains_the_carried_rollouts_first():
    """A checkpoint after step 3 (lag 2) carries steps 4 and 5, sampled by the weights of updates 2 and 3; the
    producer resumes at step 6 with the checkpoint's weights (update 4)."""
    carried = {4: ("rollout", 4, 2), 5: ("rollout", 5, 3)}
    trained, seen = drive(lag=2, first=4, last=9, carried=carried)
    assert trained[:2] == [carried[4], carried[5]]
    assert sorted(seen) == [6, 7, 8] and [v for _, _, v in trained] == [2, 3, 4, 5, 6]
    assert not any(during_sync for _, during_sync in seen.values())


def test_an_error_in_the_producer_is_raised_in_the_trainer():
    with pytest.raises(ValueError, match="reward file broke at step 3"):
        drive(lag=1, fail_at=3)


def test_in_process_engines_are_refused_with_a_reason():
    from algos.grpo_async import main

    args = Args()
    args.vllm.in_process = True
    with pytest.raises(ValueError, match="must be Ray actors"):
        main(args)


def test_defaults_and_help():
    args = Args()
    assert args.exp_name == "grpo_async" and args.train.max_lag == 1 and args.algo.is_correction == "tis"
    assert args.vllm.in_process is False
    out = subprocess.run([sys.executable, str(REPO / "algos" / "grpo_async.py"), "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--train.max-lag", "--algo.is-correction", "--vllm.num-engines", "--rollout.n-samples"):
        assert flag in out.stdout, flag


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss/policy" in line]


@pytest.mark.slow
def test_lag_zero_trains_exactly_like_grpo(tmp_path, one_thread):
    """With --train.max-lag 0 and no IS weight the pipeline is synchronous GRPO: the same samples (the engine is a
    Ray actor here, in-process there; both seeded per request) and the same updates, step for step. So is it with
    partial rollout (`--train.partial-rollout 2`): at lag 0 no sync falls inside a step, every token is fresh."""
    from algos import grpo, grpo_async

    rows = {}
    for name, mod in (("sync", grpo), ("async", grpo_async), ("partial", grpo_async)):
        args = mod.Args()
        args.train.max_steps, args.rollout.batch_size, args.eval.every = 3, 16, 0
        args.logger.quiet, args.logger.tensorboard = True, False
        args.run_dir = str(tmp_path / name)
        if mod is grpo_async:
            args.train.max_lag, args.algo.is_correction = 0, None
            args.train.partial_rollout = 2 if name == "partial" else None
        mod.main(args)
        rows[name] = _rows(tmp_path / name)
    assert [r["rollout/lag"] for r in rows["async"]] == [r["rollout/lag"] for r in rows["partial"]] == [0, 0, 0]
    assert all(r["rollout/versions_per_sample"] == 1 and r["rollout/stale_token_frac"] == 0 for r in rows["partial"])
    for name in ("async", "partial"):
        for a, b in zip(rows["sync"], rows[name], strict=True):
            for key in ("rollout/reward_mean", "rollout/response_len_mean", "loss/policy", "train/grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (name, key)


@pytest.mark.slow
def test_async_grpo_raises_eval_pass_at_1_from_the_warm_start(tmp_path, one_thread):
    """18 steps of the defaults (lag 1, truncated IS) with `--debug` (engine log-probs == trainer log-probs after
    every sync): the first step is fresh, every later one one update old, and eval pass@1 rises (measured 0.480 ->
    0.706 on 2026-11-30 from the pinned warm start, conftest.py; the test asks for +0.1)."""
    from algos.grpo_async import main

    summary, rows = short_rl_run(main, Args(), tmp_path / "run", steps=18)
    trained = [r for r in rows if "loss/policy" in r]
    assert [r["rollout/lag"] for r in trained] == [0] + [1] * 17
    assert all(0.5 < r["loss/is_weight"] < 2.0 for r in trained)
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    assert (tmp_path / "run" / "hf" / "config.json").exists()


@pytest.mark.slow
def test_two_ray_ranks_train_like_one_process(tmp_path):
    """`--train.ranks 2`: rank 0's producer generates the whole batch and broadcasts it; two ZeRO-3 ranks (with a
    ZeRO-3 reference for the KL) then take the same first update as one process, and the second step is one update
    stale on both."""
    from algos.grpo_async import main

    rows = ranks_2_vs_1(Args, main, tmp_path, zero3_other_reference)
    assert_first_step_agrees(rows)
    assert [r["rollout/lag"] for r in rows[2]] == [r["rollout/lag"] for r in rows[1]] == [0, 1]
