"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage
Normalization", arXiv:2501.03262) and REINFORCE++-baseline (`--algo.baseline group`).

No critic and no per-prompt normalisation: the scalar reward r_i of response o_i becomes a per-token reward with a
token-level KL penalty against the frozen SFT policy (KL_t = log(π_old(o_t|…) / π_ref(o_t|…)), the k1 estimate),
is summed into a reward-to-go, and the returns are normalised over every response token of the global batch:

    r̃_i      = r_i                      REINFORCE++ (any number of samples per prompt, G ≥ 1)
    r̃_i      = r_i − mean(r_1..r_G)     REINFORCE++-baseline (G ≥ 2 samples of the same prompt)
    r_{i,t}  = −β · KL_{i,t} + [t = |o_i|] · r̃_i
    R_{i,t}  = Σ_{k≥t} γ^{k−t} r_{i,k}                        (γ = 1: R_{i,t} = r̃_i − β Σ_{k≥t} KL_{i,k})
    A_{i,t}  = (R_{i,t} − μ) / σ,   μ, σ over all valid tokens of the batch       (global advantage normalisation)

The policy maximises the PPO clipped surrogate with these token advantages, ρ_{i,t} = π_θ(o_{i,t}|…) / π_old(o_{i,t}|…):

    J(θ) = E[ 1/Σ|o_i| Σ_i Σ_t min(ρ_{i,t} A_{i,t}, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_{i,t}) ]

Deviations from the paper:
1. Token-mean loss over the whole batch (DAPO, arXiv:2503.14476; OpenRLHF's default), 2 minibatches per rollout.
2. 8 samples per prompt by default for both variants, as this repository's GRPO and RLOO, so the three scripts
   generate the same rollouts; the paper's general-domain REINFORCE++ uses one (`--rollout.n-samples 1`).
3. No in-loss KL term: the KL penalty lives only in the reward (`--algo.kl-coef`, β = 0.01 here); `--algo.kl-coef 0`
   loads no reference model and leaves plain REINFORCE with global normalisation.
4. Old log-probs are recomputed by the trainer, not taken from vLLM: the engine's log-probs are kept as
   `rollout_logp` for the optional importance-sampling correction (`--algo.is-correction`); the KL in the reward uses
   the trainer's old log-probs.

Debug (embedded tiny model and task, one CPU process, in-process vLLM):
    python algos/reinforce_pp.py --train.max-steps 5 --eval.every 5
    python algos/reinforce_pp.py --algo.baseline group              # REINFORCE++-baseline
A real model:
    python algos/reinforce_pp.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
        --data.apply-chat-template --reward.func my_reward.py --rollout.max-new-tokens 1024 --actor.lr 1e-6
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro

from agents.executor import Episode, MultiTurnExecutor, Rollout, SingleTurnExecutor, load_env_factory
from core import checkpoint, data, embedded, models, packing, placement, rl_math, rollout
from core import engine as ds_engine
from core.config import CkptConfig, DataConfig, DSConfig, LoggerConfig, ModelConfig, RefConfig, check_args
from core.logger import RunLogger, run_name, timer
from core.placement import RayConfig, all_ranks, shard_minibatch
from core.rollout import VLLMConfig
from rewards.loader import RewardConfig, load_reward_func, score


@dataclass
class ActorArgs:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name_or_path="cleanrlhf/tiny-sft"))
    lr: float = 3e-4
    """peak learning rate (3e-4 suits the ~1 M embedded model; ~1e-6 for real models)."""
    warmup_steps: int = 0
    """linear learning-rate warmup steps, then cosine decay to 0.1 · lr."""
    clip_low: float = 0.2
    """ε_low: ratio lower clip 1 − ε_low."""
    clip_high: float = 0.2
    """ε_high: ratio upper clip 1 + ε_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = None
    """dual-clip constant c > 1 (Ye et al. 2020): bounds the loss of negative-advantage tokens at c·|A|."""
    level: Literal["token", "sequence"] = "token"
    """importance ratio per token (PPO/GRPO) or per sequence (GSPO, Zheng et al. 2025)."""
    entropy_coef: float = 0.0
    """entropy bonus coefficient (0: off, no extra memory)."""


@dataclass
class RolloutArgs:
    batch_size: int = 64
    """prompts per step."""
    n_samples: int = 8  # DEVIATION(2): 8 samples per prompt also without a baseline
    """G: responses sampled per prompt (the group of `--algo.baseline group`; 1 is fine without a baseline)."""
    max_new_tokens: int = 8
    """response length limit."""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same temperature)."""
    top_p: float = 1.0
    """nucleus sampling."""
    env_file: str | None = None
    """multi-turn: a Python file defining `make_env(example)` -> an environment with `reset(example) -> str` and
    `step(response) -> (feedback, reward, done)` (e.g. agents/retry_env.py). Its feedback is appended as tokens that
    are not trained on, its rewards replace `--reward.*`. None: one generation per episode, scored by `--reward.*`."""
    max_turns: int = 2
    """multi-turn: model turns per episode at most."""
    max_total_tokens: int = 256
    """multi-turn: response tokens (model + feedback) per episode at most; an episode reaching it is truncated."""


