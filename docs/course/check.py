"""Grade a course exercise: hand-computed cases on your function, then a short learning run with it.

    python docs/course/check.py 2 my_grpo.py              # lesson 2: the cases, then the learning run
    python docs/course/check.py 2 my_grpo.py --no-run     # the cases only (seconds)
    python docs/course/check.py --class submissions/      # a class: every student's files, one table

Each case gives your function small inputs whose answer was worked out by hand from the lesson's equations (the
working is in the comments of this file) and says, when your answer differs, which case, what was expected, what
you returned and, where the difference looks like a common mistake, which one. When every case passes, the learning
run trains with your file (the lesson's page says for how long) and checks that the model gets better.

A class: `submissions/<student>/<NN>_<anything>.py`, the lesson read from the file name's leading number (the
exercise files' names: `02_group_advantage.py`). `--no-run` grades the cases only; the table is also written to
`submissions/results.csv`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lessons import COURSE, LESSONS, REPO, Lesson  # noqa: E402

# Every case runs in float64 and the hand values are given to 6-7 significant digits: a right answer is off by
# < 1e-6 (the rounding of the written values), a wrong one by far more. A function that computes in float32 (e.g.
# through `.float()`) is off by at most a few float32 roundings of O(1) numbers, ~1e-6 as well.
TOL = 1e-5


class Wrong(Exception):
    """A case whose answer differs from the hand-computed one; the message is for the student."""


def _fmt(x) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().double().tolist()
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return repr(x)


def expect(got, expected, case: str, hints: tuple = ()) -> None:
    """Compare `got` with the hand-computed `expected` (numbers or nested lists); on a difference raise `Wrong`
    naming the case, both values and the first hint whose `(alternative, text)` alternative matches `got` (the
    answer a known mistake gives) or whose `(predicate, text)` predicate holds for `got`."""
    import torch

    want = torch.tensor(expected, dtype=torch.float64)
    if isinstance(got, Foreign):
        raise Wrong(f"{case}: expected a tensor like {_fmt(want)}, got {got.kind}: {got.text}")
    if not isinstance(got, torch.Tensor):
        try:
            got = torch.as_tensor(got, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise Wrong(f"{case}: expected a tensor like {_fmt(want)}, got {type(got).__name__}: {got!r}") from None
    have = got.detach().double().cpu()
    if have.shape != want.shape:
        raise Wrong(f"{case}: expected shape {tuple(want.shape)}, got {tuple(have.shape)}\n  expected {_fmt(want)}"
                    f"\n  got      {_fmt(have)}")  # fmt: skip
    if bool(torch.isfinite(have).all()) and torch.allclose(have, want, atol=TOL, rtol=TOL):
        return
    message = f"{case}\n  expected {_fmt(want)}\n  got      {_fmt(have)}"
    for clue, text in hints:
        if callable(clue):
            matched = clue(have)
        else:
            alt = torch.tensor(clue, dtype=torch.float64)
            matched = (alt.numel() == have.numel() and bool(torch.isfinite(have).all())
                       and torch.allclose(have.flatten(), alt.flatten(), atol=TOL, rtol=TOL))  # fmt: skip
        if matched:
            message += f"\n  hint: {text}"
            break
    raise Wrong(message)


def t(values, grad: bool = False):
    import torch

    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def not_finite(x) -> bool:
    import torch

    return not bool(torch.isfinite(x).all())


# ------------------------------------------------------------------------------------------------------------
# Lesson 1: RLOO's leave-one-out baseline.  A_i = r_i − (Σ_group r − r_i) / (G − 1)


def cases_1():
    # G = 4, one correct answer: the baseline of sample 0 is the mean of the others, (0 + 0 + 0) / 3 = 0, so A_0 = 1;
    # each wrong one sees (1 + 0 + 0) / 3 = 1/3, so A = −1/3. They sum to 0 (a fact of RLOO, up to the scale).
    yield "one correct answer in a group of 4 (rewards [1, 0, 0, 0], G = 4)", lambda f: f(t([1.0, 0, 0, 0]), 4), \
        lambda got: expect(got, [1.0, -1 / 3, -1 / 3, -1 / 3], "rewards [1, 0, 0, 0], G = 4",
        hints=(([0.75, -0.25, -0.25, -0.25], "this is r_i − mean(group): the baseline must leave sample i out "
                "(the mean of the other G − 1 rewards), or the sample's own reward biases its baseline"),
               ([1.0, -0.25, -0.25, -0.25], "wrong normaliser: the baseline is a mean over the G − 1 other samples, "
                "divide by G − 1, not G")))  # fmt: skip
    # G = 3, rewards [3, 0, 0]: A_0 = 3 − (0 + 0)/2 = 3; A_1 = 0 − (3 + 0)/2 = −1.5; A_2 = −1.5.
    yield "a group of 3 (rewards [3, 0, 0], G = 3)", lambda f: f(t([3.0, 0, 0]), 3), lambda got: expect(
        got, [3.0, -1.5, -1.5], "rewards [3, 0, 0], G = 3",
        hints=(([2.0, -1.0, -1.0], "this is r_i − mean(group): leave sample i out of its own baseline"),))
    # Two groups of 2 in one batch, prompt-major: (2, 0) and (1, 1). Each baseline comes from its own group only:
    # A = [2 − 0, 0 − 2, 1 − 1, 1 − 1] = [2, −2, 0, 0].
    yield "two prompts, G = 2 (rewards [2, 0, 1, 1])", lambda f: f(t([2.0, 0, 1, 1]), 2), lambda got: expect(
        got, [2.0, -2.0, 0.0, 0.0], "rewards [2, 0, 1, 1], G = 2",
        hints=((lambda a: abs(float(a[2])) > 1e-6, "samples 2 and 3 belong to the second prompt: each baseline "
                "uses only the rewards of the same prompt's group (view the rewards as (B / G, G))"),))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Lesson 2: GRPO.  A_i = (r_i − mean_group(r)) / (std_group(r) + ε), sample (unbiased) std; Dr.GRPO: no division.


def cases_2():
    # rewards [1, 0, 0, 0]: mean 0.25, deviations [0.75, −0.25, −0.25, −0.25]; sample variance
    # (0.75² + 3 · 0.25²) / (4 − 1) = 0.75 / 3 = 0.25, std 0.5, so A = deviations / 0.5 = [1.5, −0.5, −0.5, −0.5].
    yield "one correct answer in a group of 4", lambda f: f(t([1.0, 0, 0, 0]), 4), lambda got: expect(
        got, [1.5, -0.5, -0.5, -0.5], "rewards [1, 0, 0, 0], G = 4",
        hints=(([1.732051, -0.5773503, -0.5773503, -0.5773503], "you divided by the population std (÷ G inside "
                "the square root); GRPO uses the sample std (÷ (G − 1)), torch's default `std()`"),
               ([0.75, -0.25, -0.25, -0.25], "you did not divide by the group's std (only Dr.GRPO skips that)"),
               ([3.0, -1.0, -1.0, -1.0], "you divided by the variance: divide by its square root, the std")))  # fmt: skip
    # Dr.GRPO (scale_by_std=False): only the mean is removed: [0.75, −0.25, −0.25, −0.25].
    yield "Dr.GRPO: scale_by_std=False", lambda f: f(t([1.0, 0, 0, 0]), 4, scale_by_std=False), lambda got: expect(
        got, [0.75, -0.25, -0.25, -0.25], "rewards [1, 0, 0, 0], G = 4, scale_by_std=False",
        hints=(([1.5, -0.5, -0.5, -0.5], "scale_by_std=False must skip the division by the std"),))
    # Two groups of 2: (1, 1) has std 0, so A = 0 / (0 + ε) = 0 (ε keeps it finite); (0, 1): mean 0.5, deviations
    # [−0.5, 0.5], sample std sqrt((0.25 + 0.25) / 1) = 0.7071068, A = [−0.7071068, 0.7071068].
    yield "a group whose rewards are all equal, then a mixed one", lambda f: f(t([1.0, 1.0, 0.0, 1.0]), 2), \
        lambda got: expect(got, [0.0, 0.0, -0.7071068, 0.7071068], "rewards [1, 1, 0, 1], G = 2",
        hints=((not_finite, "a group whose rewards are all equal has std 0: add eps to the std before dividing"),
               ([0.0, 0.0, -1.0, 1.0], "you divided by the population std; GRPO uses the sample std (÷ (G − 1))"),
               (lambda a: abs(float(a[0])) > 1e-6, "each group is normalised by its own mean and std (view the "
                "rewards as (B / G, G))")))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Lesson 3: the PPO clip.  loss = Σ_t −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t) · m_t / N


def _clip_case(ratios, adv, mask, expected_loss, expected_grad, case, hints=(), **kw):
    """(run, check) of a clip case: the run calls the student's `policy_loss` (in the grading process) and returns
    the loss, whether it carries a gradient, and the gradient; the check compares them (in the grader)."""

    def run(policy_loss):
        import torch

        logp = torch.log(t([ratios])).requires_grad_(True)  # old_logp = 0, so ρ = exp(logp) = the given ratios
        old = torch.zeros_like(logp)
        out = policy_loss(logp, old, t([adv]), t([mask]), **kw)
        if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], dict) and isinstance(out[2], dict)):
            raise Wrong(f"{case}: return (loss, metrics dict, dict of the per-token tensors the loss used), as the "
                        f"docstring says; got {type(out).__name__}{f' of {len(out)}' if isinstance(out, tuple) else ''}")
        if not isinstance(out[2].get("ratio"), torch.Tensor) or out[2]["ratio"].shape != logp.shape:
            raise Wrong(f"{case}: the third value must hold the ratio the loss used per token (`used['ratio']`, "
                        f"shape {tuple(logp.shape)}): samples.jsonl shows it")
        loss = out[0]
        has_grad = isinstance(loss, torch.Tensor) and loss.requires_grad
        try:
            grad = torch.autograd.grad(loss, logp)[0][0] if has_grad else None
        except Exception as e:  # e.g. a loss that is not a scalar: the check names the shape first
            grad = f"the gradient of your loss could not be computed: {type(e).__name__}: {e}"
        return {"loss": loss, "has_grad": has_grad, "grad": grad}

    def check(got):
        expect(got["loss"], expected_loss, f"{case}: the loss", hints)
        if not got["has_grad"]:
            raise Wrong(f"{case}: the loss has no gradient: compute the ratio from `logp` (which carries it), not "
                        "from a detached copy")  # fmt: skip
        if isinstance(got["grad"], str):
            raise Wrong(f"{case}: {got['grad']}")
        expect(got["grad"], expected_grad, f"{case}: the gradient of the loss with respect to logp",
               hints=((lambda g: abs(float(g[0])) > 1e-6, "a clipped token must get no gradient: take the min of the "
                       "unclipped and the clipped term, so the clipped constant wins where it is smaller"),))  # fmt: skip

    return run, check


def cases_3():
    # ε = 0.2, old_logp = 0 and logp = log ρ, so ρ is what we choose; token-mean over the 3 valid tokens (the 4th is
    # masked: its huge advantage must not count).
    #   t0: ρ = 1.5, A = 1:  min(1.5·1, clip(1.5)=1.2 ·1) = 1.2 (clipped: a constant, no gradient)
    #   t1: ρ = 0.5, A = 1:  min(0.5, 0.8) = 0.5 (not clipped: ∂(−ρA)/∂logp = −ρA = −0.5)
    #   t2: ρ = 1.0, A = −1: min(−1, −1) = −1 (∂/∂logp = −ρA = 1)
    # loss = −(1.2 + 0.5 − 1) / 3 = −0.2333333; gradient = [0, −0.5, 1, 0] / 3.
    yield "A > 0: a ratio above 1 + ε is clipped, one below 1 − ε is not", *_clip_case(
        [1.5, 0.5, 1.0, 1.0], [1.0, 1.0, -1.0, 100.0], [1, 1, 1, 0], -0.2333333,
        [0.0, -0.1666667, 0.3333333, 0.0], "ratios [1.5, 0.5, 1.0, masked], advantages [1, 1, −1, 100]",
        hints=(([0.2333333], "the function returns the loss to minimise: −min(ρA, clip(ρ)A), not +min(...)"),
               ([-0.4333333], "you took the max of the two terms: PPO takes the min, min(1.5 · 1, 1.2 · 1) = 1.2 "
                "for the first token, 0.5 for the second"),
               ([-0.3333333], "the first token is not clipped: min(1.5 · 1, clip(1.5, 0.8, 1.2) · 1) = 1.2"),
               ([33.1], "the masked token counts in your loss: multiply by the mask"),
               ([-0.175], "you averaged over all 4 positions: token-mean divides by the valid tokens (the mask's sum,"
                " or num_tokens when given)")))  # fmt: skip
    # With A < 0 the clip works the other way round (PPO's bound is pessimistic):
    #   t0: ρ = 0.5, A = −1: min(−0.5, 0.8·−1 = −0.8) = −0.8 (clipped, no gradient)
    #   t1: ρ = 1.5, A = −1: min(−1.5, 1.2·−1 = −1.2) = −1.5 (not clipped: gradient −ρA = 1.5)
    # loss = −(−0.8 − 1.5) / 2 = 1.15; gradient = [0, 1.5] / 2.
    yield "A < 0: a ratio below 1 − ε is clipped, one above 1 + ε is not", *_clip_case(
        [0.5, 1.5], [-1.0, -1.0], [1, 1], 1.15, [0.0, 0.75], "ratios [0.5, 1.5], advantages [−1, −1]",
        hints=(([1.0], "with A < 0 the smaller term is the unclipped one when ρ > 1 + ε: min(ρA, clip(ρ)A) keeps "
                "−1.5, the pessimistic bound"),))  # fmt: skip
    # DAPO's clip-higher: ε_high = 0.28, so ρ = 1.5 with A = 1 gives min(1.5, 1.28) = 1.28 (ρ = 0.5 is unchanged:
    # ε_low = 0.2 gives 0.8 > 0.5). loss = −(1.28 + 0.5) / 2 = −0.89.
    yield "clip_high differs from clip_low (DAPO)", *_clip_case(
        [1.5, 0.5], [1.0, 1.0], [1, 1], -0.89, [0.0, -0.25], "ratios [1.5, 0.5], A = 1, clip_high 0.28",
        hints=(([-0.85], "the upper bound is 1 + clip_high, the lower 1 − clip_low"),), clip_high=0.28)  # fmt: skip
    # The normaliser is the whole minibatch's token count when given (the script passes it: a micro-batch holds
    # only part of the minibatch): the first case's sum −0.7 over num_tokens = 7 tokens gives −0.1.
    yield "token-mean over the minibatch: num_tokens given", *_clip_case(
        [1.5, 0.5, 1.0, 1.0], [1.0, 1.0, -1.0, 100.0], [1, 1, 1, 0], -0.1,
        [0.0, -0.5 / 7, 1 / 7, 0.0], "the first case with num_tokens=7",
        hints=(([-0.2333333], "divide by num_tokens when it is given (the minibatch's valid tokens), not by this "
                "micro-batch's"),), num_tokens=7)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Lesson 4: KL estimators.  Δ = logp − ref_logp;  k1 = Δ,  k2 = Δ²/2,  k3 = exp(−Δ) − 1 + Δ, clamped to [−10, 10]


def cases_4():
    ln2 = math.log(2.0)
    # π(x) = 0.5 and π_ref(x) = 0.25 for the sampled token: Δ = ln 0.5 − ln 0.25 = ln 2 = 0.6931472.
    #   k1 = 0.6931472;  k2 = 0.6931472² / 2 = 0.2402265;  k3 = 0.5 − 1 + 0.6931472 = 0.1931472.
    # And the reverse, π = 0.25, π_ref = 0.5: Δ = −ln 2;  k1 = −0.6931472, k2 = 0.2402265, k3 = 2 − 1 − 0.6931472.
    logp, ref = t([[math.log(0.5), math.log(0.25)]]), t([[math.log(0.25), math.log(0.5)]])
    for name, want, mistakes in (
        ("k1", [[ln2, -ln2]], ()),
        ("k2", [[0.2402265, 0.2402265]], (([[0.480453, 0.480453]], "k2 is Δ² / 2: you forgot the 1/2"),)),
        ("k3", [[0.1931472, 0.3068528]], (([[0.3068528, 0.1931472]], "k3 = exp(−Δ) − 1 + Δ with Δ = logp − "
                                           "ref_logp: your Δ has the wrong sign (that estimates KL(π_ref‖π))"),
                                          ([[1.3068528, -0.6931472]], "k3 = exp(−Δ) − 1 + Δ: the −1 is missing"))),
    ):  # fmt: skip
        yield (f"{name} on two tokens (π = 0.5 vs π_ref = 0.25, and the reverse)",
               lambda f, name=name: f(logp, ref, name),
               lambda got, name=name, want=want, mistakes=mistakes: expect(got, want, f"{name}, Δ = [ln 2, −ln 2]",
                                                                           mistakes))
    # Unbiasedness, exactly: π = [0.5, 0.5] and π_ref = [0.9, 0.1] over two tokens; each estimator, weighted by π
    # (the probability of sampling the token), must average to KL(π‖π_ref) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)
    # = 0.5108256 for k1 and k3 (k2 is biased: that is the point of the question in the lesson).
    pi, pref = [0.5, 0.5], [0.9, 0.1]
    lp, lr = t([[math.log(p) for p in pi]]), t([[math.log(p) for p in pref]])
    for name in ("k1", "k3"):
        yield (f"{name} is unbiased: E_π[{name}] = KL(π‖π_ref)",
               lambda f, name=name: (f(lp, lr, name)[0] * t(pi)).sum(),
               lambda got, name=name: expect(got, 0.5108256, f"π = [0.5, 0.5], π_ref = [0.9, 0.1]: Σ π(x) · {name}(x)",
                                             ((lambda v: float(v) < 0, "a KL must average to ≥ 0: check the sign "
                                               "of Δ"),)))  # fmt: skip
    # The mask: positions where it is 0 are 0. The clamp: Δ = −30 makes exp(−Δ) ≈ 1e13; the result is clamped to
    # 10 (and must stay finite, gradient included, or one bad token turns every weight into NaN).
    mask = t([[1.0, 0.0]])
    yield ("masked positions give 0", lambda f: f(logp, ref, "k3", mask=mask),
           lambda got: expect(got, [[0.1931472, 0.0]], "k3 with mask [1, 0]"))

    def clamp_run(approx_kl):
        import torch

        far = t([[-30.0]], grad=True)
        kl = approx_kl(far, t([[0.0]]), "k3")
        (grad,) = torch.autograd.grad(kl.sum(), far)
        return {"kl": kl, "grad": grad}

    def clamp_check(got):
        expect(got["kl"], [[10.0]], "k3 at Δ = −30 (clamped to [−10, 10])",
               ((not_finite, "exp(−Δ) overflows for large |Δ|: clamp Δ (the real code clamps it to ±20) before "
                 "exp, then clamp the result to [−10, 10]"),))  # fmt: skip
        if not_finite(_tensor(got["grad"], "the gradient at Δ = −30")):
            raise Wrong("k3 at Δ = −30: the gradient is not finite; clamp Δ before exp()")

    yield "a far-off token is clamped and stays finite", clamp_run, clamp_check


# ------------------------------------------------------------------------------------------------------------
# Lesson 5: GAE.  δ_t = r_t + γ V_{t'} − V_t,  A_t = δ_t + γλ A_{t'},  R_t = A_t + V_t  (t' the next valid position)


def _gae_case(rewards, values, mask, gamma, lam, adv, ret, case, hints=()):
    def run(gae):
        out = gae(t([rewards]), t([values], grad=True), t([mask]), gamma, lam)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise Wrong(f"{case}: return a pair (advantages, returns)")
        grad = any(bool(getattr(x, "requires_grad", False)) for x in out)
        return {"adv": out[0][0], "ret": out[1][0], "grad": grad}

    def check(got):
        expect(got["adv"], adv, f"{case}: the advantages", hints)
        expect(got["ret"], ret, f"{case}: the returns R = A + V", hints)
        if got["grad"]:
            raise Wrong(f"{case}: the advantages and returns carry a gradient (the values given had one): they are "
                        "targets, computed under torch.no_grad() (the decorator above the function)")  # fmt: skip

    return run, check


def cases_5():
    # One response of 3 tokens, reward 1 on the last, V = 0.5 everywhere, γ = λ = 1. After the last token V = 0:
    #   δ_2 = 1 + 0 − 0.5 = 0.5,  δ_1 = 0 + 0.5 − 0.5 = 0,  δ_0 = 0.
    #   A_2 = 0.5,  A_1 = 0 + 0.5 = 0.5,  A_0 = 0.5;  R = A + V = [1, 1, 1] (the Monte Carlo return).
    yield "γ = λ = 1: A is the return minus V", *_gae_case(
        [0.0, 0.0, 1.0], [0.5, 0.5, 0.5], [1, 1, 1], 1.0, 1.0, [0.5, 0.5, 0.5], [1.0, 1.0, 1.0], "γ = λ = 1",
        hints=(([0.5, 0.0, 0.0], "A_t = δ_t + γλ·A_{t+1}: carry the next advantage back (loop from the end)"),))
    # λ = 0.5: A_2 = 0.5, A_1 = 0 + 1·0.5·0.5 = 0.25, A_0 = 0 + 0.5·0.25 = 0.125; R = A + V = [0.625, 0.75, 1].
    yield "λ = 0.5", *_gae_case(
        [0.0, 0.0, 1.0], [0.5, 0.5, 0.5], [1, 1, 1], 1.0, 0.5, [0.125, 0.25, 0.5], [0.625, 0.75, 1.0],
        "γ = 1, λ = 0.5", hints=(([0.5, 0.5, 0.5], "your advantages are those of λ = 1: the carried term is γ·λ·A, "
                                  "not γ·A"),))  # fmt: skip
    # γ = 0.5, λ = 1: δ_2 = 1 − 0.5 = 0.5, δ_1 = 0 + 0.5·0.5 − 0.5 = −0.25, δ_0 = −0.25;
    # A_2 = 0.5, A_1 = −0.25 + 0.5·0.5 = 0, A_0 = −0.25 + 0.5·0 = −0.25; R = [0.25, 0.5, 1] (= 0.25, 0.5, 1: γ^k).
    yield "γ = 0.5", *_gae_case(
        [0.0, 0.0, 1.0], [0.5, 0.5, 0.5], [1, 1, 1], 0.5, 1.0, [-0.25, 0.0, 0.5], [0.25, 0.5, 1.0],
        "γ = 0.5, λ = 1", hints=(([-0.125, 0.0, 0.5], "γ multiplies the next value inside δ as well as the "
                                  "carried advantage"),
                                 ([0.0, 0.25, 0.5], "γ is missing from the recursion: the carried term is γ·λ·A_{t+1}, "
                                  "not λ·A_{t+1}"),))  # fmt: skip
    # Right padding: mask [1, 1, 0], rewards [−0.1, 0.9, 0], V [0.2, 0.4, 9] (the 9 is padding: never used). After
    # the last valid token (t = 1) V = 0:  δ_1 = 0.9 − 0.4 = 0.5,  δ_0 = −0.1 + 0.4 − 0.2 = 0.1;
    # A = [0.1 + 0.5, 0.5, 0] = [0.6, 0.5, 0];  R = [0.8, 0.9, 0] (0 at the padding).
    yield "a padded response", *_gae_case(
        [-0.1, 0.9, 0.0], [0.2, 0.4, 9.0], [1, 1, 0], 1.0, 1.0, [0.6, 0.5, 0.0], [0.8, 0.9, 0.0],
        "mask [1, 1, 0], V [0.2, 0.4, 9 (padding)]", hints=(((lambda a: float(a[1]) < 0), "the value after the last "
                                                               "valid token is 0: padding's V must not be used"),
                                                              ((lambda a: abs(float(a[2])) > 1e-6), "the mask is "
                                                               "not applied: a padded position is no step (A = R = 0 "
                                                               "there) and its V is never used"),))  # fmt: skip
    # A multi-turn episode: mask [1, 0, 1], the middle token is the environment's (not an action). It is skipped:
    # t = 0's next valid position is t = 2.  δ_2 = 1 − 0.5 = 0.5, A_2 = 0.5;  δ_0 = 0 + 0.5 − 0.5 = 0,
    # A_0 = 0 + 0.5 = 0.5;  A = [0.5, 0, 0.5], R = [1, 0, 1].
    yield "a masked token between two turns is skipped", *_gae_case(
        [0.0, 0.0, 1.0], [0.5, 7.0, 0.5], [1, 0, 1], 1.0, 1.0, [0.5, 0.0, 0.5], [1.0, 0.0, 1.0],
        "mask [1, 0, 1] (environment token in the middle), V [0.5, 7, 0.5]",
        hints=(((lambda a: abs(float(a[0]) - 0.5) > 1e-6), "a masked position is not a step: t = 0 bootstraps from "
                "the next valid position (t = 2), and the masked one passes A and V through unchanged"),))  # fmt: skip
    # The same episode at λ = 0.95, where skipping and "a step with V = 0" differ (at γ = λ = 1 they agree):
    # skipped:  A_2 = 0.5,  δ_0 = 0 + 0.5 − 0.5 = 0,  A_0 = 0 + 0.95·0.5 = 0.475;  R = [0.975, 0, 1].
    # as a step with r = V = 0:  δ_1 = 0 + 0.5 − 0 = 0.5, A_1 = 0.5 + 0.95·0.5 = 0.975;  δ_0 = 0 + 0 − 0.5 = −0.5,
    # A_0 = −0.5 + 0.95·0.975 = 0.42625.
    yield "a masked token between two turns, λ = 0.95", *_gae_case(
        [0.0, 0.0, 1.0], [0.5, 7.0, 0.5], [1, 0, 1], 1.0, 0.95, [0.475, 0.0, 0.5], [0.975, 0.0, 1.0],
        "γ = 1, λ = 0.95, mask [1, 0, 1] (environment token in the middle), V [0.5, 7, 0.5]",
        hints=(((lambda a: abs(float(a[0]) - 0.42625) < 1e-4), "the environment's token was taken as a step with "
                "V = 0: a masked position is skipped, so t = 0 bootstraps from V at t = 2 and carries A_2"),))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Lesson 6: the Bradley-Terry loss.  −log σ(r_chosen − r_rejected − margin), mean over pairs


def cases_6():
    # r_c = 2, r_r = 0: −log σ(2) = log(1 + e^−2) = 0.1269280.  The reverse pair, r_c = 0, r_r = 2: log(1 + e^2)
    # = 2.1269280.  Mean over the two pairs: 1.1269280.
    yield "two pairs, one ranked right and one wrong", lambda f: f(t([2.0, 0.0]), t([0.0, 2.0])), lambda got: expect(
        got, 1.1269280, "chosen [2, 0], rejected [0, 2]",
        hints=(([0.6931472], "σ(r_c − r_r): you compared a score with itself?"),))
    yield "one pair ranked right", lambda f: f(t([2.0]), t([0.0])), lambda got: expect(
        got, 0.1269280, "chosen [2], rejected [0]: −log σ(2)",
        hints=(([2.126928], "sign error: the loss is −log σ(r_chosen − r_rejected); you have the rejected first"),
               ([-0.1269280], "the loss is −log σ(...): minimise the negative log-likelihood"),
               ([0.8807971], "take the log: −log σ(Δ), not σ(Δ)")))  # fmt: skip
    # A margin m = 1 (the pair's label says "by at least 1"): −log σ(2 − 0 − 1) = log(1 + e^−1) = 0.3132617.
    yield "a margin", lambda f: f(t([2.0]), t([0.0]), t([1.0])), lambda got: expect(
        got, 0.3132617, "chosen [2], rejected [0], margin [1]: −log σ(2 − 1)",
        hints=(([0.0485873], "the margin is subtracted: −log σ(r_c − r_r − m)"),))

    # The gradient pushes the pair apart: ∂/∂r_c [−log σ(r_c − r_r)] = −σ(r_r − r_c) = −(1 − σ(2)) = −0.1192029.
    def gradient(reward_loss):
        import torch

        c, r = t([2.0], grad=True), t([0.0], grad=True)
        loss = reward_loss(c, r)
        return torch.autograd.grad(loss, (c, r))

    def gradient_check(got):
        expect(got[0], [-0.1192029], "∂loss/∂r_chosen at r_c = 2, r_r = 0")
        expect(got[1], [0.1192029], "∂loss/∂r_rejected at r_c = 2, r_r = 0")

    yield "the gradient raises the chosen score and lowers the rejected", gradient, gradient_check


# ------------------------------------------------------------------------------------------------------------
# Lesson 7: DPO.  h = (π_c − π_r) − (ref_c − ref_r);  loss = −log σ(β h);  rewards β(π − ref), detached


def cases_7():
    # Summed log-probs π_c = −1, π_r = −3, ref_c = ref_r = −2, β = 0.5: h = (−1 + 3) − 0 = 2, βh = 1,
    # loss = −log σ(1) = log(1 + e^−1) = 0.3132617; implicit rewards β(π − ref) = 0.5·1 = 0.5 and 0.5·(−1) = −0.5.
    def basic(dpo_loss):
        out = dpo_loss(t([-1.0], grad=True), t([-3.0], grad=True), t([-2.0]), t([-2.0]), 0.5)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise Wrong("return (loss, chosen_rewards, rejected_rewards), as the docstring says")
        grad = any(bool(getattr(x, "requires_grad", False)) for x in out[1:])
        return {"loss": out[0], "chosen": out[1], "rejected": out[2], "rewards_grad": grad}

    def basic_check(got):
        expect(got["loss"], 0.3132617, "π_c −1, π_r −3, ref −2 and −2, β = 0.5: the loss −log σ(β h), h = 2",
               hints=(([0.126928], "β multiplies h inside the sigmoid: −log σ(β·h), not −log σ(h)"),
               ([0.063464], "β belongs inside the sigmoid: −log σ(β·h), not −β·log σ(h)"),
                      ([1.313262], "sign error: h = (π_c − π_r) − (ref_c − ref_r), the chosen first"),
                      ([0.6931472], "h = 0: did you subtract the policy's margin from itself?")))  # fmt: skip
        expect(got["chosen"], [0.5], "the chosen implicit reward β(π_c − ref_c)")
        expect(got["rejected"], [-0.5], "the rejected implicit reward β(π_r − ref_r)")
        if got["rewards_grad"]:
            raise Wrong("the implicit rewards carry a gradient: they are for logging, detach them (.detach()), or a "
                        "caller that sums them into a metric backpropagates through the policy")  # fmt: skip

    yield "one pair (the loss and the implicit rewards)", basic, basic_check
    # The reference matters: the same policy log-probs with ref_c = −1, ref_r = −3 give h = 2 − 2 = 0 and the
    # loss log 2 = 0.6931472 (the policy has not moved from the reference, whatever it prefers).
    yield "a policy equal to its reference has loss log 2", lambda f: f(t([-1.0]), t([-3.0]), t([-1.0]), t([-3.0]),
                                                                         0.5)[0], lambda got: expect(
        got, 0.6931472, "π = ref = (−1, −3): h = 0",
        hints=(([0.126928], "subtract the reference's margin: h = (π_c − π_r) − (ref_c − ref_r)"),))
    # Two pairs average: h = 2 (loss 0.3132617) and h = −2 (βh = −1, loss log(1 + e) = 1.3132617): mean 0.8132617.
    yield "the mean over pairs", lambda f: f(t([-1.0, -3.0]), t([-3.0, -1.0]), t([-2.0, -2.0]), t([-2.0, -2.0]),
                                             0.5)[0], lambda got: expect(
        got, 0.8132617, "two pairs with h = 2 and h = −2",
        hints=(([1.626523], "the loss is the mean over pairs, not the sum"),))
    # cDPO, ε = 0.1 (the labels flipped with probability ε), h = 2, β = 0.5: −0.9·log σ(1) − 0.1·log σ(−1)
    # = 0.9·0.3132617 + 0.1·1.3132617 = 0.4132617.
    yield "cDPO: label smoothing", lambda f: f(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), 0.5,
                                               label_smoothing=0.1)[0], lambda got: expect(
        got, 0.4132617, "h = 2, β = 0.5, label_smoothing 0.1: −(1−ε)·log σ(βh) − ε·log σ(−βh)",
        hints=(([0.3132617], "label_smoothing changes nothing in your loss: the ε share is the flipped label, "
                "−ε·log σ(−βh)"),
               ([0.1506094], "the ε term is subtracted as a loss too: −(1−ε)·log σ(βh) − ε·log σ(−βh)"),
               ([1.2132617], "the weights are swapped: (1−ε) goes with log σ(βh), ε with log σ(−βh)")))  # fmt: skip
    # IPO (Azar et al. 2023), β = 0.5, π_c = −1, π_r = −4, ref −2 and −2: h = 3, loss (h − 1/(2β))² = (3 − 1)² = 4.
    yield "IPO", lambda f: f(t([-1.0]), t([-4.0]), t([-2.0]), t([-2.0]), 0.5, ipo=True)[0], lambda got: expect(
        got, 4.0, "ipo=True, h = 3, β = 0.5: (h − 1/(2β))²",
        hints=(([1.0], "IPO's target is 1/(2β), not 1/β"), ([0.25], "IPO regresses h itself, not β·h"),
               ([0.2014133], "with ipo=True the loss is the squared error (h − 1/(2β))², not −log σ(βh)")))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Lesson 8: the calculator agent (agents/examples/calculator_agent.py's protocol).


class ScriptedClient:
    """Stands for the executor's OpenAI-style client: answers each completion with the next scripted text and
    records the prompts it was asked."""

    def __init__(self, *texts: str):
        self.texts, self.prompts = list(texts), []
        self.completions = SimpleNamespace(create=self._create)

    async def _create(self, model: str, prompt: str, **kw):
        self.prompts.append(prompt)
        if not self.texts:
            raise Wrong(f"the agent asked the policy a question too many: {prompt!r}")
        return SimpleNamespace(choices=[SimpleNamespace(text=self.texts.pop(0))])


def cases_8():
    example = {"prompt": "37*05=", "label": "0185"}
    # (the policy's answers, the reward, the prompts the agent must have sent):
    #   "0185": a final answer, right: reward 1, one prompt (the question).
    #   "0184": a final answer, wrong: reward 0.
    #   "?", "0185": a call; the second prompt is follow_up("37*05=", "?") = "37*05=?>0185\n37*05="; right: 1.
    #   "?", "0186": a call, then a wrong copy: 0.
    plays = [(["0185"], 1.0, ["37*05="]), (["0184"], 0.0, ["37*05="]),
             (["?", "0185"], 1.0, ["37*05=", "37*05=?>0185\n37*05="]), (["?", "0186"], 0.0, None),
             (["?12*34", "0408"], 0.0, ["37*05=", "37*05=?12*34>0408\n37*05="])]  # fmt: skip

    def play(agent, texts):
        client = ScriptedClient(*texts)
        got = asyncio.run(agent(client, dict(example)))
        try:
            got = float(got)
        except (TypeError, ValueError):  # the check says what came back instead of a number
            pass
        return {"prompts": client.prompts, "reward": got}

    def play_check(got, texts, reward, prompts):
        case = f"the policy answers {texts} to 37*05="
        if prompts is not None and got["prompts"] != prompts:
            raise Wrong(f"{case}: the agent sent the prompts\n  {got['prompts']}\n  expected\n  {prompts}\n  hint: "
                        "after a call (a first answer starting with TOOL) ask again with follow_up(question, call);"
                        " any other first answer is final")  # fmt: skip
        expect(got["reward"], reward, f"{case}: the reward", hints=((lambda r: float(r) == 1.0 - reward, "the reward "
                                                                  "is score(final answer, example['label'])"),))

    for texts, reward, prompts in plays:
        yield (f"the policy answers {texts}", lambda f, texts=texts: play(f, texts),
               lambda got, texts=texts, reward=reward, prompts=prompts: play_check(got, texts, reward, prompts))


# ------------------------------------------------------------------------------------------------------------
# Lesson 10: GDPO.  Â^k = (r^k − mean_group(r^k)) / (std_group(r^k) + ε) per part k;  A = Σ_k w_k Â^k, whitened over
# the batch: A ← (A − mean_batch(A)) / (std_batch(A) + ε); sample (unbiased) stds throughout.

_SUM_FIRST = (
    "every group got the same advantages: you normalised the sum of the parts (GRPO's advantage), the collapse GDPO "
    "avoids: normalise each part in its own group first, then weigh, sum and whiten"
)
_NOT_WHITENED = (
    "the weighted sum is right but not whitened: divide it by its std over the whole batch (after removing the batch "
    "mean)"
)


def cases_10():
    # The paper's collapse example: groups of 2, parts (correct, format). Group 1 scores (0, 0) and (1, 1), group 2
    # (0, 0) and (1, 0). GRPO on the sums (0, 2) and (0, 1) gives both groups (−1/√2, 1/√2) = ±0.7071068.
    # GDPO, group 1: each part is (0, 1), sample std 1/√2, so each normalises to (−1/√2, 1/√2); the sum (−√2, √2).
    # Group 2: correct (−1/√2, 1/√2), format (0, 0) has std 0 and gives 0 (ε keeps it finite); the sum (−1/√2, 1/√2).
    # Over the batch [−√2, √2, −1/√2, 1/√2]: mean 0, sample variance (2 + 2 + 0.5 + 0.5) / 3 = 5/3, std 1.290994;
    # A = [−1.095445, 1.095445, −0.5477226, 0.5477226]: the sample right on both parts gets twice the other's.
    yield "the paper's collapse example: (0, 0), (1, 1) | (0, 0), (1, 0), weights (1, 1)", \
        lambda f: f(t([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]), t([1.0, 1.0]), 2), lambda got: expect(
        got, [-1.095445, 1.095445, -0.5477226, 0.5477226],
        "parts [[0, 0], [1, 1], [0, 0], [1, 0]], weights [1, 1], G = 2",
        hints=((not_finite, "the format part does not vary in group 2 (std 0): add eps to each part's group std "
                "before dividing"),
               ([-0.8660254, 0.8660254, -0.8660254, 0.8660254], _SUM_FIRST),
               ([-0.7071068, 0.7071068, -0.7071068, 0.7071068], _SUM_FIRST),
               ([-1.414214, 1.414214, -0.7071068, 0.7071068], _NOT_WHITENED),
               ([-1.264911, 1.264911, -0.6324555, 0.6324555], "you whitened with the population std (÷ B inside the "
                "square root); use the sample std (÷ (B − 1)), torch's default `std()`")))  # fmt: skip
    # One part is GRPO's advantage (lesson 2) whitened over the batch. G = 4: group 1 [1, 0, 0, 0] gives
    # [1.5, −0.5, −0.5, −0.5] (mean 0.25, sample std 0.5); group 2 [1, 1, 0, 1] gives [0.5, 0.5, −1.5, 0.5] (mean
    # 0.75, std 0.5). Over the 8: mean 0, sample variance (2 · 2.25 + 6 · 0.25) / 7 = 6/7, std 0.9258201;
    # A = [1.620185, −0.5400617, −0.5400617, −0.5400617, 0.5400617, 0.5400617, −1.620185, 0.5400617].
    yield "one part: GRPO's advantage whitened over the batch (G = 4)", \
        lambda f: f(t([[1.0], [0.0], [0.0], [0.0], [1.0], [1.0], [0.0], [1.0]]), t([1.0]), 4), lambda got: expect(
        got, [1.620185, -0.5400617, -0.5400617, -0.5400617, 0.5400617, 0.5400617, -1.620185, 0.5400617],
        "parts [[1], [0], [0], [0], [1], [1], [0], [1]], weights [1], G = 4",
        hints=(([1.5, -0.5, -0.5, -0.5, 0.5, 0.5, -1.5, 0.5], "this is GRPO's advantage (lesson 2): GDPO then "
                "whitens the weighted sum over the whole batch"),
               ([1.732051, -0.5773503, -0.5773503, -0.5773503, 0.5773503, 0.5773503, -1.732051, 0.5773503],
                "a population std (÷ n inside the square root) where the sample std belongs (÷ (n − 1), torch's "
                "default `std()`): in the batch whitening, or in the groups with no whitening after"),
               ([0.9354143, -0.9354143, -0.9354143, -0.9354143, 0.9354143, 0.9354143, -0.9354143, 0.9354143],
                "you normalised the part over the whole batch: each part is normalised within its own group (view the "
                "parts as (B / G, G, K)); only the weighted sum is whitened over the batch")))  # fmt: skip
    # Weights (1, 0.5) on (correct, digits), the embedded reward's parts. Group 1: (1, 1) and (0, 0.5): each part
    # normalises to (1/√2, −1/√2); 1 · 0.7071068 + 0.5 · 0.7071068 = 1.06066, so (1.06066, −1.06066). Group 2: (0, 0.5)
    # and (0, 0): correct is constant (0), digits (1/√2, −1/√2) weighed 0.5: (0.3535534, −0.3535534). Over the batch:
    # mean 0, sample variance (2 · 1.125 + 2 · 0.125) / 3 = 5/6, std 0.9128709;
    # A = [1.161895, −1.161895, 0.3872983, −0.3872983].
    yield "weights (1, 0.5) on (correct, digits)", lambda f: f(t([[1.0, 1.0], [0.0, 0.5], [0.0, 0.5], [0.0, 0.0]]),
                                                           t([1.0, 0.5]), 2), lambda got: expect(
        got, [1.161895, -1.161895, 0.3872983, -0.3872983],
        "parts [[1, 1], [0, 0.5], [0, 0.5], [0, 0]], weights [1, 0.5], G = 2",
        hints=((not_finite, "the correct part does not vary in group 2 (std 0): add eps to each part's group std "
                "before dividing"),
               ([1.095445, -1.095445, 0.5477226, -0.5477226], "the weights changed nothing: multiply each normalised "
                "part by its weight before the sum (weights applied to the raw parts are undone by the normalisation)"),
               ([1.019049, -1.019049, 0.6793662, -0.6793662], "the weights are swapped: weights[k] goes with "
                "parts[:, k]"),
               ([0.8660254, -0.8660254, 0.8660254, -0.8660254], _SUM_FIRST),
               ([1.06066, -1.06066, 0.3535534, -0.3535534], _NOT_WHITENED)))  # fmt: skip
    # A part of weight 0 adds nothing: the same parts with weights (1, 0) leave correct alone, (0.7071068, −0.7071068)
    # in group 1 and 0 in group 2 (constant); over the batch: sample variance (0.5 + 0.5) / 3 = 1/3, std 0.5773503;
    # A = [1.224745, −1.224745, 0, 0].
    yield "a part of weight 0 adds nothing", lambda f: f(t([[1.0, 1.0], [0.0, 0.5], [0.0, 0.5], [0.0, 0.0]]),
                                                     t([1.0, 0.0]), 2), lambda got: expect(
        got, [1.224745, -1.224745, 0.0, 0.0], "parts [[1, 1], [0, 0.5], [0, 0.5], [0, 0]], weights [1, 0], G = 2",
        hints=((not_finite, "a part that does not vary in its group has std 0: add eps to each part's group std"),
               (lambda a: abs(float(a[2])) > 1e-6, "with weight 0 the digits part must not count: group 2 varies "
                "only in digits, so its advantages are 0")))  # fmt: skip


CASES = {1: cases_1, 2: cases_2, 3: cases_3, 4: cases_4, 5: cases_5, 6: cases_6, 7: cases_7, 8: cases_8, 10: cases_10}

# How long a file may take to import and run all its lesson's cases, in seconds (the lesson pages say so). The
# cases themselves take well under a second and an exercise file imports in 1-2 s; the rest is room for a busy
# machine. The grading process's own start (Python and torch) is not counted.
TIME_LIMIT_S = {1: 30, 2: 30, 3: 30, 4: 30, 5: 30, 6: 30, 7: 30, 8: 30, 10: 30}
# What the grading process may use besides time: address space (it needs ~0.7 GiB: Python, torch, the exercise
# file) and the size of any file it writes.
MEMORY_LIMIT = 4 << 30
FILE_SIZE_LIMIT = 64 << 20
STARTUP_LIMIT_S = 300  # Python and torch starting in the grading process, before the student's file is read


# ------------------------------------------------------------------------------------------------------------
# Running the cases
#
# Each file is graded in a process of its own (`check.py --grade-one`, below): it imports the file, runs each case's
# `run` part on the student's function and writes what came back as plain data (numbers, lists, strings; a tensor
# as its float64 values and shape) to a results file, one JSON line per step. This process reads those lines,
# rebuilds the tensors and compares them with the hand-computed answers (each case's `check` part). A file that
# loops, exits, crashes or changes the checker's code can only do so in its own process: it fails with a message
# saying which, and the grader (and the class's other files) go on.


def load(path: Path, lesson: Lesson):
    """Import the student's file as a module (the scripts import without side effects); None and a message when it
    does not import."""
    if not path.is_file():
        return None, f"{path}: no such file"
    spec = importlib.util.spec_from_file_location(f"course_submission_{lesson.number}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the file runs
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or a bad import in the student's file
        sys.modules.pop(spec.name, None)
        return None, f"{path} does not import: {type(e).__name__}: {e}{_where(e, path)}"
    except BaseException as e:  # sys.exit(), exit(), quit() at import: SystemExit
        sys.modules.pop(spec.name, None)
        return None, (f"{path} {EXITS} while it is imported ({type(e).__name__}: {e}{_where(e, path)}): a file must "
                      "not call sys.exit(), exit() or quit(); the checker imports it and calls its function")  # fmt: skip
    if not callable(getattr(module, lesson.function, None)):
        return None, f"{path} has no function `{lesson.function}` (lesson {lesson.number} asks for it)"
    return module, None


def _where(e: BaseException, path: Path) -> str:
    """`line N of <file>` for the deepest frame of the traceback inside the student's file."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    return f" (line {frames[-1].lineno} of {path.name}: {frames[-1].line})" if frames else ""


