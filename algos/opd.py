"""On-policy distillation (Agarwal et al. 2024, GKD: "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649) in the per-token reverse-KL form of tinker-cookbook's distillation recipe.

The student π_θ (the actor) samples G responses o_1..o_G per prompt q; a frozen teacher π_T with the same tokenizer
scores the sampled tokens, and each token's advantage is the negative per-token reverse KL of the sampling policy
π_old to the teacher (no discount, detached), plus, optionally, λ times GRPO's group-relative task advantage:

    A_{i,t} = log π_T(o_{i,t} | q, o_{i,<t}) − log π_old(o_{i,t} | q, o_{i,<t})  +  λ · Â_i
    Â_i     = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + ε)              (GRPO's advantage of the task reward r_i)

The policy maximises the PPO clipped surrogate with ratio ρ_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | ...):

    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t min(ρ_{i,t} A_{i,t}, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_{i,t}) − β · KL_k3(π_θ ‖ π_ref) ]

At ρ = 1 and λ = 0 the gradient is E_{o∼π_θ}[Σ_t ∇log π_θ(o_t|…) · (log π_T(o_t|…) − log π_θ(o_t|…))]: the policy
gradient of −KL(π_θ ‖ π_T) with per-token rewards, i.e. GKD on the student's own samples with the reverse KL.

Deviations from the paper:
1. A PPO-clipped surrogate over 2 minibatches per rollout with a token-mean loss over the whole batch (DAPO,
   arXiv:2503.14476), instead of GKD's plain gradient of the per-sequence divergence.
2. The teacher scores the sampled tokens only: a one-sample estimate of the reverse KL at each position (tinker-
   cookbook), not GKD's divergence of the two full next-token distributions (no (B, T, V) teacher logits are held).
   Both sides' log-probs are taken at the rollout temperature (`--rollout.temperature`, 1 by default).
3. Every sample trains: no zero-variance filter (the teacher's signal is there when a group's rewards all agree).
   No KL to a reference by default (`--algo.kl-coef 0`); no reference model is loaded then.
4. Old log-probs are recomputed by the trainer, not taken from vLLM: the engine's log-probs are kept as
   `rollout_logp` for the optional importance-sampling correction (`--algo.is-correction`).
5. A mixture-of-experts actor's router load-balancing loss is logged (`loss/router_aux`), not trained on: J above is
   the objective (OpenRLHF's default `--aux_loss_coef 0`); add it to `loss` in `update` to keep the routing balanced.
6. The embedded teacher `cleanrlhf/tiny-grpo` is the main job's model (algos/grpo.py's defaults, pass@1 ≈ 0.95 after
   80 steps from `cleanrlhf/tiny-sft`): a better policy of the student's own size, not a larger model.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/opd.py --train.max-steps 5 --eval.every 5
A real model (the same tokenizer on both sides), the teacher on 2 Ray ranks of its own:
    python algos/opd.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
        --teacher.model Qwen/Qwen2.5-7B-Instruct --teacher.ranks 2 --teacher.no-colocate --train.ranks 4 \\
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
from core import config, flags, models, rl, rl_math, rollout, samples
from core import engine as ds_engine
from core.logger import Meter, timer
from core.placement import RayConfig, group
from core.rollout import VLLMConfig
from rewards.loader import RewardConfig, reward_group


@dataclass
class AlgoArgs:
    reward_coef: float = 0.0
    """λ: weight of GRPO's group-relative advantage of the task reward (`--reward.*`), added to every token's
    distillation advantage (needs --rollout.n-samples >= 2); 0: pure distillation, the task reward is only logged."""
    negative_reward_coef: bool = False
    """allow `--algo.reward-coef` < 0 (refused otherwise: it trains the student to fail the task reward)."""
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


@dataclass
class TeacherArgs:
    model: flags.ModelPath = "cleanrlhf/tiny-grpo"
    """the frozen teacher (HF id, local path or embedded name; the default is algos/grpo.py's trained model, built once
    by running it). It must use the actor's tokenizer: it scores the student's token ids."""
    zero_stage: Literal[0, 3] = 0
    """as --ref.zero-stage: 0, every trainer rank holds the whole teacher; 3, a DeepSpeed ZeRO-3 engine without
    optimizer, partitioned over the ranks (a teacher too big for one device)."""
    offload: bool = False
    """as --ref.offload: the teacher's parameters in CPU memory, moved to the device for its forward passes (zero-stage
    0) or its ZeRO-3 shards offloaded (3). No effect on CPU."""
    ranks: flags.PosInt | None = None
    """None: the teacher lives in the trainer ranks. N: it runs as a Ray group of its own, N ranks forming their own
    DeepSpeed world, exactly as --ref.ranks (a one-process run is then launched through Ray)."""
    colocate: bool = True
    """with `ranks`: rank i shares trainer rank i's placement bundle (at most `--train.ranks` ranks); off: bundles of
    its own."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    """with `ranks` and `no-colocate`: how its own bundles are placed over the nodes (see `--ray.strategy`, the
    default)."""
    load_in_4bit: bool = False
    """as --ref.load-in-4bit: the teacher's linears in 4-bit NF4 (bitsandbytes), about a quarter of its 16-bit
    memory; the distillation signal then carries NF4's rounding. Zero-stage 0 only."""


