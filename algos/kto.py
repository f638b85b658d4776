"""Kahneman-Tversky Optimization (KTO): alignment from unpaired desirable / undesirable examples.

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization" (arXiv:2402.01306). Each example
is a prompt x with ONE completion y labelled desirable (D) or undesirable (U); no pairs are needed. With log-probs
summed over the completion tokens (+ eos), π_θ the policy and π_ref the frozen starting model (the SFT warm start):

    r(x, y) = log π_θ(y|x) − log π_ref(y|x)                               (implicit reward, before β)
    z_ref   = max(0, mean_i [log π_θ(y_j|x_i) − log π_ref(y_j|x_i)])      (KL reference point, no gradient)
    v(x, y) = λ_D · σ(β (r − z_ref))   if y is desirable
              λ_U · σ(β (z_ref − r))   if y is undesirable
    L       = E[λ_y − v(x, y)]

z_ref estimates KL(π_θ ‖ π_ref) from mismatched pairs: prompt x_i with the completion y_j of another example, so it
measures how far the policy has drifted on text it is not being pushed on. λ_D, λ_U weigh the two classes; the paper
recommends λ_D·n_D / (λ_U·n_U) in [1, 4/3] (logged at startup).

Deviations from the paper:
1. Reference log-probs are computed once, before the first step, with the initial policy (which *is* π_ref), for
   every example and every mismatched pair the run will use, and cached (and checkpointed).
2. Each example's mismatched partner is fixed once per run (a seeded cyclic shift of a random order of the train
   set) rather than drawn inside each batch, so its reference log-prob can be cached too (TRL also fixes it when
   preprocessing). z_ref is the mean over the whole global batch (all ranks), computed in a no-grad pass before
   the gradient pass, so micro-batching does not change it.
3. Completions are packed padding-free (core/packing.py).

Debug (SFT warm start `cleanrlhf/tiny-sft`, embedded unpaired data `cleanrlhf/add2-kto`, one CPU):
    python algos/kto.py --train.max-steps 40
Several processes (ZeRO-3 over 2 ranks; see slurm/ for many hosts):
    torchrun --nproc_per_node 2 algos/kto.py --ds.zero-stage 3
A real model and dataset (rows: prompt, completion, label true/false):
    python algos/kto.py --model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path my_kto.jsonl \\
        --data.apply-chat-template --train.lr 5e-7 --model.lora-rank 16
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import tyro

from core import checkpoint, data, flags, models, packing
from core import engine as ds_engine
from core.config import CkptConfig, DataConfig, DSConfig, LoggerConfig, ModelConfig, check_args
from core.logger import RunLogger, lock_run_dir, run_name, timer


@dataclass
class TrainArgs:
    beta: flags.PosFloat = 0.1
    """β: how fast the value saturates, and the strength of the pull towards the reference (KTO §4)."""
    desirable_weight: flags.NonNegFloat = 1.0
    """λ_D: weight of the desirable examples' loss."""
    undesirable_weight: flags.NonNegFloat = 1.0
    """λ_U: weight of the undesirable examples' loss."""
    lr: flags.PosFloat = 3e-4
    """peak learning rate (3e-4 suits the ~1 M embedded model, 5e-4 already breaks it; use ~5e-7 for full
    fine-tuning of real models)."""
    batch_size: flags.PosInt = 128
    """global batch: examples per optimizer step, summed over ranks (the paper needs > 1 for the KL estimate)."""
    max_tokens_per_micro: flags.PosInt = 4096
    """packing budget: tokens (examples and their mismatched pairs) per forward/backward on one rank (gradient accumulation covers the rest)."""
    max_steps: flags.PosInt = 80
    """optimizer steps (80 x 128 examples is about one epoch of the embedded train split)."""
    warmup_steps: flags.NonNegInt = 5
    """linear learning-rate warmup steps, then cosine decay."""
    min_lr_ratio: flags.Fraction = 0.1
    """the cosine schedule ends at lr · min_lr_ratio."""
    weight_decay: flags.NonNegFloat = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2)."""
    ref_seqs_per_forward: flags.PosInt = 64
    """sequences per packed forward in the no-grad passes (reference cache, eval)."""
    seed: flags.NonNegInt = 1
    """seed of the data order, of the mismatched partners and of every rank's RNG."""
    halt_after: flags.PosInt | None = None
    """stop this invocation after this many optimizer steps (the schedule still spans max-steps), saving a
    checkpoint: the next invocation on the same --run-dir resumes. For time-limited cluster jobs."""


