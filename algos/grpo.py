"""GRPO: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

For each prompt q, sample a group of G responses o_1..o_G from the current policy, score them with a reward r_i and
use the group-normalised reward as every token's advantage (no critic):

    A_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + ε)                                  (unbiased std)

The policy maximises the PPO clipped surrogate with ratio ρ_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | ...):

    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_i) − β · KL_k3(π_θ ‖ π_ref) ]

Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), `--algo.dr-grpo`: no division by the group std and the
`seq-mean-token-sum-norm` aggregation (a constant normaliser instead of the response length).

Deviations from the paper:
1. Token-mean loss over the whole batch (DAPO, arXiv:2503.14476) instead of the per-sequence mean of the paper.
2. Groups whose rewards all agree carry no signal (A = 0) and are dropped before the update (`--algo.filter-zero-
   variance`), so the batch holds only informative samples (as DAPO's dynamic sampling, without refilling).
3. The KL penalty is off by default (`--algo.kl-coef 0`), as in DAPO and Dr.GRPO; no reference model is loaded then.
4. Old log-probs are recomputed by the trainer, not taken from vLLM: the engine's log-probs are kept as
   `rollout_logp` for the optional importance-sampling correction (`--algo.is-correction`).
5. A mixture-of-experts actor's router load-balancing loss is logged (`loss/router_aux`), not trained on: J above is
   the objective (OpenRLHF's default `--aux_loss_coef 0`); add it to `loss` in `update` to keep the routing balanced.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/grpo.py --train.max-steps 5 --eval.every 5
A real model:
    python algos/grpo.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
        --data.apply-chat-template --reward.func my_reward.py --rollout.max-new-tokens 1024 --actor.lr 1e-6
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import torch
import tyro

from core import engine as ds_engine
from core import models, rl, rl_math, rollout
from core.config import (
    ActorArgs,
    CkptConfig,
    DataConfig,
    DSConfig,
    EvalArgs,
    LoggerConfig,
    RefConfig,
    RolloutArgs,
    TrainArgs,  # fmt: skip
    check_args,
)
from core.logger import timer
from core.placement import RayConfig
from core.rollout import VLLMConfig
from rewards.loader import RewardConfig


@dataclass
class AlgoArgs:
    scale_by_std: bool = True
    """divide advantages by the group std (GRPO); off for Dr.GRPO."""
    dr_grpo: bool = False
    """Dr.GRPO: no std scaling and `seq-mean-token-sum-norm` aggregation (normaliser max-new-tokens)."""
    filter_zero_variance: bool = True
    """drop groups whose rewards are all equal (their advantages are 0)."""
    dynamic_filter_range: tuple[float, float] | None = None
    """DAPO dynamic sampling: keep only groups whose mean score lies strictly inside (LOW, HIGH) (e.g. `0 1`: not
    all solved, not all failed) and refill the batch with more prompts; None disables."""
    dynamic_filter_max_rounds: int = 3
    """generation rounds per step at most when refilling; a batch still short after them trains on what it has."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """loss aggregation (see core/rl_math.aggregate_loss)."""
    kl_coef: float = 0.0
    """β of the k3 KL penalty in the loss; 0 loads no reference model."""
    kl_target: float | None = None
    """adaptive KL (Ziegler et al. 2019): β starts at kl-coef and is moved toward this per-token KL
    (`rl_math.AdaptiveKLController`, saved in checkpoints); None keeps β fixed."""
    kl_horizon: int = 10000
    """adaptive KL horizon in samples: β changes by at most 20 % per this many samples."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the penalty."""
    is_correction: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """importance-sampling correction for the rollout engine's log-probs (see core/rl_math.policy_loss)."""
    is_threshold: tuple[float, float] = (0.5, 5.0)
    """[lo, hi] bounds of the IS weight."""


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    actor: ActorArgs = field(default_factory=ActorArgs)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutArgs = field(default_factory=RolloutArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    algo: AlgoArgs = field(default_factory=AlgoArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    data: DataConfig = field(default_factory=DataConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    ds: DSConfig = field(default_factory=DSConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
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


# ALGO LOGIC: the loss, per micro-batch of (b, T) tensors; `agg` holds the whole minibatch's normalisers.
def policy_loss(logp, old_logp, ref_logp, ent, adv, mb: dict, args: Args, kl_coef: float, agg: dict):
    """J = clipped surrogate (× IS weight) − β·KL_k3(π_θ‖π_ref) + entropy bonus, aggregated by `--algo.loss-agg`;
    returns (loss to minimise, per-token metrics of this micro-batch)."""
    mask = mb["loss_mask"]
    ratio = rl_math.importance_ratio(logp, old_logp, mask, args.actor.level)  # ρ = π_θ / π_old
    pg, clipped, _ = rl_math.clipped_surrogate(ratio, adv, args.actor.clip_low, args.actor.clip_high,
                                               args.actor.dual_clip)  # −min(ρA, clip(ρ)A)  # fmt: skip
    if args.algo.is_correction:  # DEVIATION(4): correct for the engine's own log-probs (π_old / π_vllm)
        pg = pg * rl_math.is_weight(old_logp, mb["rollout_logp"], mask, args.algo.is_correction, args.algo.is_threshold)
    loss = rl_math.aggregate_loss(pg, mask, args.algo.loss_agg, **agg)  # DEVIATION(1): token-mean
    metrics = {"loss/clipfrac": rl_math.masked_mean(clipped.float(), mask)}
    if ref_logp is not None:
        kl = rl_math.approx_kl(logp, ref_logp, args.algo.kl_estimator, mask=mask)
        loss = loss + kl_coef * rl_math.aggregate_loss(kl, mask, args.algo.loss_agg, **agg)
        metrics["loss/kl"] = rl_math.masked_mean(kl, mask)
    if ent is not None:
        loss = loss - args.actor.entropy_coef * rl_math.aggregate_loss(ent, mask, args.algo.loss_agg, **agg)
        metrics["loss/entropy"] = rl_math.masked_mean(ent, mask)
    return loss, metrics


def update(actor, ref, seqs: dict, adv: torch.Tensor, args: Args, run: rl.Run, step: int, kl_coef: float) -> dict:
    """Minibatches of the loss over one rollout: old and reference log-probs first (by the trainer), then
    `--train.epochs` passes of `--train.minibatches` optimizer steps. seqs: (B, L) batch; adv: (B,) -> metrics."""
    mask, temp, world = seqs["loss_mask"], args.rollout.temperature, run.world
    adv_tok = adv[:, None].expand_as(mask).float()
    batches = rl.minibatches(seqs, args, step, run.rank, world)
    mine = [m for _, micro in batches for m in micro]  # this rank's rows
    # one optimizer step per rollout: the policy is still the sampling policy when the loss is taken, so the old
    # log-probs are the live ones detached (ratio 1) and their extra forward pass is skipped
    on_policy = args.train.minibatches == 1 and args.train.epochs == 1
    old_logp = None if on_policy else rl.forward_rows(lambda b: rl.forward_logp(actor, b, temp)[0], seqs, mine, world, False)
    ref_logp = None if ref is None else rl.on_model(ref, rl.logp_table, seqs, args, step, run=run)  # or --ref.ranks
    meter = rl.Meter()
    for _ in range(args.train.epochs):
        for minibatch, micro in batches:
            agg = rl.agg_kwargs(mask, minibatch, args)
            for j, (r, real) in enumerate(micro):
                mb = rl.rows(seqs, r)
                logp, ent = rl.forward_logp(actor, mb, temp, args.actor.entropy_coef > 0)
                old = logp.detach() if on_policy else old_logp[r]
                ref_lp = None if ref_logp is None else ref_logp[r]
                loss, metrics = policy_loss(logp, old, ref_lp, ent, adv_tok[r], mb, args, kl_coef, agg)
                aux = models.router_aux_loss(actor)  # MoE: the router's load-balancing loss of this forward
                if aux is not None:  # DEVIATION(5): logged, not added
                    metrics["loss/router_aux"] = aux.detach()
                meter.add_loss("loss/policy", rl.backward(actor, loss, step, world, real, j == len(micro) - 1))
                meter.add(metrics, mb["loss_mask"].sum().item() if real else 0.0)
            meter.add_step("train/grad_norm", ds_engine.optimizer_step(actor, step, "actor"))  # NaN/inf: raise
    return {**meter.result(world), "train/tokens": float(mask.sum())}


def main(args: Args, engines: rollout.RolloutEngines | None = None, groups: dict | None = None) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if args.rollout.n_samples < 2:  # ALGO LOGIC: a group of one has no baseline
        raise ValueError(f"--rollout.n-samples {args.rollout.n_samples}: the group-relative advantage needs at least "
                         "2 samples per prompt (with --algo.filter-zero-variance every group of 1 is dropped)")  # fmt: skip
    # PLUMBING: `--train.ranks 1`: this process holds the DeepSpeed actor and an in-process vLLM engine. N > 1: the
    # driver starts Ray, the engine actors and N ranks, each of which runs this function with the engines given.
    if engines is None and rl.needs_launch(args):
        return rl.launch(main, args)
    rank, world, device = rl.init_rank(args, engines)
    if args.algo.dr_grpo:
        args.algo.scale_by_std, args.algo.loss_agg = False, "seq-mean-token-sum-norm"
    tokenizer, train_set, eval_set, reward = rl.load_task(args, groups)
    actor = rl.make_actor(args, device, args.train.max_steps * args.train.minibatches * args.train.epochs)
    ref = rl.make_ref(args, device, groups, actor)  # DEVIATION(3): only with --algo.kl-coef > 0 (LoRA: the actor)
    run = rl.start(args, {"actor": actor}, engines, tokenizer, eval_set, reward, rank, world, device, "grpo")
    kl_ctl = (rl_math.AdaptiveKLController(args.algo.kl_coef, args.algo.kl_target, args.algo.kl_horizon)
              if args.algo.kl_target else rl_math.FixedKLController(args.algo.kl_coef))  # fmt: skip
    kl_ctl.load_state_dict(run.client.get("kl_ctl", kl_ctl.state_dict()))
    G = args.rollout.n_samples
    keep_groups = None  # DAPO dynamic sampling: regenerate groups that are all solved or all failed
    if args.algo.dynamic_filter_range is not None:
        keep_groups = partial(groups_inside, group_size=G, low=args.algo.dynamic_filter_range[0],
                              high=args.algo.dynamic_filter_range[1])  # fmt: skip

    for step in range(run.start_step, args.train.max_steps):
        perf: dict = {}
        # 2. rollout: G episodes per prompt through the agent executor, token ids in, token ids + log-probs out
        with timer(perf, "perf/gen_s"):
            ro = rl.collect_rollout(run, args, train_set, step, keep=keep_groups)
        perf["perf/tokens_per_s"] = sum(len(e.token_ids) for e in ro.episodes) / max(perf["perf/gen_s"], 1e-9)

        # 3. rewards and advantages
        rewards, truncated = rl.shape_rewards(ro, args)
        # ALGO LOGIC: group-relative advantage, one scalar per response, broadcast to its tokens
        adv = group_advantages(rewards, G, scale_by_std=args.algo.scale_by_std)
        keep = torch.ones(len(ro.episodes), dtype=torch.bool)
        if args.algo.filter_zero_variance:  # DEVIATION(2): uninformative groups dropped
            keep = ~rl.zero_variance_groups(rewards, G)
        kept = keep.nonzero().flatten().tolist()
        stats = rl.rollout_stats(ro, rewards, truncated, keep)

        # 4. policy update on the kept samples: minibatches of the PPO-clipped loss
        with timer(perf, "perf/train_s"):
            if kept:
                seqs = rl.sequences([ro.episodes[i] for i in kept], tokenizer.pad_token_id, device, args.train.packing)
                stats.update(update(actor, ref, seqs, adv[kept], args, run, step, kl_ctl.value))
                if "loss/kl" in stats:
                    kl_ctl.update(stats["loss/kl"], len(kept))

        # 5. weight sync, eval, logging, checkpoint
        with timer(perf, "perf/sync_s"):
            sample = [ro.episodes[i].prompt_ids + ro.episodes[i].token_ids for i in kept[:4]]
            examples = [ro.episodes[i].example for i in kept[:4]]  # their pictures, for a vision-language model
            stats.update(rl.sync_weights(run, args, actor, changed=bool(kept), sample=sample, examples=examples))
        stats.update({"train/lr": actor.lr_scheduler.get_last_lr()[0], "train/kl_coef": kl_ctl.value, **perf})
        if rl.end_step(run, args, step, stats, state={"kl_ctl": kl_ctl.state_dict()}):
            return rl.finish(run, args, actor, tokenizer, halted_at=step)

    # 6. export, learning curve and summary
    return rl.finish(run, args, actor, tokenizer)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(tyro.cli(Args))