# RECIPE: OPD's setting on the embedded task (~1 M parameters), its `--help` defaults; a fork changes it here
ACTOR = dict(lr=3e-4, lr_ref_samples=256, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, adam_betas=(0.9, 0.95))
ROLLOUT = dict(batch_size=64, n_samples=8)  # prompts per step, G samples per prompt (the group)
TRAIN = dict(max_steps=30, minibatches=2, epochs=1)  # RL steps, optimizer steps per rollout, passes over it


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    actor: config.ActorArgs = field(default_factory=lambda: config.ActorArgs(**ACTOR))
    teacher: TeacherArgs = field(default_factory=TeacherArgs)
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


# ALGO LOGIC: on-policy distillation's advantage, per token.
def distill_advantages(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor,
                       task_adv: torch.Tensor | None = None, reward_coef: float = 0.0) -> torch.Tensor:  # fmt: skip
    """A_t = log π_T(y_t) − log π_old(y_t) + reward_coef · task_adv, the negative per-token reverse KL (detached).

    teacher_logp, student_logp, mask: (B, T) log-probs of the sampled tokens and the action mask; task_adv: (B,) one
    scalar per response (`group_advantages` of the task reward) or None -> (B, T), 0 where masked."""
    adv = (teacher_logp - student_logp).detach()
    if task_adv is not None and reward_coef != 0:
        adv = adv + reward_coef * task_adv[:, None]
    return torch.where(mask.bool(), adv, 0.0)


def load_teacher(args: Args, device: torch.device):
    """The frozen teacher (`--teacher.*`) in the actor's dtype, placed as a reference policy would be."""
    t = args.teacher
    model = models.load_causal_lm(config.ModelConfig(name_or_path=t.model, dtype=args.actor.model.dtype,
                                                     load_in_4bit=t.load_in_4bit), "--teacher.model", frozen=True)  # fmt: skip
    return ds_engine.make_frozen(model, config.RefConfig(zero_stage=t.zero_stage, offload=t.offload), device)


def check_teacher(args: Args) -> None:
    """The teacher scores the student's token ids, so both must read them alike: the same tokenizer vocabulary."""
    models.check_causal_lm(args.teacher.model, "--teacher.model")  # a language model's head: no reward model export
    student = models.load_tokenizer(args.actor.model.tokenizer or args.actor.model.name_or_path,
                                    "--actor.model.name-or-path / --actor.model.tokenizer")  # fmt: skip
    teacher = models.load_tokenizer(args.teacher.model, "--teacher.model")
    if teacher.get_vocab() != student.get_vocab():
        raise ValueError(f"--teacher.model {args.teacher.model!r}: its tokenizer ({len(teacher)} tokens) differs from "
                         f"the actor's ({len(student)} tokens); the teacher scores the student's token ids, so both "
                         "need the same tokenizer")  # fmt: skip


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


