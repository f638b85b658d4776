"""Tests for core/rl_math.py and the math the scripts keep to themselves (ppo.py's GAE and value loss, reinforce_pp.py's
discounted returns): hand-computed cases (arithmetic in the comments), properties, loop equivalence, gradients.

CPU only, tiny tensors, float64 wherever gradients are compared.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from algos.ppo import gae, value_loss
from algos.reinforce_pp import discounted_returns
from core.rl_math import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    approx_kl,
    entropy_from_logits,
    head_logprobs,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    overlong_penalty,
    token_rewards,
)

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def lengths_mask(lengths: list[int], T: int) -> torch.Tensor:
    """Right-padded bool mask (B, T) with the given number of valid tokens per row."""
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def assert_close(a, b, **kw):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), **kw)


# ----------------------------------------------------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------------------------------------------------


def test_masked_mean_hand():
    x = t([1.0, 2.0, NAN], [INF, -INF, NAN])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert_close(masked_mean(x, mask), 1.5)  # (1 + 2) / 2 valid tokens
    assert_close(masked_mean(x, mask, dim=-1), [1.5, 0.0])  # all-masked row: 0, not NaN
    assert_close(masked_mean(x, torch.zeros_like(mask)), 0.0)
    assert_close(masked_mean(t([2.0, 4.0]), t([1.0, 1.0])), 3.0)  # 0/1 float mask works too


def test_approx_kl_hand():
    ref = t(-1.0, -1.0, -1.0, -1.0, -1.0)
    delta = t(0.5, -1.0, 0.0, 30.0, -30.0)
    logp = ref + delta
    # k1 = Δ, clamped to ±10
    assert_close(approx_kl(logp, ref, "k1"), [0.5, -1.0, 0.0, 10.0, -10.0])
    # k2 = Δ²/2: 0.125, 0.5, 0, 450 -> 10, 450 -> 10
    assert_close(approx_kl(logp, ref, "k2"), [0.125, 0.5, 0.0, 10.0, 10.0])
    # k3 = exp(-Δ) - 1 + Δ: e^-0.5 - 0.5 = 0.10653, e^1 - 2 = 0.71828, 0, ~29 -> 10, ~e^30 -> 10
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0, 10.0, 10.0]
    assert_close(approx_kl(logp, ref, "k3"), k3)
    mask = torch.tensor([True, False, True, True, False])
    assert_close(approx_kl(logp, ref, "k3", mask=mask), [k3[0], 0.0, 0.0, 10.0, 0.0])
    with pytest.raises(ValueError, match="'k4'.*k1, k2, k3"):
        approx_kl(logp, ref, "k4")


def test_approx_kl_k3_gradient_finite_at_extremes():
    logp = t(-1000.0, 0.3, 1000.0).requires_grad_()
    approx_kl(logp, torch.zeros(3, dtype=F64), "k3").sum().backward()
    # d/dΔ (e^-Δ - 1 + Δ) = 1 - e^-Δ; the clamp to ±10 kills it at ±1000 (not NaN from e^1000 = inf)
    assert_close(logp.grad, [0.0, 1.0 - math.exp(-0.3), 0.0])


def test_token_rewards_hand():
    reward = t(2.0, 15.0, NAN)  # the empty row's reward is never used
    kl = t([0.1, 0.2, 0.3], [0.5, 0.5, NAN], [NAN, INF, 1.0])
    mask = lengths_mask([3, 2, 0], 3)
    out = token_rewards(reward, kl, 0.1, mask)
    # row 0: -0.1*kl, plus reward 2 at t=2; row 1: reward 15 clipped to 10 at t=1; row 2: nothing
    assert_close(out, [[-0.01, -0.02, -0.03 + 2.0], [-0.05, -0.05 + 10.0, 0.0], [0.0, 0.0, 0.0]])
    out = token_rewards(reward, kl, 0.1, mask, clip_range=None)
    assert_close(out[1], [-0.05, -0.05 + 15.0, 0.0])
    # the reward goes to the last valid token even if the mask is not right-padded
    out = token_rewards(t(1.0), t([NAN, 0.0, 0.0, NAN]), 0.1, torch.tensor([[False, True, True, False]]))
    assert_close(out, [[0.0, 0.0, 1.0, 0.0]])


def test_gae_hand():
    # γ = λ = 0.5, r = [0, 0, 1], V = [1, 2, 3], V after the last token = 0
    # t=2: δ = 1 + 0.5*0 - 3 = -2,     A = -2
    # t=1: δ = 0 + 0.5*3 - 2 = -0.5,   A = -0.5 + 0.25*(-2) = -1
    # t=0: δ = 0 + 0.5*2 - 1 = 0,      A = 0 + 0.25*(-1) = -0.25
    # returns = A + V = [0.75, 1, 1]; the padded 4th step (garbage) must not change anything
    rewards = t([0.0, 0.0, 1.0, NAN])
    values = t([1.0, 2.0, 3.0, 1e30])
    adv, ret = gae(rewards, values, lengths_mask([3], 4), gamma=0.5, lam=0.5)
    assert_close(adv, [[-0.25, -1.0, -2.0, 0.0]])
    assert_close(ret, [[0.75, 1.0, 1.0, 0.0]])
    # γ = λ = 1: A_t = Σ_k r_k - V_t = [1 - 1, 1 - 2, 1 - 3]; returns = 1 everywhere
    adv, ret = gae(rewards, values, lengths_mask([3], 4), gamma=1.0, lam=1.0)
    assert_close(adv, [[0.0, -1.0, -2.0, 0.0]])
    assert_close(ret, [[1.0, 1.0, 1.0, 0.0]])


def test_discounted_returns_hand():
    # γ = 0.5, r = [1, 0, 2]: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    rewards = t([1.0, 0.0, 2.0, NAN], [NAN, NAN, NAN, NAN])
    out = discounted_returns(rewards, lengths_mask([3, 0], 4), gamma=0.5)
    assert_close(out, [[1.5, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_masked_whiten_hand():
    x = t([1.0, 2.0, NAN], [3.0, 1e30, -INF])
    mask = lengths_mask([2, 1], 3)
    # valid values 1, 2, 3: mean 2, population variance (1 + 0 + 1)/3 = 2/3
    std = math.sqrt(2.0 / 3.0 + 1e-8)
    assert_close(masked_whiten(x, mask), [[-1 / std, 0.0, 0.0], [1 / std, 0.0, 0.0]])
    assert_close(masked_whiten(x, mask, scale_by_std=False), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert_close(masked_whiten(x, torch.zeros_like(mask)), torch.zeros(2, 3))
    # eps sits inside the square root: x = [0, 1e-4] -> ±5e-5 / sqrt(2.5e-9 + 1e-8) = ±0.4472
    assert_close(masked_whiten(t(0.0, 1e-4), torch.ones(2, dtype=torch.bool)), [-0.4472136, 0.4472136])


def test_aggregate_loss_hand():
    loss = t([1.0, 2.0, 3.0], [4.0, NAN, INF], [NAN, NAN, NAN])
    mask = lengths_mask([3, 1, 0], 3)
    assert_close(aggregate_loss(loss, mask, "token-mean"), 2.5)  # (1+2+3+4) / 4 tokens
    assert_close(aggregate_loss(loss, mask, "token-mean", num_tokens=8), 1.25)  # 10 / 8 (global count)
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 3.0)  # (2 + 4) / 2; empty row skipped
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean", num_seqs=4), 1.5)  # (2 + 4) / 4
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), 10.0 / 9.0)  # 10 / (B=3 * T=3)
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", num_seqs=2, max_len=5), 1.0)  # 10 / (2*5)
    with pytest.raises(ValueError, match="'token-sum'.*token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        aggregate_loss(loss, mask, "token-sum")


def test_aggregate_loss_gradients_hand():
    mask = lengths_mask([3, 1, 0], 3)
    loss = torch.ones(3, 3, dtype=F64, requires_grad=True)
    # token-mean: ∂/∂ℓ = m / N = 1/4 on valid tokens
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "token-mean"), loss)
    assert_close(grad, mask / 4.0)
    # seq-mean-token-mean: ∂/∂ℓ_{i,t} = 1 / (S * n_i), S = 2 non-empty rows: row 0 -> 1/6, row 1 -> 1/2
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "seq-mean-token-mean"), loss)
    assert_close(grad, [[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # seq-mean-token-sum-norm: ∂/∂ℓ = m / (B * T) = 1/9
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), loss)
    assert_close(grad, mask / 9.0)


def test_value_loss_hand():
    values = t([1.0, 2.0]).requires_grad_()
    old_values, returns, mask = t([0.5, 2.0]), t([2.0, 1.0]), torch.ones(1, 2, dtype=torch.bool)
    # clip 0.2, t0: V_clip = 0.5 + clamp(0.5, ±0.2) = 0.7; max((0.7-2)², (1-2)²) = 1.69 -> ℓ = 0.845 (clipped branch)
    #          t1: V = V_old -> V_clip = 2; both terms (2-1)² = 1 -> ℓ = 0.5
    # token mean (0.845 + 0.5) / 2 = 0.6725; gradient: t0 clipped -> 0, t1: (V - R) / 2 = 0.5
    loss, stats = value_loss(values, old_values, returns, mask, clip_eps=0.2)
    assert_close(loss, 0.6725)
    assert_close(stats["clipfrac"], 0.5)
    (grad,) = torch.autograd.grad(loss, values)
    assert_close(grad, [[0.0, 0.5]])
    # V inside the clip range: nothing is clipped, although V_old + (V - V_old) differs from V in the last bit for
    # a quarter of these tokens, and rounding alone made the clipped term "larger" for ~2 % of them
    gen = torch.Generator().manual_seed(0)
    inside64 = (torch.rand(64, 32, generator=gen, dtype=F64) - 0.5) * 0.4
    old32 = (inside64 + (torch.rand(64, 32, generator=gen, dtype=F64) - 0.5) * 0.38).float()  # |V - V_old| < 0.2
    inside, rets = inside64.float(), torch.randn(64, 32, generator=gen)  # V and V_old rounded independently
    assert ((old32 + (inside - old32)) != inside).float().mean() > 0.1
    assert value_loss(inside, old32, rets, torch.ones(64, 32, dtype=torch.bool), clip_eps=0.2)[1]["clipfrac"] == 0
    # unclipped: ½ (V - R)² = 0.5, 0.5 -> mean 0.5; gradient (V - R) / 2 = [-0.5, 0.5]
    loss, stats = value_loss(values, old_values, returns, mask)
    assert_close(loss, 0.5)
    assert_close(stats["clipfrac"], 0.0)
    (grad,) = torch.autograd.grad(loss, values)
    assert_close(grad, [[-0.5, 0.5]])


def test_entropy_from_logits_hand():
    # uniform over 4 -> ln 4, also for huge logits (no overflow); two finite logits and two -inf -> ln 2
    logits = t([0.0, 0.0, 0.0, 0.0], [1000.0, 1000.0, 1000.0, 1000.0], [3.0, 3.0, -INF, -INF]).requires_grad_()
    ent = entropy_from_logits(logits)
    assert_close(ent, [math.log(4), math.log(4), math.log(2)])
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # against -Σ p log p on random logits, (B, T, V)
    z = torch.randn(2, 3, 7, dtype=F64, generator=torch.Generator().manual_seed(0)) * 3
    p = z.softmax(-1)
    assert_close(entropy_from_logits(z), -(p * p.log()).sum(-1))


def test_adaptive_kl_controller_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=64)  # error = 12/6 - 1 = 1 -> clipped to 0.2
    assert_close(ctl.value, 0.1 * (1 + 0.2 * 64 / 10000))
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(torch.tensor(6.6), 64)  # error = 0.1, inside the clip
    assert_close(ctl.value, 0.1 * (1 + 0.1 * 64 / 10000))
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    ctl.update(0.0, 64)  # error = -1 -> clipped to -0.2
    assert_close(ctl.value, 0.1 * (1 - 0.2 * 64 / 10000))
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


@pytest.mark.parametrize("cls,args", [(AdaptiveKLController, (0.05, 3.0, 500)), (FixedKLController, (0.05,))])
def test_kl_controller_resumes_exactly(cls, args):
    kls = [1.0, 7.0, 2.5, 3.3, 0.1, 9.0]
    straight = cls(*args)
    for kl in kls:
        straight.update(kl, 32)
    first = cls(*args)
    for kl in kls[:3]:
        first.update(kl, 32)
    resumed = cls(*args)
    resumed.load_state_dict(first.state_dict())
    for kl in kls[3:]:
        resumed.update(kl, 32)
    assert resumed.value == straight.value
    if cls is FixedKLController:
        assert straight.value == 0.05
    else:
        assert straight.value != 0.05


# ----------------------------------------------------------------------------------------------------------------------
# importance-sampling corrections against the rollout engine's log-probs
# ----------------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------------------------------


# one entry per function that takes a mask: (number of (B, T) inputs, fn(inputs, mask) -> list of output tensors)
REWARD = t(1.0, -2.0, 30.0, 0.5)
MASKED_FNS = {
    "masked_mean": (1, lambda x, m: [masked_mean(x[0], m), masked_mean(x[0], m, dim=-1)]),
    **{f"approx_kl_{k}": (2, lambda x, m, k=k: [approx_kl(x[0], x[1], k, mask=m)]) for k in ("k1", "k2", "k3")},
    "token_rewards": (1, lambda x, m: [token_rewards(REWARD[: len(m)], x[0], 0.1, m)]),
    "gae": (2, lambda x, m: list(gae(x[0], x[1], m, gamma=0.99, lam=0.95))),
    "discounted_returns": (1, lambda x, m: [discounted_returns(x[0], m, gamma=0.9)]),
    "masked_whiten": (1, lambda x, m: [masked_whiten(x[0], m), masked_whiten(x[0], m, scale_by_std=False)]),
    **{
        f"aggregate_loss_{mode}": (1, lambda x, m, mode=mode: [aggregate_loss(x[0], m, mode)])
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    },
    "value_loss_clipped": (3, lambda x, m: _flat(value_loss(x[0], x[1], x[2], m, clip_eps=0.2))),
}


def _flat(loss_and_stats):
    loss, stats = loss_and_stats
    return [loss, *stats.values()]


@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30])
@pytest.mark.parametrize("name", list(MASKED_FNS))
def test_masked_garbage_never_changes_outputs_or_gradients(name, garbage):
    n_inputs, fn = MASKED_FNS[name]
    mask = lengths_mask([5, 3, 0, 1], 5)  # includes an all-masked row
    gen = torch.Generator().manual_seed(3)
    clean = [torch.where(mask, torch.randn(4, 5, dtype=F64, generator=gen), 0.0) for _ in range(n_inputs)]
    dirty = [torch.where(mask, x, garbage).requires_grad_() for x in clean]
    clean = [x.requires_grad_() for x in clean]
    out_clean, out_dirty = fn(clean, mask), fn(dirty, mask)
    for a, b in zip(out_clean, out_dirty, strict=True):
        assert torch.isfinite(b).all(), name
        assert torch.equal(a, b), name
    differentiable = [o for o in out_dirty if o.requires_grad]
    if not differentiable:
        return
    grads_clean = torch.autograd.grad(sum(o.sum() for o in out_clean if o.requires_grad), clean, allow_unused=True)
    grads_dirty = torch.autograd.grad(sum(o.sum() for o in differentiable), dirty, allow_unused=True)
    for a, b in zip(grads_clean, grads_dirty, strict=True):
        if a is None:
            assert b is None
            continue
        assert torch.isfinite(b).all() and torch.equal(a, b), name
        assert (b[~mask] == 0).all(), name


@pytest.mark.parametrize("name", list(MASKED_FNS))
def test_all_masked_batch_gives_zeros_not_nan(name):
    n_inputs, fn = MASKED_FNS[name]
    mask = torch.zeros(2, 3, dtype=torch.bool)
    inputs = [torch.full((2, 3), NAN, dtype=F64) for _ in range(n_inputs)]
    for out in fn(inputs, mask):
        assert (out == 0).all(), name


# ----------------------------------------------------------------------------------------------------------------------
# equivalence: vectorized == loop, micro-batches == whole batch
# ----------------------------------------------------------------------------------------------------------------------


def gae_loop(rewards, values, lengths, gamma, lam):
    """Plain Python GAE, one sequence at a time, only over its valid tokens."""
    B, T = len(rewards), len(rewards[0])
    adv, ret = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for i in reversed(range(lengths[b])):
            next_value = values[b][i + 1] if i + 1 < lengths[b] else 0.0
            delta = rewards[b][i] + gamma * next_value - values[b][i]
            running = delta + gamma * lam * running
            adv[b][i], ret[b][i] = running, running + values[b][i]
    return adv, ret


def returns_loop(rewards, lengths, gamma):
    B, T = len(rewards), len(rewards[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for i in reversed(range(lengths[b])):
            running = rewards[b][i] + gamma * running
            out[b][i] = running
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_and_discounted_returns_match_python_loop(seed, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    lengths = torch.randint(0, T + 1, (B,), generator=gen).tolist()
    mask = lengths_mask(lengths, T)
    rewards = torch.randn(B, T, dtype=F64, generator=gen)
    values = torch.randn(B, T, dtype=F64, generator=gen)
    adv_ref, ret_ref = gae_loop(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    adv, ret = gae(torch.where(mask, rewards, NAN), torch.where(mask, values, INF), mask, gamma, lam)
    assert_close(adv, adv_ref)
    assert_close(ret, ret_ref)
    assert_close(
        discounted_returns(torch.where(mask, rewards, NAN), mask, gamma), returns_loop(rewards.tolist(), lengths, gamma)
    )


@pytest.mark.parametrize("seed", range(5))
def test_gae_and_returns_skip_masked_gaps_like_the_compressed_sequence(seed):
    """A multi-turn episode's environment tokens sit masked between two turns of the model: GAE and the reward-to-go
    over such a row equal those of the row with the gaps cut out (the model's tokens only), scattered back."""
    gen = torch.Generator().manual_seed(seed)
    B, T, gamma, lam = 5, 9, 0.9, 0.8
    mask = torch.rand(B, T, generator=gen) < 0.6  # holes anywhere, also at the start and end
    rewards = torch.randn(B, T, dtype=F64, generator=gen)
    values = torch.randn(B, T, dtype=F64, generator=gen)
    adv, ret = gae(torch.where(mask, rewards, NAN), torch.where(mask, values, INF), mask, gamma, lam)
    returns = discounted_returns(torch.where(mask, rewards, NAN), mask, gamma)
    for b in range(B):
        idx = mask[b].nonzero().flatten()
        n = len(idx)
        adv_c, ret_c = gae_loop([rewards[b, idx].tolist()], [values[b, idx].tolist()], [n], gamma, lam)
        assert_close(adv[b, idx], adv_c[0][:n])
        assert_close(ret[b, idx], ret_c[0][:n])
        assert_close(returns[b, idx], returns_loop([rewards[b, idx].tolist()], [n], gamma)[0][:n])
        assert (adv[b, ~mask[b]] == 0).all() and (returns[b, ~mask[b]] == 0).all()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_add_up_to_the_whole_batch(mode):
    gen = torch.Generator().manual_seed(4)
    lengths = [5, 1, 3, 0, 2, 4]
    mask = lengths_mask(lengths, 5)
    loss = torch.randn(6, 5, dtype=F64, generator=gen).requires_grad_()
    whole = aggregate_loss(loss, mask, mode)
    (grad_whole,) = torch.autograd.grad(whole, loss)
    counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum() if mode == "seq-mean-token-mean" else 6}
    parts = [aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, **counts, max_len=5) for i in (0, 2, 4)]
    (grad_parts,) = torch.autograd.grad(sum(parts), loss)
    assert_close(sum(parts), whole)
    assert_close(grad_parts, grad_whole)
    # without the global counts each micro-batch normalises by its own, and the average is a different number
    local = sum(aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode) for i in (0, 2, 4)) / 3
    if mode != "seq-mean-token-sum-norm":  # equal-size micro-batches make Dr.GRPO's constant add up anyway
        assert not torch.isclose(local, whole)