# The words of the messages for a file that ends, outlasts or changes its grading process (the class table tags them).
EXITS, TIMED_OUT, TAMPERED, CRASHED = "ends the grading process", "did not finish within", "changed the checker's", \
    "was killed"  # fmt: skip


class Foreign:
    """Something the student's function returned that is not a number, string, list or tensor: its type and repr."""

    def __init__(self, kind: str, text: str):
        self.kind, self.text = kind, text

    def __repr__(self) -> str:
        return self.text


def _to_data(x, depth: int = 0):
    """(In the grading process.) A case's outputs as JSON-able data: a tensor (or anything torch can read as one) as
    {"tensor": flat float64 values, "shape"}, numbers, strings and None as they are, a list or tuple as a list, a
    case's own dict of outputs as {"fields"}, anything else as {"object": its type, "repr"}."""
    import torch

    if depth > 20:
        return {"object": type(x).__name__, "repr": "(nested too deep)"}
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64)
        return {"tensor": x.flatten().tolist(), "shape": list(x.shape)}
    if x is None or isinstance(x, (bool, float)):
        return x
    if isinstance(x, str):
        return x[:10_000]
    if isinstance(x, int) and abs(x) < 2**1000:
        return float(x)
    if isinstance(x, (list, tuple)):
        return [_to_data(v, depth + 1) for v in x]
    if isinstance(x, dict) and depth == 0:
        return {"fields": {str(k): _to_data(v, depth + 1) for k, v in x.items()}}
    try:
        return _to_data(torch.as_tensor(x, dtype=torch.float64), depth + 1)
    except Exception:
        return {"object": type(x).__name__, "repr": repr(x)[:300]}


