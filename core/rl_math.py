"""RL math shared by every CleanRLHF script: masked reductions, KL estimators, GAE, IS weights, loss aggregation.

The policy losses themselves are written out in the scripts (algos/grpo.py's `policy_loss`); these are their pieces.

Pure functions, tensors in and tensors out, explicit scalar arguments. Shapes: B sequences, T response tokens,
V vocabulary. `mask` is a bool or 0/1 (B, T) tensor, right-padded. Masked positions of inputs may hold garbage (even
NaN/inf): every function selects with `torch.where` before any arithmetic, so garbage reaches neither an output nor a
gradient. Defaults follow OpenRLHF; TRL and Dr.GRPO conventions are reachable through arguments (see each docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
Count = int | float | Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_CORRECTIONS = ("tis", "icepop", "seq-mask-tis")


def _keep(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is true, else 0. A select, not a product: 0 * NaN would be NaN, and so would its gradient."""
    return torch.where(mask.bool(), x, 0.0)


def _at_least_one(n: Count) -> Count:
    return n.clamp(min=1) if isinstance(n, Tensor) else max(n, 1)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over the positions where mask is true: Σ x·m / max(Σ m, 1).

    x, mask: same shape, e.g. (B, T). dim=None gives a scalar; dim=-1 gives one mean per sequence, (B,).
    An all-masked row (or tensor) gives 0, not NaN.
    """
    mask = mask.bool()
    x = _keep(x, mask)
    if dim is None:
        return x.sum() / _at_least_one(mask.sum())
    return x.sum(dim) / _at_least_one(mask.sum(dim))


def approx_kl(logp: Tensor, ref_logp: Tensor, estimator: str = "k1", mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from tokens sampled from π (Schulman, "Approximating KL divergence", 2020).

    Δ = logp − ref_logp;  k1 = Δ;  k2 = Δ²/2;  k3 = exp(−Δ) − 1 + Δ;  result clamped to [−10, 10] (as OpenRLHF).
    k1 is unbiased but noisy and can be negative (OpenRLHF's default for the reward penalty); k2 is biased with low
    variance; k3 is unbiased, ≥ 0 and low-variance (GRPO's KL loss). Swap the arguments for KL(π_ref‖π)-style uses.
    logp, ref_logp: (B, T) log-probs of the sampled tokens -> (B, T); positions where `mask` (optional) is false are 0.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid estimators: {', '.join(KL_ESTIMATORS)}")
    if mask is not None:
        logp, ref_logp = _keep(logp, mask), _keep(ref_logp, mask)
    delta = logp - ref_logp
    if estimator == "k1":
        kl = delta
    elif estimator == "k2":
        kl = 0.5 * delta.square()
    else:
        # k3 is convex with k3(±20) > 19, so clamping Δ to ±20 first changes no clamped value; it only keeps exp()
        # finite, because inf in the forward pass would make the backward pass 0 · inf = NaN.
        delta = delta.clamp(-20.0, 20.0)
        kl = torch.exp(-delta) - 1.0 + delta
    return kl.clamp(-10.0, 10.0)


def token_rewards(
    reward: Tensor,
    kl: Tensor,
    kl_coef: float,
    mask: Tensor,
    clip_range: tuple[float, float] | None = (-10.0, 10.0),
) -> Tensor:
    """Per-token reward with the KL penalty folded in (Ziegler et al. 2019, arXiv:1909.08593; OpenRLHF compute_reward).

    r_t = −kl_coef · kl_t on every response token, plus clip(reward, *clip_range) at the last valid token.
    reward: (B,) sequence-level reward; kl: (B, T) per-token KL (e.g. approx_kl k1); mask: (B, T) -> (B, T), 0 at
    masked positions. A row without a valid token gets no reward. clip_range=None disables the clip.
    """
    mask = mask.bool()
    penalty = -kl_coef * _keep(kl, mask)
    if clip_range is not None:
        reward = reward.clamp(*clip_range)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=1)  # (B,) index of the last valid token, -1 for an empty row
    at_last = positions[None, :] == last[:, None]  # (B, T), all false for an empty row
    return penalty + torch.where(at_last, reward[:, None].to(penalty.dtype), 0.0)


def masked_whiten(x: Tensor, mask: Tensor, scale_by_std: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x over the masked positions of the whole batch (OpenRLHF's advantage normalisation).

    μ = Σ x·m / Σ m,   σ² = Σ (x − μ)²·m / Σ m (population variance),   out = (x − μ) / sqrt(σ² + eps).
    scale_by_std=False returns x − μ only (OpenRLHF's `no_std_norm`, Dr.GRPO's advice). TRL's masked_whiten uses the
    unbiased (Bessel) variance instead. x, mask: same shape, e.g. (B, T) or (B,) -> same shape, 0 at masked positions.
    """
    mask = mask.bool()
    x = _keep(x, mask)
    mean = masked_mean(x, mask)
    centered = _keep(x - mean, mask)
    if not scale_by_std:
        return centered
    var = masked_mean(centered.square(), mask)
    return centered * torch.rsqrt(var + eps)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar; the mode decides how tokens and sequences are weighted.

    token-mean               Σ ℓ·m / N,  N = num_tokens or Σ m        (OpenRLHF default; DAPO; TRL "dapo"/"bnpo")
    seq-mean-token-mean      Σ_i (Σ_t ℓ·m / Σ_t m)_i / S over rows with ≥ 1 valid token, S = num_seqs or their
                             count                                   (GRPO paper; TRL "grpo")
    seq-mean-token-sum-norm  Σ ℓ·m / (S · L),  S = num_seqs or B, L = max_len or T   (Dr.GRPO; TRL "dr_grpo")
    Micro-batches and data-parallel ranks: pass the counts of the whole optimizer step (num_tokens = valid tokens;
    num_seqs = non-empty sequences for seq-mean-token-mean, all sequences for seq-mean-token-sum-norm) and sum the
    returned losses: the sum is exactly the whole-batch loss, gradients included (multiply by the world size when DDP
    averages gradients over ranks). Dr.GRPO's L is the generation budget (max new tokens): pass it as max_len so the
    normaliser does not depend on how a batch happens to be padded; the default is the padded width T.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    mask = mask.bool()
    loss = _keep(loss, mask)
    if mode == "token-mean":
        return loss.sum() / _at_least_one(mask.sum() if num_tokens is None else num_tokens)
    if mode == "seq-mean-token-mean":
        tokens = mask.sum(dim=-1)  # (B,)
        seq_means = loss.sum(dim=-1) / _at_least_one(tokens)  # an empty row gives 0 and is not counted below
        return seq_means.sum() / _at_least_one((tokens > 0).sum() if num_seqs is None else num_seqs)
    seqs = mask.shape[0] if num_seqs is None else num_seqs
    return loss.sum() / _at_least_one(seqs * (mask.shape[1] if max_len is None else max_len))