@dataclass
class TrainArgs:
    max_steps: int = 30
    """RL steps (one rollout + update each)."""
    minibatches: int = 2
    """optimizer steps per rollout: the batch is split into this many minibatches."""
    epochs: int = 1
    """passes over each rollout."""
    micro_batch_size: int = 128
    """sequences per forward/backward (gradient accumulation covers the minibatch)."""
    seed: int = 1
    """seed of the prompt order, the sampling seeds and every RNG."""
    ranks: int = 1
    """data-parallel trainer ranks. 1: this process trains (with an in-process vLLM engine on CPU). N > 1: N Ray
    actors forming one DeepSpeed world on a placement group (`--ray.*`), the vLLM engines as Ray actors
    (`--vllm.num-engines`), weights sent to them from rank 0."""
    colocate: bool = True
    """with ranks > 1: each vLLM engine shares a placement-group bundle (GPU, or CPU) with a trainer rank, half of it
    each (OpenRLHF's colocate-all; `--vllm.enable-sleep` frees the engine's GPU memory while training); off: the
    engines get bundles of their own."""
    halt_after: int | None = None
    """stop this invocation after N steps with a checkpoint; the same command with `--run-dir <run>` resumes exactly
    (for time-limited cluster jobs)."""


@dataclass
class AlgoArgs:
    baseline: Literal["none", "group"] = "none"
    """none: REINFORCE++; group: REINFORCE++-baseline, the prompt's mean reward is subtracted before the KL shaping."""
    gamma: float = 1.0
    """discount γ of the reward-to-go over response tokens (1 in the paper)."""
    filter_zero_variance: bool = False
    """drop groups whose rewards are all equal. Off: under global normalisation an all-correct group still gets a
    positive advantage (without a baseline), so these groups carry signal."""
    dynamic_filter_range: tuple[float, float] | None = None
    """DAPO dynamic sampling: keep only groups whose mean score lies strictly inside (LOW, HIGH) (e.g. `0 1`: not
    all solved, not all failed) and refill the batch with more prompts; None disables."""
    dynamic_filter_max_rounds: int = 3
    """generation rounds per step at most when refilling; a batch still short after them trains on what it has."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """loss aggregation (see core/rl_math.aggregate_loss)."""
    kl_coef: float = 0.01  # DEVIATION(3): the only KL term; none in the loss
    """β of the per-token KL penalty in the reward (Hu et al. 2025); 0 loads no reference model."""
    kl_target: float | None = None
    """adaptive KL (Ziegler et al. 2019): β starts at kl-coef and is moved toward this per-token KL
    (`rl_math.AdaptiveKLController`, saved in checkpoints); None keeps β fixed."""
    kl_horizon: int = 10000
    """adaptive KL horizon in samples: β changes by at most 20 % per this many samples."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator for the reward penalty (k1 = log π_old/π_ref, the paper's)."""
    is_correction: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """importance-sampling correction for the rollout engine's log-probs (see core/rl_math.policy_loss)."""
    is_threshold: tuple[float, float] = (0.5, 5.0)
    """[lo, hi] bounds of the IS weight."""


@dataclass
class EvalArgs:
    every: int = 10
    """evaluate every N steps (and at the start and end); 0 disables."""
    max_samples: int = 500
    """eval prompts."""
    k: int = 4
    """pass@k uses k samples per prompt at the rollout temperature; pass@1 is greedy."""
    best_metric: str | None = "eval/pass@1"
    """export the model to `<run>/best` whenever this eval metric reaches a new maximum (None: off)."""


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


