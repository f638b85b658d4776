"""Async GRPO: GRPO with generation running one step ahead of training (Noukhovitch et al. 2024, "Asynchronous
RLHF", arXiv:2410.18252), on the objective of GRPO (Shao et al. 2024, arXiv:2402.03300; see algos/grpo.py).

In algos/grpo.py the engines and the trainer take turns: generate, train, sync, generate... Here a producer thread
asks the engines (Ray actors, their own processes) for step t+1's rollout while this thread trains on step t's, so a
step costs about max(generation, training) + sync instead of their sum. The price is staleness: the rollout of step t
was sampled by the weights after step t − L (L = `--train.max-lag`, 0 is synchronous GRPO), while the trainer holds
those after step t. With μ the sampling (behaviour) policy and π_θ the trainer's current policy:

    A_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + ε)                                  (as GRPO)
    ρ_{i,t} = π_θ(o_{i,t} | ...) / π_old(o_{i,t} | ...),   π_old = π_θ before this step's update (the trust region)
    w_{i,t} = clamp(π_old(o_{i,t} | ...) / μ(o_{i,t} | ...), lo, hi)                     (truncated IS, Yao et al. 2025)
    J(θ) = E_μ[ 1/Σ|o_i| Σ_i Σ_t w_{i,t} · min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_i) − β · KL ]

μ's log-probs are the engine's own (`rollout_logp`); the clip keeps each update near π_old while w corrects for the
samples being L updates old (the decoupled objective of Hilton et al. 2021, arXiv:2110.00641).

Deviations from the paper (Noukhovitch et al. train online DPO on separate GPUs; this is GRPO):
1. Token-mean loss over the whole batch, zero-variance groups dropped, KL off by default: as algos/grpo.py.
2. The off-policy correction is truncated importance sampling on π_old/μ (`--algo.is-correction tis`, the default
   here), not the paper's plain off-policy update: at lag 1 with fp32 engines w ≈ 1 and it changes little; with bf16
   engines or a larger lag it bounds the update.
3. Which weights sample which step is fixed by the lag, not by thread timing: step t is always sampled by the weights
   after update max(t − L, first step) (the trainer waits for the engines rather than skipping ahead), so a run is
   reproducible and resumes exactly (the rollouts generated ahead are saved in the checkpoint).

Everything else is grpo.py's, flag for flag (Dr.GRPO: `--algo.dr-grpo`; DAPO refill: `--algo.dynamic-filter-range`).

Debug (embedded tiny model and task; Ray starts on this machine, the engine runs in a Ray actor):
    python algos/grpo_async.py --train.max-steps 5 --eval.every 5
A real model (not yet run on GPUs; with --train.ranks the engines get GPUs of their own, no colocation by default):
    python algos/grpo_async.py --actor.model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path prompts.jsonl \\
        --data.apply-chat-template --reward.func my_reward.py --rollout.max-new-tokens 1024 --actor.lr 1e-6 \\
        --train.ranks 2 --vllm.num-engines 2
"""

from __future__ import annotations

import math
import os
import random
import threading
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
    n_samples: int = 8
    """G: responses sampled per prompt (the group)."""
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
    max_steps: int = 80
    """RL steps (one rollout + update each)."""
    max_lag: int = 1
    """L: generation runs up to L steps ahead of training, so step t trains on samples drawn by the weights after
    update t − L (0: synchronous, as grpo.py). The producer thread never starts step t's rollout before those
    weights are in the engines, and the trainer never syncs newer weights before it has finished."""
    minibatches: int = 2
    """optimizer steps per rollout: the batch is split into this many minibatches."""
    epochs: int = 1
    """passes over each rollout."""
    micro_batch_size: int = 128
    """sequences per forward/backward (gradient accumulation covers the minibatch)."""
    seed: int = 1
    """seed of the prompt order, the sampling seeds and every RNG."""
    ranks: int = 1
    """data-parallel trainer ranks. 1: this process trains, the vLLM engines are Ray actors on this machine. N > 1:
    N Ray actors forming one DeepSpeed world on a placement group (`--ray.*`) beside the engine actors
    (`--vllm.num-engines`); rank 0 generates (its producer thread) and sends the weights."""
    colocate: bool = False
    """with ranks > 1: each vLLM engine shares a placement-group bundle with a trainer rank (both then run at once on
    it: on GPU, leave memory for both with `--vllm.gpu-memory-utilization`); off: the engines get bundles of their
    own, the usual layout for async training."""
    halt_after: int | None = None
    """stop this invocation after N steps with a checkpoint; the same command with `--run-dir <run>` resumes exactly
    (for time-limited cluster jobs)."""


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
    is_correction: Literal["tis", "icepop", "seq-mask-tis"] | None = "tis"
    """importance-sampling correction of the samples' staleness: weight π_old/μ with μ the engine's log-probs (see
    core/rl_math.policy_loss); DEVIATION(2). None trusts the stale samples as on-policy."""
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
    vllm: VLLMConfig = field(default_factory=lambda: VLLMConfig(in_process=False))
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


