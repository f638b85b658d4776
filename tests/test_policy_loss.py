"""Hand-computed cases of the policy loss that each RL script trains with: `policy_loss` of algos/grpo.py, rloo.py,
reinforce_pp.py, grpo_async.py and ppo.py, imported from the script and called as its `update` calls it (tensors
and numbers, no `args`). The clipped surrogate is written out in each script, so each is checked here (arithmetic
in the comments; float64 wherever gradients are compared).
"""

import importlib
import inspect
import math

import pytest
import torch
from test_rl_math import F64, INF, NAN, _grad_inputs, assert_close, lengths_mask, t  # the shared test helpers

from core.rl_math import masked_mean, masked_whiten

SCRIPTS = ("grpo", "rloo", "reinforce_pp", "grpo_async", "ppo")
KL_IN_LOSS = ("grpo", "rloo", "grpo_async")  # reinforce_pp and ppo put the KL penalty in the reward


@pytest.fixture(params=SCRIPTS)
def policy_loss(request):
    return importlib.import_module(f"algos.{request.param}").policy_loss


def test_every_rl_script_has_the_same_loss_signature():
    """A fork can swap one script's loss for another's: the same names in the same order, less the KL term's."""
    params = {s: list(inspect.signature(importlib.import_module(f"algos.{s}").policy_loss).parameters) for s in SCRIPTS}
    kl = ["ref_logp", "kl_coef", "kl_estimator"]
    for s in SCRIPTS:
        assert params[s] == (params["grpo"] if s in KL_IN_LOSS else [p for p in params["grpo"] if p not in kl]), s


def test_kl_and_entropy_terms_hand():
    """grpo, rloo, grpo_async: loss = surrogate + β·k3 − c·entropy, each a token mean. ρ = 1 and A = 0, so only the
    two terms remain: δ = logp − ref = [0.5, −0.5], k3 = e^−δ − 1 + δ = [e^−0.5 − 0.5, e^0.5 − 1.5]; entropies [1, 2]."""
    for script in KL_IN_LOSS:
        fn = importlib.import_module(f"algos.{script}").policy_loss
        logp = t([-1.0, -2.0]).requires_grad_()
        ref, ent = logp.detach() - t([0.5, -0.5]), t([1.0, 2.0])
        mask, zero = torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=F64)
        loss, stats, _ = fn(logp, logp.detach(), zero, mask, ref_logp=ref, kl_coef=0.1, kl_estimator="k3", ent=ent,
                         entropy_coef=0.01)  # fmt: skip
        k3 = [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]
        assert_close(loss, 0.1 * sum(k3) / 2 - 0.01 * 1.5)
        assert_close(stats["loss/kl"], sum(k3) / 2)
        assert_close(stats["loss/entropy"], 1.5)
        # ∂/∂logp of β·k3/2 per token: β·(1 − e^−δ)/2 (the surrogate's gradient is ρA = 0)
        (grad,) = torch.autograd.grad(loss, logp)
        assert_close(grad, [[0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.exp(0.5)) / 2]])


def test_ppo_and_reinforce_pp_have_no_kl_term_in_the_loss():
    for script in ("ppo", "reinforce_pp"):
        fn = importlib.import_module(f"algos.{script}").policy_loss
        with pytest.raises(TypeError, match="ref_logp"):
            fn(t([-1.0]), t([-1.0]), t([1.0]), torch.ones(1, 1, dtype=torch.bool), ref_logp=t([-2.0]))


@pytest.mark.parametrize("script", [*SCRIPTS, "opd", "cispo", "sapo", "dppo", "gmpo", "gdpo", "opsd"])
def test_the_loss_settings_are_the_scripts_and_their_old_flags_name_the_new(script, capsys, monkeypatch):
    """The clip range, dual clip, ratio level and entropy coefficient are fields of each script's `AlgoArgs` (SAPO
    has no clip, CISPO no dual clip). `--actor.clip-low` and its siblings are refused, and the message names
    `--algo.clip-low` where the script has it; the new flag sets the field the loss reads."""
    import dataclasses

    import tyro

    monkeypatch.setenv("COLUMNS", "200")  # rich does not wrap a flag name
    module = importlib.import_module(f"algos.{script}")
    fields = {f.name for f in dataclasses.fields(module.AlgoArgs)}
    assert not fields.isdisjoint({"level", "entropy_coef"})  # every script reads these two
    for flag, value, parsed in [("clip-low", "0.1", 0.1), ("clip-high", "0.28", 0.28), ("dual-clip", "3", 3.0),
                                ("level", "sequence", "sequence"), ("entropy-coef", "0.01", 0.01)]:  # fmt: skip
        name = flag.replace("-", "_")
        with pytest.raises(SystemExit):
            tyro.cli(module.Args, args=[f"--actor.{flag}", value])
        said = "".join(capsys.readouterr())
        assert f"--actor.{flag}" in said
        if name in fields:
            assert f"--algo.{flag}" in said
            assert getattr(tyro.cli(module.Args, args=[f"--algo.{flag}", value]).algo, name) == parsed
        else:
            with pytest.raises(SystemExit):
                tyro.cli(module.Args, args=[f"--algo.{flag}", value])
    capsys.readouterr()