# ALGO LOGIC: REINFORCE++'s advantage estimator.
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
    baseline: str = "none",
    group_size: int = 1,
) -> torch.Tensor:
    """A = whiten_batch(Σ_{k≥t} γ^{k−t} r_k),  r_t = −kl_coef · kl_t + [t = last] · r̃,  r̃ = r (− mean_group(r)).

    rewards: (B,) one scalar per response, prompt-major (samples i·G .. i·G+G−1 share a prompt) when baseline is
    "group"; kl: (B, T) per-token KL estimate; mask: (B, T) action mask (0 on the prompt, padding and a multi-turn
    episode's environment tokens) -> (B, T), 0 at masked positions. "last" is the last action token; the mean and
    (population) std of the whitening run over all valid tokens of the batch."""
    if baseline not in ("none", "group"):
        raise ValueError(f"unknown baseline {baseline!r}; valid: none, group")
    if rewards.dim() != 1 or kl.shape != mask.shape or kl.dim() != 2 or kl.shape[0] != rewards.numel():
        raise ValueError(f"shapes: rewards (B,), kl and mask (B, T); got rewards {tuple(rewards.shape)}, kl "
                         f"{tuple(kl.shape)}, mask {tuple(mask.shape)}")  # fmt: skip
    if baseline == "group":
        if group_size < 2 or rewards.numel() % group_size != 0:
            raise ValueError(f"baseline 'group' needs group_size >= 2 dividing B = {rewards.numel()}; got "
                             f"group_size {group_size} (--rollout.n-samples)")  # fmt: skip
        r = rewards.view(-1, group_size)  # (B/G, G)
        rewards = (r - r.mean(dim=1, keepdim=True)).reshape(-1)
    # the script already clipped the raw reward to ±reward.clip, so no second clip here
    # the reward sits on the mask's last 1: the policy's last token, also when environment tokens follow it
    per_token = rl_math.token_rewards(rewards, kl, kl_coef, mask, clip_range=None)  # (B, T)
    returns = rl_math.discounted_returns(per_token, mask, gamma)  # (B, T); carried unchanged over environment tokens
    return rl_math.masked_whiten(returns, mask)