def _from_data(x, depth: int = 0):
    """(In the grader.) The inverse of `_to_data`, checking every piece: only numbers, strings, None, lists, and the
    three tagged dicts are accepted; anything else raises ValueError."""
    import torch

    if depth > 22:
        raise ValueError("nested too deep")
    if x is None or isinstance(x, (bool, float, str)):
        return x
    if isinstance(x, int):
        return float(x)
    if isinstance(x, list):
        return [_from_data(v, depth + 1) for v in x]
    if isinstance(x, dict):
        if x.keys() == {"tensor", "shape"} and len(x["shape"]) <= 16:
            values, shape = x["tensor"], x["shape"]
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise ValueError(f"a tensor's shape is not a list of sizes: {shape!r}"[:200])
            if not (isinstance(values, list) and all(type(v) in (int, float) for v in values)):
                raise ValueError("a tensor's values are not numbers")
            if len(values) != math.prod(shape):
                raise ValueError(f"a tensor of shape {shape} with {len(values)} values")
            return torch.tensor(values, dtype=torch.float64).reshape(shape)
        if x.keys() == {"fields"} and isinstance(x["fields"], dict):
            return {str(k): _from_data(v, depth + 1) for k, v in x["fields"].items()}
        if x.keys() == {"object", "repr"} and isinstance(x["object"], str) and isinstance(x["repr"], str):
            return Foreign(x["object"][:100], x["repr"][:300])
    raise ValueError(f"not a value the checker sends: {x!r}"[:200])