def test_dual_clip_flag_must_be_above_one():
    from algos import grpo
    from core.config import check_args

    for bad in (1.0, 0.5):
        args = grpo.Args()
        args.algo.dual_clip = bad
        with pytest.raises(ValueError, match=f"--algo.dual-clip {bad}: must be > 1"):
            check_args(args)


def _policy_hand_inputs():
    # ratios 1.5, 0.5, 1.0 with A = +1, -1, +2
    old = torch.log(t([0.2, 0.4, 0.5]))
    logp = torch.log(t([0.3, 0.2, 0.5])).requires_grad_()
    return logp, old, t([1.0, -1.0, 2.0]), torch.ones(1, 3, dtype=torch.bool)


def test_policy_loss_token_hand(policy_loss):
    logp, old, adv, mask = _policy_hand_inputs()
    loss, stats, _ = policy_loss(logp, old, adv, mask)
    # t0: ρ=1.5, A=+1: min(1.5, 1.2) = 1.2 (clipped)    -> ℓ = -1.2, no gradient
    # t1: ρ=0.5, A=-1: min(-0.5, -0.8) = -0.8 (clipped) -> ℓ = +0.8, no gradient
    # t2: ρ=1,   A=+2: ℓ = -2, ∂ℓ/∂logp = -ρA = -2
    # token mean: (-1.2 + 0.8 - 2) / 3 = -0.8; gradient [0, 0, -2/3]; clipfrac 2/3
    assert_close(loss, -0.8)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, [[0.0, 0.0, -2.0 / 3.0]])
    assert_close(stats["loss/clipfrac"], 2.0 / 3.0)
    assert all(not v.requires_grad for v in stats.values())
    # clip-higher (clip_high = 0.6): t0 now unclipped, ℓ = -1.5 -> (-1.5 + 0.8 - 2) / 3 = -0.9, ∂/∂logp_0 = -1.5/3
    loss, stats, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    assert_close(loss, -0.9)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, [[-0.5, 0.0, -2.0 / 3.0]])
    assert_close(stats["loss/clipfrac"], 1.0 / 3.0)


