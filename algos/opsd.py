"""On-policy self-distillation (Zhao et al. 2026, "Self-Distilled Reasoner: On-Policy Self-Distillation for Large
Language Models", arXiv:2601.18734): one model is both the student and its own teacher, the teacher seeing what the
student does not.

The student π_θ(· | x) samples G responses o_1..o_G per question x from the question alone. The teacher is the same
model given privileged context: the row's reference answer y* spliced into its prompt by a template, h(x, y*). It
scores the student's own tokens, and each token's advantage is the negative per-token reverse KL of the sampling
policy to it (no discount, detached), plus, optionally, λ times GRPO's group-relative task advantage:

    A_{i,t} = log π_T(o_{i,t} | h(x, y*), o_{i,<t}) − log π_old(o_{i,t} | x, o_{i,<t})  +  λ · Â_i
    π_T     = π_θ_0 (`--algo.teacher frozen`: the starting weights)  or  π_θ_old (`live`: the current weights)
    Â_i     = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + ε)              (GRPO's advantage of the task reward r_i)

The policy maximises the PPO clipped surrogate with ratio ρ_{i,t} = π_θ(o_{i,t} | x, o_{i,<t}) / π_old(o_{i,t} | ...):

    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t min(ρ_{i,t} A_{i,t}, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_{i,t}) − β · KL_k3(π_θ ‖ π_ref) ]

At ρ = 1 and λ = 0 the gradient is E_{o∼π_θ(·|x)}[Σ_t ∇log π_θ(o_t|x, …) · (log π_T(o_t|h, …) − log π_θ(o_t|x, …))],
the policy gradient of −KL(π_θ(·|x) ‖ π_T(·|h(x, y*))): the student is pulled towards what it would say had it seen
the answer, token by token. The gradient flows through the student's context only; the teacher's log-probs are
constants. No verifier is needed (λ = 0, the default): the task reward is computed and logged only.

Deviations from the paper:
1. A PPO-clipped surrogate over 2 minibatches per rollout with a token-mean loss over the whole batch (DAPO,
   arXiv:2503.14476), as in algos/opd.py.
2. The teacher scores the sampled tokens only: a one-sample estimate of the reverse KL at each position (opd.py's
   signal), not the paper's divergence of the two full next-token distributions (no (B, T, V) logits are held).
   Both sides' log-probs are taken at the rollout temperature (`--rollout.temperature`, 1 by default).
3. Every sample trains: no zero-variance filter. No KL to a reference by default (`--algo.kl-coef 0`).
4. Old log-probs are recomputed by the trainer, not taken from vLLM: the engine's log-probs are kept as
   `rollout_logp` for the optional importance-sampling correction (`--algo.is-correction`).
5. A mixture-of-experts actor's router load-balancing loss is logged (`loss/router_aux`), not trained on.
6. The privileged context is the row's label (`--data.label-key`), the final answer, where the paper shows verified
   solutions: the embedded task has no worked solutions. A dataset whose label column holds a full solution gives
   the paper's setting unchanged. Pictures (`--data.image-key`) are refused: the template splices text only.
7. The embedded student `cleanrlhf/tiny-sft-hint` is a warm start of its own, because the shared warm start
   `cleanrlhf/tiny-sft` never saw a hint (greedy pass@1 with the answer in its prompt: 0.0). It is `cleanrlhf/tiny-sft`
   fine-tuned by `algos/sft.py --preset hint-warm-start` on prompts that show their answer (`cleanrlhf/add2-hint`)
   until it copies it (pass@1 0.94 with the hint); its pass@1 on the plain prompts fell to ~0.2 on the way, which
   self-distillation is to bring back.
8. The teacher defaults to the starting weights (`--algo.teacher frozen`) where the paper's single model reads the
   hint with its current weights (`live`). On the embedded task the live teacher collapsed: every update moved the
   teacher with the student, the reverse KL fell while both got worse (16 steps, pass@1 0.186 -> 0.036 at lr 3e-4;
   at 1e-4 up to 0.448 at step 4, then down to 0.212), where the frozen one went 0.186 -> 0.846.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/opsd.py --train.max-steps 5 --eval.every 5
A real model, the solution in a system turn in front of the chat-templated question:
    python algos/opsd.py --actor.model.name-or-path Qwen/Qwen3-1.7B --data.path math.jsonl --data.apply-chat-template \\
        --data.label-key solution \\
        --algo.hint-template '<|im_start|>system\\nA verified solution: {answer}<|im_end|>\\n{prompt}' \\
        --reward.func my_reward.py --rollout.max-new-tokens 1024 --actor.lr 1e-6 --train.ranks 4
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
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
    teacher: Literal["frozen", "live"] = "frozen"
    """whose weights read the privileged prompt: `frozen`, the starting weights (a fixed target: the reference policy,
    placed by `--ref.*`); `live`, the current policy, re-read every step (the two roles share every update, DEVIATION(8)
    says what that did on the embedded task)."""
    hint_template: str = "answer {answer}; {prompt}"
    """the teacher's prompt: a python format string of `{prompt}` (the student's prompt as the model sees it, chat
    template included) and `{answer}` (the row's label, `--data.label-key`). The default is the form the embedded
    student `cleanrlhf/tiny-sft-hint` learned to read (core/embedded.py `HINT_TEMPLATE`)."""
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


# RECIPE: OPSD's setting on the embedded task (~1 M parameters), its `--help` defaults; a fork changes it here
STUDENT = config.ModelConfig(name_or_path="cleanrlhf/tiny-sft-hint")  # DEVIATION(7): a warm start that reads hints
ACTOR = dict(model=STUDENT, lr=3e-4, lr_ref_samples=256, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.0, adam_betas=(0.9, 0.95))
ROLLOUT = dict(batch_size=64, n_samples=8)  # prompts per step, G samples per prompt (the group)
TRAIN = dict(max_steps=30, minibatches=2, epochs=1)  # RL steps, optimizer steps per rollout, passes over it


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


# ALGO LOGIC: the teacher's input, the privileged prompt in front of the student's own response tokens.
def hint_prompts(examples: list[dict], template: str, tokenizer, special_tokens: bool) -> list[list[int]]:
    """The teacher's prompt token ids of each example: `template` filled with the prompt as the student sees it and
    the row's label, tokenized as the data loader tokenizes prompts (`special_tokens`: a BOS where the tokenizer adds
    one, off under a chat template, which writes its own)."""
    texts = [template.format(prompt=e["prompt"], answer=e["label"]) for e in examples]
    return tokenizer(texts, add_special_tokens=special_tokens)["input_ids"] if texts else []


def teacher_episodes(episodes: list, prompts: list[list[int]]) -> list:
    """The student's episodes with each prompt replaced by the teacher's: the same response tokens, action mask and
    engine log-probs behind `prompts[i]`, so `rl.sequences` lays them out as it lays out the student's."""
    return [replace(e, prompt_ids=p) for e, p in zip(episodes, prompts, strict=True)]