def _tensor(x, what: str):
    """`x` as a float64 tensor, or Wrong naming `what` it should have been."""
    import torch

    if isinstance(x, Foreign):
        raise Wrong(f"{what}: expected a tensor, got {x.kind}: {x.text}")
    try:
        return torch.as_tensor(x, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise Wrong(f"{what}: expected a tensor, got {type(x).__name__}: {x!r}") from None


def _limit_resources(limit_s: float) -> None:
    """(In the grading process, before the student's file is read.) CPU time: what the process has used so far plus
    twice the time limit (a loop that outlives the grader's clock still ends); address space; written file size;
    no core dumps."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime + 2 * limit_s + 5)
    for what, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 5), (resource.RLIMIT_AS, MEMORY_LIMIT, MEMORY_LIMIT),
                             (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT, FILE_SIZE_LIMIT), (resource.RLIMIT_CORE, 0, 0)):
        old_soft, old_hard = resource.getrlimit(what)
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
        resource.setrlimit(what, (min(soft, hard), hard))  # fmt: skip


def grade_one(number: int, path: Path, out_path: Path, limit_s: float, sandbox: bool = True) -> int:
    """The grading process: import `path`, run each case's `run` part on its function, write one JSON line per step
    to `out_path`: {"ready"} (the clock starts), {"file": problem} or {"imported"}, then per case {"running": i} and
    {"case": i, "out": data} or {"case": i, "wrong": message}, {"tampered": names} if the file changed this module,
    and {"done"}. The comparisons are the grader's. `sandbox` False leaves this process's resource limits as they
    are (the checker's own tests, grading files known to return, in their own process)."""
    import torch  # noqa: F401  (the checker's own start, before the clock)

    lesson = LESSONS[number]
    cases = list(CASES[number]())
    out = open(out_path, "a", encoding="utf-8")
    dumps, to_data, load_file, where = json.dumps, _to_data, load, _where  # as they are before the file is read

    def write(**line) -> None:
        out.write(dumps(line) + "\n")
        out.flush()

    write(ready=True)
    if sandbox:
        _limit_resources(limit_s)
    grader = vars(sys.modules[__name__])
    before = dict(grader)

    def changed() -> list[str]:
        return sorted(k for k, v in before.items() if grader.get(k) is not v and not k.startswith("__"))

    module, problem = load_file(path, lesson)
    if module is None:
        write(file=problem)
    else:
        write(imported=True)
        fn = getattr(module, lesson.function)
        for i, (_, run, _check) in enumerate(cases):
            write(running=i)
            try:
                write(case=i, out=to_data(run(fn)))
            except Wrong as e:
                write(case=i, wrong=str(e))
            except NotImplementedError:
                write(case=i, wrong=f"`{lesson.function}` is not written yet (it raises NotImplementedError)")
            except Exception as e:
                write(case=i, wrong=f"your function raised {type(e).__name__}: {e}{where(e, path)}")
            except BaseException as e:  # SystemExit from sys.exit(), exit(), quit()
                write(case=i, wrong=f"your function {EXITS} ({type(e).__name__}: {e}{where(e, path)}): it must "
                                    "return its answer, not call sys.exit(), exit() or quit()")  # fmt: skip
    names = changed()
    if names:
        write(tampered=names)
    write(done=True)
    out.close()
    return 0


def _read_lines(path: Path) -> list[dict]:
    lines = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return lines
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(item, dict):
            lines.append(item)
    return lines


def _kill_group(proc: subprocess.Popen) -> None:
    """End the grading process and anything it started in its group (it leads its own process group; what left the
    group: `_no_strays`)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process now, zombies included (Linux's /proc)."""
    out = {}
    for name in (n for n in os.listdir("/proc") if n.isdigit()):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:  # not a process, or one that has just ended
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...; starttime is the 20th
        out[int(name)] = (int(fields[1]), int(fields[19]))
    return out


@contextlib.contextmanager
def _no_strays():
    """Around a grading process (or a learning run): what it leaves running is ended when it ends. The process leads
    a group of its own, which `_kill_group` kills; a process the student's code detaches from that group (a new
    session, a daemon's double fork) escaped it and ran on after grading. So while inside, this process adopts the
    orphans of what it starts (Linux's PR_SET_CHILD_SUBREAPER: the kernel gives them to it instead of init); on
    leaving, every process that became its child meanwhile is killed with its descendants, and reaped. Elsewhere than
    Linux: the group kill only."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
        was = ctypes.c_int(0)
        if libc is not None and libc.prctl(37, ctypes.byref(was), 0, 0, 0) != 0:  # PR_GET_CHILD_SUBREAPER
            libc = None
    except (OSError, AttributeError):
        libc = None
    if libc is None:
        yield
        return
    if not was.value:
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    me = os.getpid()
    before = {(pid, start) for pid, (ppid, start) in _processes().items() if ppid == me}
    try:
        yield
    finally:
        for _ in range(100):  # each round kills what is there; the orphans its kills make come back as children
            procs = _processes()
            strays = [pid for pid, (ppid, start) in procs.items() if ppid == me and (pid, start) not in before]
            if not strays:
                break
            doomed, todo = set(strays), list(strays)
            while todo:
                parent = todo.pop()
                for pid, (ppid, _) in procs.items():
                    if ppid == parent and pid not in doomed:
                        doomed.add(pid)
                        todo.append(pid)
            for pid in doomed:
                try:
                    os.kill(pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
            for pid in strays:  # this process's children now: reaped, so that none stays a zombie
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        if not was.value:
            libc.prctl(36, 0, 0, 0, 0)


def _grade_cases(lesson: Lesson, path: Path, limit_s: float | None = None, in_process: bool = False) -> tuple[list, str]:
    """Grade `path`'s cases in a process of its own; ([(case name, None if it passed else what is wrong)], what the
    file printed). `in_process`: in this one, unsandboxed, for files known to return (the checker's tests of its
    verdicts on planted mistakes: the same cases and comparisons without a Python start per file)."""
    limit = float(limit_s or TIME_LIMIT_S[lesson.number])
    cases = list(CASES[lesson.number]())
    if not path.is_file():
        return [("the file", f"{path}: no such file")], ""
    with tempfile.TemporaryDirectory(prefix=f"course{lesson.number}_cases_") as tmp:
        results_path, log_path = Path(tmp) / "results.jsonl", Path(tmp) / "output.log"
        results_path.touch()
        if in_process:
            grade_one(lesson.number, path.resolve(), results_path, limit, sandbox=False)
            return _verdicts(lesson, path, cases, _read_lines(results_path), 0, False, limit, ""), ""
        cmd = [sys.executable, str(Path(__file__).resolve()), "--grade-one", str(lesson.number), str(path.resolve()),
               str(results_path), str(limit)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        timed_out = False
        with open(log_path, "wb") as log, _no_strays():
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
            start, ready_at = time.monotonic(), None
            try:
                while proc.poll() is None:
                    time.sleep(0.05)
                    now = time.monotonic()
                    if ready_at is None and results_path.stat().st_size > 0:
                        ready_at = now
                    if (ready_at is None and now - start > STARTUP_LIMIT_S) or (
                            ready_at is not None and now - ready_at > limit):
                        timed_out = True
                        break
            finally:
                _kill_group(proc)  # the process if it still runs, and whatever it left running
        lines = _read_lines(results_path)
        printed = log_path.read_text(encoding="utf-8", errors="replace")
    return _verdicts(lesson, path, cases, lines, proc.returncode, timed_out, limit, printed), printed


def _verdicts(lesson, path, cases, lines, rc, timed_out, limit, printed) -> list[tuple[str, str | None]]:
    """The grader's side: each case's outputs compared with its hand-computed answer; a case the grading process did
    not get through fails with what happened to it (time limit, exit, crash)."""
    seen = {k for line in lines for k in line}
    outputs, running = {}, None
    for line in lines:
        if type(line.get("case")) is int and ("out" in line or "wrong" in line):
            outputs[line["case"]] = line
        elif type(line.get("running")) is int:
            running = line["running"]
    done = "done" in seen
    tail = "\n".join(printed.strip().splitlines()[-8:])
    said = f"\n  the end of what it printed:\n    {tail.replace(chr(10), chr(10) + '    ')}" if tail else ""
    if done:
        stopped = None
    elif timed_out:
        stopped = (f"{TIMED_OUT} the lesson's time limit ({limit:g} s to import the file and run every case): an "
                   "endless loop, or far too slow")  # fmt: skip
        if "ready" not in seen:
            stopped = f"the grading process could not start within {STARTUP_LIMIT_S} s (Python and torch){said}"
    elif rc is not None and rc < 0:
        sig = {9: "SIGKILL: out of memory?", 24: "SIGXCPU: it used more CPU time than the limit allows",
               25: "SIGXFSZ: it wrote a file larger than the limit", 11: "SIGSEGV"}.get(-rc, f"signal {-rc}")
        stopped = f"{CRASHED} ({sig}){said}"
    else:
        stopped = (f"{EXITS} (exit status {rc}) before the checker got its answers: a file must not call os._exit(),"
                   f" sys.exit() or exit(), nor end the process another way{said}")  # fmt: skip
    if "ready" not in seen and not done:
        return [("the file", stopped if timed_out else f"the grading process failed to start{said}")]
    problem = next((line["file"] for line in lines if isinstance(line.get("file"), str)), None)
    if problem is not None:
        return [("the file", problem)]
    if "imported" not in seen:
        return [("the file", f"{path.name} {stopped} (while it was imported)")]
    results = []
    for i, (name, _run, check) in enumerate(cases):
        line = outputs.get(i)
        if line is None:
            why = f"your function {stopped}" if i == running else "not run: the grading process ended before it"
            if stopped is None:
                why = "the grading process skipped this case"
        elif "wrong" in line:
            why = str(line["wrong"])
        else:
            try:
                got = _from_data(line["out"])
            except (ValueError, TypeError, RuntimeError) as e:
                why = f"the checker could not read what your function returned: {e}"
            else:
                try:
                    check(got)
                    why = None
                except Wrong as e:
                    why = str(e)
                except Exception as e:  # a value of the wrong kind that the check could not compare
                    why = f"what your function returned could not be compared: {type(e).__name__}: {e}"
        results.append((name, why))
    tampered = next((line["tampered"] for line in lines if isinstance(line.get("tampered"), list)), None)
    if tampered:
        names = ", ".join(f"`{n}`" for n in tampered[:8] if isinstance(n, str))
        results.insert(0, ("the file", f"{path.name} {TAMPERED} {names} (e.g. `import __main__; __main__.expect = "
                                       "...`): a file is graded on what its function returns, and fails when it "
                                       "changes the checker"))  # fmt: skip
    return results


def run_cases(lesson: Lesson, path: Path, limit_s: float | None = None,
              in_process: bool = False) -> list[tuple[str, str | None]]:  # fmt: skip
    """[(case name, None if it passed else what is wrong)]; a file that does not load gives one failed entry. The
    file runs in a process of its own, for at most `limit_s` seconds (default: the lesson's TIME_LIMIT_S);
    `in_process` grades it in this one (see `_grade_cases`)."""
    return _grade_cases(lesson, path, limit_s, in_process)[0]


# ------------------------------------------------------------------------------------------------------------
# The learning run


def run_command(lesson: Lesson, path: Path, run_dir: Path) -> list[str]:
    """The command of the lesson's learning run with the student's file."""
    common = ["--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(run_dir)]
    if lesson.runs is not None:  # a core/ exercise: the script runs with it in place of the real module
        module = lesson.source.removesuffix(".py").replace("/", ".")
        return [sys.executable, str(COURSE / "run_with.py"), f"{module}={path}", str(REPO / lesson.runs),
                *lesson.run_flags, *common]  # fmt: skip
    return [sys.executable, str(path), *lesson.run_flags, *common]


def judge(lesson: Lesson, run_dir: Path) -> tuple[bool, str]:
    """Did the run learn? RL lessons: greedy pass@1 on the held-out prompts rose by 0.1 or more; lesson 6: held-out
    ranking accuracy rose by 0.2 or more, to 0.7 at least (a fresh head ranks about half the pairs right; the real
    loss reaches 0.78 in these 60 steps); lesson 7: held-out preference accuracy rose by 0.15 or more."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if lesson.number == 6:
        first, last = summary["eval_accuracy_first"], summary["eval_accuracy_last"]
        return last >= max(0.7, first + 0.2), f"held-out ranking accuracy {first:.3f} -> {last:.3f} (needs ≥ 0.7 and +0.2)"
    if lesson.number == 7:
        first, last = summary["eval_pref_accuracy_first"], summary["eval_pref_accuracy_last"]
        return last >= first + 0.15, f"held-out preference accuracy {first:.3f} -> {last:.3f} (needs +0.15)"
    first, last = summary["eval_pass@1_first"], summary["eval_pass@1_last"]
    return last >= first + 0.1, f"greedy pass@1 {first:.3f} -> {last:.3f} (needs +0.1)"


def agent_run(path: Path, work: Path) -> tuple[bool, str]:
    """Lesson 8: the calculator recipe at a small size (tests/test_tool_agent.py's): a short SFT on demonstrations
    where a quarter of the first answers are calls, then 8 GRPO steps through the student's agent. The tool-call
    rate and the reward must both rise from the first step to the mean of the last three."""
    sys.path.insert(0, str(REPO))
    from agents.examples import calculator_agent as calc

    task, demos = calc.write_data(work / "data", tool_share=0.25)
    sft = [sys.executable, str(REPO / "algos/sft.py"), "--model.name-or-path", "cleanrlhf/tiny-sft", "--data.path",
           str(demos), "--train.max-steps", "400", "--train.lr", "1e-3", "--train.batch-size", "64",
           "--train.warmup-steps", "0", "--eval.every", "0", "--ckpt.every", "0", "--logger.quiet",
           "--logger.no-tensorboard", "--run-dir", str(work / "sft"), "--export-dir", str(work / "sft-model")]  # fmt: skip
    grpo = [sys.executable, str(REPO / "algos/grpo.py"), "--actor.model.name-or-path", str(work / "sft-model"),
            "--data.path", str(task), "--rollout.agent-file", str(path), "--train.max-steps", "8", "--eval.every",
            "0", "--logger.quiet", "--logger.no-tensorboard", "--run-dir", str(work / "grpo")]  # fmt: skip
    for cmd, log in ((sft, work / "sft.log"), (grpo, work / "grpo.log")):
        if not _run(cmd, log):
            return False, f"the run failed; the end of its output:\n{_tail(log)}"
    rows = [json.loads(line) for line in open(work / "grpo" / "metrics.jsonl")]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    if any(r.get("rollout/agent_errors", 0) for r in steps):
        return False, "your agent raised errors during the rollouts (rollout/agent_errors > 0): see grpo.log"

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    calls = [mean("rollout/agent_calls_mean", p) - 1 for p in (steps[:1], steps[-3:])]
    reward = [mean("rollout/reward_mean", p) for p in (steps[:1], steps[-3:])]
    ok = calls[1] > calls[0] + 0.3 and reward[1] > reward[0] + 0.2
    return ok, (f"tool-call rate {calls[0]:.2f} -> {calls[1]:.2f} (needs +0.3), reward {reward[0]:.2f} -> "
                f"{reward[1]:.2f} (needs +0.2)")  # fmt: skip


# A learning run that has not ended after this long is stopped and fails (they take 1-7 minutes on a 2-core CPU,
# see teacher.md): a student's function that loops on the run's inputs must not hold up a class.
RUN_LIMIT_S = 1800


def _run(cmd: list[str], log: Path, limit_s: float | None = None) -> bool:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    limit_s = RUN_LIMIT_S if limit_s is None else limit_s
    with open(log, "w") as out, _no_strays():
        proc, timed_out = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                           start_new_session=True), False  # fmt: skip
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)  # the run if it is still going, and any process it left behind
    if timed_out:
        with open(log, "a") as out:
            out.write(f"\n[check] the run was stopped: it did not finish within {limit_s:g} s\n")
    return proc.returncode == 0