# ----------------------------------------------------------------------------------------------------------------------
# gradients against finite differences (float64)
# ----------------------------------------------------------------------------------------------------------------------


def _grad_inputs(seed, spread):
    gen = torch.Generator().manual_seed(seed)
    mask = lengths_mask([4, 3, 1], 4)
    old = torch.randn(3, 4, dtype=F64, generator=gen)
    new = (old + spread * torch.randn(3, 4, dtype=F64, generator=gen)).requires_grad_()
    return gen, mask, old, new


def test_value_loss_gradcheck_with_clipping_active():
    gen, mask, old_values, values = _grad_inputs(8, spread=0.3)
    returns = old_values + torch.randn(3, 4, dtype=F64, generator=gen)
    _, stats = value_loss(values, old_values, returns, mask, clip_eps=0.1)
    assert 0 < stats["clipfrac"] < 1
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old_values, returns, mask, clip_eps=0.1)[0], (values,))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_loss_and_entropy_and_logprobs_gradcheck(mode):
    _, mask, _, loss = _grad_inputs(9, spread=1.0)
    assert torch.autograd.gradcheck(lambda x: aggregate_loss(x, mask, mode, num_tokens=None), (loss,))
    logits = torch.randn(2, 3, 5, dtype=F64, generator=torch.Generator().manual_seed(9)).requires_grad_()
    labels = torch.tensor([[0, 4, 2], [1, 1, 3]])
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, temperature=0.7), (logits,))


