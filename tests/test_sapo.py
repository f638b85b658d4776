"""algos/sapo.py: the SAPO loss by hand (from the paper's equation: −f_τ(ρ)·A with f_τ(ρ) = σ(τ(ρ − 1))·4/τ, τ_pos for
A > 0 and τ_neg otherwise, token mean), and a short run of the real loop that learns."""

import math

import pytest
import torch
from conftest import short_rl_run

from algos.sapo import Args, main, policy_loss

F64 = torch.float64


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_soft_gate_by_hand_inside_and_outside_the_trust_region_for_both_signs():
    # ρ = [1, 1, 2, 0.5] (log-ratios 0, 0, ln 2, −ln 2), A = [+1, −1, +1, −1], τ_pos = 1, τ_neg = 1.05, a masked 5th
    # token holding NaN. Per token, with s = σ(τ(ρ − 1)):
    #   ℓ = −s·(4/τ)·A                     ∂ℓ/∂log π = −A·4·s·(1 − s)·ρ   (chain rule: ∂ρ/∂log π = ρ)
    #   t0: τ 1,    s = σ(0) = 1/2      ℓ = −2          grad −1           (on-policy: GRPO's gradient)
    #   t1: τ 1.05, s = 1/2             ℓ = +2/1.05     grad +1
    #   t2: τ 1,    s = σ(1)            ℓ = −4σ(1)      grad −4σ(1)(1 − σ(1))·2
    #   t3: τ 1.05, s = σ(−0.525)       ℓ = +s·4/1.05   grad +4s(1 − s)·0.5
    # loss = Σ ℓ / 4, gradients / 4.
    s2, s3 = sigmoid(1.0), sigmoid(1.05 * -0.5)
    old = t([-1.0, -1.0, -1.0, -1.0, 0.0])
    logp = (old + t([0.0, 0.0, math.log(2.0), -math.log(2.0), 0.0])).detach()
    logp[0, 4] = float("nan")
    logp.requires_grad_()
    adv, mask = t([1.0, -1.0, 1.0, -1.0, float("inf")]), torch.tensor([[True, True, True, True, False]])
    loss, stats, _ = policy_loss(logp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)
    per_token = [-2.0, 2.0 / 1.05, -4.0 * s2, s3 * 4.0 / 1.05]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = [-1.0, 1.0, -4.0 * s2 * (1 - s2) * 2.0, 4.0 * s3 * (1 - s3) * 0.5, 0.0]
    assert grad[0].tolist() == pytest.approx([g / 4 for g in expected], abs=1e-12)
    weights = [1.0, 1.0, 4.0 * s2 * (1 - s2) * 2.0, 4.0 * s3 * (1 - s3) * 0.5]
    assert stats["loss/gate_weight"].item() == pytest.approx(sum(weights) / 4, rel=1e-12)


def test_a_hotter_gate_fades_an_off_policy_token_faster():
    # ρ = 3, A = −1: the gradient weight 4σ(1 − σ)·ρ with σ = σ(2τ) shrinks as τ grows (σ moves into its tail)
    logp, old, mask = t([math.log(3.0)]), t([0.0]), torch.ones(1, 1, dtype=torch.bool)
    grads = []
    for tau in (1.05, 2.0, 4.0):
        lp = logp.clone().requires_grad_()
        loss, _, _ = policy_loss(lp, old, t([-1.0]), mask, tau_pos=1.0, tau_neg=tau)
        grads.append(torch.autograd.grad(loss, lp)[0].item())
        s = sigmoid(tau * 2.0)
        assert grads[-1] == pytest.approx(4 * s * (1 - s) * 3.0, rel=1e-12)
    assert grads[0] > grads[1] > grads[2] > 0


def test_bad_temperatures_are_refused(tmp_path):
    args = Args(run_dir=str(tmp_path / "run"))
    args.algo.tau_pos, args.algo.tau_neg = 2.0, 1.0
    with pytest.raises(ValueError, match="need 0 < τ_pos <= τ_neg"):
        main(args)


@pytest.mark.slow
def test_sapo_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """12 steps of the real loop (DeepSpeed actor, in-process vLLM, weight sync and --debug every step) learn."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run")
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    # w(ρ) = 4σ(τ(ρ − 1))(1 − σ(τ(ρ − 1)))·ρ is 1 at ρ = 1, peaks at ≈ 1.575 near ρ = 2 for τ = 1 (less for τ = 1.05),
    # and falls to 0 far from 1: a mean over tokens lies in (0, 1.58)
    assert all(0 < r["loss/gate_weight"] < 1.58 for r in rows if "loss/gate_weight" in r)