def update(actor, ref, teacher, seqs: dict, task_adv: torch.Tensor | None, args: Args, run: rl.Run, step: int,
           kl_coef: float, trace: samples.Trace = samples.NO_TRACE) -> dict:  # fmt: skip
    """Minibatches of the loss over one rollout: old, teacher and reference log-probs, the token advantages from them,
    then `--train.epochs` passes of `--train.minibatches` optimizer steps; `trace` keeps what the loss saw of a few
    samples (samples.jsonl). seqs: (B, L) batch; task_adv: (B,) | None."""
    mask, temp, world = seqs["loss_mask"], args.rollout.temperature, run.world
    batches = rl.minibatches(seqs, args.train, step, run.rank, world)
    mine = [m for _, micro in batches for m in micro]  # this rank's rows
    # the advantage needs the sampling policy's log-probs of every row (also when on-policy), so they are gathered
    old_logp = rl.forward_rows(lambda b: rl.forward_logp(actor, b, temp)[0], seqs, mine, world, True,
                               args.train.sp_size)  # on all ranks  # fmt: skip
    teacher_logp = rl.on_model(teacher, rl.logp_table, seqs, args.train, temp, step, run=run)  # or --teacher.ranks
    ref_logp = None if ref is None else rl.on_model(ref, rl.logp_table, seqs, args.train, temp, step, run=run)
    meter = Meter()
    # ALGO LOGIC: the teacher's log-prob of each sampled token minus the student's: (B, L) prompt-major, by row below
    adv_tok = distill_advantages(teacher_logp, old_logp, mask, task_adv, args.algo.reward_coef)
    reverse_kl = rl_math.masked_mean(old_logp - teacher_logp, mask)  # the quantity distillation drives to 0
    meter.add({"opd/reverse_kl": reverse_kl}, mask.sum().item())  # the same on every rank
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
                loss, metrics, used = loss_fn(logp, old_logp[r], adv_tok[r], mb["loss_mask"], rollout_logp=mb["rollout_logp"],
                                              ent=ent, ref_logp=None if ref is None else ref_logp[r], **norm)  # fmt: skip
                trace.add(r, mb["loss_mask"], minibatch=k, logp=logp, old_logp=old_logp[r], **used,
                          teacher_logp=teacher_logp[r])  # what the loss used  # fmt: skip
                metrics |= rl.router_aux(actor)  # DEVIATION(5): a MoE router's balancing loss, logged, not added
                meter.add_loss("loss/policy", rl.backward(actor, loss, step, world, real, last))
                meter.add(metrics, mb["loss_mask"].sum().item() if real else 0.0)
            meter.add_step("train/grad_norm", ds_engine.optimizer_step(actor, step, "actor"))  # NaN/inf: raise
    return {**meter.result(world), "train/tokens": float(mask.sum())}


