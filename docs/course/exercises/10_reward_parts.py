# Course exercise, lesson 10: Rewards with several parts (GDPO) (docs/course/10_reward_parts.md).
# A copy of algos/gdpo.py with the body of `gdpo_advantages` left for you to write; the rest is the
# real code and runs as the file it copies. Check your function, then a short learning run with it:
#     python docs/course/check.py 10 <this file>
# Written by docs/course/make_exercises.py from the real file; edit your own copy, not this one.
"""GDPO: Group reward-Decoupled Normalization Policy Optimization (Liu et al. 2026, arXiv:2601.05242).

GRPO's samples and clipped surrogate, with another advantage for rewards that have several parts (correctness, format,
length, ...). GRPO normalises the sum of the parts within each group; two groups whose sums differ in scale but not in
order then get the same advantages (rewards (0, 2) and (0, 1): both (−0.71, 0.71)), and a part that varies little is
drowned by one that varies much. GDPO normalises each part k within its group first, sums them with weights w_k, and
whitens the sum over the batch:

    Â_i^k = (r_i^k − mean_group(r^k)) / (std_group(r^k) + ε)                             (each part on its own)
    A_i   = Σ_k w_k · Â_i^k,      A_i ← (A_i − mean_batch(A)) / (std_batch(A) + ε)        (then the whole batch)

    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_i) − β · KL_k3(π_θ ‖ π_ref) ]

The parts come from the reward function's `components` (rewards/loader.py's contract: `{"rewards": ..., "components":
{"correct": [...], "digits": [...]}}`); the default reward is rewards/arithmetic_parts.py (exact match and per-digit
partial credit on the embedded task). `--algo.component-weights correct 1 digits 0.5`; None weighs every part 1.

Deviations from the paper:
1. Token-mean loss over the whole batch (DAPO, arXiv:2503.14476) instead of the per-sequence mean of the paper.
2. Groups in which no part varies carry no signal (every Â = 0) and are dropped before the update (`--algo.filter-zero-
   variance`); the batch whitening runs over the kept samples, the batch that trains.
3. The KL penalty is off by default (`--algo.kl-coef 0`), as in DAPO and Dr.GRPO; no reference model is loaded then.
4. Old log-probs are recomputed by the trainer, not taken from vLLM: the engine's log-probs are kept as
   `rollout_logp` for the optional importance-sampling correction (`--algo.is-correction`).
5. A mixture-of-experts actor's router load-balancing loss is logged (`loss/router_aux`), not trained on: J above is
   the objective (OpenRLHF's default `--aux_loss_coef 0`); add it to `loss` in `update` to keep the routing balanced.
6. `--reward.*` shaping (a truncated response's reward, the overlong penalty, the clip) applies to the scalar reward
   that is logged (`rollout/reward_mean`), not to the parts GDPO normalises.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/gdpo.py --train.max-steps 5 --eval.every 5
A real model:
    python algos/gdpo.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
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
from rewards import arithmetic_parts
from rewards.loader import RewardConfig, reward_group


@dataclass
class AlgoArgs:
    component_weights: dict[str, float] | None = None
    """w_k of each reward part, by the names the reward function gives its `components` (`correct 1 digits 0.5`);
    every part the function returns must have one. None: every part weighs 1."""
    filter_zero_variance: bool = True
    """drop groups in which no reward part varies (their advantages are 0)."""
    dynamic_filter_range: flags.OpenInterval | None = None
    """DAPO dynamic sampling: keep only groups whose mean score lies strictly inside (LOW, HIGH) (e.g. `0 1`: not
    all solved, not all failed) and refill the batch with more prompts; None disables."""
    dynamic_filter_max_rounds: flags.PosInt = 3
    """generation rounds per step at most when refilling; a batch still short after them trains on what it has."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """loss aggregation (see core/rl_math.aggregate_loss)."""
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
    kl_coef: flags.NonNegFloat = 0.0
    """β of the k3 KL penalty in the loss; 0 loads no reference model."""
    kl_target: flags.PosFloat | None = None
    """adaptive KL (Ziegler et al. 2019): β starts at kl-coef and is moved toward this per-token KL
    (`rl_math.AdaptiveKLController`, saved in checkpoints); None keeps β fixed."""
    kl_horizon: flags.PosInt = 10000
    """adaptive KL horizon in samples: β changes by at most 20 % per this many samples."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the penalty."""
    is_correction: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """importance-sampling correction for the rollout engine's log-probs (core/rl_math.is_weight)."""
    is_threshold: flags.WeightBounds = (0.5, 5.0)
    """[lo, hi] bounds of the IS weight."""


PARTS = arithmetic_parts.__file__  # the embedded task's two reward parts (exact match, per-digit credit)


# RECIPE: GDPO's setting on the embedded task (~1 M parameters), its `--help` defaults; a fork changes it here
ACTOR = dict(lr=3e-4, lr_ref_samples=256, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, adam_betas=(0.9, 0.95))
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


# ALGO LOGIC: GDPO's advantage estimator.
def gdpo_advantages(parts: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-9):
    """A = whiten_batch(Σ_k w_k · (r^k − mean_group(r^k)) / (std_group(r^k) + eps)), unbiased stds.

    parts: (B, K) reward parts, rows prompt-major (samples i·G .. i·G+G−1 share a prompt); weights: (K,) -> (B,)."""
    # YOUR CODE HERE: the docstring above says what to return (lesson 10).
    raise NotImplementedError("lesson 10: write gdpo_advantages")