@dataclass
class EvalArgs:
    every: flags.NonNegInt = 20
    """evaluate every N steps (and at the start and the end); 0 disables every eval, the start and end included."""
    max_samples: flags.PosInt = 1000
    """held-out examples used (the embedded test split holds both completions of each of 500 prompts)."""


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    completion_key: str = "completion"
    """field holding the completion (the prompt is `--data.input-key`)."""
    desirable_key: str = "label"
    """field holding true (desirable) or false (undesirable)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name_or_path="cleanrlhf/tiny-sft"))
    data: DataConfig = field(default_factory=lambda: DataConfig(path="cleanrlhf/add2-kto"))
    train: TrainArgs = field(default_factory=TrainArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    ds: DSConfig = field(default_factory=DSConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run_dir: str | None = None
    """run folder (metrics, TensorBoard, checkpoints); default `<logger.run-root>/<exp_name>__<seed>__<time>`.
    Pass an existing one to resume from its latest checkpoint."""
    export_dir: str | None = None
    """where the final HF model is written; default `<run_dir>/hf`."""


# ALGO LOGIC: the objective. policy_logps, ref_logps, desirable: (B,), one summed completion log-prob per example.
def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: float | torch.Tensor,
             beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KTO loss, mean over the B examples, and the detached implicit rewards β·r (B,).

    r = π − ref;  v = λ_D·σ(β(r − z)) if desirable else λ_U·σ(β(z − r));  L = mean(λ_y − v).
    kl: the reference point z (a scalar; detached: the paper does not backpropagate through it)."""
    r = policy_logps - ref_logps
    z = torch.as_tensor(kl, dtype=r.dtype, device=r.device).detach()
    desirable = desirable.bool()
    value = torch.where(desirable, desirable_weight * torch.sigmoid(beta * (r - z)),
                        undesirable_weight * torch.sigmoid(beta * (z - r)))  # fmt: skip
    lam = torch.where(desirable, desirable_weight, undesirable_weight)
    return (lam - value).mean(), beta * r.detach()


