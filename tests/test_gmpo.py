"""algos/gmpo.py: the GMPO loss against the paper's objective written out independently here (Zhao et al. 2025,
arXiv:2507.20673: 1/G Σ_i sgn(A_i) (Π_t |min(ρ_t A_i, clip(ρ_t, e^−ε_low, e^ε_high) A_i)|)^{1/|o_i|}), GRPO's gradient
at ρ = 1, an outlier token's smaller pull, and a short run of the real loop that learns."""

import math

import pytest
import torch
from conftest import short_rl_run

from algos import grpo
from algos.gmpo import Args, main, policy_loss

F64 = torch.float64


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def papers_objective(logp, old_logp, adv, lengths, eps_low, eps_high):
    """J of the paper, response by response, in its product form: sgn(A)·(Π_t |min(ρ_t A, clip(ρ_t)·A)|)^{1/|o|}."""
    total = 0
    for i, n in enumerate(lengths):
        a = adv[i, 0]
        rho = torch.exp(logp[i, :n] - old_logp[i, :n])
        clipped = rho.clamp(math.exp(-eps_low), math.exp(eps_high))
        terms = torch.minimum(rho * a, clipped * a).abs()
        total = total + torch.sign(a) * torch.prod(terms) ** (1.0 / n)
    return total / len(lengths)


def test_the_gradient_is_autograds_of_the_papers_objective():
    # 3 responses of 4, 2 and 3 tokens, A = +1.5, −0.5, +0.8; ratios spread over (e^−0.9, e^0.9) so that some tokens
    # sit outside (e^−0.4, e^0.4) on each side; padding holds NaN
    g = torch.Generator().manual_seed(0)
    lengths, T = [4, 2, 3], 4
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    old = torch.log(torch.rand(3, T, generator=g, dtype=F64) * 0.8 + 0.1)
    logp = (old + (torch.rand(3, T, generator=g, dtype=F64) - 0.5) * 1.8).detach()
    logp[~mask], old[~mask] = float("nan"), float("inf")
    adv = t([1.5] * T, [-0.5] * T, [0.8] * T)
    adv[~mask] = float("nan")
    logp.requires_grad_()
    loss, stats, _ = policy_loss(logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    want = -papers_objective(logp, old, adv, lengths, 0.4, 0.4)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    got = torch.autograd.grad(loss, logp)[0]
    expected = torch.autograd.grad(want, logp)[0]
    assert torch.allclose(got[mask], expected[mask], rtol=1e-10, atol=1e-14) and not got[~mask].any()
    log_ratio = (logp - old).detach()[mask]
    outside = ((log_ratio > 0.4) | (log_ratio < -0.4)).sum().item()
    assert 0 < stats["loss/clipfrac"].item() <= outside / mask.sum().item()  # some held at a bound (A's side only)


def test_at_ratio_one_the_gradient_is_grpos_with_the_per_sequence_mean():
    # ρ = 1: every geometric mean is 1, the loss −mean_i A_i, and ∂loss/∂log π_t = −A_i / (|o_i| · G), as GRPO's
    # clipped surrogate aggregated per sequence (seq-mean-token-mean)
    logp = torch.log(t([0.3, 0.6, 0.2], [0.5, 0.4, 0.1])).requires_grad_()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = t([2.0] * 3, [-1.0] * 3)
    loss, _, _ = policy_loss(logp, logp.detach(), adv, mask)
    ref, _, _ = grpo.policy_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12) and loss.item() == pytest.approx(-(2 - 1) / 2)
    got, want = torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0]
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert got.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 1 / 4, 1 / 4, 0], abs=1e-12)


def test_an_outlier_token_moves_the_objective_less_than_under_grpo():
    # one response, ratios [3, 1, 1, 1], A = +1, both clips wide open (no token held):
    #   GMPO: A · 3^{1/4} = 1.316, the outlier's gradient 3^{1/4} / 4 = 0.329
    #   GRPO (per-sequence mean): A · (3 + 1 + 1 + 1) / 4 = 1.5, the outlier's gradient 3 / 4 = 0.75
    old = torch.log(t([0.1, 0.5, 0.5, 0.5]))
    logp = torch.log(t([0.3, 0.5, 0.5, 0.5])).requires_grad_()
    adv, mask = t([1.0] * 4), torch.ones(1, 4, dtype=torch.bool)
    gm, _, _ = policy_loss(logp, old, adv, mask, clip_low=5.0, clip_high=5.0)
    ar, _, _ = grpo.policy_loss(logp, old, adv, mask, clip_low=5.0, clip_high=5.0, agg="seq-mean-token-mean")
    assert -gm.item() == pytest.approx(3 ** 0.25, rel=1e-12) and -ar.item() == pytest.approx(1.5, rel=1e-12)
    assert abs(-gm.item() - 1) < abs(-ar.item() - 1)
    g_gm, g_ar = torch.autograd.grad(gm, logp)[0][0, 0].item(), torch.autograd.grad(ar, logp)[0][0, 0].item()
    assert g_gm == pytest.approx(-(3 ** 0.25) / 4, rel=1e-12) and g_ar == pytest.approx(-0.75, rel=1e-12)


def test_the_clip_binds_only_the_way_the_advantage_pushes():
    # A > 0: a token at ρ = e^0.6 (above e^0.4) is held at 0.4 (no gradient); one at ρ = e^−0.6 is not held (its
    # smaller value is the pessimistic one). A < 0: the mirror. Two tokens each; loss = −A · exp(mean c).
    up, down = 0.6, -0.6
    for a, held in [(1.0, [True, False]), (-1.0, [False, True])]:
        old = torch.log(t([0.2, 0.2]))
        logp = (old + t([up, down])).detach().requires_grad_()
        loss, stats, _ = policy_loss(logp, old, t([a, a]), torch.ones(1, 2, dtype=torch.bool))
        c = [0.4 if held[0] else up, -0.4 if held[1] else down]
        assert loss.item() == pytest.approx(-a * math.exp(sum(c) / 2), rel=1e-12)
        grad = torch.autograd.grad(loss, logp)[0][0].tolist()
        assert [g == 0 for g in grad] == held, (a, grad)
        assert stats["loss/clipfrac"].item() == pytest.approx(0.5)


def test_a_response_split_over_ranks_is_refused(nothing_loads):
    args = Args()
    args.train.sp_size, args.train.ranks = 2, 2
    with pytest.raises(ValueError, match=r"--train.sp-size 2: GMPO's geometric mean spans a whole response"):
        main(args)


@pytest.mark.slow
def test_gmpo_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """12 steps of the real loop (DeepSpeed actor, in-process vLLM, --debug every sync) learn: measured 0.48 -> 0.772
    on the 2-core AMD EPYC (2026-12-05)."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run")
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