def groups_inside(scores: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic sampling: which groups have a mean score strictly inside (low, high), i.e. are neither all solved
    nor all failed (with 0-1 scores and the range (0, 1)). scores: (B,) prompt-major -> (B / group_size,) bool."""
    mean = scores.view(-1, group_size).mean(dim=1)
    return (mean > low) & (mean < high)


def sequences(episodes: list[Episode], pad_id: int, device) -> dict:
    """Right-padded prompt+response batch (B, L): the loss mask is True on the tokens the policy generated (the
    episode's action mask), `rollout_logp` holds the engine's log-probs at the same positions."""
    examples = [{"input_ids": e.prompt_ids + e.token_ids, "loss_mask": [0] * len(e.prompt_ids) + e.action_mask}
                for e in episodes]  # fmt: skip
    batch = packing.collate_padded(examples, pad_id, device)
    batch["rollout_logp"] = torch.zeros(batch["loss_mask"].shape)
    for row, e in enumerate(episodes):
        batch["rollout_logp"][row, len(e.prompt_ids) : len(e.prompt_ids) + len(e.token_ids)] = torch.tensor(e.logprobs)
    return batch


def forward_logp(model, batch: dict, temperature: float, entropy: bool = False):
    """Per-token log-probs (B, L) of the batch's tokens (position t: log p(x_t | x_<t)), and optionally entropies."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    logits = logits[:, :-1]
    logp = rl_math.logprobs_from_logits(logits, batch["input_ids"][:, 1:], temperature=temperature)
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    ent = None
    if entropy:
        ent = rl_math.entropy_from_logits(logits.float() / temperature)
        ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    return logp, ent


@torch.no_grad()
def evaluate(executor: SingleTurnExecutor | MultiTurnExecutor, eval_set: list[dict], args: Args) -> dict:
    """pass@1 (greedy) and pass@k (k samples at the rollout temperature), overall and per data source; an answer is
    correct when its reward is above 0.5."""
    greedy = executor.run(eval_set, n=1, seed=None, step=-1, temperature=0.0)
    sampled = executor.run(eval_set, n=args.eval.k, seed=12345, step=-1)
    p1 = (greedy.rewards > 0.5).float()
    pk = (sampled.rewards > 0.5).float().view(len(eval_set), args.eval.k).max(dim=1).values
    out = {"eval/pass@1": p1.mean().item(), f"eval/pass@{args.eval.k}": pk.mean().item()}
    sources = sorted({e["datasource"] for e in eval_set})
    if len(sources) > 1:
        for s in sources:
            idx = torch.tensor([e["datasource"] == s for e in eval_set])
            out[f"eval/{s}/pass@1"] = p1[idx].mean().item()
    return out


def launch(args: Args) -> dict:
    """`--train.ranks N`: start Ray, the vLLM engine actors and N trainer ranks (one DeepSpeed world) on one placement
    group, and run `main` on every rank, as torchrun would; returns rank 0's summary."""
    resources = placement.init_ray(args.ray)
    gpu, n = resources.get("GPU", 0) > 0, args.train.ranks
    pg, share, engine_options = placement.place_rl(n, args.vllm.num_engines, args.vllm.tensor_parallel_size,
                                                   args.train.colocate, args.ray.strategy, args.ray.timeout_s)  # fmt: skip
    # resolved once here: the ranks must agree on the model, the run folder and the engines
    args.actor.model.name_or_path = embedded.resolve_model(args.actor.model.name_or_path)
    if args.ref.name_or_path:
        args.ref.name_or_path = embedded.resolve_model(args.ref.name_or_path)
    args.run_dir = str(Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed)))
    args.vllm.in_process = False
    engines = rollout.create_engines(args.actor.model.name_or_path, args.vllm, seed=args.train.seed,
                                     actor_options=engine_options, init_broadcast=False)  # fmt: skip
    group = None
    try:
        group = placement.ModelGroup(placement.Worker, n, "actor", pg=pg, num_cpus_per_rank=share,
                                     num_gpus_per_rank=share if gpu else 0, timeout_s=args.ray.timeout_s,
                                     backend=args.ds.backend)  # fmt: skip
        group.timeout_s = 10 * 365 * 86400.0  # the whole run is one call; a rank that dies still ends it at once
        return group.run(_run_rank, args, engines, os.getcwd())[0]
    finally:
        if group is not None:
            group.shutdown()
        engines.shutdown()


def _run_rank(worker, args: Args, engines, cwd: str) -> dict:
    os.chdir(cwd)  # relative paths of the command line mean what they meant to the driver
    return main(args, engines)


