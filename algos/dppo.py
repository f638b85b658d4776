"""DPPO: Divergence Proximal Policy Optimization (Qi, Zhou, Liu, Pang, Du, Lin and Lee 2026, "Rethinking the Trust
Region in LLM Reinforcement Learning", arXiv:2602.04879).

GRPO's samples and advantages (G responses per prompt, A_i = (r_i − mean(r)) / (std(r) + ε)), with another trust
region. PPO's clip bounds the ratio of one sampled token, a one-sample estimate of how far the policy moved: a rare
token whose probability goes from 1e-4 to 1e-3 has ratio 10 and is clipped although almost nothing moved, while a
likely token that falls from 0.99 to 0.80 keeps ratio 0.81 and passes although a fifth of the mass moved. DPPO bounds
the divergence between the trained policy π_θ and the rollout policy μ (the engine that sampled the tokens) on the
binary distribution {o_t, not o_t} of each sampled token, p = π_θ(o_t | ...), q = μ(o_t | ...):

    D_TV(q, p) = |p − q|                                  D_KL(q, p) = q log(q / p) + (1 − q) log((1 − q) / (1 − p))

A token leaves the gradient when that divergence exceeds δ in the direction its advantage pushes (up for A > 0, down
for A < 0), and there is no ratio clip. With ρ_{i,t} = p / q against the rollout policy itself:

    M_{i,t} = 0  if  D(q, p) > δ  and  (A_i > 0 and p > q  or  A_i < 0 and p < q),   else 1
    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t M_{i,t} · ρ_{i,t} · A_i ]        ∇J = E[ 1/Σ|o_i| Σ_i Σ_t M_{i,t} · ρ_{i,t} · A_i ∇log p ]

`--algo.divergence tv|kl`, `--algo.delta` (None: the paper's 0.15 for TV, 0.05 for KL).

Deviations from the paper:
1. Token-mean loss over the whole batch, as the paper's 1/Σ|o_i|; `--algo.loss-agg` offers the others.
2. Groups whose rewards all agree carry no signal (A = 0) and are dropped before the update (`--algo.filter-zero-
   variance`), so the batch holds only informative samples (as DAPO's dynamic sampling, without refilling).
3. The KL penalty is off by default (`--algo.kl-coef 0`), as in DAPO and Dr.GRPO; no reference model is loaded then.
4. μ is the engine's own log-probs of the sampled tokens (`rollout_logp`), so DPPO needs no importance-sampling
   correction and the trainer computes no old log-probs: the ratio and the mask are against the sampler itself.
5. A mixture-of-experts actor's router load-balancing loss is logged (`loss/router_aux`), not trained on: J above is
   the objective (OpenRLHF's default `--aux_loss_coef 0`); add it to `loss` in `update` to keep the routing balanced.
6. The ratio's weight on ∇log p is capped at `--algo.ratio-cap` (20, detached): a token the engine sampled at
   q = 1e-5 may move to p = q + δ inside the region, and the uncapped weight 1.5e4 would be one token's whole step.
7. The default `--actor.lr` is 1e-4, not GRPO's 3e-4: without a ratio clip a step goes further. On the embedded task
   (warm start at pass@1 0.48, 2-core AMD EPYC, 2026-12-05), 3e-4 took the rollout reward from 0.38 to 0.15 at step 2
   and eval pass@1 to 0.714 at step 12; 1e-4 kept the reward at 0.36-0.52 and reached 0.776.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/dppo.py --train.max-steps 5 --eval.every 5
A real model:
    python algos/dppo.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
        --data.apply-chat-template --reward.func my_reward.py --rollout.max-new-tokens 1024 --actor.lr 1e-6
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
from core import config, flags, rl, rl_math, rollout, samples
from core import engine as ds_engine
from core.logger import Meter, timer
from core.placement import RayConfig, group
from core.rollout import VLLMConfig
from rewards.loader import RewardConfig, reward_group


@dataclass
class AlgoArgs:
    scale_by_std: bool = True
    """divide advantages by the group std (GRPO); off for Dr.GRPO."""
    dr_grpo: bool = False
    """Dr.GRPO: no std scaling and `seq-mean-token-sum-norm` aggregation (normaliser max-new-tokens)."""
    filter_zero_variance: bool = True
    """drop groups whose rewards are all equal (their advantages are 0)."""
    dynamic_filter_range: flags.OpenInterval | None = None
    """DAPO dynamic sampling: keep only groups whose mean score lies strictly inside (LOW, HIGH) (e.g. `0 1`: not
    all solved, not all failed) and refill the batch with more prompts; None disables."""
    dynamic_filter_max_rounds: flags.PosInt = 3
    """generation rounds per step at most when refilling; a batch still short after them trains on what it has."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """loss aggregation (see core/rl_math.aggregate_loss)."""
    divergence: Literal["tv", "kl"] = "tv"
    """the binary divergence between the rollout policy μ and π_θ on each sampled token: total variation |p − q| or
    KL(q ‖ p) over {o_t, not o_t}."""
    delta: flags.PosFloat | None = None
    """δ: a token whose divergence exceeds it, moved the way its advantage pushes, leaves the gradient. None: the
    paper's default for the divergence, 0.15 (tv) or 0.05 (kl)."""
    ratio_cap: flags.AboveOne | None = 20.0  # DEVIATION(6)
    """the largest weight ρ = p / q on a token's ∇log p (detached); None: uncapped."""
    entropy_coef: flags.NonNegFloat = 0.0
    """entropy bonus coefficient (0: off, no extra memory)."""
    kl_coef: flags.NonNegFloat = 0.0
    """β of the k3 KL penalty in the loss; 0 loads no reference model."""
    kl_target: flags.PosFloat | None = None
    """adaptive KL (Ziegler et al. 2019): β starts at kl-coef and is moved toward this per-token KL
    (`rl_math.AdaptiveKLController`, saved in checkpoints); None keeps β fixed."""
    kl_horizon: flags.PosInt = 10000
    """adaptive KL horizon in samples: β changes by at most 20 % per this many samples."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the penalty."""


