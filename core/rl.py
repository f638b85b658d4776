"""The plumbing every RL script (algos/grpo.py, rloo.py, reinforce_pp.py, ppo.py, grpo_async.py, cispo.py, sapo.py,
opd.py) calls by name.

Plain functions over plain values, no trainer class: a script's `main` reads top to bottom as

    placed = {"ref": group(args.ref, ...), "reward": reward_group(args.reward)}  # models on Ray ranks of their own
    if engines is None and rl.needs_launch(args.train, placed):
        return rl.launch(main, args, placed)                               # --train.ranks N: every rank runs main
    rank, world, device = rl.init_rank(engines, args.ds, args.train.seed, args.run_dir)  # 1. setup
    tokenizer, train_set, eval_set = rl.load_task(args)
    reward = load_reward(args.rollout, args.reward, groups.get("reward"))  # rewards/ (agents/make.py)
    actor = rl.make_actor(args, device, schedule=partial(lr_schedule, ...))  # the script's lr schedule
    ref = rl.make_ref(args.ref, args.actor.model, device, groups) if <the script's KL term is on> else None
    episodes = partial(make_executor, args.rollout, reward, ...)          # agents/: how prompts become episodes
    run = rl.start(args, {"actor": actor}, engines, tokenizer, eval_set, episodes, rank, world, device, name)
    for step in range(run.start_step, args.train.max_steps):
        ro = rl.collect_rollout(run, args.rollout, train_set, step, refill)  # 2. rollout (the script's refill policy)
        rewards, truncated = rl.shape_rewards(ro, ...the script's shaping)  # 3. rewards -> the script's advantages
        ... the script's update: rl.minibatches(seqs, args.train, ...), rl.micro_batches, rl.forward_logp, its loss,
            rl.backward, optimizer_step
        samples.log(run, step, ro, rewards, keep, trace, G)                # samples.jsonl (core/samples.py)
        stats.update(rl.sync_weights(run, actor))                           # 5. sync, eval, log, checkpoint
        if rl.end_step(run, args.eval, args.ckpt, step, stats, state):      # True: --train.halt-after stops here
            return rl.finish(run, actor, tokenizer, halted_at=step)
    return rl.finish(run, actor, tokenizer)                                 # 6. export and summary

The script wires the pieces: its reward (rewards/), its episode executor (agents/) and the models it places in
groups of their own (`core.placement.Group`); core runs what it is given and imports neither agents/ nor rewards/.
The launch over several processes (`launch`, `needs_launch`) is `core.launch`'s, imported here for the scripts.
Only the launch and start functions (`launch`, `load_task`, `make_actor`, `start`) take the whole `Args`; every
other function takes the sections it reads (`args.train`, `args.rollout`, `args.eval`, ...), and what the loop needs
of the run's settings after `start` (its seed, steps, halt, hybrid engine, `--debug`) is in the `Run` it returns.
Core decides no algorithm: what a script chooses (the filter, the reward shaping, whether a reference is loaded, the
loss and its normalisers) it passes here as plain values; nothing here reads `args.algo`. Distributed bookkeeping
lives here, not in the loss: with `--train.ranks N` every rank holds the whole rollout and
trains on its share of every minibatch (`minibatches`), in as many passes as every other rank (under ZeRO-3 each
forward is a collective), and `backward` scales the loss so that DeepSpeed's average over ranks is the minibatch's
token mean. Metric names mean one thing in every script (see `core.logger.Meter`).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from core import (
    checkpoint,
    data,
    models,
    moe,
    packing,
    placement,
    rl_math,
    rollout,
    samples,
    sequence_parallel,
    vision,
)
from core import engine as ds_engine
from core.config import ModelConfig, actor_lr, samples_per_update
from core.episode import Episode, Rollout
from core.launch import check_files, engine_lora_rank
from core.launch import launch as launch  # the scripts call it as rl.launch
from core.launch import needs_launch as needs_launch  # and rl.needs_launch
from core.logger import RunLogger, lock_run_dir, run_name
from core.placement import all_ranks, shard_minibatch


# ----------------------------------------------------------------------------------------------------- 1. setup
def init_rank(engines, ds, seed: int, run_dir: str | None) -> tuple[int, int, torch.device]:
    """Join the trainer world (`ds`: the `--ds.*` section's backend and timeout) and seed every RNG from `seed`
    (`--train.seed`; data order and sampling seeds are derived from (seed, step), so they do not depend on these).
    `engines` None: this process starts the run, and its `--run-dir` is checked first. Returns (rank, world, device)."""
    if engines is None:  # this process starts the run (a rank of `launch` was checked by its driver)
        check_files(run_dir)
        # an earlier run's in-process engine, dropped unclosed, would destroy this run's world later
        rollout.release_dropped_engines()
    rank, world, device = ds_engine.init_distributed(ds.backend, ds.timeout_s)
    if world > 1 and engines is None:
        raise ValueError("several trainer ranks: use --train.ranks N (Ray placement, shared vLLM engine actors), "
                         "not torchrun")  # fmt: skip
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return rank, world, device


def response_budget(ro_cfg) -> tuple[int, str]:
    """Tokens each prompt must leave free in the context for its response (`ro_cfg`: the `--rollout.*` section), and
    the flags that set them."""
    multi_turn = ro_cfg.env_file is not None or ro_cfg.agent_file is not None
    reserve = ro_cfg.max_new_tokens + (ro_cfg.max_total_tokens if multi_turn else 0)
    return reserve, "--rollout.max-new-tokens" + (" + --rollout.max-total-tokens" if multi_turn else "")


def load_task(args) -> tuple[object, list[dict], list[dict]]:
    """The task: the tokenizer, the (mixed) training prompts and the eval prompts, loaded and checked before any
    model (the reward is the script's: `agents.make.load_reward`). A prompt must leave room for its response in the
    model's context: rows that cannot fit are skipped and counted here, instead of failing inside the rollout engine
    mid-run."""
    actor_path = args.actor.model.name_or_path
    reserve, reserve_flag = response_budget(args.rollout)
    limits = {"max_position_embeddings of --actor.model.name-or-path":
              models.max_positions(actor_path, "--actor.model.name-or-path"),
              "--vllm.max-model-len": args.vllm.max_model_len}  # fmt: skip
    cfg = replace(args.data, max_len=data.resolve_max_len(args.data.max_len, limits, reserve, reserve_flag))
    tokenizer = models.load_tokenizer(args.actor.model.tokenizer or actor_path,
                                      "--actor.model.name-or-path / --actor.model.tokenizer")  # fmt: skip
    make = partial(data.prompt_example, tokenizer=tokenizer, cfg=cfg, reserve=reserve)
    if cfg.image_key:  # vision-language: each row's picture joins its prompt (core/vision.py)
        make = vision.with_image(make, cfg, tokenizer, vision.load_image_processor(actor_path))
    train_set = data.mix(data.build_examples(data.load_sources(cfg.path, cfg.split, cfg.max_samples), make, cfg),
                         cfg.probs, args.train.seed)  # fmt: skip
    eval_sources = data.load_sources(cfg.eval_path or cfg.path, cfg.eval_split, args.eval.max_samples)
    eval_set = [e for g in data.build_examples(eval_sources, make, cfg) for e in g]
    return tokenizer, train_set, eval_set


def make_actor(args, device: torch.device, lr: float, schedule=None):
    """The trained policy: `--actor.model.*` as a DeepSpeed engine with AdamW at peak lr `lr` (the script's choice:
    `--actor.lr`, or `scaled_lr` of it), `--actor.adam-betas` and `--actor.weight-decay`, and the script's
    learning-rate schedule (`schedule(update)`: the peak lr's multiplier at each optimizer step, the script's
    `lr_schedule`; None: constant). `--actor.routing-replay`: what it does not carry, and a dense or unsupported
    actor, are refused before the model loads (`core.moe.check_replay_flags`, `check_config`)."""
    if args.actor.routing_replay:
        from transformers import AutoConfig

        moe.check_replay_flags(args)
        path = models._check_model_path(args.actor.model.name_or_path, "--actor.model.name-or-path")
        moe.check_config(AutoConfig.from_pretrained(path), "--actor.routing-replay")
    model = models.load_causal_lm(args.actor.model, "--actor.model.name-or-path").to(device)
    if args.actor.routing_replay:
        moe.check_routing_replay(model, "--actor.routing-replay")
    if args.train.sp_size > 1:  # --train.sp-size: the actor's forwards split each row's tokens over an SP group
        if not args.train.packing or args.data.image_key:  # (models on ranks of their own: refused by `launch`)
            raise ValueError("--train.sp-size needs --train.packing and is not built for pictures (--data.image-key: "
                             "padded forwards)")  # fmt: skip
        sequence_parallel.setup(model, args.train.sp_size)
    ds_engine.tp_data_split(args.ds, args.train.sp_size)  # --ds.tensor-parallel-size: refused with SP or a bad size
    a = args.actor
    engine = ds_engine.make_engine(model, args.ds, lr, schedule, weight_decay=a.weight_decay, betas=a.adam_betas,
                                   hybrid=args.vllm.enable_sleep, ema_beta=a.ema_beta)  # fmt: skip
    engine.replays_routing = a.routing_replay  # `forward_logp` replays the engine's routing on this model only
    return engine


def scaled_lr(actor, ro_cfg, train) -> float:
    """The actor's peak lr for this run's samples per optimizer step (`core.config.actor_lr`: `--actor.lr` scaled down
    by samples / `--actor.lr-ref-samples` for a smaller minibatch, the linear scaling rule); the `--actor.*`,
    `--rollout.*` and `--train.*` sections. The RL scripts call it for the lr they give `make_actor`."""
    return actor_lr(actor, samples_per_update(ro_cfg, train))


def make_ref(cfg, model: ModelConfig, device: torch.device, groups: dict | None = None, actor=None):
    """The frozen reference policy of a KL term (`cfg`: the `--ref.*` section; its model defaults to the actor's
    starting one, `model`: `--actor.model.*`); the script calls it only when its KL term is on. With `--ref.ranks N`:
    built in the reference's own group (`build_model`). A LoRA `actor` (`--actor.model.lora-rank N`) whose reference
    is its own starting model is its own reference: the actor engine with its adapters switched off
    (`core.engine.AdaptersOff`, the frozen base it adapts), no second copy of the weights (`--ref.zero-stage` and
    `--ref.offload` then do not apply: the reference lives where the actor does)."""
    own_base = cfg.name_or_path in (None, model.name_or_path)
    if actor is not None and model.lora_rank > 0 and own_base and not (groups and "ref" in groups):
        return ds_engine.AdaptersOff(actor)
    return build_model(groups, "ref", load_ref, device, cfg, model)


def load_ref(cfg, model: ModelConfig, role: str = "ref", device: torch.device | None = None):
    """A frozen policy as a DeepSpeed inference engine: `cfg` (a `RefConfig` section, `--ref.*`; a fork's second
    reference passes its own, e.g. `build_model(groups, "ref2", load_ref, device, args.ref2, args.actor.model, "ref2")`)
    names the model (default the actor's starting one, `model`) and its ZeRO stage; the actor's dtype. Flags in
    errors are named by `role`."""
    path = cfg.name_or_path or model.name_or_path
    flag = f"--{role}.name-or-path" if cfg.name_or_path else "--actor.model.name-or-path"
    frozen = models.load_causal_lm(ModelConfig(name_or_path=path, dtype=model.dtype, load_in_4bit=cfg.load_in_4bit),
                                   flag, frozen=True)  # fmt: skip
    return ds_engine.make_frozen(frozen, cfg, device)


@dataclass
class Run:
    """What the loop of an RL script needs besides its models: the world, the engines and the agent executor, the run
    folder, the logger, and where the run starts (a resumed run: the checkpoint's step and client state)."""

    rank: int
    world: int
    device: torch.device
    models: dict  # {"actor": engine, ...}: checkpointed, offloaded while the engines generate (hybrid engine)
    engines: rollout.RolloutEngines
    executor: object  # the script's episode executor (agents/): `run(batch, n, seed, step) -> Rollout`, `close()`
    eval_set: list[dict]
    run_dir: Path
    ckpt_dir: Path
    logger: RunLogger
    start_step: int
    client: dict  # the checkpoint's client state ({} for a new run)
    first_eval: dict
    best: float = -math.inf
    name: str = "rl"
    own_engines: bool = False  # created by this run (single process): `finish` shuts them down
    idle_steps: int = 0  # steps whose update trained nothing (the script's filter dropped every sample)
    # the run's settings the loop reads after `start` (from `--train.*`, `--vllm.enable-sleep`, `--debug`)
    seed: int = 1  # data order and sampling seeds derive from (seed, step)
    max_steps: int = 0
    halt_after: int | None = None  # stop (checkpointed) after this many steps of this process
    hybrid: bool = False  # hybrid engine: the engines sleep while the trainer trains, its states leave the GPU
    debug: bool = False  # check the engines' log-probs against the trainer's after every weight sync


def start(args, engine_models: dict, engines, tokenizer, eval_set: list[dict], episodes, rank: int, world: int,
          device: torch.device, name: str) -> Run:  # fmt: skip
    """Create the rollout engines (or connect to the launcher's), lock the run folder (rank 0; a second run on it is
    refused), resume from the newest intact checkpoint (flags checked against the run's config.json), build the
    script's episode executor over the engines (`episodes(engines, tokenizer)`, e.g. `agents.make.make_executor`)
    and run (or restore) the first eval (none with `--eval.every 0`)."""
    run_dir = Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed))
    lock_run_dir(run_dir, enabled=rank == 0)  # one run writes a run folder: a second one is refused here
    ckpt_dir = Path(args.ckpt.dir or run_dir / "checkpoints")
    checkpoint.refuse_finished(run_dir, ckpt_dir, args.train.max_steps, args.ckpt.resume)  # before the engines
    own_engines = engines is None
    if engines is None:
        if args.vllm.in_process is False or args.vllm.num_engines > 1:  # engine actors: Ray as `--ray.*` says
            placement.init_ray(args.ray)
        engines = rollout.create_engines(args.actor.model.name_or_path, args.vllm, seed=args.train.seed,
                                         tokenizer=args.actor.model.tokenizer,
                                         max_lora_rank=engine_lora_rank(args.actor.model, args.vllm))  # fmt: skip
    elif engines.backend == "broadcast":
        engines.init_broadcast(rank, world)  # rank 0 (or every rank: its ZeRO-3 partitions) sends to the engine actors
    if args.actor.routing_replay:  # each sample carries the experts its engine routed it to
        engines.record_routing()
    start_step, client = checkpoint.resume(engine_models, ckpt_dir, run_dir, args)
    if start_step:
        placement.sync_weights(engines, engine_models["actor"], rank)  # the engines start from the checkpoint's weights
    logger = RunLogger(args.logger, run_dir, args, args.train.max_steps, enabled=rank == 0, resume_step=start_step)
    executor = episodes(engines, tokenizer)  # the script's: single turn, an environment's turns or an agent's calls
    if args.vllm.enable_sleep:  # hybrid engine: DeepSpeed states stay off the GPU while the engines generate
        for m in engine_models.values():
            placement.offload_states(m)
    run = Run(rank, world, device, engine_models, engines, executor, eval_set, run_dir, ckpt_dir, logger, start_step,
              client, first_eval={}, best=client.get("best", -math.inf), name=name, own_engines=own_engines,
              idle_steps=client.get("idle_steps", 0), seed=args.train.seed, max_steps=args.train.max_steps,
              halt_after=args.train.halt_after, hybrid=args.vllm.enable_sleep, debug=args.debug)  # fmt: skip
    if args.eval.every:  # --eval.every 0: no eval at all, the first one included (first_eval stays {})
        run.first_eval = client.get("first_eval") or all_ranks(evaluate(run, args.eval, 0) if rank == 0 else None,
                                                               world)  # fmt: skip
        if start_step == 0:  # a resumed run logged it when it started
            logger.log(run.first_eval, 0, shown=("eval/pass@1",))
    first = run.first_eval.get("eval/pass@1")
    lr = engine_models["actor"].lr_scheduler.base_lrs[0]  # the peak lr the script gave its actor
    if lr != args.actor.lr:
        samples = samples_per_update(args.rollout, args.train)
        logger.print(f"[{name}] --actor.lr {args.actor.lr:g} scaled to {lr:.3g} for {samples:g} samples "
                     f"per optimizer step ({samples:g} / --actor.lr-ref-samples {args.actor.lr_ref_samples}); "
                     "--actor.lr-ref-samples None keeps --actor.lr)")  # fmt: skip
    logger.print(f"[{name}] {len(eval_set)} eval prompts, {world} trainer rank(s), eval pass@1 "
                 f"{'off (--eval.every 0)' if first is None else f'{first:.3f}'} at step {start_step}")  # fmt: skip
    return run


@torch.no_grad()
def evaluate(run: Run, eval_cfg, step: int) -> dict:
    """pass@1 (greedy) and pass@k (k = `eval_cfg.k` > 1 samples at the rollout temperature; `eval_cfg` the `--eval.*`
    section; k = 1: greedy pass@1 only), overall and per data source; an answer is correct when its reward is above
    0.5. The first `--logger.eval-samples` greedy answers go to samples.jsonl under `step` (the metrics row the eval
    belongs to)."""
    eval_set, k = run.eval_set, eval_cfg.k
    greedy = run.executor.run(eval_set, n=1, seed=None, step=-1, temperature=0.0)
    shown = samples.eval_rows(run.executor.tokenizer, greedy, step, run.logger.cfg.eval_samples)
    run.logger.log_samples(shown, step)
    p1 = (greedy.rewards > 0.5).float()
    out = {"eval/pass@1": p1.mean().item()}
    if k > 1:  # (a sampled pass@1 would overwrite the greedy one under the same name)
        sampled = run.executor.run(eval_set, n=k, seed=12345, step=-1)
        out[f"eval/pass@{k}"] = (sampled.rewards > 0.5).float().view(len(eval_set), k).max(dim=1).values.mean().item()
    sources = sorted({e["datasource"] for e in eval_set})
    if len(sources) > 1:
        for s in sources:
            idx = torch.tensor([e["datasource"] == s for e in eval_set])
            out[f"eval/{s}/pass@1"] = p1[idx].mean().item()
    return out


# --------------------------------------------------------------------------------------------------- 2. rollout
def step_prompts(run: Run, ro_cfg, train_set: list[dict], step: int, round_: int = 0) -> tuple[list[dict], list[int]]:
    """This rank's share of the step's `--rollout.batch-size` prompts (`ro_cfg`: the `--rollout.*` section; round > 0:
    a refill) and their sampling seeds (the samples of prompt j get seed j, j + 1, ...). Seeds follow the prompt's
    place in the global batch, so the samples do not depend on the number of ranks."""
    G = ro_cfg.n_samples
    idx = data.batch_indices(len(train_set), ro_cfg.batch_size, step, run.seed + 7919 * round_)
    mine = placement.split_contiguous(list(range(len(idx))), run.world)[run.rank]
    base = run.seed * 1_000_003 + step * 10_007 + round_
    return [train_set[idx[j]] for j in mine], [base + j * G for j in mine]


def generate(run: Run, ro_cfg, train_set: list[dict], step: int, round_: int = 0) -> Rollout:
    """This rank's share of the step's prompts (`step_prompts`), `--rollout.n-samples` episodes each."""
    prompts, seeds = step_prompts(run, ro_cfg, train_set, step, round_)
    return run.executor.run(prompts, ro_cfg.n_samples, seeds, step)


def refill(ro: Rollout, more, G: int, *, keep, max_rounds: int) -> Rollout:
    """DAPO dynamic sampling, a refill policy a script hands `collect_rollout` (`partial(rl.refill, keep=...,
    max_rounds=...)`): keep the groups of `ro` for which `keep(scores) -> (groups,) bool` holds and generate more
    rounds (`more(round) -> Rollout`) until the batch is full again or `max_rounds` rounds were generated. A batch
    still empty after them is returned as the last round was (the zero-variance filter drops most of it)."""
    want, fresh_reward, parts, rounds = len(ro.episodes) // G, ro.rewards.mean().item(), [], 0
    logs = dict(ro.logs)
    while True:
        parts.append(ro.take_groups(keep(ro.scores), G))
        rounds += 1
        if sum(len(p.episodes) for p in parts) >= want * G or rounds >= max_rounds:
            break
        ro = more(rounds)
    pool = Rollout.cat(parts)
    if pool.episodes:
        ro = pool.take_groups(torch.arange(len(pool.episodes) // G) < want, G)
    ro.logs = {**logs, "rollout/filter_rounds": rounds, "rollout/filter_groups": len(ro.episodes) // G,
               "rollout/fresh_reward_mean": fresh_reward}  # fmt: skip
    return ro


def gather(ro: Rollout, world: int) -> Rollout:
    """Every rank gets the whole rollout (advantages and minibatches are global): one all-gather."""
    if world == 1:
        return ro
    parts = [None] * world
    torch.distributed.all_gather_object(parts, ro)
    whole = Rollout.cat(parts)
    whole.logs = all_ranks(ro.logs, world, reduce=True)
    return whole


def collect_rollout(run: Run, ro_cfg, train_set: list[dict], step: int, refill=None) -> Rollout:
    """Step `step`'s rollout on every rank (`ro_cfg`: the `--rollout.*` section): generate this rank's prompts, pass
    them through the script's refill policy when it gives one (`refill(ro, more, G) -> Rollout`, `more(round)` a
    further generation round: DAPO's is `refill` here with the script's filter), gather the ranks' parts, and (hybrid
    engine) hand the GPU from the engines to the trainer."""
    ro = generate(run, ro_cfg, train_set, step)
    if refill is not None:
        ro = refill(ro, partial(generate, run, ro_cfg, train_set, step), ro_cfg.n_samples)
    ro = gather(ro, run.world)
    if run.hybrid:  # hybrid engine: the engines' GPU memory goes to training
        if run.rank == 0:
            run.engines.sleep()
        for m in run.models.values():
            placement.reload_states(m)  # DeepSpeed states back on the GPU (no-op on CPU)
    return ro


# ------------------------------------------------------------------------------------------------ 3. rewards
def shape_rewards(ro: Rollout, truncated_reward: float | None, overlong_buffer: int, overlong_factor: float,
                  max_new_tokens: int, clip: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rollout's rewards shaped as the script says, and which episodes were truncated, both (B,): a truncated
    response's reward replaced by `truncated_reward` (None: kept), DAPO's overlong penalty over the last
    `overlong_buffer` tokens of `max_new_tokens` (`rl_math.overlong_penalty`; 0: off), then clipped to ±`clip`."""
    rewards = ro.rewards
    truncated = torch.tensor([e.truncated for e in ro.episodes], dtype=torch.bool)
    if truncated_reward is not None:
        rewards = torch.where(truncated, torch.tensor(truncated_reward), rewards)
    if overlong_buffer:
        lengths = torch.tensor([len(e.token_ids) for e in ro.episodes])
        rewards = rewards + rl_math.overlong_penalty(lengths, max_new_tokens, overlong_buffer, overlong_factor)
    return rewards.clamp(-clip, clip), truncated


def rollout_stats(ro: Rollout, rewards: torch.Tensor, truncated: torch.Tensor, keep: torch.Tensor) -> dict:
    """rollout/* metrics of the step (after shaping; kept_frac: the share of samples the update trains on)."""
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/response_len_mean": float(np.mean([len(e.token_ids) for e in ro.episodes])),
        "rollout/truncated_frac": truncated.float().mean().item(),
        "rollout/kept_frac": keep.float().mean().item(),
        **ro.logs,
    }


# ---------------------------------------------------------------------------------------------------- 4. update
def sequences(episodes: list[Episode], pad_id: int, device, packed: bool = True) -> dict:
    """The rollout as a right-padded prompt+response table (B, L): the loss mask is True on the tokens the policy
    generated (the episode's action mask), `rollout_logp` holds the engine's log-probs at the same positions. Every
    per-token quantity of the update (advantages, old and reference log-probs, values) lives in this (B, L) layout;
    the model forwards pack the real tokens padding-free (`model_inputs`) unless `packed` is False (`--train.no-
    packing`: the padded forward, the reference the packed one is tested against). Episodes that carry `versions`
    (grpo_async's partial rollout: the weights version that sampled each response token) give a `versions` table
    too, −1 off the responses. Episodes that carry `routed_experts` (`--actor.routing-replay`) give `routing`, the
    per-row list of the engine's tables, which `forward_logp` replays (`rows` slices it with the rows); None for an
    episode with no trained token that carries none (a failed agent episode: routed to filler experts)."""
    if not episodes:  # a step whose filter kept nothing: no table (the script trains nothing)
        return {}
    examples = [{"input_ids": e.prompt_ids + e.token_ids, "loss_mask": [0] * len(e.prompt_ids) + e.action_mask}
                for e in episodes]  # fmt: skip
    batch = packing.collate_padded(examples, pad_id, device)
    batch["rollout_logp"] = torch.zeros(batch["loss_mask"].shape)
    tagged = bool(episodes) and all(hasattr(e, "versions") for e in episodes)
    if tagged:
        batch["versions"] = torch.full(batch["loss_mask"].shape, -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        response = slice(len(e.prompt_ids), len(e.prompt_ids) + len(e.token_ids))
        batch["rollout_logp"][row, response] = torch.tensor(e.logprobs)
        if tagged:
            batch["versions"][row, response] = torch.tensor(e.versions, dtype=torch.long)
    if any(e.routed_experts is not None for e in episodes):  # None: an episode with nothing to train (a failed agent)
        untabled = [i for i, e in enumerate(episodes) if e.routed_experts is None and any(e.action_mask)]
        assert not untabled, f"episodes {untabled} are trained on and carry no routing table"
        batch["routing"] = [e.routed_experts for e in episodes]
    batch["packed"] = packed
    if any(e.example.get("pixel_values") is not None for e in episodes):  # pictures: the padded forward (vision.py)
        batch = vision.add_pixels(batch, [e.example for e in episodes])
    return batch


def rows(batch: dict, r: list[int]) -> dict:
    """The batch's rows `r` (every tensor of it, and the per-row lists of pictures; other entries as they are)."""
    return {k: v[r] if isinstance(v, torch.Tensor) else [v[i] for i in r] if isinstance(v, list) else v
            for k, v in batch.items()}  # fmt: skip


FULL_TABLE = 0.01
"""`model_inputs` forwards a (b, L) table as it is when at most this share of it is padding. sdpa's attention per
token grows with the row's width: at the Qwen2-0.5B shape on CPU (2026-11-29), 32 rows of 74 tokens cost 75 ms of
attention per layer (forward and backward), the same tokens packed two to a 148-token row 101 ms, where the layer's
linears take ~2.1 s: packing costs ~1.2 % of a step more in attention, and pays off once it drops over ~1 % of the
table (each padding token costs a whole token's linears)."""


def model_inputs(model, batch: dict) -> tuple[dict, torch.Tensor]:
    """The forward inputs for a (b, L) table of `sequences`, and `index` (b, L): where token (b, t)'s output lands
    in the forward's flattened (R · W) output, −1 at padding. Packed (default): the real tokens only, in rows
    (core.packing.pack_padded) of twice the longest sequence for sdpa/eager attention (whose block-diagonal mask
    costs O(row length²)), one row for flash-attention's varlen kernels and FlexAttention's block mask
    (`models.packs_in_one_row`). Unpacked: the padded table itself, also for sdpa/eager when under `FULL_TABLE` of
    it is padding (packing would save no more tokens than its twice-as-wide rows cost in attention)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    config = getattr(getattr(model, "module", model), "config", None)
    one_row = models.packs_in_one_row(str(getattr(config, "_attn_implementation", "")))
    full = not one_row and sum(lengths) >= (1 - FULL_TABLE) * batch["input_ids"].numel() and (
        sequence_parallel.sp_group(model) is None)  # fmt: skip
    if not batch.get("packed", True) or batch.get("pixel_values") is not None or full:  # pictures: multimodal RoPE
        width = batch["input_ids"].shape[1]
        index = torch.arange(batch["input_ids"].numel(), device=batch["input_ids"].device).view(-1, width)
        index = index.masked_fill(batch["attention_mask"] == 0, -1)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return {**inputs, **vision.model_kwargs(batch)}, index
    packed = packing.pack_padded(batch["input_ids"], lengths, None if one_row else 2 * max(lengths))
    return {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}, packed["index"]


def previous_token(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A forward's per-position output y (R, W) read back into the (b, L) table one token late: position t holds y
    at token t − 1 (what the model computed before seeing token t); 0 at position 0 and at padding."""
    prev = torch.cat([torch.full_like(index[:, :1], -1), index[:, :-1]], dim=1)
    prev = torch.where(index >= 0, prev, -1)
    out = y.reshape(-1)[prev.clamp(min=0)]
    return torch.where(prev >= 0, out, torch.zeros_like(out))


def forward_logp(model, batch: dict, temperature: float, entropy: bool = False):
    """Per-token log-probs (b, L) of a (b, L) table (position t: log p(x_t | x_<t) where the loss mask is set, 0
    elsewhere), and optionally entropies. The forward sees the packed real tokens (`model_inputs`; a table with almost
    no padding as it is), and only the target positions go through the LM head, a chunk of tokens at a time
    (`models.causal_logprobs`): the full (tokens, vocab) logits are never held."""
    inputs, index = model_inputs(model, batch)
    b, t = batch["loss_mask"].nonzero(as_tuple=True)  # the targets; t ≥ 1 (a prompt token is never one)
    # --train.sp-size N: this rank forwards 1/N of the tokens; the log-probs come back whole on every rank of its group
    fn = models.causal_logprobs if sequence_parallel.sp_group(model) is None else sequence_parallel.causal_logprobs
    # --actor.routing-replay: the actor's forward (`replays_routing`, set by `make_actor`; also its LoRA base as the
    # reference) routes every token to the experts the engine chose (R3, core/moe.py). A separate reference or
    # teacher model routes on its own: the engine's record is the actor's, not theirs
    routing, replay, own = batch.get("routing"), contextlib.nullcontext(), None
    if routing is not None and any(r is not None for r in routing) and getattr(model, "replays_routing", False):
        table = moe.table_for_forward(routing, index, inputs["input_ids"].numel())
        own = [] if torch.is_grad_enabled() else None  # the update's forwards measure the mismatch, no extra forward
        replay = moe.replay_routing(model, table, own)
    with replay:
        logp, ent = fn(model, inputs, index[b, t - 1], batch["input_ids"][b, t], temperature, entropy)
    zeros = torch.zeros(batch["loss_mask"].shape, dtype=logp.dtype, device=logp.device)
    out = zeros.index_put((b, t), logp)
    if own:
        valid = moe.recorded_positions(routing, index, table.shape[0])
        mask = batch["loss_mask"].bool()
        gap = (out.detach() - batch["rollout_logp"].to(out.device))[mask].abs()
        REPLAY_STATS.append((moe.routing_mismatch(own[-1], table, valid), int(valid.sum()), gap.sum().item(),
                             gap.numel()))  # fmt: skip
    return out, (None if ent is None else zeros.index_put((b, t), ent))


REPLAY_STATS: list[tuple[float, int, float, int]] = []
"""`--actor.routing-replay`: (mismatch share, decisions' tokens, summed |log-prob gap|, tokens) of each update forward
since the last `replay_stats`."""


def replay_stats(world: int = 1) -> dict:
    """The step's routing-replay metrics, from the update's forwards since the last call ({} without replay):
    `moe/routing_mismatch`, the share of (token, layer) decisions over real tokens where the trainer's router chose
    another expert set than the engine recorded (what replay overrides), and `moe/logp_gap`, the mean |trainer −
    engine| log-prob over the trained tokens with replay on (after the step's earlier optimizer steps, with
    `--train.minibatches` > 1 or `--train.epochs` > 1). `world` > 1: over every rank's forwards (a collective: every
    rank calls it)."""
    share, n, gap, tokens = zip(*REPLAY_STATS) if REPLAY_STATS else ((), (), (), ())
    REPLAY_STATS.clear()
    sums = [sum(s * k for s, k in zip(share, n)), sum(n), sum(gap), sum(tokens)]
    if world > 1:
        sums = [ds_engine.all_reduce(x) for x in sums]
    if not sums[1] and not sums[3]:
        return {}
    return {"moe/routing_mismatch": sums[0] / max(sums[1], 1), "moe/logp_gap": sums[2] / max(sums[3], 1)}


def minibatches(seqs: dict, train, step: int, rank: int, world: int) -> list[tuple[list[int], list[tuple[list[int], bool]]]]:
    """The step's `--train.minibatches` minibatches over the rows of the (B, L) table `seqs` (`train`: the `--train.*`
    section), shuffled by (seed, step): [(rows, micro)] with `rows` the whole minibatch (all ranks) and `micro` this
    rank's micro-batches of it, [(row indices, real)], of `--train.micro-batch-size` rows or, with
    `--train.max-tokens-per-micro N`, filled up to N tokens (`placement.shard_minibatch`); every rank gets as many
    micro-batches as every other (a padding one is `real` False and its loss counts 0)."""
    n, lengths = len(seqs["loss_mask"]), seqs["attention_mask"].sum(1).tolist()
    # --train.sp-size / --ds.tensor-parallel-size: the ranks of an SP or TP group share their micro-batches
    group = train.sp_size * ds_engine.tp_group_size()
    rank, world = rank // group, world // group
    order = list(range(n))
    random.Random(train.seed + step).shuffle(order)
    size = max(1, math.ceil(n / train.minibatches))
    return [(order[i : i + size], shard_minibatch(order[i : i + size], rank, world, train.micro_batch_size,
                                                  lengths, train.max_tokens_per_micro))
            for i in range(0, n, size)]  # fmt: skip


@torch.no_grad()
def forward_rows(fn, batch: dict, micro: list[tuple[list[int], bool]], world: int, gather_ranks: bool,
                 sp: int = 1) -> torch.Tensor:  # fmt: skip
    """`fn(rows(batch, r)) -> (b, L)` on this rank's micro-batches `micro`, written into a (B, L) tensor. Every pass
    runs, padding ones included (under ZeRO-3 each forward is a collective). `gather_ranks`: each row was computed by
    exactly one rank (0 elsewhere), or by every rank of one SP group of `sp` ranks (`--train.sp-size`) or of one
    tensor-parallel group (`--ds.tensor-parallel-size`, `core.engine.tp_group_size`), so a sum over ranks divided by
    the group's size gives every rank every row."""
    out = torch.zeros(batch["loss_mask"].shape, device=batch["loss_mask"].device)
    for r, real in micro:
        value = fn(rows(batch, r))
        if real:
            out[r] = value
    if gather_ranks and world > 1:
        torch.distributed.all_reduce(out)
        group = sp * ds_engine.tp_group_size()
        out = out / group if group > 1 else out
    return out


def on_model(model, fn, *args, run: Run):
    """`fn(engine, rank, world, *args)` where `model` lives. In the trainer ranks (`model` a DeepSpeed engine or
    module): on this rank, with the trainer's rank and world. In a group of its own (`model` a `ModelGroup`, from
    `--ref.ranks` / `--critic.ranks`): trainer rank 0 starts it on every rank of the group, with the group's rank,
    world and engine, and every trainer rank gets the result of the group's rank 0, its tensors on this rank's
    device. `fn` must leave every rank of its world with the same result (tables summed over the world, metrics
    reduced), so that the two layouts return the same."""
    if not isinstance(model, placement.ModelGroup):
        return fn(model, run.rank, run.world, *args)
    out = model.run(_on_worker, fn, *_to(args, torch.device("cpu")))[0] if run.rank == 0 else None
    return _to(all_ranks(out, run.world), run.device)


def _on_worker(worker, fn, *args):
    worker.calls = getattr(worker, "calls", 0) + 1
    out = fn(worker.engine, worker.rank, worker.world_size, *_to(args, worker.device))
    return _to(out, torch.device("cpu")) if worker.rank == 0 else None


def _to(x, device: torch.device):
    """Every tensor in `x` (nested in dicts, lists and tuples) on `device`; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_to(v, device) for v in x)
    return x


def build_model(groups: dict | None, role: str, build, device: torch.device, *args):
    """`build(*args, device=device)`: the model of `role` in this process, or, with `--<role>.ranks N` (a group in
    `groups`, started by `launch`), on every rank of that group (each its own device, the group's world), started by
    trainer rank 0. Returns the built model or the group, which `on_model` and `core.checkpoint` take alike."""
    if not groups or role not in groups:
        return build(*args, device=device)
    group = groups[role]
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return group
    group.run(_build_on_worker, build, *args)
    return group


def _build_on_worker(worker, build, *args) -> None:
    worker.engine = build(*args, device=worker.device)


def logp_table(model, rank: int, world: int, seqs: dict, train, temperature: float, step: int) -> torch.Tensor:
    """log π (B, L) at `temperature` of every row of the rollout table `seqs` (0 off the loss mask), e.g. the
    reference's: each rank of the world computes its micro-batches of the step's minibatches (`train`: the
    `--train.*` section), and the rows are summed over the world. For `on_model`."""
    mine = [m for _, micro in minibatches(seqs, train, step, rank, world) for m in micro]
    with ds_engine.on_device(model, seqs["loss_mask"].device):
        return forward_rows(lambda b: forward_logp(model, b, temperature)[0], seqs, mine, world, True,
                            train.sp_size)  # fmt: skip


def router_aux(model) -> dict:
    """{"loss/router_aux": the load-balancing loss of a mixture-of-experts model's last forward, detached} to log
    beside the loss ({} for a dense model)."""
    aux = models.router_aux_loss(model)
    return {} if aux is None else {"loss/router_aux": aux.detach()}


def micro_batches(seqs: dict, micro: list[tuple[list[int], bool]]):
    """This rank's micro-batches of one minibatch (`minibatches`' `micro`), as (row indices, their rows of `seqs`,
    real, last): `real` False for a padding pass (its loss counts 0), `last` True for the accumulation boundary."""
    for j, (r, real) in enumerate(micro):
        yield r, rows(seqs, r), real, j == len(micro) - 1


def backward(engine, loss: torch.Tensor, step: int, world: int, real: bool, last: bool, what: str = "loss") -> float:
    """One micro-batch's backward: stop before any optimizer step on a NaN/inf loss; scale by the number of ranks
    DeepSpeed averages gradients over (the world, or the world over `--ds.tensor-parallel-size`: the ranks of a TP
    group hold shards of one gradient; the loss is this rank's share of the minibatch's token mean) or by 0 for a
    padding pass; mark the last micro-batch of the minibatch as the accumulation boundary. Returns the unscaled loss
    (0 for padding) over the ranks of the engine's SP or TP group (`--train.sp-size`, which all hold the same loss; 1
    without), so that its sum over micro-batches and ranks is the minibatch's loss. With sequence parallelism each
    rank's backward gives the gradient of its own tokens' share of the loss: the same world scaling holds."""
    ds_engine.check_finite(loss, step, what)
    engine.set_gradient_accumulation_boundary(last)
    tp = ds_engine.tp_group_size()
    engine.backward(loss * (world // tp if real else 0.0))
    group = sequence_parallel.sp_group(engine)
    return loss.item() / (1 if group is None else torch.distributed.get_world_size(group)) / tp if real else 0.0


# ---------------------------------------------------------------------------------------- 5. sync, eval, save
def sync_weights(run: Run, actor, changed: bool = True, sample: list[list[int]] | None = None,
                 examples: list[dict] | None = None) -> dict:  # fmt: skip
    """Hand the GPU back to the engines and send them the actor's new weights, in the order a hybrid engine needs:
    weights memory back, new weights in, then the KV cache. `changed` False skips the transfer (nothing trained).
    `--debug` (`run.debug`) with `sample` token lists: check that the engines' log-probs equal the trainer's (on every
    rank: under ZeRO-3 the trainer's forward is a collective); `examples`: the samples' dataset examples, whose
    pictures both sides then see."""
    stats, t0 = {}, time.perf_counter()
    if run.hybrid and run.rank == 0:
        run.engines.wake_up(["weights"])
    if changed:
        stats = placement.sync_weights(run.engines, actor, run.rank)
        stats["perf/transfer_s"] = time.perf_counter() - t0  # gather, send and load the weights (no debug check)
    if run.hybrid and run.rank == 0:
        run.engines.wake_up(["kv_cache"])
    if changed and run.debug and sample:
        t1 = time.perf_counter()
        rollout.check_weights(run.engines, actor.module, sample, examples=examples)
        stats["perf/debug_check_s"] = time.perf_counter() - t1
    return stats


def end_step(run: Run, eval_cfg, ckpt, step: int, stats: dict, state: dict | None = None, warn_every: int = 10) -> bool:
    """The end of step `step`: eval every `--eval.every` steps and at the last (`eval_cfg`: the `--eval.*` section;
    a new best exported to <run>/best), warn when the step trained nothing (`rollout/kept_frac` 0), log the metrics
    row, checkpoint every `--ckpt.every` steps (`ckpt`: the `--ckpt.*` section), at the last and when halting, and
    (hybrid engine) move the trainer's states off the GPU for the next rollout. Returns True when
    `--train.halt-after` stops here."""
    last = step == run.max_steps - 1
    if getattr(run.models["actor"], "replays_routing", False):  # --actor.routing-replay: over every rank's forwards
        stats.update(replay_stats(run.world))
    if stats.get("rollout/kept_frac", 1.0) == 0:  # the script's filter dropped every sample: nothing was trained
        run.idle_steps += 1
        if (run.idle_steps - 1) % warn_every == 0:  # the first such step, then every `warn_every`-th
            run.logger.print(f"[{run.name}] warning: step {step + 1} trained nothing: every group was filtered out "
                             f"(rollout/kept_frac 0), {run.idle_steps} such step(s) so far")  # fmt: skip
    if eval_cfg.every and ((step + 1) % eval_cfg.every == 0 or last):
        stats.update(all_ranks(evaluate(run, eval_cfg, step + 1) if run.rank == 0 else None, run.world))
        if eval_cfg.best_metric and stats.get(eval_cfg.best_metric, -math.inf) > run.best:
            run.best = stats[eval_cfg.best_metric]
            ds_engine.export_hf(run.models["actor"], run.executor.tokenizer, run.run_dir / "best")
    run.logger.log(stats, step + 1, shown=("rollout/reward_mean", "eval/pass@1"))
    halted = run.halt_after is not None and step + 1 - run.start_step >= run.halt_after and not last
    if halted or (ckpt.every and ((step + 1) % ckpt.every == 0 or last)):
        client = {"step": step, "first_eval": run.first_eval, "best": run.best, "idle_steps": run.idle_steps,
                  **(state or {})}  # fmt: skip
        checkpoint.save(run.models, run.ckpt_dir, step, client, ckpt.keep_last)
    if run.hybrid and not (last or halted):  # DeepSpeed states off the GPU while the engines generate
        for m in run.models.values():
            placement.offload_states(m)
    if halted:
        run.logger.print(f"[{run.name}] halted after {run.halt_after} steps; resume with --run-dir {run.run_dir}")
        run.logger.close({"steps": step + 1, "halted": True})
    return halted


def finish(run: Run, actor, tokenizer, halted_at: int | None = None) -> dict:
    """Export the trained policy to <run>/hf (and its EMA to <run>/hf_ema with `--actor.ema-beta`), plot the
    learning curve, print and return the run's summary. A halted run (`halted_at`: its last step) only returns where
    to resume from. The executor releases what it holds (an agent server and its reference to the engines), and the
    engines this run created are shut down at the end (not whenever the garbage collector reaches them)."""
    run.executor.close()
    try:
        if halted_at is not None:
            return {"steps": halted_at + 1, "halted": True, "run_dir": str(run.run_dir)}
        ds_engine.export_hf(actor, tokenizer, run.run_dir / "hf")
        if getattr(actor, "ema_beta", 0) > 0:  # --actor.ema-beta: the moving average of the weights, beside them
            ds_engine.export_hf(actor, tokenizer, run.run_dir / "hf_ema", ema=True)
        run.logger.plot(run.run_dir / "learning_curve.png", ("rollout/reward_mean", "eval/pass@1"))
        summary = {"steps": run.max_steps, "eval_pass@1_first": run.first_eval.get("eval/pass@1"),
                   "eval_pass@1_last": run.logger.latest("eval/pass@1", None),  # None: --eval.every 0
                   "reward_mean_last": run.logger.latest("rollout/reward_mean"),
                   "steps_without_update": run.idle_steps, "run_dir": str(run.run_dir)}  # fmt: skip
        run.logger.close(summary)
        return summary
    finally:
        if run.own_engines:
            run.engines.shutdown()

