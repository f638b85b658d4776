"""Behaviour every RL script shares, checked on each of them: exact resume after `--train.halt-after`, the best-eval
export, DAPO dynamic filtering with refill (grpo.py has its own, stricter filtering test in test_grpo.py), the
multi-turn `--rollout.env-file` flag and `--eval.every 0`."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch


def _rows(run_dir) -> dict[int, dict]:
    """metrics.jsonl rows by step (a resumed run appends to the same file)."""
    rows: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def _small(module: str, run_dir, steps: int):
    mod = importlib.import_module(f"algos.{module}")
    args = mod.Args()
    args.train.max_steps, args.rollout.batch_size, args.train.micro_batch_size = steps, 16, 64
    args.eval.every, args.eval.max_samples = 2, 64
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(run_dir)
    return mod, args


@pytest.mark.slow
def test_eval_k_1_is_greedy_pass_at_1_only_and_k_2_adds_the_sampled_pass_at_2():
    """`--eval.k 1`: the greedy pass@1 alone (a sampled pass@1 would overwrite it under the same name); `--eval.k 2`:
    the greedy pass@1 and pass@2, the share of prompts one of whose 2 samples at the rollout temperature is right."""
    from types import SimpleNamespace

    from core import rl
    from core.config import EvalArgs

    calls = []

    class Executor:
        tokenizer = None

        def run(self, prompts, n, seed, step, temperature=None):
            calls.append((n, temperature))  # greedy: every other answer right; sampled: one of each prompt's two
            return SimpleNamespace(rewards=torch.tensor([1.0, 0.0] * (len(prompts) * n // 2)), episodes=[])

    logger = SimpleNamespace(cfg=SimpleNamespace(eval_samples=0), log_samples=lambda rows, step: None)
    run = SimpleNamespace(eval_set=[{"datasource": "add2"}] * 4, executor=Executor(), logger=logger)
    assert rl.evaluate(run, EvalArgs(k=1), 0) == {"eval/pass@1": 0.5} and calls == [(1, 0.0)]
    calls.clear()
    assert rl.evaluate(run, EvalArgs(k=2), 0) == {"eval/pass@1": 0.5, "eval/pass@2": 1.0}
    assert calls == [(1, 0.0), (2, None)]


def test_eval_every_0_runs_no_eval_at_all(tmp_path, monkeypatch, one_thread):
    """`--eval.every 0` ("0 disables") once still evaluated every eval prompt at step 0 (the first eval) and at the
    last step: now nothing is evaluated, no eval/* metric is logged, and the summary's eval fields are None."""
    from algos import grpo
    from core import rl

    monkeypatch.setattr(rl, "evaluate", lambda *a, **k: pytest.fail("evaluated with --eval.every 0"))
    args = grpo.Args()
    args.train.max_steps, args.rollout.batch_size, args.rollout.n_samples = 1, 8, 4
    args.eval.every = 0
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(tmp_path / "run")
    summary = grpo.main(args)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "loss/policy" in rows[0]
    assert not [k for r in rows for k in r if k.startswith("eval/")], rows
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    for out in (summary, saved):
        assert out["eval_pass@1_first"] is None and out["eval_pass@1_last"] is None, out
    assert not (tmp_path / "run" / "best").exists() and (tmp_path / "run" / "hf" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("module", ["grpo", "ppo", "grpo_async"])
def test_halt_and_resume_reproduces_the_uninterrupted_run(module, tmp_path, one_thread):
    """4 steps straight vs 2 steps, halt (checkpoint), then the same command resumes for steps 3-4: rewards, losses
    and eval are equal, because the data position, sampling seeds, RNGs, optimizer (and critic) state are restored
    and the engine gets the checkpoint's weights (and PPO's adaptive KL coefficient its β). grpo_async's step 3 was
    sampled by the weights of update 2, which the resumed run no longer has: the checkpoint carries that rollout.
    The best eval so far is exported to <run>/best."""
    mod, straight = _small(module, tmp_path / "straight", 4)
    _, part = _small(module, tmp_path / "part", 4)
    if module == "ppo":  # PPO with its KL in the reward, under the adaptive controller: its β is state to restore
        straight.algo.kl_target = part.algo.kl_target = 1e-3
    mod.main(straight)
    part.train.halt_after = 2
    assert mod.main(part)["halted"]
    part.train.halt_after = None
    mod.main(part)
    expected, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "part")
    trained = [json.loads(line)["step"] for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
               if "loss/policy" in line]  # fmt: skip
    assert trained == [1, 2, 3, 4]  # the second invocation resumed at step 3 instead of starting over
    keys = ["rollout/reward_mean", "loss/policy", "eval/pass@1", "train/kl_coef"]
    keys += ["loss/value", "loss/kl"] if module == "ppo" else []
    for step in (3, 4):
        for key in keys:
            if key in expected[step]:
                assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert "loss/policy" in expected[4] and "eval/pass@1" in expected[4]
    if module == "ppo":
        assert expected[2]["train/kl_coef"] != expected[4]["train/kl_coef"] != straight.algo.kl_coef  # β moved
    assert (tmp_path / "part" / "best" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("module", ["rloo", "reinforce_pp", "ppo"])
def test_dynamic_filtering_in_every_fork(module, tmp_path, one_thread):
    """`--algo.dynamic-filter-range 0 1`: the trained batch holds only groups neither all solved nor all failed, so
    its reward mean is strictly between 0 and 1 while refills keep it full (or hit the round limit)."""
    mod, args = _small(module, tmp_path / "run", 1)
    args.eval.every = 0
    args.algo.dynamic_filter_range, args.algo.dynamic_filter_max_rounds = (0.0, 1.0), 4
    if hasattr(args.algo, "filter_zero_variance"):
        args.algo.filter_zero_variance = True
    mod.main(args)
    row = _rows(tmp_path / "run")[1]
    assert 1 <= row["rollout/filter_rounds"] <= 4
    assert row["rollout/filter_groups"] == 16 or row["rollout/filter_rounds"] == 4
    assert 0 < row["rollout/reward_mean"] < 1
    if "rollout/kept_frac" in row:
        assert row["rollout/kept_frac"] == 1.0  # no group left for the zero-variance filter to drop


@pytest.mark.slow
def test_hybrid_engine_sleeps_while_training_and_wakes_before_the_sync(tmp_path, monkeypatch, one_thread):
    """`--vllm.enable-sleep`: after each rollout the engine sleeps (its GPU memory would go to training), its weights
    wake before the sync, its KV cache after it, and nothing is generated while it sleeps; generation still works
    and the `--debug` check passes after every sync. DeepSpeed's states go off the GPU before each rollout and come
    back after it. (On CPU neither frees anything, but the calls are real; tests/test_gpu.py moves states on CUDA.)"""
    from core import rollout

    calls = []

    def record(name):
        original = getattr(rollout.RolloutEngines, name)

        def wrapper(self, *a, **k):
            calls.append((name, tuple(a[0]) if name == "wake_up" and a else None))
            return original(self, *a, **k)

        monkeypatch.setattr(rollout.RolloutEngines, name, wrapper)

    for name in ("sleep", "wake_up", "update_weights", "generate"):
        record(name)
    from core import placement

    def record_states(name):  # the DeepSpeed side (moves states on CUDA; no-op on CPU)
        original = getattr(placement, name)

        def wrapper(engine):
            calls.append((name, None))
            return original(engine)

        monkeypatch.setattr(placement, name, wrapper)

    for name in ("offload_states", "reload_states"):
        record_states(name)
    mod, args = _small("grpo", tmp_path / "run", 2)
    args.eval.every, args.vllm.enable_sleep, args.debug = 0, True, True
    mod.main(args)
    events = [c for c in calls if c[0] != "generate"]
    step = [("sleep", None), ("reload_states", None), ("wake_up", ("weights",)), ("update_weights", None),
            ("wake_up", ("kv_cache",))]  # fmt: skip
    assert events == [("offload_states", None), *step, ("offload_states", None), *step]
    asleep, offloaded = False, False
    for name, tags in calls:
        asleep = True if name == "sleep" else (False if tags == ("kv_cache",) else asleep)
        offloaded = True if name == "offload_states" else (False if name == "reload_states" else offloaded)
        assert not (name == "generate" and asleep)
        assert not (name == "update_weights" and offloaded)  # the sync reads the trainer's weights on the GPU


@pytest.mark.slow
@pytest.mark.parametrize("module", ["grpo", "rloo", "reinforce_pp", "ppo"])
def test_multi_turn_environment_flag(module, tmp_path, monkeypatch, one_thread):
    """`--rollout.env-file agents/retry_env.py` selects the multi-turn executor without touching the loop: wrong first
    answers get the prompt again as feedback (tokens masked out of the loss) and a second try worth 0.5, so rewards
    are in {0, 0.5, 1}, some episodes take two turns, and training runs on them."""
    from agents import executor as agent_executor

    seen = []
    original = agent_executor.MultiTurnExecutor.run

    def spy(self, *a, **k):
        ro = original(self, *a, **k)
        seen.append(ro)
        return ro

    monkeypatch.setattr(agent_executor.MultiTurnExecutor, "run", spy)
    mod, args = _small(module, tmp_path / "run", 2)
    args.rollout.env_file = str(Path(mod.__file__).resolve().parents[1] / "agents" / "retry_env.py")
    summary = mod.main(args)
    train = [ro for ro in seen if len(ro.episodes) == args.rollout.batch_size * args.rollout.n_samples]
    assert train, "the multi-turn executor did not produce the training rollouts"
    rewards = torch.cat([ro.rewards for ro in train])
    assert set(rewards.tolist()) <= {0.0, 0.5, 1.0} and (rewards == 1.0).any()
    two_turns = [e for ro in train for e in ro.episodes if 0 in e.action_mask]
    assert two_turns, "no episode got feedback"
    for e in two_turns:  # model tokens, then the masked feedback (the prompt again), then the model's second try
        first_feedback = e.action_mask.index(0)
        assert e.action_mask[:first_feedback] == [1] * first_feedback and e.action_mask[-1] == 1
    from core import rl  # the ported scripts build their batches with core.rl.sequences

    loss_mask = getattr(mod, "sequences", rl.sequences)(two_turns, 0, "cpu")["loss_mask"]  # exactly the action mask
    for row, e in enumerate(two_turns):
        expected = [0] * len(e.prompt_ids) + e.action_mask
        assert loss_mask[row].tolist() == expected + [0] * (loss_mask.shape[1] - len(expected))
    rows = [json.loads(line) for line in open(Path(summary["run_dir"]) / "metrics.jsonl")]
    assert 1.0 < rows[-1]["rollout/turns_mean"] <= 2.0 and math.isfinite(rows[-1]["loss/policy"])
    if module == "ppo":  # the critic trains on them too (GAE skips the feedback tokens)
        assert math.isfinite(rows[-1]["loss/value"])