def align_to_student(table: torch.Tensor, teacher_prompt_lens: list[int], student_prompt_lens: list[int],
                     response_lens: list[int]) -> torch.Tensor:  # fmt: skip
    """Move each row's response from the teacher's (B, L_T) table into the student's (B, L_S) layout: row i's response
    starts at teacher_prompt_lens[i] in `table` and at student_prompt_lens[i] in the result, and holds
    response_lens[i] tokens; 0 elsewhere. L_S = max(student prompt + response)."""
    width = max(p + n for p, n in zip(student_prompt_lens, response_lens))
    out = table.new_zeros(len(response_lens), width)
    for i, (t, s, n) in enumerate(zip(teacher_prompt_lens, student_prompt_lens, response_lens)):
        out[i, s : s + n] = table[i, t : t + n]
    return out


def check_hints(args: Args, examples: list[dict], prompts: list[list[int]]) -> None:
    """Refuse, before any model loads, a teacher prompt that leaves no room for the response in the model's context,
    naming its training row."""
    limit = models.max_positions(args.actor.model.name_or_path, "--actor.model.name-or-path")
    reserve, reserve_flag = rl.response_budget(args.rollout)
    for i, (e, p) in enumerate(zip(examples, prompts)):
        if limit is not None and len(p) + reserve > limit:
            raise ValueError(f"training row {i} (prompt {e['prompt'][:40]!r}, label {str(e['label'])[:40]!r}): its "
                             f"teacher prompt from --algo.hint-template is {len(p)} tokens, and with {reserve_flag} "
                             f"{reserve} it passes the model's context of {limit}")  # fmt: skip


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