def test_policy_loss_ratio_is_clamped_at_e20(policy_loss):
    # log-ratio 100 with A = -1: ρ = e^min(100, 20) = e^20, ℓ = -min(-e^20, -1.2) = e^20 (fp32: no inf), no gradient
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), 100.0, requires_grad=True)
    loss, _, _ = policy_loss(logp, old, -torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert_close(loss, math.exp(20.0), rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.item() == 0.0


def test_policy_loss_dual_clip_hand(policy_loss):
    old = torch.zeros(1, 2, dtype=F64)
    logp = torch.log(t([5.0, 5.0])).requires_grad_()  # ρ = 5 on both tokens
    adv, mask = t([-1.0, 1.0]), torch.ones(1, 2, dtype=torch.bool)
    loss_plain, _, _ = policy_loss(logp, old, adv, mask)
    loss_dual, stats, _ = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    # A=-1: plain ℓ = -min(-5, -1.2) = 5; dual ℓ = min(5, -3*(-1)) = 3.   A=+1: ℓ = -min(5, 1.2) = -1.2 in both
    assert_close(loss_plain, (5.0 - 1.2) / 2)
    assert_close(loss_dual, (3.0 - 1.2) / 2)
    assert_close(stats["loss/dual_clipfrac"], 0.5)


def test_policy_loss_sequence_level_hand(policy_loss):
    # row 0: log-ratios [0.1, 0.3] -> mean 0.2, ρ = e^0.2 = 1.221 > 1.2, A = +1 -> clipped: ℓ = -1.2 on both tokens
    # row 1: log-ratios [0.3, -0.3] -> mean 0, ρ = 1, A = -2 -> ℓ = 2 on both tokens
    # seq-mean-token-mean: (-1.2 + 2) / 2 = 0.4
    # gradient: row 0 is clipped -> 0; row 1: each ℓ_t sees logp_s through the mean, ∂ℓ_t/∂logp_s = -ρA/2 = 1;
    # both ℓ_t of the row, weight 1/(2 rows * 2 tokens) each: 2 * 1 / 4 = 0.5 per token
    old = torch.full((2, 2), -1.0, dtype=F64)
    logp = (old + t([0.1, 0.3], [0.3, -0.3])).requires_grad_()
    adv = t([1.0, 1.0], [-2.0, -2.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats, _ = policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean")
    assert_close(loss, 0.4)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, [[0.0, 0.0], [0.5, 0.5]])
    assert_close(stats["loss/clipfrac"], 0.5)
    # token level on the same data differs: row 0 token 0 (ρ = e^0.1 = 1.105) is no longer clipped
    loss_tok, _, _ = policy_loss(logp, old, adv, mask, level="token", agg="seq-mean-token-mean")
    assert not torch.isclose(loss_tok, loss)
    with pytest.raises(ValueError, match="'seq'"):
        policy_loss(logp, old, adv, mask, level="seq")


def _is_inputs(w_rows):
    """ratio 1 (logp = old), A = 1, so the per-token loss is -weight; w = exp(old - rollout) as given."""
    w = t(*w_rows)
    old = torch.full_like(w, math.log(0.5))
    return old.clone().requires_grad_(), old, torch.ones_like(w), torch.ones_like(w, dtype=torch.bool), old - w.log()


def test_is_correction_tis_clamps(policy_loss):
    logp, old, adv, mask, rollout = _is_inputs([[0.25, 1.0, 8.0]])
    loss, stats, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_correction="tis", is_threshold=(0.5, 5))
    # weights clamp([0.25, 1, 8], 0.5, 5) = [0.5, 1, 5] -> loss -(0.5 + 1 + 5)/3; ∂/∂logp_t = -A ρ w_t / 3
    assert_close(loss, -6.5 / 3)
    assert_close(stats["loss/is_weight"], 6.5 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, [[-0.5 / 3, -1.0 / 3, -5.0 / 3]])


def test_is_correction_icepop_zeroes_out_of_band(policy_loss):
    logp, old, adv, mask, rollout = _is_inputs([[0.25, 1.0, 8.0]])
    loss, _, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_correction="icepop")
    # weights [0, 1, 0]: out-of-band tokens contribute neither loss nor gradient
    assert_close(loss, -1.0 / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, [[0.0, -1.0 / 3, 0.0]])


def test_is_correction_seq_mask_tis_masks_whole_sequences(policy_loss):
    # row 0: w = [2, 8], geometric mean 4 in [0.5, 5] -> kept, weights [2, 8] (8 alone would be out of band)
    # row 1: w = [8, 8], geometric mean 8 -> the whole sequence is dropped
    # row 2: w = [0.1, 10], geometric mean 1 -> kept, weights [0.1, 10]
    # token mean over 6 tokens: -(2 + 8 + 0.1 + 10) / 6
    logp, old, adv, mask, rollout = _is_inputs([[2.0, 8.0], [8.0, 8.0], [0.1, 10.0]])
    loss, _, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_correction="seq-mask-tis")
    assert_close(loss, -20.1 / 6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, [[-2 / 6, -8 / 6], [0.0, 0.0], [-0.1 / 6, -10 / 6]])


def test_is_correction_argument_errors(policy_loss):
    logp, old, adv, mask, rollout = _is_inputs([[1.0]])
    with pytest.raises(ValueError, match="needs rollout_logp"):
        policy_loss(logp, old, adv, mask, is_correction="tis")
    with pytest.raises(ValueError, match="'tis2'"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_correction="tis2")


