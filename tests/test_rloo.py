"""algos/rloo.py: the leave-one-out advantage, its input checks, the CLI, and a short learning run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import short_rl_run

from algos.rloo import Args, main, rloo_advantages

REPO = Path(__file__).resolve().parent.parent


def test_rloo_advantages_hand_case():
    # group 1: rewards 1, 0, 0, 1 (sum 2): A = 1 − (2 − 1)/3 = 2/3 for the ones, 0 − 2/3 for the zeros
    # group 2: rewards 3, 1, 1, 1 (sum 6): A = 3 − 3/3 = 2 for the three, 1 − 5/3 = −2/3 for the ones
    r = torch.tensor([1.0, 0, 0, 1, 3, 1, 1, 1])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2 / 3, -2 / 3, -2 / 3])
    assert torch.allclose(rloo_advantages(r, 4), expected, atol=1e-6)
    # G = 2: each sample's baseline is the other sample's reward
    assert rloo_advantages(torch.tensor([0.25, 1.0, -1.0, 2.0]), 2).tolist() == [-0.75, 0.75, -3.0, 3.0]


def test_equal_reward_group_gives_exactly_zero_advantage():
    r = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 0.3, 0.3, 0.3, 0.3, 0, 1, 0, 0])
    adv = rloo_advantages(r, 4)
    assert torch.equal(adv[:12], torch.zeros(12))
    assert torch.allclose(adv[12:], torch.tensor([-1 / 3, 1.0, -1 / 3, -1 / 3]))


def test_rloo_is_scaled_mean_centering_and_sums_to_zero_per_group():
    # A_i = G/(G−1) · (r_i − mean): the leave-one-out baseline only rescales mean-centering (no std involved)
    g = torch.Generator().manual_seed(0)
    for G in (2, 3, 5, 8):
        r = torch.randn(6 * G, generator=g, dtype=torch.float64)
        adv = rloo_advantages(r, G)
        centered = r.view(-1, G) - r.view(-1, G).mean(dim=1, keepdim=True)
        assert torch.allclose(adv, (G / (G - 1) * centered).reshape(-1))
        assert torch.allclose(adv.view(-1, G).sum(dim=1), torch.zeros(6, dtype=torch.float64), atol=1e-12)


def _rloo_loop(rewards: list[float], G: int) -> list[float]:
    out = []
    for i in range(len(rewards) // G):
        grp = rewards[i * G : (i + 1) * G]
        for j in range(G):
            others = [grp[k] for k in range(G) if k != j]
            out.append(grp[j] - sum(others) / len(others))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_rloo_vectorized_equals_loop(seed):
    g = torch.Generator().manual_seed(seed)
    G, n = 2 + seed % 5, 3 + seed
    r = torch.randn(n * G, generator=g)
    if seed % 2:  # binary rewards, as the rule reward gives, with some all-equal groups
        r = (r > 0.3).float()
    expected = _rloo_loop(r.tolist(), G)
    assert rloo_advantages(r, G).tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_rloo_rejects_bad_inputs():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.ones(4), 0)
    with pytest.raises(ValueError, match="divisible by group_size 4"):
        rloo_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match=r"got shape \(2, 4\)"):
        rloo_advantages(torch.ones(2, 4), 4)


def test_main_refuses_one_sample_per_prompt_before_loading_anything():
    args = Args()
    args.rollout.n_samples = 1
    with pytest.raises(ValueError, match="--rollout.n-samples 1"):
        main(args)


def test_import_has_no_side_effects_and_defaults():
    args = Args()
    assert args.exp_name == "rloo"
    assert args.actor.model.name_or_path == "cleanrlhf/tiny-sft"
    assert args.algo.kl_coef == 0.0
    assert args.rollout.n_samples >= 2
    assert not hasattr(args.algo, "scale_by_std")  # RLOO never divides by a std


def test_help_lists_grouped_flags():
    out = subprocess.run([sys.executable, str(REPO / "algos" / "rloo.py"), "--help"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--actor.lr", "--algo.clip-high", "--actor.model.name-or-path", "--reward.func",
                 "--rollout.n-samples", "--algo.kl-coef", "--algo.filter-zero-variance", "--algo.loss-agg",
                 "--vllm.sync-bucket-mb", "--ds.zero-stage", "--eval.k"):  # fmt: skip
        assert flag in out.stdout, flag
    assert "--algo.dr-grpo" not in out.stdout


@pytest.mark.slow
def test_rloo_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """A short run of the real loop (DeepSpeed actor + in-process vLLM + weight sync every step) learns."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run", steps=16, eval_k=4)  # the sampled pass@4 too, as by default
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    logged = set().union(*rows)
    for key in ("rollout/reward_mean", "rollout/kept_frac", "loss/policy", "loss/clipfrac", "train/grad_norm",
                "train/lr", "perf/gen_s", "perf/train_s", "perf/sync_s", "eval/pass@1", "eval/pass@4"):  # fmt: skip
        assert key in logged, key
    assert "loss/kl" not in logged  # kl_coef 0: no reference model, no KL term
    assert (tmp_path / "run" / "hf" / "config.json").exists()