def update(actor, ref, teacher, seqs: dict, t_seqs: dict, layout: tuple, task_adv: torch.Tensor | None, args: Args,
           run: rl.Run, step: int, kl_coef: float, trace: samples.Trace = samples.NO_TRACE) -> dict:  # fmt: skip
    """Minibatches of the loss over one rollout: old, teacher and reference log-probs, the token advantages from them,
    then `--train.epochs` passes of `--train.minibatches` optimizer steps; `trace` keeps what the loss saw of a few
    samples (samples.jsonl). seqs: (B, L) student table; t_seqs: (B, L_T) the same responses behind the teacher's
    prompts; layout: (teacher prompt lengths, student prompt lengths, response lengths), `align_to_student`'s;
    teacher: None (live: the actor itself) or the frozen starting policy; task_adv: (B,) | None."""
    mask, temp, world = seqs["loss_mask"], args.rollout.temperature, run.world
    batches = rl.minibatches(seqs, args.train, step, run.rank, world)
    mine = [m for _, micro in batches for m in micro]  # this rank's rows
    # the advantage needs the sampling policy's log-probs of every row (also when on-policy), so they are gathered
    old_logp = rl.forward_rows(lambda b: rl.forward_logp(actor, b, temp)[0], seqs, mine, world, True,
                               args.train.sp_size)  # on all ranks  # fmt: skip
    # ALGO LOGIC: the teacher reads the privileged prompt, then the student's tokens; live: the same weights as old_logp
    if teacher is None:
        t_mine = [m for _, micro in rl.minibatches(t_seqs, args.train, step, run.rank, world) for m in micro]
        t_table = rl.forward_rows(lambda b: rl.forward_logp(actor, b, temp)[0], t_seqs, t_mine, world, True,
                                  args.train.sp_size)  # fmt: skip
    else:
        t_table = rl.on_model(teacher, rl.logp_table, t_seqs, args.train, temp, step, run=run)  # or --ref.ranks
    teacher_logp = align_to_student(t_table, *layout)  # (B, L): each response where the student's table holds it
    ref_logp = None if ref is None else rl.on_model(ref, rl.logp_table, seqs, args.train, temp, step, run=run)
    meter = Meter()
    # ALGO LOGIC: the teacher's log-prob of each sampled token minus the student's: (B, L) prompt-major, by row below
    adv_tok = distill_advantages(teacher_logp, old_logp, mask, task_adv, args.algo.reward_coef)
    reverse_kl = rl_math.masked_mean(old_logp - teacher_logp, mask)  # the quantity distillation drives to 0
    meter.add({"opsd/reverse_kl": reverse_kl}, mask.sum().item())  # the same on every rank
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
    t = args.algo.hint_template  # ALGO LOGIC: the teacher sees the question and the answer; text only (DEVIATION(6))
    if "{prompt}" not in t or "{answer}" not in t:
        raise ValueError(f"--algo.hint-template {t!r}: needs both {{prompt}} (the student's prompt) and {{answer}} "
                         "(the row's label): the teacher must see the question and what the student does not")  # fmt: skip
    if args.data.image_key:
        raise ValueError(f"--data.image-key {args.data.image_key!r}: opsd.py splices a text hint into text prompts and "
                         "is not built for pictures")  # fmt: skip
    # PLUMBING: --train.ranks 1: this process trains, beside an in-process engine; N: Ray ranks run this, engines given
    frozen = args.algo.teacher == "frozen"  # DEVIATION(8): the starting weights read the hints: the reference policy
    uses_ref = args.algo.kl_coef > 0 or frozen  # (and the KL term needs it, DEVIATION(3))
    # PLUMBING: the models this script places on Ray ranks of their own with `--<role>.ranks N` (core places them)
    placed = {"ref": group(args.ref, unused=None if uses_ref else "the KL term is off (--algo.kl-coef 0) and the "
                                                                  "teacher is live (--algo.teacher live)"),
              "reward": reward_group(args.reward)}  # fmt: skip
    if engines is None:  # the files the episodes read (reward, agent, environment), checked before anything loads
        check_episode_files(args.rollout, args.reward)
        if rl.needs_launch(args.train, placed):
            return rl.launch(main, args, placed)
    rank, world, device = rl.init_rank(engines, args.ds, args.train.seed, args.run_dir)
    tokenizer, train_set, eval_set = rl.load_task(args)
    hints = partial(hint_prompts, template=t, tokenizer=tokenizer, special_tokens=not args.data.apply_chat_template)
    check_hints(args, train_set, hints(train_set))  # every row's teacher prompt fits, before any model loads
    reward = load_reward(args.rollout, args.reward, (groups or {}).get("reward"))  # None: the episodes reward themselves
    schedule = partial(lr_schedule, warmup=args.actor.warmup_steps, floor=args.actor.min_lr_ratio,
                       total=args.train.max_steps * args.train.minibatches * args.train.epochs)  # optimizer steps
    actor = rl.make_actor(args, device, rl.scaled_lr(args.actor, args.rollout, args.train), schedule)
    ref = rl.make_ref(args.ref, args.actor.model, device, groups, actor) if uses_ref else None  # LoRA: adapters off
    teacher = ref if frozen else None  # None: the actor reads the hints itself (live)
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
            # ALGO LOGIC: the same responses behind the privileged prompts, and where each response sits in both
            t_eps = teacher_episodes(ro.episodes, hints([e.example for e in ro.episodes]))
            t_seqs = rl.sequences(t_eps, tokenizer.pad_token_id, device, args.train.packing)
            layout = ([len(e.prompt_ids) for e in t_eps], [len(e.prompt_ids) for e in ro.episodes],
                      [len(e.token_ids) for e in ro.episodes])  # fmt: skip
            stats.update(update(actor, ref if args.algo.kl_coef > 0 else None, teacher, seqs, t_seqs, layout, task_adv,
                                args, run, step, kl_ctl.value, trace=trace))  # fmt: skip
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
