"""Small batches do not collapse: at 8 prompts × 4 samples (what a laptop user picks to go faster) the default
learning rate took grpo.py's and rloo.py's rollout reward from 0.41 to 0.125 at step 2 and to 0 at step 3, and eval
pass@1 from 0.522 to 0.032 in 12 steps: Adam's steps are as large on the noisy gradient of 16 samples as on the
clean one of 256. `--actor.lr` is now the lr for `--actor.lr-ref-samples` (256) samples per optimizer step, and a
run with fewer scales it down in proportion (core.config.actor_lr)."""

import importlib

import pytest
from conftest import short_rl_run

from algos.grpo import ACTOR
from core.config import ActorArgs, actor_lr


def test_the_lr_scales_down_with_fewer_samples_per_optimizer_step_and_never_up():
    actor = ActorArgs(**{**ACTOR, "lr": 3e-4, "lr_ref_samples": 256})
    assert actor_lr(actor, 256) == 3e-4 and actor_lr(actor, 4096) == 3e-4  # the reference batch and larger: as given
    assert actor_lr(actor, 16) == pytest.approx(3e-4 * 16 / 256, rel=1e-12)  # 8 prompts × 4 samples / 2 minibatches
    assert actor_lr(ActorArgs(**{**ACTOR, "lr": 3e-4, "lr_ref_samples": None}), 16) == 3e-4  # None: the lr as given


def test_grpo_defaults_train_at_the_given_lr_and_a_small_batch_at_a_scaled_one():
    from algos.grpo import Args
    from core import rl

    args = Args()
    assert rl.scaled_lr(args.actor, args.rollout, args.train) == args.actor.lr  # 64 × 8 / 2 = 256 samples per optimizer step
    args.rollout.batch_size, args.rollout.n_samples = 8, 4
    assert rl.scaled_lr(args.actor, args.rollout, args.train) == pytest.approx(args.actor.lr / 16, rel=1e-12)
    args.train.minibatches = 1
    assert rl.scaled_lr(args.actor, args.rollout, args.train) == pytest.approx(args.actor.lr / 8, rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo"])  # rloo.py scales its lr with the same core.rl.scaled_lr
def test_eight_prompts_by_four_samples_for_12_steps_do_not_collapse(name, tmp_path):
    """12 steps of the script's defaults at 8 × 4 (in-process vLLM, --debug after every sync). Measured on grpo.py
    (2026-11-28, 2-core Xeon, warm start at 0.522): unscaled, rollout reward 0.41 -> 0.125 -> 0.0 and eval pass@1
    0.032 after 12 steps; at the scaled lr (1.9e-5) the reward stayed in 0.22-0.44 and eval pass@1 ended at 0.60."""
    module = importlib.import_module(f"algos.{name}")
    args = module.Args()
    args.rollout.batch_size, args.rollout.n_samples = 8, 4
    summary, rows = short_rl_run(module.main, args, tmp_path / "run", steps=12)
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert len(steps) == 12
    assert max(r["train/lr"] for r in steps) <= args.actor.lr * 16 / 256 * (1 + 1e-6)  # the scaled peak
    late = [r["rollout/reward_mean"] for r in steps[-6:]]
    assert sum(late) / len(late) >= 0.2, [round(r["rollout/reward_mean"], 3) for r in steps]
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] - 0.05, summary
