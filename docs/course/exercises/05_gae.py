# Course exercise, lesson 5: A critic and GAE (PPO) (docs/course/05_gae.md).
# A copy of algos/ppo.py with the body of `gae` left for you to write; the rest is the
# real code and runs as the file it copies. Check your function, then a short learning run with it:
#     python docs/course/check.py 5 <this file>
# Written by docs/course/make_exercises.py from the real file; edit your own copy, not this one.
"""PPO with a learned critic and GAE for RLHF (Ouyang et al. 2022, InstructGPT, arXiv:2203.02155; Stiennon et al.
2020, arXiv:2009.01325), with the clipped surrogate of Schulman et al. 2017 (PPO, arXiv:1707.06347) and generalized
advantage estimation of Schulman et al. 2016 (GAE, arXiv:1506.02438).

A critic V_φ (a causal LM body with a scalar head) predicts the return at every response token. The scalar reward r_i
of response o_i becomes a per-token reward with a KL penalty against the frozen SFT policy (KL_t = log π_old(o_t|…) −
log π_ref(o_t|…), the k1 estimate), and GAE turns rewards and values into advantages and the critic's targets:

    r_{i,t}  = −β · KL_{i,t} + [t = |o_i|] · r_i
    δ_{i,t}  = r_{i,t} + γ · V_old(s_{i,t+1}) − V_old(s_{i,t}),      V_old(s_{i,|o_i|+1}) = 0
    Â_{i,t}  = Σ_{k≥t} (γλ)^{k−t} δ_{i,k},      R_{i,t} = Â_{i,t} + V_old(s_{i,t})           (the critic's target)
    A_{i,t}  = (Â_{i,t} − μ) / σ,   μ, σ over all valid tokens of the batch                  (advantage whitening)

The policy maximises the PPO clipped surrogate, ρ_{i,t} = π_θ(o_{i,t}|…) / π_old(o_{i,t}|…), and the critic minimises
the clipped value loss (Schulman et al. 2017's code; OpenRLHF's ValueLoss):

    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t min(ρ_{i,t} A_{i,t}, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_{i,t}) ]
    L(φ) = E[ 1/Σ|o_i| Σ_i Σ_t ½ · max((V_φ − R)², (V_old + clip(V_φ − V_old, −ε_v, ε_v) − R)²) ]

Deviations from the papers:
1. Token-mean loss over the whole batch (DAPO, arXiv:2503.14476; OpenRLHF's default), 2 minibatches per rollout; the
   critic is a second DeepSpeed engine with its own optimizer, stepped on the same minibatches (no shared body and no
   value-loss coefficient).
2. 8 samples per prompt by default, as this repository's GRPO, RLOO and REINFORCE++, so the four scripts generate the
   same rollouts; InstructGPT samples one response per prompt (`--rollout.n-samples 1`).
3. No in-loss KL term and no pretraining-mix (PPO-ptx) term: the KL penalty lives only in the reward
   (`--algo.kl-coef`, β = 0.01 here, fixed rather than adaptive); `--algo.kl-coef 0` loads no reference model.
4. Old log-probs are recomputed by the trainer, not taken from vLLM: the engine's log-probs are kept as
   `rollout_logp` for the optional importance-sampling correction (`--algo.is-correction`).
5. The critic is warm-started from the policy (the SFT model) with a fresh scalar head by default, as OpenRLHF allows;
   InstructGPT initialises it from the reward model (`--critic.name-or-path <rm folder>`).
6. A mixture-of-experts actor's router load-balancing loss is logged (`loss/router_aux`), not trained on: J above is
   the objective (OpenRLHF's default `--aux_loss_coef 0`); add it to `loss` in `update` to keep the routing balanced.

Multi-turn episodes (`--rollout.env-file`): the environment's feedback tokens are masked out of both losses, and GAE
skips them (V and A carried through unchanged), so the feedback is part of the transition between two model turns.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/ppo.py --train.max-steps 5 --eval.every 5
    python algos/ppo.py --critic.warmup-steps 5                     # critic-only updates for the first 5 steps
    python algos/ppo.py --rollout.env-file agents/retry_env.py      # multi-turn: environment feedback between turns
Several trainer ranks (Ray placement group, one DeepSpeed world of actor + critic engines, vLLM engine actors):
    python algos/ppo.py --train.ranks 2 --ds.zero-stage 3
A real model:
    python algos/ppo.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
        --data.apply-chat-template --reward.func my_reward.py --rollout.max-new-tokens 1024 --actor.lr 1e-6 \\
        --critic.lr 9e-6 --critic.name-or-path runs/my_rm/hf
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import tyro

from agents.make import check_episode_files, load_reward, make_executor
from core import config, flags, models, rl, rl_math, rollout, samples, sequence_parallel
from core import engine as ds_engine
from core.logger import Meter, timer
from core.placement import RayConfig, group
from core.rollout import VLLMConfig
from rewards.loader import RewardConfig, reward_group


@dataclass
class CriticArgs:
    name_or_path: flags.ModelPath | None = None  # DEVIATION(5): the SFT policy's body by default, not the reward model's
    """critic initialisation: a causal LM (fresh scalar head) or a reward model folder from algos/rm.py (its head is
    kept). Default: the actor's model, i.e. the SFT warm start. The dtype is the actor's."""
    lr: flags.PosFloat = 1e-3
    """peak learning rate of the critic (its own AdamW and warmup/cosine schedule)."""
    lr_warmup_steps: flags.NonNegInt = 0
    """linear learning-rate warmup of the critic's optimizer, in optimizer steps."""
    value_clip: flags.NonNegFloat | None = 0.2
    """ε_v: a new value may move at most this far from the rollout's value before its loss stops shrinking
    (PPO's value clipping); None turns it off."""
    warmup_steps: flags.NonNegInt = 0
    """critic-only steps at the start: the first N rollouts update the critic and leave the actor (and vLLM) as
    they are, so the policy gradient starts with a fitted baseline."""
    ranks: flags.PosInt | None = None
    """None: the critic lives in the trainer ranks (a second DeepSpeed engine of their world). N: a Ray group of its
    own, N ranks forming their own DeepSpeed world (`--ds.*` settings), OpenRLHF's layout; the trainer's rank 0
    sends it each rollout for its values and its update. A one-process run is launched through Ray for it."""
    colocate: bool = True
    """with `ranks`: rank i shares trainer rank i's placement bundle (at most `--train.ranks` ranks); off: bundles of
    its own."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    """with `ranks` and `no-colocate`: how its own bundles are placed over the nodes (see `--ray.strategy`, the
    default)."""
    lora_rank: flags.NonNegInt = 0
    """LoRA rank of the critic (its value head trains whole beside the adapters); 0 trains every parameter."""
    load_in_4bit: bool = False
    """QLoRA critic: its body's linears in 4-bit NF4, needs `lora-rank` > 0; ZeRO 0-2."""