def test_zero_variance_group_gives_zero_advantage_and_no_gradient(policy_loss):
    # two GRPO-style groups of 4 responses: group 0 all rewarded 0.7 (no signal), group 1 mixed
    rewards = t([0.7, 0.7, 0.7, 0.7], [0.0, 1.0, 0.0, 1.0])
    ones = torch.ones(4, dtype=torch.bool)
    seq_adv = torch.stack([masked_whiten(group, ones) for group in rewards]).reshape(8)  # per-group (r - mean)/std
    assert_close(seq_adv[:4], torch.zeros(4), atol=1e-6, rtol=0)
    assert_close(seq_adv[4:], [-1.0, 1.0, -1.0, 1.0], atol=1e-6, rtol=0)
    assert_close(torch.stack([masked_whiten(g, ones, scale_by_std=False) for g in rewards])[0], torch.zeros(4))
    # downstream: broadcast to tokens; the zero-variance group gets no loss and no gradient
    gen = torch.Generator().manual_seed(1)
    mask = lengths_mask([3, 5, 1, 4, 5, 2, 3, 4], 5)
    old = torch.randn(8, 5, dtype=F64, generator=gen)
    logp = (old + 0.3 * torch.randn(8, 5, dtype=F64, generator=gen)).requires_grad_()
    loss, _, _ = policy_loss(logp, old, seq_adv[:, None].expand(8, 5), mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad[:4], torch.zeros(4, 5), atol=1e-9, rtol=0)
    assert (grad[4:][mask[4:]] != 0).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ratio_one_gives_no_clipping(policy_loss, level):
    gen = torch.Generator().manual_seed(2)
    mask = lengths_mask([4, 2, 0], 4)
    old = torch.randn(3, 4, dtype=F64, generator=gen)
    adv = torch.randn(3, 4, dtype=F64, generator=gen)
    loss, stats, _ = policy_loss(old.clone(), old, adv, mask, clip_low=0.0, clip_high=0.0, level=level)
    assert stats["loss/clipfrac"] == 0.0
    assert_close(loss, -masked_mean(adv, mask))  # ρ = 1: ℓ = -A


def test_dual_clip_never_increases_loss_and_leaves_positive_advantages_alone(policy_loss):
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        mask = lengths_mask([6, 3, 5, 1], 6)
        old = torch.randn(4, 6, dtype=F64, generator=gen)
        logp = old + 2.0 * torch.randn(4, 6, dtype=F64, generator=gen)  # ratios up to e^±6: the dual clip bites
        adv = torch.randn(4, 6, dtype=F64, generator=gen)
        # per-token losses: a one-token mask per position, so each call returns that token's ℓ
        for b, tt in mask.nonzero().tolist():
            one = torch.zeros_like(mask)
            one[b, tt] = True
            plain, _, _ = policy_loss(logp, old, adv, one)
            dual, _, _ = policy_loss(logp, old, adv, one, dual_clip=3.0)
            assert dual <= plain
            if adv[b, tt] >= 0:
                assert dual == plain
        _, stats, _ = policy_loss(logp, old, adv, mask, dual_clip=3.0)
        assert stats["loss/dual_clipfrac"] > 0


def test_policy_loss_micro_batches_with_num_tokens_equal_whole_batch(policy_loss):
    gen = torch.Generator().manual_seed(5)
    mask = lengths_mask([4, 2, 3, 1], 4)
    old = torch.randn(4, 4, dtype=F64, generator=gen)
    logp = (old + 0.5 * torch.randn(4, 4, dtype=F64, generator=gen)).requires_grad_()
    adv = torch.randn(4, 4, dtype=F64, generator=gen)
    whole, _, _ = policy_loss(logp, old, adv, mask)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    n = mask.sum()
    parts = [
        policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], num_tokens=n)[0] for i in (0, 2)
    ]
    (grad_parts,) = torch.autograd.grad(sum(parts), logp)
    assert_close(sum(parts), whole)
    assert_close(grad_parts, grad_whole)