# Pieces of the policy loss that every RL script writes out in its own `policy_loss` (algos/grpo.py's).
def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """ρ = π_θ / π_old per token, exp(clamp(logp − old_logp, ±20)); level "sequence" (GSPO) gives every token of a
    sequence exp(mean_t(logp − old_logp)) over its valid tokens, differentiable through the mean (each token's
    log-prob gets 1/|y_i| of ∂ℓ/∂ log ρ_i). logp: (B, T) with gradient; old_logp, mask: (B, T) -> (B, T), 1 at masked
    positions' log-ratio 0."""
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown policy-loss level {level!r}; valid levels: token, sequence")
    mask = mask.bool()
    log_ratio = _keep(logp, mask) - _keep(old_logp, mask).detach()
    if level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    return torch.exp(log_ratio.clamp(-20.0, 20.0))


def is_weight(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str,
              threshold: tuple[float, float] = (0.5, 5.0)) -> Tensor:  # fmt: skip
    """Importance weight (detached) correcting for the rollout engine's log-probs, w = exp(old_logp − rollout_logp),
    (lo, hi) = threshold: "tis" clamp(w, lo, hi) (truncated IS, Yao et al. 2025); "icepop" w inside [lo, hi], 0
    outside (IcePop, Ring-1T report); "seq-mask-tis" w, and 0 on every token of a sequence whose geometric mean
    exp(mean_t log w) is outside [lo, hi] (as OpenRLHF). (B, T) each -> (B, T)."""
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {mode!r}; valid: None, {', '.join(IS_CORRECTIONS)}")
    if rollout_logp is None:
        raise ValueError(f"is_correction={mode!r} needs rollout_logp (the inference engine's log-probs)")
    mask = mask.bool()
    lo, hi = threshold
    log_w = _keep(_keep(old_logp, mask).detach() - _keep(rollout_logp, mask).detach(), mask)
    w = torch.exp(log_w)
    if mode == "tis":
        return w.clamp(lo, hi)
    if mode == "icepop":
        return torch.where((w >= lo) & (w <= hi), w, 0.0)
    seq_w = torch.exp(masked_mean(log_w, mask, dim=-1))  # (B,) geometric mean of w over valid tokens
    return torch.where(((seq_w >= lo) & (seq_w <= hi))[:, None], w, 0.0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy of softmax(logits): H = logsumexp(z) − Σ_v softmax(z)_v · z_v.

    logits: (B, T, V) (any leading shape) -> (B, T), in logits' dtype (call .float() first for accurate bf16).
    Stable for large logits (no un-shifted exp); −inf logits (top-k/top-p filtering) contribute 0, not NaN.
    """
    probs = torch.softmax(logits, dim=-1)
    z = logits.masked_fill(probs == 0, 0.0)  # p = 0 terms are 0; 0 · (−inf) would be NaN
    return torch.logsumexp(logits, dim=-1) - (probs * z).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) gathered at labels, without a full (B, T, V) float32 copy when avoidable.

    logp_{b,t} = z_{b,t,y} − logsumexp_v z_{b,t,v},  z = logits / temperature (the sampler's temperature, so the
    log-probs match what vLLM sampled from). logits: (B, T, V); labels: (B, T) valid token ids -> (B, T) float32
    (float64 stays float64). fp32/fp64: gather minus logsumexp, no log_softmax tensor. bf16/fp16: one row (T, V) at
    a time in float32. Under autograd each row's float32 activations are kept for backward; the saving is complete
    for the no-grad passes (old and reference log-probs), which see the largest batches.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dtype in (torch.float32, torch.float64):
        if temperature != 1.0:
            logits = logits / temperature
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):  # (T, V), (T)
        row_logp = F.log_softmax(row_logits.float() / temperature, dim=-1)
        rows.append(row_logp.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


class _HeadLogprobs(torch.autograd.Function):
    """logp and entropy of softmax(h Wᵀ / τ) at `labels`, one chunk of tokens at a time, never holding the (N, V)
    logits of more than one chunk; the backward recomputes each chunk's logits (what a fused LM-head + log-softmax
    kernel does). Saved for backward: h, W, labels and the (N,) logsumexp."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, chunk: int, with_entropy: bool):
        n, acc = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for tests
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            z = (hidden[i:j] @ weight.t()).to(acc).div_(temperature)  # (c, V): one of at most two such buffers
            lse[i:j] = torch.logsumexp(z, dim=-1)
            logp[i:j] = z.gather(-1, labels[i:j, None]).squeeze(-1) - lse[i:j]
            if with_entropy:  # H = lse − Σ_v p_v z_v
                p = z.sub(lse[i:j, None]).exp_()
                ent[i:j] = lse[i:j] - torch.linalg.vecdot(p, z)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return (logp, ent) if with_entropy else (logp, torch.zeros(0, device=hidden.device))

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, labels, lse = ctx.saved_tensors
        tau, chunk, acc = ctx.temperature, ctx.chunk, lse.dtype
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        entropy = ctx.with_entropy and grad_ent is not None and grad_ent.numel() > 0
        for i in range(0, hidden.shape[0], chunk):
            j = min(i + chunk, hidden.shape[0])
            h = hidden[i:j]
            z = (h @ weight.t()).to(acc).div_(tau)
            p = z.sub(lse[i:j, None]).exp_()
            g_logp = grad_logp[i:j, None].to(acc)
            # ∂logp/∂z = onehot(y) − p;   ∂H/∂z = −p ⊙ (z − Σ_v p_v z_v); in place, two (c, V) buffers
            if entropy:
                z.sub_(torch.linalg.vecdot(p, z)[:, None]).mul_(p).mul_(-grad_ent[i:j, None].to(acc))
                gz = z.sub_(p.mul_(g_logp))
            else:
                gz = p.mul_(-g_logp)
            gz.scatter_add_(-1, labels[i:j, None], g_logp).div_(tau)  # z = h Wᵀ / τ
            if grad_h is not None:
                grad_h[i:j] = (gz @ weight.to(acc)).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(gz.t(), h.to(acc))
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def head_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0, chunk: int = 256,
                  entropy: bool = False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Log-probs (and entropies) of `labels` under softmax(hidden · weightᵀ / temperature), computed `chunk` tokens at
    a time in float32, forward and backward, so the (tokens, vocab) float32 logits exist for one chunk only: at 4,096
    tokens and a 151,936-token vocabulary the full logits alone are 2.5 GB, a 256-token chunk's 0.16 GB.

    hidden: (..., H) final hidden states (after the model's last norm); weight: (V, H) the LM head (no bias, as in
    Llama/Qwen); labels: (...) token ids -> logp (...) float32, entropy (...) float32 or None. Equal to
    `logprobs_from_logits(hidden @ weight.T, labels, temperature)` and `entropy_from_logits` up to float32 rounding,
    gradients included (tests/test_rl_math.py)."""
    if temperature <= 0 or chunk < 1:
        raise ValueError(f"temperature must be > 0 and chunk >= 1, got {temperature}, {chunk}")
    shape = labels.shape
    logp, ent = _HeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), float(temperature),
                                    int(chunk), entropy)  # fmt: skip
    return logp.view(shape), (ent.view(shape) if entropy else None)


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), as in OpenRLHF and TRL.

    β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n_steps / horizon): β grows while the measured KL is above the
    target and shrinks below it, by at most 20 % per `horizon` steps. n_steps is what OpenRLHF passes: the number of
    samples since the last update. Only β is state; target and horizon come from the script's Args.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """Constant KL coefficient β = kl_coef; same interface as AdaptiveKLController, update() does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, Eq. 13), added to the reward.

    With L = max_new_tokens and a buffer of B tokens:  0 for |y| ≤ L − B;  −factor · (|y| − (L − B)) / B inside the
    buffer, reaching −factor at |y| = L, the length of a response cut at the limit.

    lengths: (B,) response lengths in tokens -> (B,) penalties ≤ 0. buffer 0 disables it (all zeros)."""
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_new_tokens:
        raise ValueError(f"overlong buffer {buffer} > max_new_tokens {max_new_tokens}")
    start = max_new_tokens - buffer
    return -factor * ((lengths - start).clamp(min=0) / buffer).clamp(max=1.0)