# ALGO LOGIC: the learning-rate schedule, the multiplier of --train.lr at each optimizer step (CleanRL anneals by hand).
def lr_schedule(update: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over `warmup` optimizer steps, then cosine decay from 1 to `floor` at update `total`."""
    progress = min(1.0, (update - warmup) / max(1, total - warmup))  # of the decay, after the warm-up
    return (update + 1) / warmup if update < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def kto_example(row: dict, tokenizer, cfg: DataConfig, completion_key: str, desirable_key: str) -> dict:
    """`data.sft_example` of prompt + completion, plus its label, prompt length and prompt text (to pair evals)."""
    ex = data.sft_example(row, tokenizer, replace(cfg, output_key=completion_key))
    label = row.get(desirable_key)
    if label is None:
        raise data.BadRow(desirable_key, f"missing key {desirable_key!r}")
    if label not in (True, False):  # also accepts 0 / 1
        raise data.BadRow(desirable_key, f"key {desirable_key!r} must hold true or false, got {label!r}")
    return {**ex, "desirable": bool(label), "prompt_len": ex["loss_mask"].index(1), "prompt": str(row[cfg.input_key])}


def mismatched(ex: dict, other: dict) -> dict:
    """Prompt of `ex` followed by the completion of `other`: a sample for the KL reference point."""
    completion = other["input_ids"][other["prompt_len"] :]
    ids = ex["input_ids"][: ex["prompt_len"]] + completion
    return {"input_ids": ids, "loss_mask": [0] * ex["prompt_len"] + [1] * len(completion)}


def seq_logps(model, examples: list[dict], device) -> torch.Tensor:
    """Summed target log-probs (S,) of S examples from one packed forward (rows of twice the longest example)."""
    batch = packing.collate_packed(examples, device, row_len=2 * max(len(ex["input_ids"]) for ex in examples))
    logp = packing.token_logprobs(model, batch)
    return torch.stack([s.sum() for s in packing.unpack(logp * batch["loss_mask"], batch["segments"])])


def micro_batches(idx: list[int], examples: list[dict], max_tokens: int) -> list[list[int]]:
    """Split indices, in order, into groups of at most `max_tokens` tokens (an example and its mismatched pair)."""
    groups, size = [[]], 0
    for i in idx:
        n = len(examples[i]["input_ids"])
        if groups[-1] and size + n > max_tokens:
            groups, size = groups + [[]], 0
        groups[-1].append(i)
        size += n
    return groups


@torch.no_grad()
def all_seq_logps(model, seqs: list[dict], chunk: int, rank: int, world: int, device) -> torch.Tensor:
    """(S,) summed log-probs of every sequence, in eval mode. Each data-parallel rank `rank` of `world` (the ranks of a
    TP group share one) computes an equal-sized slice (padded with repeats, so ZeRO-3's collective forwards stay in
    step) and a sum over ranks assembles it."""
    was_training = model.training
    model.eval()
    n = len(seqs)
    per_rank = -(-n // world)
    out = torch.zeros(n, device=device, dtype=torch.float64)
    for start in range(0, per_rank, chunk):
        idx = [rank * per_rank + i for i in range(start, min(start + chunk, per_rank))]
        with torch.compiler.set_stance("force_eager"):  # one-off passes: --ds.compile pays off in training only
            lp = seq_logps(model, [seqs[i % n] for i in idx], device).double()
        keep = torch.tensor([i < n for i in idx], device=device)
        out[torch.tensor([i % n for i in idx], device=device)[keep]] = lp[keep]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        out /= dist.get_world_size() // world  # the ranks that computed each slice
    model.train(was_training)
    return out.float().cpu()


def evaluate(model, examples: list[dict], ref: torch.Tensor, args: Args, rank: int, world: int, device) -> dict:
    """Held-out log-likelihood of desirable vs undesirable completions, implicit rewards, and, for prompts that have
    both kinds, how often the desirable completion gets the higher reward (ties count half)."""
    logps = all_seq_logps(model, examples, args.train.ref_seqs_per_forward, rank, world, device)
    rewards = args.train.beta * (logps - ref)
    good = torch.tensor([ex["desirable"] for ex in examples])
    by_prompt: dict[str, list[list[float]]] = defaultdict(lambda: [[], []])
    for ex, r in zip(examples, rewards.tolist()):
        by_prompt[ex["prompt"]][int(ex["desirable"])].append(r)
    paired = [(sum(d) / len(d), sum(u) / len(u)) for u, d in by_prompt.values() if u and d]
    metrics = {
        "eval/logp_desirable": logps[good].mean().item(),
        "eval/logp_undesirable": logps[~good].mean().item(),
        "eval/reward_desirable": rewards[good].mean().item(),
        "eval/reward_undesirable": rewards[~good].mean().item(),
    }
    metrics["eval/logp_gap"] = metrics["eval/logp_desirable"] - metrics["eval/logp_undesirable"]
    if paired:
        metrics["eval/pref_accuracy"] = sum(float(d > u) + 0.5 * float(d == u) for d, u in paired) / len(paired)
    return metrics


def main(args: Args) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    if args.data.image_key:  # PLUMBING: pictures are read by sft.py, dpo.py and the RL scripts
        raise ValueError(f"--data.image-key {args.data.image_key!r}: kto.py reads no pictures (sft.py, dpo.py and the "
                         "RL scripts do)")  # fmt: skip
    # PLUMBING: process group (world of one for `python algos/kto.py`), tokenizer, examples, policy, engine.
    rank, world, device = ds_engine.init_distributed(args.ds.backend, args.ds.timeout_s)
    # Same seed on every rank for the data order (each rank slices the same global batch); per-rank offset for
    # everything stochastic inside the model (dropout), so ranks do not draw identical noise.
    random.seed(args.train.seed + rank)
    np.random.seed(args.train.seed + rank)
    torch.manual_seed(args.train.seed + rank)
    if args.train.batch_size < 2:
        raise ValueError("--train.batch-size must be >= 2: the KL reference point needs mismatched pairs")
    # a sample longer than the model's context is skipped and counted, not trained past the position embeddings
    limits = {"max_position_embeddings of --model.name-or-path": models.max_positions(args.model.name_or_path)}
    args.data.max_len = data.resolve_max_len(args.data.max_len, limits)
    tokenizer = models.load_tokenizer(args.model.tokenizer or args.model.name_or_path)
    log = print if rank == 0 else (lambda *_: None)
    make = partial(kto_example, tokenizer=tokenizer, cfg=args.data, completion_key=args.completion_key,
                   desirable_key=args.desirable_key)  # fmt: skip
    sources = data.load_sources(args.data.path, args.data.split, args.data.max_samples)
    train_set = data.mix(data.build_examples(sources, make, args.data, log), args.data.probs, args.train.seed)
    eval_sources = data.load_sources(args.data.eval_path or args.data.path, args.data.eval_split, args.eval.max_samples)
    eval_set = [ex for g in data.build_examples(eval_sources, make, args.data, log) for ex in g]
    # DEVIATION(2): example order[k]'s mismatched partner is order[k + 1], fixed for the run.
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.train.seed)).tolist()
    partner = {order[k]: order[(k + 1) % len(order)] for k in range(len(order))}
    model = models.load_causal_lm(args.model).to(device)
    # PLUMBING: --ds.tensor-parallel-size N (each linear layer split over N ranks): groups of N ranks share each
    # example, and the data is split over the groups (dp_rank, dp_world; without it: rank, world). `copies`: the ranks
    # that hold each example
    dp_rank, dp_world = ds_engine.tp_data_split(args.ds)
    copies = world // dp_world
    schedule = partial(lr_schedule, warmup=args.train.warmup_steps, total=args.train.max_steps,
                       floor=args.train.min_lr_ratio)  # per optimizer step
    engine = ds_engine.make_engine(model, args.ds, args.train.lr, schedule, weight_decay=args.train.weight_decay,
                                   betas=args.train.adam_betas)  # fmt: skip

    run_dir = Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed))
    ckpt_dir = Path(args.ckpt.dir or run_dir / "checkpoints")
    lock_run_dir(run_dir, enabled=rank == 0)  # PLUMBING: one run writes a run folder: a second one is refused here
    # PLUMBING: resume from the newest intact checkpoint (flags checked against config.json); (0, {}) if new
    start_step, client = checkpoint.resume({"model": engine}, ckpt_dir, run_dir, args)
    logger = RunLogger(args.logger, run_dir, args, args.train.max_steps, enabled=rank == 0, resume_step=start_step)
    n_good = sum(ex["desirable"] for ex in train_set)
    ratio = args.train.desirable_weight * n_good / max(args.train.undesirable_weight * (len(train_set) - n_good), 1e-9)
    logger.print(f"[kto] {len(train_set)} train ({n_good} desirable) / {len(eval_set)} eval examples, "
                 f"λ_D·n_D/(λ_U·n_U) = {ratio:.2f} (paper: 1 to 4/3), world size {world}, run dir {run_dir}")  # fmt: skip

    # 2. reference log-probs ---------------------------------------------------------------------------------------
    # ALGO LOGIC: π_ref is the starting policy, so before the first step the policy's own log-probs ARE the
    # reference's (DEVIATION 1). A resumed run takes them from the checkpoint: the policy has moved since.
    perf: dict = {}
    chunk = args.train.ref_seqs_per_forward
    with timer(perf, "perf/ref_s"):
        if "eval_ref" in client:
            train_ref, eval_ref = client["train_ref"], client["eval_ref"]
        else:
            eval_ref = all_seq_logps(engine.module, eval_set, chunk, dp_rank, dp_world, device)
            steps = range(args.train.max_steps)  # only the examples this run's batches use (pure function of seed)
            used = sorted({i for s in steps for i in data.batch_indices(len(train_set), args.train.batch_size, s,
                                                                        args.train.seed)})  # fmt: skip
            seqs = [train_set[i] for i in used] + [mismatched(train_set[i], train_set[partner[i]]) for i in used]
            train_ref = torch.full((len(train_set), 2), float("nan"))  # [completion, mismatched]; NaN: never used
            train_ref[used] = all_seq_logps(engine.module, seqs, chunk, dp_rank, dp_world, device).view(2, -1).T
    first_eval = {}  # --eval.every 0: no eval at all, the first one included
    if args.eval.every:
        first_eval = client.get("first_eval") or evaluate(engine.module, eval_set, eval_ref, args, dp_rank, dp_world,
                                                          device)  # fmt: skip
    if start_step == 0:  # a resumed run logged it when it started
        logger.log({**first_eval, **perf}, 0)
    tokens_seen, t_train, step = 0.0, 0.0, start_step - 1

    for step in range(start_step, args.train.max_steps):
        # 3. batch: the global batch is a pure function of (seed, step); each TP group (each rank, without it) takes
        # every dp_world-th example; sums over ranks count an example once per rank of its group: / copies
        idx = data.batch_indices(len(train_set), args.train.batch_size, step, args.train.seed)[dp_rank::dp_world]
        groups = micro_batches(idx, train_set, args.train.max_tokens_per_micro)
        n_micro = int(ds_engine.all_reduce(len(groups), op="max"))  # ranks must run the same number of passes
        t0 = time.perf_counter()

        # 4. KL reference point: no-grad policy pass over the mismatched pairs, mean over the global batch
        log_ratio_sum = 0.0
        with torch.no_grad():
            for i in range(n_micro):
                g, weight = (groups[i], 1.0) if i < len(groups) else (groups[0], 0.0)  # weight 0: a pad pass
                kl_logps = seq_logps(engine, [mismatched(train_set[j], train_set[partner[j]]) for j in g], device)
                log_ratio_sum += weight * (kl_logps.cpu() - train_ref[g, 1]).sum().item()
        kl_estimate = ds_engine.all_reduce(log_ratio_sum) / copies / args.train.batch_size
        z_ref = max(0.0, kl_estimate)

        # 5. policy update: forward / backward over micro-batches, one optimizer step
        t = args.train
        stats = torch.zeros(6, dtype=torch.float64)  # sums of: loss, r_D, n_D, r_U, n_U, tokens
        for i in range(n_micro):
            g, weight = (groups[i], 1.0) if i < len(groups) else (groups[0], 0.0)
            examples = [train_set[j] for j in g]
            good = torch.tensor([ex["desirable"] for ex in examples], device=device)
            logps = seq_logps(engine, examples, device)
            loss, rewards = kto_loss(logps, train_ref[g, 0].to(device), good, z_ref, t.beta, t.desirable_weight,
                                     t.undesirable_weight)  # fmt: skip
            ds_engine.check_finite(loss, step)  # PLUMBING: a NaN/inf loss or gradient stops the run before the step
            # mean over the global batch; DeepSpeed averages gradients over its data-parallel ranks
            # (engine.dp_world_size: the world, or the world over --ds.tensor-parallel-size), so scale by their number.
            engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            engine.backward(loss * len(g) / t.batch_size * engine.dp_world_size * weight)
            n_tok = sum(len(ex["input_ids"]) for ex in examples)
            stats += weight * torch.tensor([loss.item() * len(g), rewards[good].sum().item(), good.sum().item(),
                                            rewards[~good].sum().item(), (~good).sum().item(), n_tok])  # fmt: skip
        grad_norm = ds_engine.optimizer_step(engine, step)
        t_train += time.perf_counter() - t0

        # 6. logging, eval, checkpoint
        s = [ds_engine.all_reduce(x) / copies for x in stats.tolist()]
        tokens_seen += s[5]
        metrics = {
            "loss/kto": s[0] / t.batch_size,
            "train/kl": z_ref,
            "train/kl_estimate": kl_estimate,
            "train/reward_desirable": s[1] / max(s[2], 1.0),
            "train/reward_undesirable": s[3] / max(s[4], 1.0),
            "train/desirable_frac": s[2] / t.batch_size,
            "train/lr": engine.lr_scheduler.get_last_lr()[0],
            "train/grad_norm": grad_norm,
            "train/tokens": s[5],
            "perf/step_s": t_train / (step + 1 - start_step),
            "perf/tokens_per_s": tokens_seen / max(t_train, 1e-9),
        }
        last = step == t.max_steps - 1
        if args.eval.every and ((step + 1) % args.eval.every == 0 or last):
            with timer(metrics, "perf/eval_s"):
                metrics.update(evaluate(engine.module, eval_set, eval_ref, args, dp_rank, dp_world, device))
        logger.log(metrics, step + 1, shown=("loss/kto", "train/kl", "eval/logp_gap"))
        halted = t.halt_after is not None and step + 1 - start_step >= t.halt_after and not last
        if halted or (args.ckpt.every and ((step + 1) % args.ckpt.every == 0 or last)):
            checkpoint.save({"model": engine}, ckpt_dir, step, {"step": step, "first_eval": first_eval,
                            "train_ref": train_ref, "eval_ref": eval_ref}, args.ckpt.keep_last)  # fmt: skip
        if halted:
            logger.print(f"[kto] halted after {t.halt_after} steps; resume with --run-dir {run_dir}")
            logger.close({"steps": step + 1, "halted": True})
            return {"steps": step + 1, "halted": True, "run_dir": str(run_dir)}

    # 7. export and summary
    export_dir = Path(args.export_dir or run_dir / "hf")
    ds_engine.export_hf(engine, tokenizer, export_dir)
    summary = {
        "steps": step + 1,
        "train_loss_last": logger.latest("loss/kto"),
        "eval_logp_gap_first": first_eval.get("eval/logp_gap"),  # None: --eval.every 0
        "eval_logp_gap_last": logger.latest("eval/logp_gap", None),
        "eval_pref_accuracy_first": first_eval.get("eval/pref_accuracy"),  # also None: no prompt with both kinds
        "eval_pref_accuracy_last": logger.latest("eval/pref_accuracy", None),
        "ref_s": perf["perf/ref_s"],
        "step_s": logger.latest("perf/step_s"),
        "tokens_per_s": logger.latest("perf/tokens_per_s"),
        "export_dir": str(export_dir),
    }
    logger.close(summary)
    return summary


if __name__ == "__main__":
    from core.noise import quiet_libraries

    quiet_libraries()  # PLUMBING: library messages to <run>/run.log (--logger.verbose: on the console)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(tyro.cli(Args))