def test_sequence_level_equals_gspo_objective(policy_loss):
    # GSPO: ρ_i = exp(mean_t(logp - old)), ℓ_i = -min(ρ_i A_i, clip(ρ_i) A_i), differentiated through the mean
    gen = torch.Generator().manual_seed(6)
    mask = lengths_mask([5, 2, 4, 1, 3], 5)
    old = torch.randn(5, 5, dtype=F64, generator=gen)
    logp = (old + 0.2 * torch.randn(5, 5, dtype=F64, generator=gen)).requires_grad_()
    seq_adv = torch.randn(5, dtype=F64, generator=gen)
    adv = seq_adv[:, None].expand(5, 5)
    rho = torch.exp(masked_mean(logp - old, mask, dim=-1))
    per_seq = -torch.min(rho * seq_adv, rho.clamp(1 - 0.05, 1 + 0.05) * seq_adv)  # (B,)
    n_tokens = mask.sum(-1)
    for agg, direct in [
        ("seq-mean-token-mean", per_seq.mean()),
        ("token-mean", (per_seq * n_tokens).sum() / n_tokens.sum()),
    ]:
        ours, stats, _ = policy_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.05, level="sequence", agg=agg)
        assert 0 < stats["loss/clipfrac"] < 1  # some sequences clipped, some not
        assert_close(ours, direct)
        assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(direct, logp, retain_graph=True)[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"clip_high": 0.28, "dual_clip": 3.0},
        {"level": "sequence", "agg": "seq-mean-token-mean", "clip_low": 0.05, "clip_high": 0.05},
        {"is_correction": "tis", "agg": "seq-mean-token-sum-norm"},
    ],
)
def test_policy_loss_gradcheck_with_clipping_active(policy_loss, kwargs):
    gen, mask, old, logp = _grad_inputs(7, spread=0.4)
    adv = torch.randn(3, 4, dtype=F64, generator=gen)
    rollout = old + 0.5 * torch.randn(3, 4, dtype=F64, generator=gen)
    if kwargs.get("is_correction"):
        kwargs = {**kwargs, "rollout_logp": rollout}
    _, stats, _ = policy_loss(logp, old, adv, mask, **kwargs)
    assert 0 < stats["loss/clipfrac"] < 1
    assert torch.autograd.gradcheck(lambda lp: policy_loss(lp, old, adv, mask, **kwargs)[0], (logp,))


# one entry per loss option whose inputs carry a mask: (number of (B, T) inputs, fn(loss, inputs, mask) -> outputs)
MASKED_CASES = {
    "token_dual": (3, lambda f, x, m: _flat(f(x[0], x[1], x[2], m, dual_clip=3.0))),
    "sequence": (3, lambda f, x, m: _flat(f(x[0], x[1], x[2], m, level="sequence", agg="seq-mean-token-mean"))),
    **{c: (4, lambda f, x, m, c=c: _flat(f(*x[:3], m, rollout_logp=x[3], is_correction=c)))
       for c in ("tis", "icepop", "seq-mask-tis")},  # fmt: skip
    "entropy": (4, lambda f, x, m: _flat(f(*x[:3], m, ent=x[3], entropy_coef=0.1))),
}


def _flat(loss_and_stats):
    loss, stats, _ = loss_and_stats  # the per-token tensors the loss used are not outputs a gradient flows from
    return [loss, *stats.values()]


@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30])
@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_masked_garbage_never_changes_outputs_or_gradients(policy_loss, case, garbage):
    n_inputs, fn = MASKED_CASES[case]
    mask = lengths_mask([5, 3, 0, 1], 5)  # includes an all-masked row
    gen = torch.Generator().manual_seed(3)
    clean = [torch.where(mask, torch.randn(4, 5, dtype=F64, generator=gen), 0.0) for _ in range(n_inputs)]
    dirty = [torch.where(mask, x, garbage).requires_grad_() for x in clean]
    clean = [x.requires_grad_() for x in clean]
    out_clean, out_dirty = fn(policy_loss, clean, mask), fn(policy_loss, dirty, mask)
    for a, b in zip(out_clean, out_dirty, strict=True):
        assert torch.isfinite(b).all() and torch.equal(a, b), case
    grads_clean = torch.autograd.grad(sum(o.sum() for o in out_clean if o.requires_grad), clean, allow_unused=True)
    grads_dirty = torch.autograd.grad(sum(o.sum() for o in out_dirty if o.requires_grad), dirty, allow_unused=True)
    for a, b in zip(grads_clean, grads_dirty, strict=True):
        if a is None:
            assert b is None
            continue
        assert torch.isfinite(b).all() and torch.equal(a, b), case
        assert (b[~mask] == 0).all(), case


@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_all_masked_batch_gives_zeros_not_nan(policy_loss, case):
    n_inputs, fn = MASKED_CASES[case]
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for out in fn(policy_loss, [torch.full((2, 3), NAN, dtype=F64) for _ in range(n_inputs)], mask):
        assert (out == 0).all(), case