# ----------------------------------------------------------------------------------------------------------------------
# logprobs_from_logits
# ----------------------------------------------------------------------------------------------------------------------


def _logits_and_labels(seed=10, B=3, T=4, V=50):
    gen = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(B, T, V, generator=gen), torch.randint(0, V, (B, T), generator=gen)


def _reference(logits, labels):
    return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_fp32_matches_log_softmax_gather(temperature, monkeypatch):
    logits, labels = _logits_and_labels()
    logits.requires_grad_()
    expected = _reference(logits / temperature, labels)
    (grad_expected,) = torch.autograd.grad(expected.sum(), logits)

    def no_full_log_softmax(*args, **kwargs):
        raise AssertionError("the fp32 path must not build a (B, T, V) log_softmax")

    monkeypatch.setattr(F, "log_softmax", no_full_log_softmax)
    out = logprobs_from_logits(logits, labels, temperature=temperature)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    torch.testing.assert_close(grad, grad_expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logprobs_low_precision_close_and_fp32_out(dtype):
    logits, labels = _logits_and_labels()
    low = logits.to(dtype).requires_grad_()
    out = logprobs_from_logits(low, labels, temperature=0.7)
    assert out.dtype == torch.float32
    # exact math on the rounded logits, in fp32
    torch.testing.assert_close(out, _reference(low.float() / 0.7, labels), atol=1e-5, rtol=1e-5)
    # close to the full-precision answer (bf16 keeps ~3 significant digits of logits up to ~10)
    torch.testing.assert_close(out, _reference(logits / 0.7, labels), atol=0.1, rtol=0)
    out.sum().backward()
    assert low.grad.dtype == dtype and torch.isfinite(low.grad.float()).all()
    with torch.no_grad():
        assert torch.equal(logprobs_from_logits(low, labels, 0.7), out.detach())
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(low, labels, temperature=0.0)


# ------------------------------------------------------------------------------------------ overlong penalty
def test_overlong_penalty_hand_cases():
    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    # L = 16, buffer 4: free up to 12, then −1/4 per token, −1 at the limit (and beyond)
    out = overlong_penalty(lengths, max_new_tokens=16, buffer=4, factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4, factor=0.5), out * 0.5)
    assert (overlong_penalty(lengths, 16, 0) == 0).all()  # buffer 0: off
    with pytest.raises(ValueError, match="buffer 20 > max_new_tokens 16"):
        overlong_penalty(lengths, 16, 20)