def main(args: Args, engines: rollout.RolloutEngines | None = None) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if args.algo.filter_zero_variance and args.rollout.n_samples < 2:
        raise ValueError(f"--algo.filter-zero-variance needs --rollout.n-samples >= 2, got {args.rollout.n_samples}: "
                         "every group of 1 sample has zero variance and would be dropped")  # fmt: skip
    if args.algo.baseline == "group" and args.rollout.n_samples < 2:
        raise ValueError(f"--algo.baseline group needs --rollout.n-samples >= 2, got {args.rollout.n_samples}")
    # PLUMBING: `--train.ranks 1`: this process holds the DeepSpeed actor and an in-process vLLM engine. N > 1: the
    # driver starts Ray, the engine actors and N ranks, each of which runs this function with the engines given.
    if args.train.ranks > 1 and engines is None:
        return launch(args)
    rank, world, device = ds_engine.init_distributed(args.ds.backend, args.ds.timeout_s)
    if world > 1 and engines is None:
        raise ValueError("several trainer ranks: use --train.ranks N (Ray placement, shared vLLM engine actors), "
                         "not torchrun")  # fmt: skip
    # Seeds: data order and sampling seeds are derived from (seed, step); RNGs seeded once for the rest.
    random.seed(args.train.seed)
    np.random.seed(args.train.seed)
    torch.manual_seed(args.train.seed)
    actor_path = embedded.resolve_model(args.actor.model.name_or_path)
    args.actor.model.name_or_path = actor_path
    # PLUMBING: each prompt must leave room for its response in the model's context: rows that cannot fit are
    # skipped and counted here, instead of failing inside the rollout engine mid-run
    multi_turn = args.rollout.env_file is not None
    reserve = args.rollout.max_new_tokens + (args.rollout.max_total_tokens if multi_turn else 0)
    reserve_flag = "--rollout.max-new-tokens" + (" + --rollout.max-total-tokens" if multi_turn else "")
    limits = {"max_position_embeddings of --actor.model.name-or-path":
              models.max_positions(actor_path, "--actor.model.name-or-path"),
              "--vllm.max-model-len": args.vllm.max_model_len}  # fmt: skip
    args.data.max_len = data.resolve_max_len(args.data.max_len, limits, reserve, reserve_flag)
    tokenizer = models.load_tokenizer(args.actor.model.tokenizer or actor_path,
                                      "--actor.model.name-or-path / --actor.model.tokenizer")  # fmt: skip
    make = partial(data.prompt_example, tokenizer=tokenizer, cfg=args.data, reserve=reserve)
    train_set = data.mix(data.build_examples(data.load_sources(args.data.path, args.data.split, args.data.max_samples),
                                             make, args.data), args.data.probs, args.train.seed)  # fmt: skip
    eval_sources = data.load_sources(args.data.eval_path or args.data.path, args.data.eval_split, args.eval.max_samples)
    eval_set = [e for g in data.build_examples(eval_sources, make, args.data) for e in g]
    reward_func, reward_source = load_reward_func(args.reward)

    model = models.load_causal_lm(args.actor.model, "--actor.model.name-or-path").to(device)
    total_updates = args.train.max_steps * args.train.minibatches * args.train.epochs
    actor = ds_engine.make_engine(
        model, args.ds, args.actor.lr, total_updates, args.actor.warmup_steps, hybrid=args.vllm.enable_sleep
    )
    ref = None
    if args.algo.kl_coef > 0:  # PLUMBING: frozen reference policy (--ref.*), only when the KL penalty is on
        ref_path = embedded.resolve_model(args.ref.name_or_path or actor_path)
        ref_flag = "--ref.name-or-path" if args.ref.name_or_path else "--actor.model.name-or-path"
        ref_model = models.load_causal_lm(ModelConfig(name_or_path=ref_path, dtype=args.actor.model.dtype), ref_flag)
        ref = ds_engine.make_frozen(ref_model, args.ref, device)
    if engines is None:
        engines = rollout.create_engines(actor_path, args.vllm, seed=args.train.seed)
    elif rank == 0 and engines.backend == "broadcast":
        engines.init_broadcast()  # this rank sends the weights to the engine actors

    run_dir = Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed))
    ckpt_dir = Path(args.ckpt.dir or run_dir / "checkpoints")
    # PLUMBING: resume from the newest intact checkpoint (flags checked against config.json); (0, {}) if new
    start_step, client = checkpoint.resume({"actor": actor}, ckpt_dir, run_dir, args)
    if start_step:
        placement.sync_weights(engines, actor, rank)  # the engines start from the checkpoint's weights
    kl_ctl = (rl_math.AdaptiveKLController(args.algo.kl_coef, args.algo.kl_target, args.algo.kl_horizon)
              if args.algo.kl_target else rl_math.FixedKLController(args.algo.kl_coef))  # fmt: skip
    kl_ctl.load_state_dict(client.get("kl_ctl", kl_ctl.state_dict()))
    logger = RunLogger(args.logger, run_dir, args, args.train.max_steps, enabled=rank == 0, resume_step=start_step)
    # PLUMBING: the agent executor: prompt tokens -> vLLM generation -> checked reward (single turn), or turns of
    # generation and environment feedback (`--rollout.env-file`); the loop below is the same for both
    if args.rollout.env_file:
        executor = MultiTurnExecutor(engines, tokenizer, load_env_factory(args.rollout.env_file),
                                     args.rollout.max_new_tokens, args.rollout.max_turns, args.rollout.max_total_tokens,
                                     args.rollout.temperature, args.rollout.top_p)  # fmt: skip
    else:
        executor = SingleTurnExecutor(engines, tokenizer, partial(score, reward_func, reward_source),
                                      args.rollout.max_new_tokens, args.rollout.temperature, args.rollout.top_p)  # fmt: skip
    if args.vllm.enable_sleep:  # hybrid engine: DeepSpeed states stay off the GPU while the engines generate
        placement.offload_states(actor)
    first_eval = client.get("first_eval") or all_ranks(evaluate(executor, eval_set, args) if rank == 0 else None, world)
    best = client.get("best", -math.inf)  # the best eval so far (`--eval.best-metric`), exported to <run>/best
    if start_step == 0:  # a resumed run logged it when it started
        logger.log(first_eval, 0, shown=("eval/pass@1",))
    logger.print(f"[reinforce_pp] {len(train_set)} prompts, {world} trainer rank(s), eval pass@1 "
                 f"{first_eval['eval/pass@1']:.3f} at step {start_step}")  # fmt: skip

    G = args.rollout.n_samples

    def generate(step: int, round_: int) -> Rollout:
        """This rank's share of the step's prompts (round > 0: a refill), G episodes each. Seeds follow the prompt's
        place in the global batch, so the samples do not depend on the number of ranks."""
        idx = data.batch_indices(len(train_set), args.rollout.batch_size, step, args.train.seed + 7919 * round_)
        mine = placement.split_contiguous(list(range(len(idx))), world)[rank]
        base = args.train.seed * 1_000_003 + step * 10_007 + round_
        return executor.run([train_set[idx[j]] for j in mine], G, [base + j * G for j in mine], step)

    for step in range(start_step, args.train.max_steps):
        perf: dict = {}
        # 2. rollout: G episodes per prompt through the agent executor, token ids in, token ids + log-probs out
        with timer(perf, "perf/gen_s"):
            ro = generate(step, 0)
            extra, want = dict(ro.logs), len(ro.episodes) // G
            if args.algo.dynamic_filter_range is not None:  # DAPO dynamic sampling with refill
                lo, hi = args.algo.dynamic_filter_range
                fresh_reward, parts, rounds = ro.rewards.mean().item(), [], 0
                while True:
                    parts.append(ro.take_groups(groups_inside(ro.scores, G, lo, hi), G))
                    rounds += 1
                    full = sum(len(p.episodes) for p in parts) >= want * G
                    if full or rounds >= args.algo.dynamic_filter_max_rounds:
                        break
                    ro = generate(step, rounds)
                pool = Rollout.cat(parts)
                if pool.episodes:  # else train on the last round as it is (the zero-variance filter drops most of it)
                    ro = pool.take_groups(torch.arange(len(pool.episodes) // G) < want, G)
                extra.update({"rollout/filter_rounds": rounds, "rollout/filter_groups": len(ro.episodes) // G,
                              "rollout/fresh_reward_mean": fresh_reward})  # fmt: skip
            if world > 1:  # PLUMBING: every rank gets the whole rollout: advantages and minibatches are global
                parts = [None] * world
                torch.distributed.all_gather_object(parts, ro)
                ro, extra = Rollout.cat(parts), all_ranks(extra, world, reduce=True)
            if args.vllm.enable_sleep:  # hybrid engine: the engines' GPU memory goes to training
                if rank == 0:
                    engines.sleep()
                placement.reload_states(actor)  # DeepSpeed states back on the GPU (no-op on CPU)
            episodes, rewards = ro.episodes, ro.rewards

        # 3. rewards and advantages
        truncated = torch.tensor([e.truncated for e in episodes], dtype=torch.bool)
        if args.reward.stop_properly_penalty is not None:
            rewards = torch.where(truncated, torch.tensor(args.reward.stop_properly_penalty), rewards)
        if args.reward.overlong_buffer:
            lengths = torch.tensor([len(e.token_ids) for e in episodes])
            rewards = rewards + rl_math.overlong_penalty(lengths, args.rollout.max_new_tokens,
                                                         args.reward.overlong_buffer,
                                                         args.reward.overlong_penalty_factor)  # fmt: skip
        rewards = rewards.clamp(-args.reward.clip, args.reward.clip)
        keep = torch.ones(len(episodes), dtype=torch.bool)
        if args.algo.filter_zero_variance:  # optional (off): drops whole groups whose rewards all agree
            keep = (rewards.view(-1, G).std(dim=1) > 0).repeat_interleave(G)
        kept = keep.nonzero().flatten().tolist()  # prompt-major, whole groups: the order the group baseline needs
        stats = {
            "rollout/reward_mean": rewards.mean().item(),
            "rollout/response_len_mean": float(np.mean([len(e.token_ids) for e in episodes])),
            "rollout/truncated_frac": truncated.float().mean().item(),
            "rollout/kept_frac": keep.float().mean().item(),
            **extra,
        }

        # 4. policy update: old and reference log-probs by the trainer (DEVIATION(4)), KL-shaped returns, globally
        #    whitened advantages, then minibatches of the PPO-clipped loss
        with timer(perf, "perf/train_s"):
            if kept:
                seqs = sequences([episodes[i] for i in kept], tokenizer.pad_token_id, device)
                mask = seqs["loss_mask"]
                mb_size = max(1, math.ceil(len(kept) / args.train.minibatches))
                order = list(range(len(kept)))  # advantages are in prompt-major order; minibatches mix prompts
                random.Random(args.train.seed + step).shuffle(order)
                # PLUMBING: each rank trains on its share of every minibatch (all ranks: the same number of passes)
                minibatches = [(rows, shard_minibatch(rows, rank, world, args.train.micro_batch_size))
                               for rows in (order[m0 : m0 + mb_size] for m0 in range(0, len(kept), mb_size))]  # fmt: skip
                # old and reference log-probs of every row, before any update
                with torch.no_grad(), ds_engine.on_device(ref, device):
                    old_logp = torch.zeros(mask.shape, device=mask.device)
                    ref_logp = None if ref is None else torch.zeros(mask.shape, device=mask.device)
                    for _, micro in minibatches:  # this rank's rows (a padding pass writes nothing)
                        for r, real in micro:
                            mb = {k: v[r] for k, v in seqs.items()}
                            logp = forward_logp(actor, mb, args.rollout.temperature)[0]  # a collective: always
                            # the reference too (`--ref.zero-stage 3`)
                            ref_lp = None if ref is None else forward_logp(ref, mb, args.rollout.temperature)[0]
                            if real:
                                old_logp[r] = logp
                                if ref_logp is not None:
                                    ref_logp[r] = ref_lp
                    # PLUMBING: the advantages are whitened over the whole batch, so every rank needs every row's
                    # log-probs: each row was filled by exactly one rank (0 on the others), a sum gathers them
                    if world > 1:
                        for t in (old_logp, ref_logp):
                            if t is not None:
                                torch.distributed.all_reduce(t)
                    kl = torch.zeros_like(old_logp)
                    if ref_logp is not None:  # KL_t of the sampling policy to the reference, on the sampled tokens
                        kl = rl_math.approx_kl(old_logp, ref_logp, args.algo.kl_estimator, mask=mask)
                        stats["loss/kl"] = rl_math.masked_mean(kl, mask).item()
                    # ALGO LOGIC: KL-shaped reward-to-go per token, normalised over every response token of the batch
                    adv_tok = reinforce_pp_advantages(rewards[kept].to(old_logp.device), kl, mask, kl_ctl.value,
                                                      args.algo.gamma, args.algo.baseline, G)  # fmt: skip
                    if "loss/kl" in stats:  # β for the next rollout
                        kl_ctl.update(stats["loss/kl"], mask.shape[0])
                losses, clipfracs, ents, norms = [], [], [], []  # losses: one per optimizer step
                for _ in range(args.train.epochs):
                    for rows, micro in minibatches:
                        n_tok = mask[rows].sum().item()  # the whole minibatch's tokens, over all ranks
                        losses.append(0.0)
                        clipfracs.append(0.0)  # the minibatch's fraction of clipped tokens, weighted as the loss
                        for j, (r, real) in enumerate(micro):
                            mb = {k: v[r] for k, v in seqs.items()}
                            logp, ent = forward_logp(actor, mb, args.rollout.temperature, args.actor.entropy_coef > 0)
                            agg = {"num_tokens": n_tok, "num_seqs": len(rows), "max_len": mask.shape[1]}
                            if args.algo.loss_agg == "seq-mean-token-sum-norm":
                                agg["max_len"] = args.rollout.max_new_tokens
                            # DEVIATION(1): token-mean over the minibatch (the default --algo.loss-agg)
                            loss, pstats = rl_math.policy_loss(
                                logp, old_logp[r], adv_tok[r], mb["loss_mask"], clip_low=args.actor.clip_low,
                                clip_high=args.actor.clip_high, dual_clip=args.actor.dual_clip, level=args.actor.level,
                                agg=args.algo.loss_agg, rollout_logp=mb["rollout_logp"],
                                is_correction=args.algo.is_correction, is_threshold=args.algo.is_threshold, **agg,
                            )  # fmt: skip
                            # DEVIATION(3): no KL term in the loss; the penalty is in the reward (adv_tok)
                            if ent is not None:
                                ent_mean = rl_math.aggregate_loss(ent, mb["loss_mask"], args.algo.loss_agg, **agg)
                                loss = loss - args.actor.entropy_coef * ent_mean
                                if real:
                                    ents.append(rl_math.masked_mean(ent, mb["loss_mask"]).item())
                            ds_engine.check_finite(loss, step)  # stops before the optimizer step
                            # DeepSpeed averages gradients over ranks: × world makes them sum to the global token mean
                            loss = loss * (world if real else 0.0)
                            actor.set_gradient_accumulation_boundary(j == len(micro) - 1)
                            actor.backward(loss)
                            losses[-1] += loss.item()  # the ranks' shares add up to the minibatch loss × world
                            if real:  # token-weighted: the same over any number of ranks (× world, as the loss)
                                share = mb["loss_mask"].sum().item() / max(n_tok, 1) * world
                                clipfracs[-1] += pstats["clipfrac"].item() * share
                        norms.append(ds_engine.optimizer_step(actor, step, "actor"))  # NaN/inf gradients: raise
                upd = {"loss/policy": float(np.mean(losses)), "loss/clipfrac": float(np.mean(clipfracs)),
                       "train/grad_norm": float(np.mean(norms))}  # fmt: skip
                if ents:
                    upd["loss/entropy"] = float(np.mean(ents))
                stats.update(all_ranks(upd, world, reduce=True))  # loss/policy: the mean of (share × world) = the sum
                stats["train/tokens"] = float(mask.sum())

        # 5. weight sync, eval, logging, checkpoint
        with timer(perf, "perf/sync_s"):
            if args.vllm.enable_sleep and rank == 0:  # weights back first, new weights in, then the KV cache
                engines.wake_up(["weights"])
            if kept:
                stats.update(placement.sync_weights(engines, actor, rank))
            if args.vllm.enable_sleep and rank == 0:
                engines.wake_up(["kv_cache"])
            if kept and args.debug:  # on every rank: under ZeRO-3 the trainer's forward is a collective
                rollout.check_weights(engines, actor.module, [episodes[i].prompt_ids + episodes[i].token_ids
                                                              for i in kept[:4]])  # fmt: skip
        stats["train/lr"] = actor.lr_scheduler.get_last_lr()[0]
        stats["train/kl_coef"] = kl_ctl.value
        last = step == args.train.max_steps - 1
        if args.eval.every and ((step + 1) % args.eval.every == 0 or last):
            stats.update(all_ranks(evaluate(executor, eval_set, args) if rank == 0 else None, world))
            if args.eval.best_metric and stats.get(args.eval.best_metric, -math.inf) > best:
                best = stats[args.eval.best_metric]
                ds_engine.export_hf(actor, tokenizer, run_dir / "best")
        n_tokens = sum(len(e.token_ids) for e in episodes)
        perf["perf/tokens_per_s"] = n_tokens / max(perf["perf/gen_s"], 1e-9)
        logger.log({**stats, **perf}, step + 1, shown=("rollout/reward_mean", "eval/pass@1"))
        halted = args.train.halt_after is not None and step + 1 - start_step >= args.train.halt_after and not last
        if halted or (args.ckpt.every and ((step + 1) % args.ckpt.every == 0 or last)):
            state = {"step": step, "first_eval": first_eval, "best": best, "kl_ctl": kl_ctl.state_dict()}
            checkpoint.save({"actor": actor}, ckpt_dir, step, state, args.ckpt.keep_last)
        if args.vllm.enable_sleep and not (last or halted):  # DeepSpeed states off the GPU while the engines generate
            placement.offload_states(actor)
        if halted:
            logger.print(f"[reinforce_pp] halted after {args.train.halt_after} steps; resume with --run-dir {run_dir}")
            logger.close({"steps": step + 1, "halted": True})
            return {"steps": step + 1, "halted": True, "run_dir": str(run_dir)}

    # 6. export, learning curve and summary
    ds_engine.export_hf(actor, tokenizer, run_dir / "hf")
    logger.plot(run_dir / "learning_curve.png", ("rollout/reward_mean", "eval/pass@1"))
    summary = {"steps": args.train.max_steps, "eval_pass@1_first": first_eval["eval/pass@1"],
               "eval_pass@1_last": logger.latest("eval/pass@1"), "reward_mean_last": logger.latest("rollout/reward_mean"),
               "run_dir": str(run_dir)}  # fmt: skip
    logger.close(summary)
    return summary


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(tyro.cli(Args))