@dataclass
class AlgoArgs:
    gamma: flags.Fraction = 1.0
    """discount γ of GAE over response tokens (1 in InstructGPT/OpenRLHF: the reward comes once, at the end)."""
    lam: flags.Fraction = 0.95
    """GAE λ (Schulman et al. 2016): 1 uses the full Monte-Carlo return, 0 the one-step TD error."""
    whiten_advantages: bool = True
    """normalise the advantages over every valid token of the batch (mean 0, std 1); the critic's targets are not."""
    dynamic_filter_range: flags.OpenInterval | None = None
    """DAPO dynamic sampling: keep only groups whose mean score lies strictly inside (LOW, HIGH) (e.g. `0 1`: not
    all solved, not all failed) and refill the batch with more prompts; None disables."""
    dynamic_filter_max_rounds: flags.PosInt = 3
    """generation rounds per step at most when refilling; a batch still short after them trains on what it has."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """loss aggregation of the policy and value losses (see core/rl_math.aggregate_loss)."""
    clip_low: flags.NonNegFloat = 0.2
    """ε_low: ratio lower clip 1 − ε_low."""
    clip_high: flags.NonNegFloat = 0.2
    """ε_high: ratio upper clip 1 + ε_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: flags.AboveOne | None = None
    """dual-clip constant c > 1 (Ye et al. 2020): bounds the loss of negative-advantage tokens at c·|A|."""
    level: Literal["token", "sequence"] = "token"
    """importance ratio per token (PPO/GRPO) or per sequence (GSPO, Zheng et al. 2025)."""
    entropy_coef: flags.NonNegFloat = 0.0
    """entropy bonus coefficient (0: off, no extra memory)."""
    kl_coef: flags.NonNegFloat = 0.01  # DEVIATION(3): the only KL term; none in the loss
    """β of the per-token KL penalty in the reward (Ziegler et al. 2019); 0 loads no reference model."""
    kl_target: flags.PosFloat | None = None
    """adaptive KL (Ziegler et al. 2019): β starts at kl-coef and is moved toward this per-token KL
    (`rl_math.AdaptiveKLController`, saved in checkpoints); None keeps β fixed."""
    kl_horizon: flags.PosInt = 10000
    """adaptive KL horizon in samples: β changes by at most 20 % per this many samples."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator for the reward penalty (k1 = log π_old/π_ref, InstructGPT's)."""
    is_correction: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """importance-sampling correction for the rollout engine's log-probs (core/rl_math.is_weight)."""
    is_threshold: flags.WeightBounds = (0.5, 5.0)
    """[lo, hi] bounds of the IS weight."""