def _tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def learning_run(lesson: Lesson, path: Path, work: Path) -> tuple[bool, str]:
    """Train with the student's file; (learned?, what was measured or why the run failed)."""
    if lesson.number == 8:
        return agent_run(path, work)
    run_dir, log = work / "run", work / "run.log"
    if not _run(run_command(lesson, path, run_dir), log):
        return False, f"the run failed; the end of its output ({log}):\n{_tail(log)}"
    return judge(lesson, run_dir)


# ------------------------------------------------------------------------------------------------------------
# One submission, and a class


def grade(lesson: Lesson, path: Path, run: bool = True, work: Path | None = None, say=print,
          limit_s: float | None = None) -> dict:
    """Cases (in a process of their own, `limit_s` seconds at most: default the lesson's), then (when they all pass
    and `run`) the learning run. Returns {"passed", "cases", "failed": [...], "run": measured or None, "learned": bool
    or None}."""
    results, printed = _grade_cases(lesson, path, limit_s)
    failed = [(name, why) for name, why in results if why is not None]
    say(f"lesson {lesson.number} ({lesson.title}): {path}")
    if printed.strip():
        lines = printed.rstrip().splitlines()
        say(f"  what your file printed{f' (the last 40 of {len(lines)} lines)' if len(lines) > 40 else ''}:")
        say("    " + "\n    ".join(lines[-40:]))
    for name, why in results:
        say(f"  {'ok  ' if why is None else 'FAIL'} {name}")
        if why:
            say("       " + why.replace("\n", "\n       "))
    out = {"passed": not failed, "cases": len(results), "failed": failed, "run": None, "learned": None}
    if failed or not run:
        if failed:
            say(f"{len(failed)} of {len(results)} cases fail: fix them first (the learning run waits for them)")
        else:
            say(f"all {len(results)} cases pass (--no-run: no learning run)")
        return out
    say(f"all {len(results)} cases pass; the learning run (a few minutes on a 2-core CPU) ...")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix=f"course{lesson.number}_") as tmp:
        try:
            learned, measured = learning_run(lesson, path, Path(work or tmp))
        except (OSError, KeyError, TypeError, ValueError) as e:  # no summary, a metric missing: the run went wrong
            learned, measured = False, f"the run's results could not be read: {type(e).__name__}: {e}"
    out.update(run=measured, learned=learned, passed=learned, run_s=round(time.time() - start, 1))
    say(f"  {'ok  ' if learned else 'FAIL'} learning run ({out['run_s']:.0f} s): {measured}")
    if not learned:
        say("  the cases pass but the model did not learn with your file: look for what the cases do not cover "
            "(other arguments, dtypes, batch shapes)")  # fmt: skip
    return out