class Pipeline:
    """PLUMBING: the hand-off between the producer thread (rank 0), which generates rollouts, and the training loop.

    `synced` counts the updates whose weights are in the engines; `ready[t]` holds step t's rollout once generated.
    The producer starts step t when synced >= t − lag; the trainer syncs update u + 1 only after every step up to
    u + lag is generated. Together: step t is sampled by exactly the weights of update max(t − lag, first step), and
    the engines never generate during a sync or an eval. Errors of the producer are raised in the trainer."""

    def __init__(self, produce, first: int, last: int, lag: int, carried: dict):
        self.produce, self.last, self.lag = produce, last, lag
        self.synced, self.ready, self.error, self.stopped = first, dict(carried), None, False
        self.generated = first + len(carried)  # steps < generated are in `ready` or already trained on
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def _run(self) -> None:
        try:
            for t in range(self.generated, self.last):
                with self.cond:
                    self.cond.wait_for(lambda t=t: self.synced >= t - self.lag or self.stopped)
                    if self.stopped:
                        return
                    version = self.synced
                item = self.produce(t, version)
                with self.cond:
                    self.ready[t], self.generated = item, t + 1
                    self.cond.notify_all()
        except BaseException as e:  # handed to the trainer, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait(self, done) -> None:
        with self.cond:
            self.cond.wait_for(lambda: done() or self.error is not None)
            if self.error is not None:
                raise self.error

    def take(self, t: int):
        """Step t's rollout (waits for it)."""
        self._wait(lambda: t in self.ready)
        with self.cond:
            return self.ready.pop(t)

    def engines_idle_for(self, t: int) -> dict:
        """Wait until every rollout that the weights before update t + 1 must sample is generated; the engines are
        then idle until `synced(t + 1)`. Returns those rollouts (steps t + 1 .. t + lag), which a checkpoint keeps."""
        self._wait(lambda: self.generated >= min(t + self.lag + 1, self.last))
        with self.cond:
            return dict(self.ready)

    def synced_update(self, t: int) -> None:
        """The engines hold the weights after step t's update: the producer may go on."""
        with self.cond:
            self.synced = t + 1
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=60)