# RECIPE: DPPO's setting on the embedded task (~1 M parameters), its `--help` defaults; a fork changes it here
# (the lr: 1e-4 where GRPO takes 3e-4, DEVIATION(7))
ACTOR = dict(lr=1e-4, lr_ref_samples=256, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, adam_betas=(0.9, 0.95))
ROLLOUT = dict(batch_size=64, n_samples=8)  # prompts per step, G samples per prompt (the group)
TRAIN = dict(max_steps=80, minibatches=2, epochs=1)  # RL steps, optimizer steps per rollout, passes over it


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    actor: config.ActorArgs = field(default_factory=lambda: config.ActorArgs(**ACTOR))
    ref: config.RefConfig = field(default_factory=config.RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: config.RolloutArgs = field(default_factory=lambda: config.RolloutArgs(**ROLLOUT))
    train: config.TrainArgs = field(default_factory=lambda: config.TrainArgs(**TRAIN))
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


# ALGO LOGIC: GRPO's advantage estimator.
def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-9):
    """A_i = (r_i − mean_group(r)) / (std_group(r) + eps), unbiased std; without scaling only the mean is removed.

    rewards: (B,) ordered prompt-major (samples i·G .. i·G+G−1 share a prompt) -> (B,)."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def groups_inside(scores: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic sampling: which groups have a mean score strictly inside (low, high), i.e. are neither all solved
    nor all failed (with 0-1 scores and the range (0, 1)). scores: (B,) prompt-major -> (B / group_size,) bool."""
    mean = scores.view(-1, group_size).mean(dim=1)
    return (mean > low) & (mean < high)