def test_overlong_penalty_is_monotone_in_length():
    lengths = torch.arange(0, 40)
    out = overlong_penalty(lengths, 32, 8, 2.0)
    assert (out[1:] <= out[:-1]).all() and out.max() == 0 and out.min() == -2.0


# ----------------------------------------------------------------- chunked LM head: log-probs and entropy
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_head_logprobs_equal_the_full_logits_path_values_and_gradients(temperature, chunk):
    """In float64 the chunked head (logits recomputed per chunk in backward) equals logprobs_from_logits and
    entropy_from_logits on the full (B, T, V) logits to 1e-12, values and gradients of both inputs."""
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(2, 19, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(101, 16, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 101, (2, 19), generator=g)
    up_lp, up_ent = torch.randn(2, 19, dtype=torch.float64, generator=g), torch.randn(2, 19, dtype=torch.float64, generator=g)
    z = h @ w.t()
    want_lp, want_ent = logprobs_from_logits(z, y, temperature), entropy_from_logits(z / temperature)
    want_grads = torch.autograd.grad((want_lp * up_lp).sum() + (want_ent * up_ent).sum(), (h, w))
    lp, ent = head_logprobs(h, w, y, temperature, chunk=chunk, entropy=True)
    grads = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), (h, w))
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    lp_only, none = head_logprobs(h, w, y, temperature, chunk=chunk)
    assert none is None
    want_h = torch.autograd.grad((logprobs_from_logits(h @ w.t(), y, temperature) * up_lp).sum(), h)[0]
    torch.testing.assert_close(torch.autograd.grad((lp_only * up_lp).sum(), h)[0], want_h, rtol=0, atol=1e-12)


def test_head_logprobs_in_float32_and_bf16():
    """float32 inputs: within float32 rounding of the float64 result; bf16 inputs (a bf16 model's head): float32
    outputs, gradients in the inputs' dtype."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, dtype=torch.float64, generator=g)
    w = torch.randn(503, 32, dtype=torch.float64, generator=g) / 4
    y = torch.randint(0, 503, (64,), generator=g)
    want, _ = head_logprobs(h, w, y)
    got, _ = head_logprobs(h.float(), w.float(), y, chunk=10)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    lp, ent = head_logprobs(hb, wb, y, chunk=10, entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    lp.sum().backward()
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16 and bool(torch.isfinite(hb.grad.float()).all())
    with pytest.raises(ValueError, match="temperature must be > 0 and chunk >= 1"):
        head_logprobs(h, w, y, chunk=0)