def main(args: Args, engines: rollout.RolloutEngines | None = None) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if args.rollout.n_samples < 2:  # ALGO LOGIC: a group of one has advantage 0 (NaN with the std scaling)
        raise ValueError(f"--rollout.n-samples {args.rollout.n_samples}: GRPO's group-relative advantage needs at least "
                         "2 samples per prompt (with --algo.filter-zero-variance every group of 1 is dropped)")  # fmt: skip
    # PLUMBING: `--train.ranks 1`: this process holds the DeepSpeed actor, the vLLM engines are Ray actors (their own
    # processes, so that they generate while this one trains). N > 1: the driver starts Ray, the engine actors and N
    # ranks, each of which runs this function with the engines given.
    if args.vllm.in_process or args.vllm.enable_sleep:
        raise ValueError("grpo_async.py generates while it trains: the engines must be Ray actors with their own "
                         "memory (no --vllm.in-process, no --vllm.enable-sleep; algos/grpo.py has both)")  # fmt: skip
    if args.train.max_lag < 0:
        raise ValueError(f"--train.max-lag {args.train.max_lag}: must be 0 (synchronous) or more")
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
    if args.algo.dr_grpo:
        args.algo.scale_by_std, args.algo.loss_agg = False, "seq-mean-token-sum-norm"
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
    actor = ds_engine.make_engine(model, args.ds, args.actor.lr, total_updates, args.actor.warmup_steps)
    ref = None
    if args.algo.kl_coef > 0:  # PLUMBING: frozen reference policy (--ref.*), only when the KL penalty is on
        ref_path = embedded.resolve_model(args.ref.name_or_path or actor_path)
        ref_flag = "--ref.name-or-path" if args.ref.name_or_path else "--actor.model.name-or-path"
        ref_model = models.load_causal_lm(ModelConfig(name_or_path=ref_path, dtype=args.actor.model.dtype), ref_flag)
        ref = ds_engine.make_frozen(ref_model, args.ref, device)
    own_engines = engines is None  # started here (one process): shut down here, with Ray if it was started here
    own_ray = False
    if own_engines and device.type == "cpu":
        # PLUMBING: the engines compute while this process trains: leave them their cores (one each per tensor-
        # parallel worker). Oversubscribed, a step took 12 s instead of 0.5 s on 2 cores (OpenMP threads spinning).
        free = len(os.sched_getaffinity(0)) - args.vllm.num_engines * args.vllm.tensor_parallel_size
        torch.set_num_threads(max(1, min(torch.get_num_threads(), free)))
    if own_engines:
        import ray

        own_ray = not ray.is_initialized()
        placement.init_ray(args.ray)  # on this machine, or the cluster at --ray.address
        engines = rollout.create_engines(actor_path, args.vllm, seed=args.train.seed)
    elif rank == 0 and engines.backend == "broadcast":
        engines.init_broadcast()  # this rank sends the weights to the engine actors
    pipe = None
    try:
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
        # PLUMBING: the agent executor (single turn, or turns with an environment), called from the producer thread
        if args.rollout.env_file:
            executor = MultiTurnExecutor(engines, tokenizer, load_env_factory(args.rollout.env_file),
                                         args.rollout.max_new_tokens, args.rollout.max_turns,
                                         args.rollout.max_total_tokens, args.rollout.temperature,
                                         args.rollout.top_p)  # fmt: skip
        else:
            executor = SingleTurnExecutor(engines, tokenizer, partial(score, reward_func, reward_source),
                                          args.rollout.max_new_tokens, args.rollout.temperature,
                                          args.rollout.top_p)  # fmt: skip
        first_eval = client.get("first_eval") or all_ranks(evaluate(executor, eval_set, args) if rank == 0 else None,
                                                           world)  # fmt: skip
        best = client.get("best", -math.inf)  # the best eval so far (`--eval.best-metric`), exported to <run>/best
        if start_step == 0:  # a resumed run logged it when it started
            logger.log(first_eval, 0, shown=("eval/pass@1",))
        logger.print(f"[grpo_async] {len(train_set)} prompts, {world} trainer rank(s), max lag "
                     f"{args.train.max_lag}, eval pass@1 {first_eval['eval/pass@1']:.3f} at step {start_step}")  # fmt: skip

        G = args.rollout.n_samples

        def generate(step: int, round_: int) -> Rollout:
            """The step's prompts (round > 0: a refill), G episodes each; seeds follow the prompt's place in the
            batch, as in grpo.py."""
            idx = data.batch_indices(len(train_set), args.rollout.batch_size, step, args.train.seed + 7919 * round_)
            base = args.train.seed * 1_000_003 + step * 10_007 + round_
            return executor.run([train_set[i] for i in idx], G, [base + j * G for j in range(len(idx))], step)

        def produce(step: int, version: int) -> dict:
            """2. rollout of one step, in the producer thread: G episodes per prompt, DAPO refills when asked."""
            perf: dict = {}
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
                    if pool.episodes:  # else train on the last round as it is
                        ro = pool.take_groups(torch.arange(len(pool.episodes) // G) < want, G)
                    extra.update({"rollout/filter_rounds": rounds, "rollout/filter_groups": len(ro.episodes) // G,
                                  "rollout/fresh_reward_mean": fresh_reward})  # fmt: skip
            extra["rollout/lag"] = step - version  # updates between the sampling weights and the trained ones
            return {"rollout": ro, "extra": extra, "perf": perf}

        if rank == 0:
            pipe = Pipeline(produce, start_step, args.train.max_steps, args.train.max_lag, client.get("ahead", {}))
            pipe.thread.start()

        for step in range(start_step, args.train.max_steps):
            perf: dict = {}
            with timer(perf, "perf/wait_s"):  # the trainer idle: the rollout is not ready yet
                item = all_ranks(pipe.take(step) if rank == 0 else None, world)
            ro, extra = item["rollout"], item["extra"]
            perf.update(item["perf"])
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
            # ALGO LOGIC: group-relative advantage, one scalar per response, broadcast to its tokens
            adv = group_advantages(rewards, G, scale_by_std=args.algo.scale_by_std)
            keep = torch.ones(len(episodes), dtype=torch.bool)
            if args.algo.filter_zero_variance:  # DEVIATION(1): uninformative groups dropped
                keep = (rewards.view(-1, G).std(dim=1) > 0).repeat_interleave(G)
            kept = keep.nonzero().flatten().tolist()
            stats = {
                "rollout/reward_mean": rewards.mean().item(),
                "rollout/response_len_mean": float(np.mean([len(e.token_ids) for e in episodes])),
                "rollout/truncated_frac": truncated.float().mean().item(),
                "rollout/kept_frac": keep.float().mean().item(),
                **extra,
            }

            # 4. policy update on the (stale) rollout: π_old = the weights before this update, the IS weight π_old/μ
            with timer(perf, "perf/train_s"):
                if kept:
                    random.Random(args.train.seed + step).shuffle(kept)
                    seqs = sequences([episodes[i] for i in kept], tokenizer.pad_token_id, device)
                    mask = seqs["loss_mask"]
                    adv_tok = adv[kept][:, None].expand_as(mask).float()
                    mb_size = max(1, math.ceil(len(kept) / args.train.minibatches))
                    # PLUMBING: each rank trains on its share of every minibatch (all ranks: the same number of passes)
                    minibatches = [(rows, shard_minibatch(rows, rank, world, args.train.micro_batch_size))
                                   for rows in (list(range(m0, min(m0 + mb_size, len(kept))))
                                                for m0 in range(0, len(kept), mb_size))]  # fmt: skip
                    # one optimizer step per rollout: π_old is the live policy detached (ratio 1; the staleness is
                    # the IS weight's business), so the extra forward pass for old log-probs is skipped
                    on_policy = args.train.minibatches == 1 and args.train.epochs == 1
                    # old and reference log-probs of this rank's rows, before any update
                    with torch.no_grad(), ds_engine.on_device(ref, device):
                        old_logp = None if on_policy else torch.zeros(mask.shape, device=mask.device)
                        ref_logp = None if ref is None else torch.zeros(mask.shape, device=mask.device)
                        for _, micro in minibatches:
                            for r, _ in micro:
                                mb = {k: v[r] for k, v in seqs.items()}
                                if old_logp is not None:
                                    old_logp[r] = forward_logp(actor, mb, args.rollout.temperature)[0]
                                if ref_logp is not None:
                                    ref_logp[r] = forward_logp(ref, mb, args.rollout.temperature)[0]
                    losses, clipfracs, kls, ents, norms, isw = [], [], [], [], [], []  # losses: one per optimizer step
                    for _ in range(args.train.epochs):
                        for rows, micro in minibatches:
                            n_tok = mask[rows].sum().item()  # the whole minibatch's tokens, over all ranks
                            losses.append(0.0)
                            for j, (r, real) in enumerate(micro):
                                mb = {k: v[r] for k, v in seqs.items()}
                                logp, ent = forward_logp(actor, mb, args.rollout.temperature,
                                                         args.actor.entropy_coef > 0)  # fmt: skip
                                agg = {"num_tokens": n_tok, "num_seqs": len(rows), "max_len": mask.shape[1]}
                                if args.algo.loss_agg == "seq-mean-token-sum-norm":
                                    agg["max_len"] = args.rollout.max_new_tokens
                                old = logp.detach() if on_policy else old_logp[r]
                                # ALGO LOGIC: clipped surrogate around π_old, times clamp(π_old / μ) (DEVIATION(2))
                                loss, pstats = rl_math.policy_loss(
                                    logp, old, adv_tok[r], mb["loss_mask"], clip_low=args.actor.clip_low,
                                    clip_high=args.actor.clip_high, dual_clip=args.actor.dual_clip,
                                    level=args.actor.level, agg=args.algo.loss_agg, rollout_logp=mb["rollout_logp"],
                                    is_correction=args.algo.is_correction, is_threshold=args.algo.is_threshold, **agg,
                                )  # fmt: skip
                                if ref_logp is not None:
                                    kl = rl_math.approx_kl(logp, ref_logp[r], args.algo.kl_estimator,
                                                           mask=mb["loss_mask"])  # fmt: skip
                                    kl_loss = rl_math.aggregate_loss(kl, mb["loss_mask"], args.algo.loss_agg, **agg)
                                    loss = loss + kl_ctl.value * kl_loss
                                    if real:
                                        kls.append(rl_math.masked_mean(kl, mb["loss_mask"]).item())
                                if ent is not None:
                                    ent_mean = rl_math.aggregate_loss(ent, mb["loss_mask"], args.algo.loss_agg, **agg)
                                    loss = loss - args.actor.entropy_coef * ent_mean
                                    if real:
                                        ents.append(rl_math.masked_mean(ent, mb["loss_mask"]).item())
                                ds_engine.check_finite(loss, step)  # stops before the optimizer step
                                # DeepSpeed averages gradients over ranks: × world makes them sum to the token mean
                                loss = loss * (world if real else 0.0)
                                actor.set_gradient_accumulation_boundary(j == len(micro) - 1)
                                actor.backward(loss)
                                losses[-1] += loss.item()  # the ranks' shares add up to the minibatch loss × world
                                if real:
                                    clipfracs.append(pstats["clipfrac"].item())
                                    if "is_weight_mean" in pstats:
                                        isw.append(pstats["is_weight_mean"].item())
                            norms.append(ds_engine.optimizer_step(actor, step, "actor"))  # NaN/inf gradients: raise
                    upd = {"loss/policy": float(np.mean(losses)), "train/grad_norm": float(np.mean(norms))}
                    upd.update({k: float(np.mean(v)) for k, v in (("loss/clipfrac", clipfracs), ("loss/kl", kls),
                                                                  ("loss/entropy", ents), ("loss/is_weight", isw)) if v})  # fmt: skip
                    stats.update(all_ranks(upd, world, reduce=True))  # loss/policy: the mean of (share × world) = sum
                    stats["train/tokens"] = float(mask.sum())
                    if "loss/kl" in stats:
                        kl_ctl.update(stats["loss/kl"], len(kept))

            # 5. weight sync (once the engines have drawn what the old weights must draw), eval, logging, checkpoint
            with timer(perf, "perf/wait_s"):
                ahead = pipe.engines_idle_for(step) if rank == 0 else {}
            with timer(perf, "perf/sync_s"):
                stats.update(placement.sync_weights(engines, actor, rank))  # every step: the lag counts updates
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
                # the rollouts generated ahead (steps step+1 .. step+lag) travel with the checkpoint: a resumed run
                # trains on the very samples the uninterrupted one would
                state = {"step": step, "first_eval": first_eval, "best": best, "kl_ctl": kl_ctl.state_dict(),
                         "ahead": ahead}  # fmt: skip
                checkpoint.save({"actor": actor}, ckpt_dir, step, state, args.ckpt.keep_last)
            if rank == 0 and not halted:
                pipe.synced_update(step)  # the engines may generate again, now with these weights
            if halted:
                logger.print(
                    f"[grpo_async] halted after {args.train.halt_after} steps; resume with --run-dir {run_dir}"
                )
                logger.close({"steps": step + 1, "halted": True})
                return {"steps": step + 1, "halted": True, "run_dir": str(run_dir)}

        # 6. export, learning curve and summary
        ds_engine.export_hf(actor, tokenizer, run_dir / "hf")
        logger.plot(run_dir / "learning_curve.png", ("rollout/reward_mean", "eval/pass@1"))
        summary = {"steps": args.train.max_steps, "eval_pass@1_first": first_eval["eval/pass@1"],
                   "eval_pass@1_last": logger.latest("eval/pass@1"),
                   "reward_mean_last": logger.latest("rollout/reward_mean"), "run_dir": str(run_dir)}  # fmt: skip
        logger.close(summary)
        return summary
    finally:
        if pipe is not None:
            pipe.stop()
        if own_engines:
            engines.shutdown()
        if own_ray:
            ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(tyro.cli(Args))