def main(args: Args, engines: rollout.RolloutEngines | None = None, groups: dict | None = None) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    config.check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if args.algo.reward_coef != 0 and args.rollout.n_samples < 2:  # ALGO LOGIC: a group of one has no baseline
        raise ValueError(f"--algo.reward-coef {args.algo.reward_coef}: the group-relative task advantage needs "
                         f"--rollout.n-samples >= 2, got {args.rollout.n_samples}")  # fmt: skip
    if args.algo.reward_coef < 0 and not args.algo.negative_reward_coef:  # a sign slip would unlearn the task
        raise ValueError(f"--algo.reward-coef {args.algo.reward_coef}: a negative weight trains the student to fail "
                         "the task reward; add --algo.negative-reward-coef if that is meant")  # fmt: skip
    check_teacher(args)  # ALGO LOGIC: the teacher must read the student's token ids (builds an embedded teacher once)
    # PLUMBING: --train.ranks 1: this process trains, beside an in-process engine; N: Ray ranks run this, engines given
    uses_ref = args.algo.kl_coef > 0  # ALGO LOGIC: the KL term needs the reference policy (DEVIATION(3))
    # PLUMBING: the models this script places on Ray ranks of their own with `--<role>.ranks N` (core places them)
    placed = {"ref": group(args.ref, unused=None if uses_ref else "the KL term is off: --algo.kl-coef 0"),
              "teacher": group(args.teacher),
              "reward": reward_group(args.reward)}  # fmt: skip
    if engines is None:  # the files the episodes read (reward, agent, environment), checked before anything loads
        check_episode_files(args.rollout, args.reward)
        if rl.needs_launch(args.train, placed):
            return rl.launch(main, args, placed)
    rank, world, device = rl.init_rank(engines, args.ds, args.train.seed, args.run_dir)
    tokenizer, train_set, eval_set = rl.load_task(args)
    reward = load_reward(args.rollout, args.reward, (groups or {}).get("reward"))  # None: the episodes reward themselves
    schedule = partial(lr_schedule, warmup=args.actor.warmup_steps, floor=args.actor.min_lr_ratio,
                       total=args.train.max_steps * args.train.minibatches * args.train.epochs)  # optimizer steps
    actor = rl.make_actor(args, device, rl.scaled_lr(args.actor, args.rollout, args.train), schedule)
    ref = rl.make_ref(args.ref, args.actor.model, device, groups, actor) if uses_ref else None  # LoRA: adapters off
    teacher = rl.build_model(groups, "teacher", load_teacher, device, args)  # PLUMBING: here, or its --teacher.ranks
    episodes = partial(make_executor, args.rollout, reward, args.actor.model.name_or_path, args.vllm.max_model_len)
    run = rl.start(args, {"actor": actor}, engines, tokenizer, eval_set, episodes, rank, world, device, args.exp_name)
    kl_ctl = (rl_math.AdaptiveKLController(args.algo.kl_coef, args.algo.kl_target, args.algo.kl_horizon)
              if args.algo.kl_target else rl_math.FixedKLController(args.algo.kl_coef))  # fmt: skip
    kl_ctl.load_state_dict(run.client.get("kl_ctl", kl_ctl.state_dict()))
    G = args.rollout.n_samples

    for step in range(run.start_step, args.train.max_steps):
        perf: dict = {}
        # 2. rollout: G episodes per prompt through the agent executor, token ids in, token ids + log-probs out
        with timer(perf, "perf/gen_s"):
            ro = rl.collect_rollout(run, args.rollout, train_set, step)
        perf["perf/tokens_per_s"] = sum(len(e.token_ids) for e in ro.episodes) / max(perf["perf/gen_s"], 1e-9)

        # 3. rewards and advantages
        rw = args.reward  # shaping: a truncated response's reward, DAPO's overlong penalty, clipping
        rewards, truncated = rl.shape_rewards(ro, rw.stop_properly_penalty, rw.overlong_buffer, rw.overlong_penalty_factor,
                                              args.rollout.max_new_tokens, rw.clip)  # fmt: skip
        # ALGO LOGIC: the task term, GRPO's advantage (B,); `update` adds the teacher's term, which needs log-probs
        task_adv = group_advantages(rewards, G).to(device) if args.algo.reward_coef != 0 else None
        keep = torch.ones(len(ro.episodes), dtype=torch.bool)  # DEVIATION(3): no filter
        kept = keep.nonzero().flatten().tolist()
        stats = rl.rollout_stats(ro, rewards, truncated, keep)

        # 4. policy update on every sample, a few of them traced
        trace = samples.Trace(samples.watch(keep, G, args.logger.samples), kept)
        with timer(perf, "perf/train_s"):
            seqs = rl.sequences(ro.episodes, tokenizer.pad_token_id, device, args.train.packing)
            stats.update(update(actor, ref, teacher, seqs, task_adv, args, run, step, kl_ctl.value, trace=trace))
        samples.log(run, step, ro, rewards, keep, trace, G)  # -> samples.jsonl, a panel every show-every steps
        if "loss/kl" in stats:  # β for the next rollout
            kl_ctl.update(stats["loss/kl"], len(ro.episodes))

        # 5. weight sync, eval, logging, checkpoint
        with timer(perf, "perf/sync_s"):
            sample = [e.prompt_ids + e.token_ids for e in ro.episodes[:4]]
            examples = [e.example for e in ro.episodes[:4]]  # their pictures, for a vision-language model
            stats.update(rl.sync_weights(run, actor, sample=sample, examples=examples))
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
