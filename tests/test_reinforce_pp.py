"""algos/reinforce_pp.py: KL-shaped, globally whitened token advantages, input checks, the CLI, a short learning run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import short_rl_run

from algos.reinforce_pp import Args, main, reinforce_pp_advantages

REPO = Path(__file__).resolve().parent.parent


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def test_hand_case_without_kl():
    # rewards 1 and 0, lengths 2 and 3, γ = 1, no KL: returns [1, 1 | 0, 0, 0] over the 5 valid tokens,
    # μ = 0.4, population σ² = (2·0.6² + 3·0.4²)/5 = 0.24
    mask = right_padded_mask([2, 3], 3)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, 3), mask, kl_coef=0.1)
    s = math.sqrt(0.24 + 1e-8)
    expected = torch.tensor([[0.6 / s, 0.6 / s, 0.0], [-0.4 / s, -0.4 / s, -0.4 / s]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_hand_case_with_kl_and_discount():
    # one row of 3 tokens, kl = 0.1, 0.2, 0.3, β = 0.5, γ = 0.5, reward 1 at the last token:
    # r_t = −0.05, −0.1, −0.15 + 1;  R_2 = 0.85, R_1 = −0.1 + 0.5·0.85 = 0.325, R_0 = −0.05 + 0.5·0.325 = 0.1125
    # second row: reward 0, 2 tokens, kl = 0.4, 0 (pad kl is garbage and must not leak): R = −0.2 + 0.5·0, 0
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, float("nan")]])
    mask = right_padded_mask([3, 2], 3)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), kl, mask, kl_coef=0.5, gamma=0.5)
    returns = [0.1125, 0.325, 0.85, -0.2, 0.0]
    mu = sum(returns) / 5
    sd = math.sqrt(sum((x - mu) ** 2 for x in returns) / 5 + 1e-8)
    expected = torch.tensor([[0.1125, 0.325, 0.85], [-0.2, 0.0, mu]])
    expected = (expected - mu) / sd
    expected[1, 2] = 0.0
    assert torch.allclose(adv, expected, atol=1e-5)


def test_group_baseline_hand_case_and_equal_group_gives_zero():
    # G = 2, rewards (1, 0) and (1, 1), equal lengths 4, no KL: r̃ = 0.5, −0.5, 0, 0; μ = 0,
    # σ² = (4·0.25 + 4·0.25)/16 = 0.125. The equal-reward group gets exactly 0.
    mask = torch.ones(4, 4, dtype=torch.bool)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, 4), mask, 0.0,
                                  baseline="group", group_size=2)  # fmt: skip
    a = 0.5 / math.sqrt(0.125 + 1e-8)
    assert torch.allclose(adv[0], torch.full((4,), a)) and torch.allclose(adv[1], torch.full((4,), -a))
    assert torch.equal(adv[2:], torch.zeros(2, 4))
    # without the baseline the all-correct group carries signal: it is above the batch mean
    plain = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, 4), mask, 0.0)
    assert (plain[2:] > 0.5).all() and (plain[1] < 0).all()


def test_gamma_one_matches_the_paper_closed_form():
    # Hu et al. 2025, eq. 8: A_t = r − β Σ_{k≥t} KL_k (before normalisation over the batch's valid tokens)
    g = torch.Generator().manual_seed(0)
    B, T, beta = 6, 7, 0.3
    mask = right_padded_mask([7, 1, 4, 5, 2, 6], T)
    r, kl = torch.randn(B, generator=g), torch.randn(B, T, generator=g).abs()
    adv = reinforce_pp_advantages(r, kl, mask, beta)
    kl_m = torch.where(mask, kl, 0.0)
    raw = r[:, None] - beta * kl_m.flip(1).cumsum(1).flip(1)  # suffix sums of KL
    vals = raw[mask]
    expected = (raw - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + 1e-8)
    assert torch.allclose(adv[mask], expected[mask], atol=1e-5)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))


def test_whitened_and_shift_invariant():
    g = torch.Generator().manual_seed(1)
    B, T = 8, 5
    mask = right_padded_mask([5, 3, 1, 4, 5, 2, 3, 4], T)
    r, kl = torch.randn(B, generator=g), torch.randn(B, T, generator=g)
    adv = reinforce_pp_advantages(r, kl, mask, 0.1)
    assert adv[mask].mean().abs() < 1e-5 and (adv[mask].pow(2).mean() - 1).abs() < 1e-4
    # a constant added to every reward moves every return by the same amount: global whitening removes it
    assert torch.allclose(reinforce_pp_advantages(r + 3.0, kl, mask, 0.1), adv, atol=1e-4)
    # with the group baseline, a constant per group is removed as well
    shift = torch.tensor([5.0, -2.0, 0.5, 7.0]).repeat_interleave(2)
    a = reinforce_pp_advantages(r, kl, mask, 0.1, baseline="group", group_size=2)
    assert torch.allclose(reinforce_pp_advantages(r + shift, kl, mask, 0.1, baseline="group", group_size=2), a,
                          atol=1e-4)  # fmt: skip


def _reinforce_pp_loop(rewards, kl, lengths, kl_coef, gamma, baseline, G):
    """Plain python: baseline, per-token shaped reward, reward-to-go, whitening over all valid tokens."""
    rewards = list(rewards)
    if baseline == "group":
        for i in range(len(rewards) // G):
            m = sum(rewards[i * G : (i + 1) * G]) / G
            for j in range(i * G, (i + 1) * G):
                rewards[j] -= m
    returns = []
    for b, n in enumerate(lengths):
        per = [-kl_coef * kl[b][t] for t in range(n)]
        if n:
            per[-1] += rewards[b]
        row, run = [0.0] * n, 0.0
        for t in reversed(range(n)):
            run = per[t] + gamma * run
            row[t] = run
        returns.append(row)
    flat = [x for row in returns for x in row]
    mu = sum(flat) / len(flat)
    sd = math.sqrt(sum((x - mu) ** 2 for x in flat) / len(flat) + 1e-8)
    return [[(x - mu) / sd for x in row] for row in returns]


@pytest.mark.parametrize("seed", range(6))
def test_vectorized_equals_loop(seed):
    g = torch.Generator().manual_seed(seed)
    G = 2 + seed % 3
    B, T = 4 * G, 9
    lengths = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lengths[0] = T  # one full row; an empty row (length 0) may occur and gets nothing
    r = (torch.rand(B, generator=g) > 0.5).float() if seed % 2 else torch.randn(B, generator=g)
    kl = torch.randn(B, T, generator=g) * 0.2
    baseline, gamma, kl_coef = ("group", "none")[seed % 2], (1.0, 0.9, 0.5)[seed % 3], (0.0, 0.05, 0.3)[seed % 3]
    mask = right_padded_mask(lengths, T)
    adv = reinforce_pp_advantages(r, kl.masked_fill(~mask, float("inf")), mask, kl_coef, gamma, baseline, G)
    expected = _reinforce_pp_loop(r.tolist(), kl.tolist(), lengths, kl_coef, gamma, baseline, G)
    for b, n in enumerate(lengths):
        assert adv[b, :n].tolist() == pytest.approx(expected[b], rel=1e-4, abs=1e-5)
        assert torch.equal(adv[b, n:], torch.zeros(T - n))


def test_rejects_bad_inputs():
    mask = torch.ones(4, 3, dtype=torch.bool)
    r, kl = torch.ones(4), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="unknown baseline 'mean'"):
        reinforce_pp_advantages(r, kl, mask, 0.1, baseline="mean")
    with pytest.raises(ValueError, match="group_size >= 2"):
        reinforce_pp_advantages(r, kl, mask, 0.1, baseline="group", group_size=1)
    with pytest.raises(ValueError, match="dividing B = 4"):
        reinforce_pp_advantages(r, kl, mask, 0.1, baseline="group", group_size=3)
    with pytest.raises(ValueError, match="shapes"):
        reinforce_pp_advantages(r, torch.zeros(4, 2), mask, 0.1)
    with pytest.raises(ValueError, match="shapes"):
        reinforce_pp_advantages(torch.ones(3), kl, mask, 0.1)
    # no baseline: any group size (including 1 sample per prompt) is fine
    assert reinforce_pp_advantages(r, kl, mask, 0.1, group_size=3).shape == (4, 3)


def test_main_refuses_group_baseline_with_one_sample_before_loading_anything():
    args = Args()
    args.algo.baseline, args.rollout.n_samples = "group", 1
    with pytest.raises(ValueError, match="--algo.baseline group needs --rollout.n-samples >= 2"):
        main(args)


def test_import_has_no_side_effects_and_defaults():
    args = Args()
    assert args.exp_name == "reinforce_pp"
    assert args.actor.model.name_or_path == "cleanrlhf/tiny-sft"
    assert args.algo.kl_coef > 0 and args.algo.kl_estimator == "k1"  # KL in the reward is REINFORCE++'s default
    assert args.algo.baseline == "none" and args.algo.gamma == 1.0


def test_help_lists_grouped_flags():
    out = subprocess.run([sys.executable, str(REPO / "algos" / "reinforce_pp.py"), "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--actor.lr", "--algo.clip-high", "--actor.model.name-or-path", "--reward.func",
                 "--rollout.n-samples", "--algo.kl-coef", "--algo.kl-estimator", "--algo.baseline", "--algo.gamma",
                 "--vllm.sync-bucket-mb", "--ds.zero-stage", "--eval.k"):  # fmt: skip
        assert flag in out.stdout, flag
    assert "{none,group}" in out.stdout


@pytest.mark.slow
def test_reinforce_pp_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """A short run of the real loop (actor + frozen reference + in-process vLLM + weight sync every step) learns."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run")
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    kls = [row["loss/kl"] for row in rows if "loss/kl" in row]
    assert len(kls) == 12, "the default kl_coef > 0 must load the reference model and log the KL every step"
    assert kls[0] == pytest.approx(0.0, abs=1e-4)  # the first rollout's policy is the reference
    assert all(math.isfinite(k) for k in kls) and max(abs(k) for k in kls[1:]) > 0
    assert (tmp_path / "run" / "hf" / "config.json").exists()
