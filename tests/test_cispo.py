"""algos/cispo.py: the CISPO loss by hand (from the paper's equation: −sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·log π_θ,
token mean), and a short run of the real loop that learns."""

import math

import pytest
import torch
from conftest import short_rl_run

from algos.cispo import Args, main, policy_loss

F64 = torch.float64


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_every_token_keeps_its_gradient_weighted_by_the_truncated_ratio():
    # ratios 1.5, 0.5, 1, 4 (π_θ / π_old = 0.3/0.2, 0.2/0.4, 0.5/0.5, 1.0/0.25); A = +1, −1, +2, +1; a masked 5th token
    # with NaN inputs. Weight floor 1 − ε_low = 0 (the paper's: no lower bound), cap 1 + ε_high = 3:
    #   w = clip(ρ, 0, 3) = [1.5, 0.5, 1, 3]: token 3 is at the cap (clipfrac 1/4)
    #   ℓ_t = −w·A·log π_θ;  loss = Σ ℓ / 4 = −(1.5·ln 0.3 − 0.5·ln 0.2 + 2·ln 0.5 + 3·ln 1) / 4
    #   ∂loss/∂log π_t = −w·A / 4 = [−0.375, 0.125, −0.5, −0.75]: token 0 (ρ = 1.5 > 1.2 with A > 0) and token 1
    #   (ρ = 0.5 < 0.8 with A < 0), which PPO's clip would zero, keep theirs.
    old = torch.log(t([0.2, 0.4, 0.5, 0.25, 0.5]))
    logp = torch.log(t([0.3, 0.2, 0.5, 1.0, 0.5])).detach()
    logp[0, 4], old[0, 4] = float("nan"), float("inf")
    logp.requires_grad_()
    adv, mask = t([1.0, -1.0, 2.0, 1.0, float("nan")]), torch.tensor([[True, True, True, True, False]])
    loss, stats, _ = policy_loss(logp, old, adv, mask, clip_low=1.0, clip_high=2.0)
    expected = -(1.5 * math.log(0.3) - 0.5 * math.log(0.2) + 2 * math.log(0.5) + 0.0) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].tolist() == pytest.approx([-0.375, 0.125, -0.5, -0.75, 0.0], abs=1e-12)
    assert stats["loss/clipfrac"].item() == pytest.approx(0.25)


def test_a_lower_bound_truncates_small_ratios_and_ratio_one_is_the_policy_gradient():
    # floor 1 − 0.2 = 0.8: ρ = 0.5 -> w = 0.8; A = −1: ∂loss/∂log π = −0.8·(−1) / 1 = 0.8, and loss = 0.8·ln 0.2
    logp, old = torch.log(t([0.2])).requires_grad_(), torch.log(t([0.4]))
    loss, _, _ = policy_loss(logp, old, t([-1.0]), torch.ones(1, 1, dtype=torch.bool), clip_low=0.2, clip_high=2.0)
    assert loss.item() == pytest.approx(0.8 * math.log(0.2), rel=1e-12)
    assert torch.autograd.grad(loss, logp)[0].item() == pytest.approx(0.8, rel=1e-12)
    # ρ = 1 (the first minibatch): w = 1, the gradient is −A/N for every token, as GRPO's
    lp = torch.log(t([0.3, 0.6])).requires_grad_()
    loss, stats, _ = policy_loss(lp, lp.detach(), t([2.0, -1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert torch.autograd.grad(loss, lp)[0][0].tolist() == pytest.approx([-1.0, 0.5], abs=1e-12)
    assert stats["loss/clipfrac"].item() == 0.0


@pytest.mark.slow
def test_cispo_raises_eval_pass_at_1_from_the_warm_start(tmp_path):
    """12 steps of the real loop (DeepSpeed actor, in-process vLLM, weight sync and --debug every step) learn."""
    summary, rows = short_rl_run(main, Args(), tmp_path / "run")
    assert summary["eval_pass@1_last"] >= summary["eval_pass@1_first"] + 0.1, summary
    # at the default lr (1e-4) later minibatches' weights move but stay under the cap of 5 in 12 steps; never all capped
    assert max(r.get("loss/clipfrac", 0) for r in rows) < 1