# RECIPE: PPO's setting on the embedded task (~1 M parameters), its `--help` defaults; a fork changes it here
ACTOR = dict(lr=3e-4, lr_ref_samples=256, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, adam_betas=(0.9, 0.95))
ROLLOUT = dict(batch_size=64, n_samples=8)  # prompts per step, G samples per prompt (the group)
TRAIN = dict(max_steps=30, minibatches=2, epochs=1)  # RL steps, optimizer steps per rollout, passes over it


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    actor: config.ActorArgs = field(default_factory=lambda: config.ActorArgs(**ACTOR))
    ref: config.RefConfig = field(default_factory=config.RefConfig)
    critic: CriticArgs = field(default_factory=CriticArgs)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: config.RolloutArgs = field(default_factory=lambda: config.RolloutArgs(**ROLLOUT))  # DEVIATION(2): G = 8 (InstructGPT: 1)
    train: config.TrainArgs = field(default_factory=lambda: config.TrainArgs(**TRAIN))  # max-steps counts the critic warm-up
    algo: AlgoArgs = field(default_factory=AlgoArgs)
    eval: config.EvalArgs = field(default_factory=config.EvalArgs)
    data: config.DataConfig = field(default_factory=config.DataConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    ds: config.DSConfig = field(default_factory=config.DSConfig)
    ckpt: config.CkptConfig = field(default_factory=config.CkptConfig)
    logger: config.LoggerConfig = field(default_factory=config.LoggerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    run_dir: str | None = None
    """run folder; default `<logger.run-root>/<exp_name>__<seed>__<time>`. An existing one resumes."""
    debug: bool = False
    """after every weight sync, check that the engine's log-probs equal the trainer's."""


# ALGO LOGIC: PPO's advantage estimator: KL-shaped token rewards, GAE with the critic's values, whitening.
@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438), as in OpenRLHF's PPO.

    δ_t = r_t + γ·V_{t'} − V_t,   A_t = δ_t + γλ·A_{t'},   R_t = A_t + V_t (the critic's target),
    where t' is the next *valid* position after t (V = 0, A = 0 after the last one). Masked positions are skipped,
    not treated as steps: with right padding every sequence ends at its own last valid token, and in a multi-turn
    episode the environment's feedback tokens (masked out, between two turns of the model) are part of the
    transition from the last token of one turn to the first of the next. rewards, values, mask: (B, T) ->
    (advantages, returns), both (B, T), 0 at masked positions, without gradient (they are targets). A loop over T,
    vectorised over B.
    """
    # YOUR CODE HERE: the docstring above says what to return (lesson 5).
    raise NotImplementedError("lesson 5: write gae")


def ppo_advantages(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, R) = gae(r, V),  r_t = −kl_coef · kl_t + [t = last] · reward;  A whitened over the batch's valid tokens.

    rewards: (B,) one scalar per response; kl: (B, T) per-token KL estimate; values: (B, T) the rollout critic's
    V(s_t), the value of the state before token t; mask: (B, T) response mask -> advantages (B, T) (whitened when
    `whiten`) and returns R = Â + V (B, T), the critic's targets (never whitened); both 0 at masked positions."""
    if (
        rewards.dim() != 1
        or kl.dim() != 2
        or not kl.shape == values.shape == mask.shape == (rewards.numel(), kl.shape[1])
    ):
        raise ValueError(f"shapes: rewards (B,), kl, values and mask (B, T); got rewards {tuple(rewards.shape)}, kl "
                         f"{tuple(kl.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)}")  # fmt: skip
    # the script already clipped the raw reward to ±reward.clip, so no second clip here
    per_token = rl_math.token_rewards(rewards, kl, kl_coef, mask, clip_range=None)  # (B, T)
    advantages, returns = gae(per_token, values, mask, gamma, lam)  # (B, T), (B, T)
    if whiten:
        advantages = rl_math.masked_whiten(advantages, mask)
    return advantages, returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over the valid tokens (population variances): 1 is a perfect critic, 0 one no better
    than the batch mean, < 0 one worse than it. values, returns, mask: (B, T) -> scalar; NaN when Var(R) = 0 (as
    CleanRL's ppo.py)."""
    mask = mask.bool()
    v, r = values[mask].double(), returns[mask].double()
    var_r = r.var(unbiased=False) if r.numel() else torch.tensor(0.0, dtype=torch.float64)
    if var_r == 0:
        return torch.tensor(float("nan"))
    return (1 - (r - v).var(unbiased=False) / var_r).float()


def groups_inside(scores: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic sampling: which groups have a mean score strictly inside (low, high), i.e. are neither all solved
    nor all failed (with 0-1 scores and the range (0, 1)). scores: (B,) prompt-major -> (B / group_size,) bool."""
    mean = scores.view(-1, group_size).mean(dim=1)
    return (mean > low) & (mean < high)


def make_critic(args: Args, total_updates: int, device: torch.device):
    """V_φ: a causal LM body + scalar head (`--critic.name-or-path`, default the actor's model) as a second DeepSpeed
    engine with its own AdamW and warmup/cosine schedule. A fresh head is drawn from `--train.seed`, the same on
    every rank and wherever the critic lives. models.TokenValues returns per-token values from the engine's own
    forward (ZeRO-3 accumulation)."""
    flag = "--critic.name-or-path" if args.critic.name_or_path else "--actor.model.name-or-path"
    models.check_4bit_training(args.critic.load_in_4bit, args.critic.lora_rank, "--critic.")
    with torch.random.fork_rng(devices=[]):  # the head from --train.seed alone: the same in the critic's own group
        torch.manual_seed(args.train.seed)
        body = models.load_scalar_model(args.critic.name_or_path or args.actor.model.name_or_path,
                                        args.actor.model.dtype, args.actor.model.attn_implementation, flag,
                                        args.critic.load_in_4bit, args.critic.lora_rank)  # fmt: skip
    critic = models.TokenValues(body).to(device)
    sequence_parallel.setup(critic, args.train.sp_size)  # --train.sp-size N: its forwards split the rows as the actor's
    schedule = partial(lr_schedule, warmup=args.critic.lr_warmup_steps, total=total_updates, floor=0.1)  # its own
    return ds_engine.make_engine(critic, args.ds, args.critic.lr, schedule, hybrid=args.vllm.enable_sleep)


def forward_values(critic, batch: dict) -> torch.Tensor:
    """Values (B, L) aligned with forward_logp: position t holds V(x_<t), the critic's value of the state before
    token t is generated (the scalar head on hidden state t − 1); 0 at position 0 and at padding."""
    inputs, index = rl.model_inputs(critic, batch)  # packed padding-free, as the actor's passes
    if sequence_parallel.sp_group(critic) is None:
        return rl.previous_token(critic(**inputs), index)  # models.TokenValues: (R, W) -> (B, L)
    return rl.previous_token(sequence_parallel.token_values(critic, inputs), index)  # each rank 1/N of the tokens


def values_table(critic, rank: int, world: int, seqs: dict, args: Args, step: int) -> torch.Tensor:
    """V_old (B, L) of every row of the rollout: each rank its micro-batches, summed over the world (`rl.on_model`)."""
    mine = [m for _, micro in rl.minibatches(seqs, args.train, step, rank, world) for m in micro]
    return rl.forward_rows(partial(forward_values, critic), seqs, mine, world, True, args.train.sp_size)


# ALGO LOGIC: the critic's loss and update, ½ max((V − R)², (V_clip − R)²), one optimizer step per minibatch
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = None,
    agg: str = "token-mean",
    **agg_kwargs: int | float | torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss with PPO-style value clipping (OpenRLHF's ValueLoss; TRL's cliprange_value).

    ℓ_t = ½ · max((V_clip − R)², (V − R)²),  V_clip = V_old + clamp(V − V_old, −clip_eps, clip_eps);
    ℓ_t = ½ · (V − R)² when clip_eps is None.  loss = aggregate_loss(ℓ, mask, agg, **agg_kwargs).
    values: (B, T) with gradient; old_values, returns, mask: (B, T), used detached. Returns (loss, stats), stats
    detached: clipfrac (fraction of valid tokens where V was clamped and the clipped term is the larger one),
    values_mean.
    """
    mask = mask.bool()
    values = torch.where(mask, values, 0.0)
    old_values, returns = torch.where(mask, old_values, 0.0).detach(), torch.where(mask, returns, 0.0).detach()
    err = (values - returns).square()
    if clip_eps is None:
        loss, clipped = 0.5 * err, torch.zeros_like(mask)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clipped = (values_clipped - returns).square()
        # clipped only where the clamp moved V: inside the range V_clip = V_old + (V − V_old) can differ from V in the
        # last bit, and that rounding would count as clipping (and depend on the micro-batch's BLAS blocking)
        moved = (values - old_values).abs() > clip_eps
        loss, clipped = 0.5 * torch.max(err_clipped, err), (err_clipped > err) & moved
    stats = {
        "clipfrac": rl_math.masked_mean(clipped.float(), mask).detach(),
        "values_mean": rl_math.masked_mean(values.detach(), mask),
    }
    return rl_math.aggregate_loss(loss, mask, agg, **agg_kwargs), stats


def critic_update(critic, rank: int, world: int, seqs: dict, old_values, returns, args: Args, step: int) -> dict:
    """`--train.epochs` passes of the clipped value loss over the step's minibatches (this rank's micro-batches of
    each). It needs nothing from the actor's update (the targets are fixed), so it runs before it, in the trainer
    ranks or in the critic's own group (`rl.on_model`). seqs, old_values, returns: (B, L) -> critic metrics."""
    mask, meter = seqs["loss_mask"], Meter()
    max_len = args.rollout.max_new_tokens if args.algo.loss_agg == "seq-mean-token-sum-norm" else mask.shape[1]
    for _ in range(args.train.epochs):
        for minibatch, micro in rl.minibatches(seqs, args.train, step, rank, world):
            norm = {"num_tokens": mask[minibatch].sum().item(), "num_seqs": len(minibatch), "max_len": max_len}
            for r, mb, real, last in rl.micro_batches(seqs, micro):
                values = forward_values(critic, mb)
                vloss, vstats = value_loss(values, old_values[r], returns[r], mb["loss_mask"],
                                           args.critic.value_clip, args.algo.loss_agg, **norm)  # fmt: skip
                meter.add_loss("loss/value", rl.backward(critic, vloss, step, world, real, last, "critic value loss"),
                               "critic/grad_norm")
                meter.add({"critic/clipfrac": vstats["clipfrac"]}, mb["loss_mask"].sum().item() if real else 0.0)
            meter.add_step("critic/grad_norm", ds_engine.optimizer_step(critic, step, "critic"))  # NaN/inf: raise
    return {**meter.result(world), "critic/lr": critic.lr_scheduler.get_last_lr()[0]}


# ALGO LOGIC: the learning-rate schedule, the multiplier of --actor.lr at each optimizer step (CleanRL anneals by hand).
def lr_schedule(update: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over `warmup` optimizer steps, then cosine decay from 1 to `floor` at update `total`."""
    progress = min(1.0, (update - warmup) / max(1, total - warmup))  # of the decay, after the warm-up
    return (update + 1) / warmup if update < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ALGO LOGIC: the loss of one micro-batch of (b, T) tensors, normalised by its whole minibatch's counts.
def policy_loss(logp, old_logp, adv, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None, level="token",
                rollout_logp=None, is_correction=None, is_threshold=(0.5, 5.0), ent=None, entropy_coef=0.0,
                agg="token-mean", num_tokens=None, num_seqs=None, max_len=None):  # fmt: skip
    """J = clipped surrogate (× IS weight) + entropy bonus; no KL term (DEVIATION(3): the KL penalty is in the reward).

    Aggregated by `agg` with the whole minibatch's `num_tokens` / `num_seqs` / `max_len` (rl_math.aggregate_loss).
    logp (with gradient) and every other tensor: (b, T). Returns (loss to minimise, this micro-batch's metrics, the
    per-token tensors it computed and used: ratio, advantage, entropy, KL, for samples.jsonl)."""
    adv = torch.where(mask.bool(), adv, 0.0)  # what lies off the mask reaches no gradient (a GSPO ratio spans it)
    ratio = rl_math.importance_ratio(logp, old_logp, mask, level)  # ρ = π_θ / π_old (per sequence: GSPO)
    surr, surr_clipped = ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    pg = -torch.min(surr, surr_clipped)  # −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)·A)
    metrics = {"loss/clipfrac": rl_math.masked_mean((surr_clipped < surr).float(), mask)}
    if dual_clip is not None:  # dual clip (Ye et al. 2020): where A < 0 the loss is at most −c·A
        metrics["loss/dual_clipfrac"] = rl_math.masked_mean(((adv < 0) & (pg > -dual_clip * adv)).float(), mask)
        pg = torch.where(adv < 0, torch.min(pg, -dual_clip * adv), pg)
    if is_correction:  # DEVIATION(4): correct for the engine's own log-probs, w = π_old / π_vllm (detached)
        w = rl_math.is_weight(old_logp, rollout_logp, mask, is_correction, is_threshold)
        pg, metrics["loss/is_weight"] = pg * w, rl_math.masked_mean(w, mask)
    norm = {"num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    loss = rl_math.aggregate_loss(pg, mask, agg, **norm)  # DEVIATION(1): token-mean
    if ent is not None:
        loss = loss - entropy_coef * rl_math.aggregate_loss(ent, mask, agg, **norm)
        metrics["loss/entropy"] = rl_math.masked_mean(ent, mask)
    used = {"ratio": ratio, "advantage": adv, "entropy": ent}  # per token, as the loss used them (samples.jsonl)
    return loss, metrics, used


def update(actor, critic, ref, seqs: dict, rewards: torch.Tensor, args: Args, run: rl.Run, step: int, kl_coef: float,
           trace: samples.Trace = samples.NO_TRACE):  # fmt: skip
    """Both updates over one rollout: old log-probs, V_old and reference log-probs of every row first (GAE and the
    whitening are global, so every rank gets every row), the advantages and the critic's targets, then the critic's
    `--train.epochs` passes of `--train.minibatches` steps and, after the critic warm-up (step ≥
    --critic.warmup-steps), the actor's; `trace` keeps what the loss saw of a few samples (samples.jsonl).
    seqs: (B, L) batch; rewards: (B,) -> metrics."""
    mask, temp, world = seqs["loss_mask"], args.rollout.temperature, run.world
    batches = rl.minibatches(seqs, args.train, step, run.rank, world)
    mine = [m for _, micro in batches for m in micro]  # this rank's rows
    old_logp = rl.forward_rows(lambda b: rl.forward_logp(actor, b, temp)[0], seqs, mine, world, True,
                               args.train.sp_size)  # every row on every rank  # fmt: skip
    old_values = rl.on_model(critic, values_table, seqs, args, step, run=run)  # trainer ranks or --critic.ranks
    ref_logp = None if ref is None else rl.on_model(ref, rl.logp_table, seqs, args.train, temp, step, run=run)
    out, kl = {"critic/warmup": float(step < args.critic.warmup_steps)}, torch.zeros_like(old_logp)
    if ref_logp is not None:  # KL_t of the sampling policy to the reference, on the sampled tokens
        kl = rl_math.approx_kl(old_logp, ref_logp, args.algo.kl_estimator, mask=mask)
        out["loss/kl"] = rl_math.masked_mean(kl, mask).item()
    # ALGO LOGIC: KL-shaped token rewards -> GAE with the rollout critic's values -> whitened advantages
    adv, returns = ppo_advantages(rewards.to(mask.device), kl, old_values, mask, kl_coef, args.algo.gamma,
                                  args.algo.lam, args.algo.whiten_advantages)  # fmt: skip
    out.update({"critic/values_mean": rl_math.masked_mean(old_values, mask).item(),
                "critic/returns_mean": rl_math.masked_mean(returns, mask).item(),
                "critic/explained_variance": explained_variance(old_values, returns, mask).item()})  # fmt: skip
    out.update(rl.on_model(critic, critic_update, seqs, old_values, returns, args, step, run=run))
    meter = Meter()
    # Dr.GRPO's constant normaliser is the generation budget, not the padded width of the batch
    max_len = args.rollout.max_new_tokens if args.algo.loss_agg == "seq-mean-token-sum-norm" else mask.shape[1]
    loss_fn = partial(policy_loss, clip_low=args.algo.clip_low, clip_high=args.algo.clip_high,
                      dual_clip=args.algo.dual_clip, level=args.algo.level, is_correction=args.algo.is_correction,
                      is_threshold=args.algo.is_threshold, entropy_coef=args.algo.entropy_coef, agg=args.algo.loss_agg,
                      max_len=max_len)  # fmt: skip
    for _ in range(args.train.epochs if step >= args.critic.warmup_steps else 0):  # warm-up: the actor waits
        for k, (minibatch, micro) in enumerate(batches):  # normalisers: the whole minibatch, every rank
            norm = {"num_tokens": mask[minibatch].sum().item(), "num_seqs": len(minibatch)}
            for r, mb, real, last in rl.micro_batches(seqs, micro):
                logp, ent = rl.forward_logp(actor, mb, temp, args.algo.entropy_coef > 0)
                loss, metrics, used = loss_fn(logp, old_logp[r], adv[r], mb["loss_mask"], rollout_logp=mb["rollout_logp"],
                                              ent=ent, **norm)  # fmt: skip
                trace.add(r, mb["loss_mask"], minibatch=k, logp=logp, old_logp=old_logp[r], **used, value=old_values[r],
                          kl=None if ref is None else kl[r])  # the KL its token rewards used  # fmt: skip
                metrics |= rl.router_aux(actor)  # DEVIATION(6): a MoE router's balancing loss, logged, not added
                meter.add_loss("loss/policy", rl.backward(actor, loss, step, world, real, last, "actor loss"))
                meter.add(metrics, mb["loss_mask"].sum().item() if real else 0.0)
            meter.add_step("train/grad_norm", ds_engine.optimizer_step(actor, step, "actor"))  # NaN/inf: raise
    return {**out, **meter.result(world), "train/tokens": float(mask.sum())}


def main(args: Args, engines: rollout.RolloutEngines | None = None, groups: dict | None = None) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    config.check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if not 0 <= args.critic.warmup_steps < args.train.max_steps:  # ALGO LOGIC: the actor must train at least once
        raise ValueError(f"--critic.warmup-steps {args.critic.warmup_steps} must be in [0, --train.max-steps "
                         f"{args.train.max_steps}): the actor would never be trained")  # fmt: skip
    if args.data.image_key:  # the critic's scalar-head forward (core.models.TokenValues) takes no pictures
        raise ValueError("--data.image-key: ppo.py's critic does not see pictures; use grpo.py, rloo.py or "
                         "reinforce_pp.py")  # fmt: skip
    # PLUMBING: `--train.ranks 1`: this process holds the DeepSpeed actor and critic and an in-process vLLM engine.
    # N > 1: the driver starts Ray, the engine actors and N ranks, each of which runs this function with the engines
    # given and holds an actor and a critic engine of the same DeepSpeed world.
    uses_ref = args.algo.kl_coef > 0  # ALGO LOGIC: the KL term needs the reference policy (DEVIATION(3))
    # PLUMBING: the models this script places on Ray ranks of their own with `--<role>.ranks N` (core places them)
    placed = {"ref": group(args.ref, unused=None if uses_ref else "the KL term is off: --algo.kl-coef 0"),
              "critic": group(args.critic),
              "reward": reward_group(args.reward)}  # fmt: skip
    if engines is None:  # the files the episodes read (reward, agent, environment), checked before anything loads
        check_episode_files(args.rollout, args.reward)
        if rl.needs_launch(args.train, placed):
            return rl.launch(main, args, placed)
    rank, world, device = rl.init_rank(engines, args.ds, args.train.seed, args.run_dir)
    tokenizer, train_set, eval_set = rl.load_task(args)
    reward = load_reward(args.rollout, args.reward, (groups or {}).get("reward"))  # None: the episodes reward themselves
    updates = args.train.minibatches * args.train.epochs  # per step, of the actor and of the critic
    schedule = partial(lr_schedule, warmup=args.actor.warmup_steps, floor=args.actor.min_lr_ratio,
                       total=(args.train.max_steps - args.critic.warmup_steps) * updates)  # the actor's optimizer steps
    actor = rl.make_actor(args, device, rl.scaled_lr(args.actor, args.rollout, args.train), schedule)
    critic = rl.build_model(groups, "critic", make_critic, device, args, args.train.max_steps * updates)  # DEVIATION(5)
    ref = rl.make_ref(args.ref, args.actor.model, device, groups, actor) if uses_ref else None  # LoRA: adapters off
    episodes = partial(make_executor, args.rollout, reward, args.actor.model.name_or_path, args.vllm.max_model_len)
    run = rl.start(args, {"actor": actor, "critic": critic}, engines, tokenizer, eval_set, episodes, rank, world,
                   device, args.exp_name)  # fmt: skip
    kl_ctl = (rl_math.AdaptiveKLController(args.algo.kl_coef, args.algo.kl_target, args.algo.kl_horizon)
              if args.algo.kl_target else rl_math.FixedKLController(args.algo.kl_coef))  # fmt: skip
    kl_ctl.load_state_dict(run.client.get("kl_ctl", kl_ctl.state_dict()))
    G = args.rollout.n_samples
    bounds = args.algo.dynamic_filter_range  # DAPO dynamic sampling: regenerate groups all solved or all failed
    refill = None if bounds is None else partial(rl.refill, keep=partial(groups_inside, group_size=G, low=bounds[0],
                                                 high=bounds[1]), max_rounds=args.algo.dynamic_filter_max_rounds)

    for step in range(run.start_step, args.train.max_steps):
        perf: dict = {}
        # 2. rollout: G episodes per prompt through the agent executor, token ids in, token ids + log-probs out
        with timer(perf, "perf/gen_s"):
            ro = rl.collect_rollout(run, args.rollout, train_set, step, refill)  # refill: the script's policy
        perf["perf/tokens_per_s"] = sum(len(e.token_ids) for e in ro.episodes) / max(perf["perf/gen_s"], 1e-9)

        # 3. rewards (the advantages need the critic's values: GAE runs in `update`)
        rw = args.reward  # shaping: a truncated response's reward, DAPO's overlong penalty, clipping
        rewards, truncated = rl.shape_rewards(ro, rw.stop_properly_penalty, rw.overlong_buffer, rw.overlong_penalty_factor,
                                              args.rollout.max_new_tokens, rw.clip)  # fmt: skip
        keep = torch.ones(len(ro.episodes), dtype=torch.bool)  # no filter: PPO trains on every sample
        stats = rl.rollout_stats(ro, rewards, truncated, keep)

        # 4. critic and policy update: GAE, then minibatches of the clipped value loss and (after the warm-up) the
        # PPO-clipped loss; the loss mask is the episodes' action mask (multi-turn feedback: 0, GAE carries through)
        trace = samples.Trace(samples.watch(keep, G, args.logger.samples), list(range(len(keep))))
        with timer(perf, "perf/train_s"):
            seqs = rl.sequences(ro.episodes, tokenizer.pad_token_id, device, args.train.packing)
            stats.update(update(actor, critic, ref, seqs, rewards, args, run, step, kl_ctl.value, trace=trace))
        samples.log(run, step, ro, rewards, keep, trace, G)  # -> samples.jsonl, a panel every show-every steps
        if "loss/kl" in stats:  # β for the next rollout
            kl_ctl.update(stats["loss/kl"], len(ro.episodes))

        # 5. weight sync, eval, logging, checkpoint
        with timer(perf, "perf/sync_s"):
            # during the critic warm-up vLLM already holds the actor's weights, unless sleep level 2 dropped them
            changed = step >= args.critic.warmup_steps or (args.vllm.enable_sleep and args.vllm.sleep_level == 2)
            sample = [e.prompt_ids + e.token_ids for e in ro.episodes[:4]]
            stats.update(rl.sync_weights(run, actor, changed=changed, sample=sample))
        stats.update({"train/lr": actor.lr_scheduler.get_last_lr()[0], "train/kl_coef": kl_ctl.value, **perf})
        if rl.end_step(run, args.eval, args.ckpt, step, stats, state={"kl_ctl": kl_ctl.state_dict()}):
            return rl.finish(run, actor, tokenizer, halted_at=step)

    # 6. export, learning curve and summary
    return rl.finish(run, actor, tokenizer)


if __name__ == "__main__":
    from core.noise import quiet_libraries

    quiet_libraries()  # PLUMBING: library messages to <run>/run.log (--logger.verbose: on the console)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(tyro.cli(Args))