def _tag(why: str) -> str:
    """A short word for the class table when a file looped, exited, crashed or changed the checker."""
    for words, tag in ((TAMPERED, "changed the checker"), (TIMED_OUT, "time limit"), (EXITS, "exits"),
                       (CRASHED, "killed")):
        if words in why:
            return f" ({tag})"
    return ""


def grade_class(folder: Path, run: bool, limit_s: float | None = None) -> int:
    """Every `<folder>/<student>/<NN>_*.py`: a table of students x lessons, also written to results.csv."""
    from rich.console import Console
    from rich.table import Table

    numbers = sorted(n for n, lesson in LESSONS.items() if lesson.function)
    rows = []
    for student in sorted(p for p in folder.iterdir() if p.is_dir()):
        cells = {}
        for file in sorted(student.glob("*.py")):
            m = re.match(r"(\d+)_", file.name)
            if m is None or int(m.group(1)) not in numbers:
                continue
            res = grade(LESSONS[int(m.group(1))], file, run=run, say=lambda *_: None, limit_s=limit_s)
            if res["failed"]:
                name, why = res["failed"][0]
                cells[int(m.group(1))] = f"fail: {name}{_tag(why)}"
            elif res["learned"] is False:
                cells[int(m.group(1))] = f"cases ok, run: {res['run']}"
            else:
                cells[int(m.group(1))] = "pass" + ("" if res["learned"] else " (cases)")
        rows.append((student.name, cells))
    table = Table(title=f"{folder}: {'cases and learning runs' if run else 'cases only (--no-run)'}")
    table.add_column("student")
    for n in numbers:
        table.add_column(f"{n}")
    for name, cells in rows:
        table.add_row(name, *(cells.get(n, "-") for n in numbers))
    Console(width=200).print(table)
    with open(folder / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *[f"lesson {n}" for n in numbers]])
        for name, cells in rows:
            writer.writerow([name, *(cells.get(n, "") for n in numbers)])
    print(f"written: {folder / 'results.csv'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lesson", nargs="?", type=int, help="the lesson number (1-8, 10)")
    ap.add_argument("file", nargs="?", type=Path, help="your copy of the lesson's exercise")
    ap.add_argument("--no-run", action="store_true", help="the cases only, no learning run")
    ap.add_argument("--class", dest="klass", type=Path, help="grade a folder of submissions: <student>/<NN>_*.py")
    ap.add_argument("--work-dir", type=Path, help="keep the learning run's files here (default: a temporary folder)")
    ap.add_argument("--time-limit", type=float, metavar="S", help="seconds a file may take to import and run its "
                    "cases (default: the lesson's, which its page states)")  # fmt: skip
    opts = ap.parse_args(argv)
    if opts.time_limit is not None and not opts.time_limit > 0:
        ap.error(f"--time-limit {opts.time_limit:g}: give a number of seconds above 0")
    if opts.klass is not None:
        if not opts.klass.is_dir():
            ap.error(f"--class {opts.klass}: not a folder")
        return grade_class(opts.klass, not opts.no_run, opts.time_limit)
    if opts.lesson is None or opts.file is None:
        ap.error("give a lesson number and your file (or --class FOLDER)")
    lesson = LESSONS.get(opts.lesson)
    if lesson is None or lesson.function is None:
        ap.error(f"lesson {opts.lesson} has no exercise; lessons with one: "
                 f"{', '.join(str(n) for n, x in LESSONS.items() if x.function)}")  # fmt: skip
    if opts.work_dir:
        opts.work_dir.mkdir(parents=True, exist_ok=True)
    res = grade(lesson, opts.file, run=not opts.no_run, work=opts.work_dir, limit_s=opts.time_limit)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--grade-one"]:  # the process that grades one file (see _grade_cases)
        number, path, out, limit = sys.argv[2:6]
        sys.exit(grade_one(int(number), Path(path), Path(out), float(limit)))
    sys.exit(main())