def reward_parts(episodes, weights: dict[str, float] | None, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, K) parts each episode's reward function gave (`Episode.extra["component/<name>"]`) and their (K,)
    weights, in the order of the names; a ValueError naming the reward file and the part when a part has no weight,
    a weight no part, or an episode lacks one."""
    names = sorted({k.removeprefix("component/") for e in episodes for k in e.extra if k.startswith("component/")})
    if not names:
        raise ValueError(f"reward function {source}: returns no 'components' (named reward parts, one number per "
                         "query each, e.g. rewards/arithmetic_parts.py); GDPO normalises parts, it needs at least one")  # fmt: skip
    if weights is not None and sorted(weights) != names:
        raise ValueError(f"--algo.component-weights {sorted(weights)}: the reward function {source} gives the parts "
                         f"{names}; give one weight per part")  # fmt: skip
    for e in episodes:
        if missing := [n for n in names if f"component/{n}" not in e.extra]:
            raise ValueError(f"reward function {source}: component {missing[0]!r} missing on some queries of a batch")
    parts = torch.tensor([[e.extra[f"component/{n}"] for n in names] for e in episodes], dtype=torch.float32)
    return parts, torch.tensor([1.0 if weights is None else weights[n] for n in names])


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


# ALGO LOGIC: the loss of one micro-batch of (b, T) tensors, normalised by its whole minibatch's counts.
def policy_loss(logp, old_logp, adv, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None, level="token",
                rollout_logp=None, is_correction=None, is_threshold=(0.5, 5.0), ent=None, entropy_coef=0.0,
                ref_logp=None, kl_coef=0.0, kl_estimator="k3",
                agg="token-mean", num_tokens=None, num_seqs=None, max_len=None):  # fmt: skip
    """J = clipped surrogate (× IS weight) − β·KL(π_θ‖π_ref) + entropy bonus.

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
    """Minibatches of the loss over one rollout: old and reference log-probs first (by the trainer), then
    `--train.epochs` passes of `--train.minibatches` optimizer steps; `trace` keeps what the loss saw of a few samples
    (samples.jsonl). seqs: (B, L) batch; adv: (B,) -> metrics."""
    mask, temp, world = seqs["loss_mask"], args.rollout.temperature, run.world
    adv_tok = adv[:, None].expand_as(mask).float()
    batches = rl.minibatches(seqs, args.train, step, run.rank, world)
    mine = [m for _, micro in batches for m in micro]  # this rank's rows
    # one optimizer step per rollout: the old log-probs are the live ones detached (ratio 1), no extra forward pass
    on_policy = args.train.minibatches == 1 and args.train.epochs == 1
    old_logp = None if on_policy else rl.forward_rows(lambda b: rl.forward_logp(actor, b, temp)[0], seqs, mine, world, False)
    ref_logp = None if ref is None else rl.on_model(ref, rl.logp_table, seqs, args.train, temp, step, run=run)
    meter = Meter()
    # Dr.GRPO's constant normaliser is the generation budget, not the padded width of the batch
    max_len = args.rollout.max_new_tokens if args.algo.loss_agg == "seq-mean-token-sum-norm" else mask.shape[1]
    loss_fn = partial(policy_loss, clip_low=args.algo.clip_low, clip_high=args.algo.clip_high,
                      dual_clip=args.algo.dual_clip, level=args.algo.level, is_correction=args.algo.is_correction,
                      is_threshold=args.algo.is_threshold, entropy_coef=args.algo.entropy_coef, agg=args.algo.loss_agg,
                      max_len=max_len, kl_coef=kl_coef, kl_estimator=args.algo.kl_estimator)  # fmt: skip
    for _ in range(args.train.epochs):
        for k, (minibatch, micro) in enumerate(batches):  # normalisers: the whole minibatch, every rank
            norm = {"num_tokens": mask[minibatch].sum().item(), "num_seqs": len(minibatch)}
            for r, mb, real, last in rl.micro_batches(seqs, micro):
                logp, ent = rl.forward_logp(actor, mb, temp, args.algo.entropy_coef > 0)
                old = logp.detach() if on_policy else old_logp[r]
                loss, metrics, used = loss_fn(logp, old, adv_tok[r], mb["loss_mask"], rollout_logp=mb["rollout_logp"],
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
    rw = args.reward  # ALGO LOGIC: without a reward source given, the embedded task's two parts (PARTS)
    rw.func = rw.func or (None if rw.model or rw.remote_url or rw.judge_url else PARTS)
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
        # ALGO LOGIC: each part normalised in its group, weighted, summed, whitened over the kept batch
        source = rw.func or rw.model or ", ".join(rw.remote_url) or rw.judge_url
        parts, weights = reward_parts(ro.episodes, args.algo.component_weights, source)
        keep = torch.ones(len(ro.episodes), dtype=torch.bool)
        if args.algo.filter_zero_variance:  # DEVIATION(2): groups in which no part varies (A = 0) are dropped
            keep = (parts.view(-1, G, parts.shape[1]).std(dim=1) > 0).any(dim=-1).repeat_interleave(G)
        kept = keep.nonzero().flatten().tolist()
        adv = torch.zeros(len(ro.episodes))
        adv[kept] = gdpo_advantages(parts[kept], weights, G) if kept else adv[kept]
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