# ALGO LOGIC: the learning-rate schedule, the multiplier of --actor.lr at each optimizer step (CleanRL anneals by hand).
def lr_schedule(update: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over `warmup` optimizer steps, then cosine decay from 1 to `floor` at update `total`."""
    progress = min(1.0, (update - warmup) / max(1, total - warmup))  # of the decay, after the warm-up
    return (update + 1) / warmup if update < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ALGO LOGIC: the binary divergence between μ and π_θ on the sampled token, the trust region's measure.
def binary_divergence(p: torch.Tensor, q: torch.Tensor, divergence: str = "tv") -> torch.Tensor:
    """D(q, p) on the two outcomes {o_t, not o_t}, p = π_θ(o_t), q = μ(o_t): total variation |p − q| ("tv") or
    KL(q ‖ p) = q log(q / p) + (1 − q) log((1 − q) / (1 − p)) ("kl"; 0 · log 0 = 0). p, q: (...) -> (...)."""
    if divergence == "tv":
        return (p - q).abs()
    return torch.xlogy(q, q) - torch.xlogy(q, p) + torch.xlogy(1 - q, 1 - q) - torch.xlogy(1 - q, 1 - p)


# ALGO LOGIC: the loss of one micro-batch of (b, T) tensors, normalised by its whole minibatch's counts.
def policy_loss(logp, old_logp, adv, mask, *, divergence="tv", delta=0.15, ratio_cap=20.0, ent=None, entropy_coef=0.0,
                ref_logp=None, kl_coef=0.0, kl_estimator="k3",
                agg="token-mean", num_tokens=None, num_seqs=None, max_len=None):  # fmt: skip
    """J = M · ρ · A against the rollout policy (old_logp: μ's log-probs, DEVIATION(4)) − β·KL(π_θ‖π_ref) + entropy
    bonus; M drops a token whose binary divergence exceeds δ the way its advantage pushes. The loss's value is −M·ρ·A,
    its gradient −M · min(ρ, ratio_cap) · A · ∇log p (sg: the weight is a constant).

    Aggregated by `agg` with the whole minibatch's `num_tokens` / `num_seqs` / `max_len` (rl_math.aggregate_loss).
    logp (with gradient) and every other tensor: (b, T). Returns (loss to minimise, this micro-batch's metrics, the
    per-token tensors it computed and used: ratio, advantage, entropy, KL, for samples.jsonl)."""
    m = mask.bool()  # what lies off the mask (padding, NaN) reaches no gradient
    adv, logp, old_logp = torch.where(m, adv, 0.0), torch.where(m, logp, 0.0), torch.where(m, old_logp, 0.0)
    p, q = logp.detach().exp(), old_logp.exp()  # π_θ(o_t) and μ(o_t)
    div = binary_divergence(p, q, divergence)
    pushed = torch.where(adv > 0, p > q, p < q)  # moved the way its advantage pushes it
    keep = ~((div > delta) & pushed) & m  # M: inside the trust region, or moving back toward μ
    ratio = (logp - old_logp).clamp(max=20.0).exp()  # ρ = π_θ / μ, no clip (the exponent bounded against overflow)
    weight = ratio.detach() if ratio_cap is None else ratio.detach().clamp(max=ratio_cap)  # DEVIATION(6)
    pg = -torch.where(keep, adv * (ratio.detach() + weight * (logp - logp.detach())), 0.0)  # value −MρA, ∇ −MwA∇log p
    metrics = {"loss/clipfrac": rl_math.masked_mean((~keep).float(), mask),  # the tokens the region dropped
               "loss/divergence": rl_math.masked_mean(div, mask)}  # fmt: skip
    norm = {"num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    loss = rl_math.aggregate_loss(pg, mask, agg, **norm)  # DEVIATION(1): token-mean
    if ref_logp is not None:
        kl = rl_math.approx_kl(logp, ref_logp, kl_estimator, mask=mask)
        loss = loss + kl_coef * rl_math.aggregate_loss(kl, mask, agg, **norm)
        metrics["loss/kl"] = rl_math.masked_mean(kl, mask)
    if ent is not None:
        loss = loss - entropy_coef * rl_math.aggregate_loss(ent, mask, agg, **norm)
        metrics["loss/entropy"] = rl_math.masked_mean(ent, mask)
    used = {"ratio": ratio, "advantage": adv, "entropy": ent,  # per token, as the loss used them (samples.jsonl)
            "kl": kl if ref_logp is not None else None}
    return loss, metrics, used


def update(actor, ref, seqs: dict, adv: torch.Tensor, args: Args, run: rl.Run, step: int, kl_coef: float,
           trace: samples.Trace = samples.NO_TRACE) -> dict:  # fmt: skip
    """Minibatches of the loss over one rollout: reference log-probs first (by the trainer; the ratio's μ is the
    engine's), then `--train.epochs` passes of `--train.minibatches` optimizer steps; `trace` keeps what the loss saw
    of a few samples (samples.jsonl). seqs: (B, L) batch; adv: (B,) -> metrics."""
    mask, temp, world = seqs["loss_mask"], args.rollout.temperature, run.world
    adv_tok = adv[:, None].expand_as(mask).float()
    batches = rl.minibatches(seqs, args.train, step, run.rank, world)
    ref_logp = None if ref is None else rl.on_model(ref, rl.logp_table, seqs, args.train, temp, step, run=run)
    meter = Meter()
    # Dr.GRPO's constant normaliser is the generation budget, not the padded width of the batch
    max_len = args.rollout.max_new_tokens if args.algo.loss_agg == "seq-mean-token-sum-norm" else mask.shape[1]
    delta = args.algo.delta or {"tv": 0.15, "kl": 0.05}[args.algo.divergence]  # the paper's δ for each divergence
    loss_fn = partial(policy_loss, divergence=args.algo.divergence, delta=delta, ratio_cap=args.algo.ratio_cap,
                      entropy_coef=args.algo.entropy_coef, agg=args.algo.loss_agg,
                      max_len=max_len, kl_coef=kl_coef, kl_estimator=args.algo.kl_estimator)  # fmt: skip
    for _ in range(args.train.epochs):
        for k, (minibatch, micro) in enumerate(batches):  # normalisers: the whole minibatch, every rank
            norm = {"num_tokens": mask[minibatch].sum().item(), "num_seqs": len(minibatch)}
            for r, mb, real, last in rl.micro_batches(seqs, micro):
                logp, ent = rl.forward_logp(actor, mb, temp, args.algo.entropy_coef > 0)
                old = mb["rollout_logp"]  # DEVIATION(4): μ, the engine's log-probs of the tokens it sampled
                loss, metrics, used = loss_fn(logp, old, adv_tok[r], mb["loss_mask"],
                                              ent=ent, ref_logp=None if ref is None else ref_logp[r], **norm)  # fmt: skip
                trace.add(r, mb["loss_mask"], minibatch=k, logp=logp, old_logp=old, **used)  # what the loss used
                metrics |= rl.router_aux(actor)  # DEVIATION(5): a MoE router's balancing loss, logged, not added
                meter.add_loss("loss/policy", rl.backward(actor, loss, step, world, real, last))
                meter.add(metrics, mb["loss_mask"].sum().item() if real else 0.0)
            meter.add_step("train/grad_norm", ds_engine.optimizer_step(actor, step, "actor"))  # NaN/inf: raise
    return {**meter.result(world), "train/tokens": float(mask.sum())}


def main(args: Args, engines: rollout.RolloutEngines | None = None, groups: dict | None = None) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    config.check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if args.rollout.n_samples < 2:  # ALGO LOGIC: a group of one has no baseline
        raise ValueError(f"--rollout.n-samples {args.rollout.n_samples}: the group-relative advantage needs at least "
                         "2 samples per prompt (with --algo.filter-zero-variance every group of 1 is dropped)")  # fmt: skip
    # PLUMBING: --train.ranks 1: this process trains, beside an in-process engine; N: Ray ranks run this, engines given
    uses_ref = args.algo.kl_coef > 0  # ALGO LOGIC: the KL term needs the reference policy (DEVIATION(3))
    # PLUMBING: the models this script places on Ray ranks of their own with `--<role>.ranks N` (core places them)
    placed = {"ref": group(args.ref, unused=None if uses_ref else "the KL term is off: --algo.kl-coef 0"),
              "reward": reward_group(args.reward)}  # fmt: skip
    if engines is None:  # the files the episodes read (reward, agent, environment), checked before anything loads
        check_episode_files(args.rollout, args.reward)
        if rl.needs_launch(args.train, placed):
            return rl.launch(main, args, placed)
    rank, world, device = rl.init_rank(engines, args.ds, args.train.seed, args.run_dir)
    if args.algo.dr_grpo:
        args.algo.scale_by_std, args.algo.loss_agg = False, "seq-mean-token-sum-norm"
    tokenizer, train_set, eval_set = rl.load_task(args)
    reward = load_reward(args.rollout, args.reward, (groups or {}).get("reward"))  # None: the episodes reward themselves
    schedule = partial(lr_schedule, warmup=args.actor.warmup_steps, floor=args.actor.min_lr_ratio,
                       total=args.train.max_steps * args.train.minibatches * args.train.epochs)  # optimizer steps
    actor = rl.make_actor(args, device, rl.scaled_lr(args.actor, args.rollout, args.train), schedule)
    ref = rl.make_ref(args.ref, args.actor.model, device, groups, actor) if uses_ref else None  # LoRA: adapters off
    episodes = partial(make_executor, args.rollout, reward, args.actor.model.name_or_path, args.vllm.max_model_len)
    run = rl.start(args, {"actor": actor}, engines, tokenizer, eval_set, episodes, rank, world, device, args.exp_name)
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

        # 3. rewards and advantages
        rw = args.reward  # shaping: a truncated response's reward, DAPO's overlong penalty, clipping
        rewards, truncated = rl.shape_rewards(ro, rw.stop_properly_penalty, rw.overlong_buffer, rw.overlong_penalty_factor,
                                              args.rollout.max_new_tokens, rw.clip)  # fmt: skip
        # ALGO LOGIC: group-relative advantage, one scalar per response, broadcast to its tokens
        adv = group_advantages(rewards, G, scale_by_std=args.algo.scale_by_std)
        keep = torch.ones(len(ro.episodes), dtype=torch.bool)
        if args.algo.filter_zero_variance:  # DEVIATION(2): groups whose rewards all agree (A = 0) are dropped
            keep = (rewards.view(-1, G).std(dim=1) > 0).repeat_interleave(G)
        kept = keep.nonzero().flatten().tolist()
        stats = rl.rollout_stats(ro, rewards, truncated, keep)

        # 4. policy update on the kept samples (none kept: nothing trains, rl.end_step warns), a few of them traced
        trace = samples.Trace(samples.watch(keep, G, args.logger.samples), kept)
        with timer(perf, "perf/train_s"):
            seqs = rl.sequences([ro.episodes[i] for i in kept], tokenizer.pad_token_id, device, args.train.packing)
            stats.update(update(actor, ref, seqs, adv[kept].to(device), args, run, step, kl_ctl.value, trace=trace)
                         if kept else {})  # fmt: skip
        samples.log(run, step, ro, rewards, keep, trace, G, adv)  # -> samples.jsonl, a panel every show-every steps
        if "loss/kl" in stats:  # β for the next rollout
            kl_ctl.update(stats["loss/kl"], len(kept))

        # 5. weight sync, eval, logging, checkpoint
        with timer(perf, "perf/sync_s"):
            sample = [ro.episodes[i].prompt_ids + ro.episodes[i].token_ids for i in kept[:4]]
            examples = [ro.episodes[i].example for i in kept[:4]]  # their pictures, for a vision-language model
            stats.update(rl.sync_weights(run, actor, changed=bool(kept), sample=sample, examples=examples))
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
