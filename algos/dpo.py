"""Direct Preference Optimization (DPO), with IPO and conservative DPO (label smoothing) as options.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model"
(arXiv:2305.18290). For prompt x with chosen response y_w and rejected response y_l, log-probs summed over the
response tokens (+ eos), π_θ the policy and π_ref the frozen starting model (the SFT warm start):

    h = [log π_θ(y_w|x) − log π_θ(y_l|x)] − [log π_ref(y_w|x) − log π_ref(y_l|x)]
    DPO / cDPO:  L = −(1 − ε) · log σ(β h) − ε · log σ(−β h)        (ε = --train.label-smoothing, Mitchell 2023)
    IPO:         L = (h − 1/(2β))²                                  (Azar et al. 2023, arXiv:2310.12036)
    optional:    + α · NLL(y_w), token mean over chosen responses  (α = --train.nll-coef; RPO, arXiv:2404.19733)

The implicit rewards r_w = β(log π_θ(y_w|x) − log π_ref(y_w|x)) and r_l are what `eval/pref_accuracy` ranks by.

Deviations from the paper:
1. Reference log-probs are computed once, before the first step, with the initial policy (which *is* π_ref), for
   the pairs the run's batches will use, and cached (and checkpointed). `--train.live-ref` recomputes them every step instead: LoRA runs disable the adapters
   for that pass (no copy), full fine-tuning keeps a frozen replica on every rank (not ZeRO-sharded).
2. Chosen and rejected responses of a micro-batch are packed padding-free into ONE forward pass, and the prompt
   they share is computed once: both responses branch off it under a 4D attention mask (prefix sharing,
   core/packing.py `collate_prefix_shared`; `--train.no-share-prompt` packs the two sequences whole).
3. IPO uses summed log-probs like DPO (the IPO paper's and TRL's IPO average per token).
4. The loss is the mean over the pairs of the global batch (all micro-batches, all ranks), so neither packing nor
   data parallelism changes it.
5. Vision-language pairs (`--data.image-key`): chosen and rejected both follow the prompt's pictures
   (core/vision.py), and pairs with pictures take the padded forward, not 2.'s packed one (Qwen2-VL's multimodal RoPE
   needs the padded batch's positions, as in sft.py).

Debug (SFT warm start `cleanrlhf/tiny-sft`, embedded preference pairs `cleanrlhf/add2-pref`, one CPU):
    python algos/dpo.py --train.max-steps 40
Several processes (ZeRO-3 over 2 ranks; see slurm/ for many hosts):
    torchrun --nproc_per_node 2 algos/dpo.py --ds.zero-stage 3
A real model and dataset:
    python algos/dpo.py --model.name-or-path Qwen/Qwen2.5-0.5B-Instruct --data.path my_pairs.jsonl \\
        --data.apply-chat-template --train.lr 5e-7 --train.batch-size 64 --model.lora-rank 16
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

from core import checkpoint, data, flags, models, packing, samples, sequence_parallel, vision
from core import engine as ds_engine
from core.config import CkptConfig, DataConfig, DSConfig, LoggerConfig, ModelConfig, check_args
from core.logger import RunLogger, lock_run_dir, run_name, timer


@dataclass
class TrainArgs:
    beta: flags.PosFloat = 1.0
    """β: strength of the implicit KL constraint to the reference (DPO paper, Eq. 7). 0.1 is the usual choice for
    LLMs; on the embedded task 1.0 reaches 90 % held-out accuracy in fewer steps (docs/algos/dpo.md)."""
    label_smoothing: flags.NonNegFloat = 0.0
    """ε: assumed probability that a preference label is flipped (conservative DPO); 0 is plain DPO."""
    ipo: bool = False
    """use the IPO loss (h − 1/(2β))² instead of the logistic loss."""
    nll_coef: flags.NonNegFloat = 0.0
    """α: weight of an SFT (NLL) term on the chosen responses (RPO); 0 disables."""
    live_ref: bool = False
    """recompute reference log-probs every step (see deviation 1) instead of caching them once up front."""
    lr: flags.PosFloat = 5e-4
    """peak learning rate (5e-4 suits the ~1 M embedded model, 1e-3 breaks it; use ~5e-7 for full fine-tuning of
    real models)."""
    batch_size: flags.PosInt = 128
    """global batch: preference pairs per optimizer step, summed over ranks."""
    max_tokens_per_micro: flags.PosInt = 4096
    """packing budget: chosen + rejected tokens per forward/backward on one rank (gradient accumulation covers the rest)."""
    max_steps: flags.PosInt = 80
    """optimizer steps (80 x 128 pairs is about one epoch of the embedded train split)."""
    warmup_steps: flags.NonNegInt = 5
    """linear learning-rate warmup steps, then cosine decay."""
    min_lr_ratio: flags.Fraction = 0.1
    """the cosine schedule ends at lr · min_lr_ratio."""
    weight_decay: flags.NonNegFloat = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2)."""
    share_prompt: bool = True
    """compute a pair's common prefix (its prompt) once, with chosen and rejected branching off it in the same
    packed row (exact: each response sees only the prompt and itself). Needs sdpa or eager attention; off packs
    chosen and rejected as two whole sequences."""
    sp_size: flags.PosInt = 1
    """sequence parallelism for long context (DeepSpeed-Ulysses, core/sequence_parallel.py): each packed row's tokens
    are split over this many consecutive ranks, which train on the same pairs; must divide the number of ranks and of
    attention heads, and needs --train.no-share-prompt. Reference and eval passes run unsplit."""
    ref_pairs_per_forward: flags.PosInt = 32
    """pairs per packed forward in the no-grad passes (reference cache, eval)."""
    seed: flags.NonNegInt = 1
    """seed of the data order and of every rank's RNG."""
    halt_after: flags.PosInt | None = None
    """stop this invocation after this many optimizer steps (the schedule still spans max-steps), saving a
    checkpoint: the next invocation on the same --run-dir resumes. For time-limited cluster jobs."""


@dataclass
class EvalArgs:
    every: flags.NonNegInt = 20
    """evaluate every N steps (and at the start and the end); 0 disables every eval, the start and end included."""
    max_samples: flags.PosInt = 500
    """held-out pairs used."""


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    chosen_key: str = "chosen"
    """field holding the preferred response (the prompt is `--data.input-key`)."""
    rejected_key: str = "rejected"
    """field holding the dispreferred response."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name_or_path="cleanrlhf/tiny-sft"))
    data: DataConfig = field(default_factory=lambda: DataConfig(path="cleanrlhf/add2-pref"))
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


# ALGO LOGIC: the objective. All inputs (P,): one summed response log-prob per pair.
def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, label_smoothing: float = 0.0,
             ipo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """DPO / cDPO / IPO loss, mean over the P pairs, and the detached implicit rewards (P,) of chosen and rejected.

    h = (π_c − π_r) − (ref_c − ref_r);  DPO/cDPO: −(1−ε)·logσ(βh) − ε·logσ(−βh);  IPO: (h − 1/(2β))²;
    rewards: β(π_c − ref_c), β(π_r − ref_r)."""
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


# ALGO LOGIC: the learning-rate schedule, the multiplier of --train.lr at each optimizer step (CleanRL anneals by hand).
def lr_schedule(update: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over `warmup` optimizer steps, then cosine decay from 1 to `floor` at update `total`."""
    progress = min(1.0, (update - warmup) / max(1, total - warmup))  # of the decay, after the warm-up
    return (update + 1) / warmup if update < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def pair_logps(model, pairs: list[dict], device, share_prompt: bool = False,
               sp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Summed response log-probs (P,) of the chosen and of the rejected responses of P pairs, from ONE packed
    forward in rows of twice the longest sequence (sdpa's mask costs O(row length^2), so bounded rows keep
    attention linear in the number of pairs). `share_prompt`: each pair is its common prefix once plus the two
    remainders (DEVIATION 2); else chosen 1..P then rejected 1..P as whole sequences. `sp`: the tokens are split
    over the model's sequence-parallel group (`--train.sp-size`; every rank of the group passes the same pairs).
    Pairs with pictures: one padded forward of chosen 1..P then rejected 1..P (DEVIATION 5)."""
    if pairs[0]["chosen"].get("pixel_values") is not None:
        seqs = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        batch = vision.collate(seqs, 0, device)  # the pad id is masked out
        sums = (packing.token_logprobs(model, batch) * batch["loss_mask"]).sum(1)  # (2P,)
        return sums[: len(pairs)], sums[len(pairs) :]
    row_len = 2 * max(len(p[k]["input_ids"]) for p in pairs for k in ("chosen", "rejected"))
    if share_prompt:
        batch = packing.collate_prefix_shared([[p["chosen"], p["rejected"]] for p in pairs], device, row_len)
        sums = packing.prefix_shared_logp_sums(model, batch)  # (2P,): chosen, rejected of pair 0, then pair 1, ...
        return sums[0::2], sums[1::2]
    seqs = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    batch = packing.collate_packed(seqs, device, row_len=row_len)
    logp = (sequence_parallel.token_logprobs if sp else packing.token_logprobs)(model, batch)  # (R, L)
    sums = torch.stack([s.sum() for s in packing.unpack(logp * batch["loss_mask"], batch["segments"])])  # (2P,)
    return sums[: len(pairs)], sums[len(pairs) :]


def micro_batches(idx: list[int], pairs: list[dict], max_tokens: int) -> list[list[int]]:
    """Split pair indices, in order, into groups of at most `max_tokens` chosen + rejected tokens."""
    groups, size = [[]], 0
    for i in idx:
        n = len(pairs[i]["chosen"]["input_ids"]) + len(pairs[i]["rejected"]["input_ids"])
        if groups[-1] and size + n > max_tokens:
            groups, size = groups + [[]], 0
        groups[-1].append(i)
        size += n
    return groups


@torch.no_grad()
def all_pair_logps(model, pairs: list[dict], chunk: int, rank: int, world: int, device,
                   share_prompt: bool = False) -> torch.Tensor:  # fmt: skip
    """(P, 2) summed log-probs [chosen, rejected] of every pair, in eval mode. Each data-parallel rank (`rank` of
    `world`; the ranks of an SP or TP group share one) computes an equal-sized slice (padded with repeats, so ZeRO-3's
    and AutoTP's collective forwards stay in step) and a sum over ranks, divided by the ranks of a group, assembles
    it."""
    was_training = model.training
    model.eval()
    n = len(pairs)
    per_rank = -(-n // world)
    out = torch.zeros(n, 2, device=device, dtype=torch.float64)
    for start in range(0, per_rank, chunk):
        idx = [rank * per_rank + i for i in range(start, min(start + chunk, per_rank))]
        with torch.compiler.set_stance("force_eager"):  # one-off passes: --ds.compile pays off in training only
            c, r = pair_logps(model, [pairs[i % n] for i in idx], device, share_prompt)
        keep = torch.tensor([i < n for i in idx], device=device)
        rows = torch.tensor([i % n for i in idx], device=device)
        out[rows[keep]] = torch.stack([c, r], dim=1)[keep].double()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        out /= dist.get_world_size() // world  # the ranks that computed each slice
    model.train(was_training)
    return out.float()


@torch.no_grad()
def reference_logps(engine, ref_model, pairs: list[dict], device,
                    share_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Live reference log-probs (--train.live-ref): the frozen replica, or the LoRA policy with its adapters off."""
    if ref_model is not None:
        return pair_logps(ref_model, pairs, device, share_prompt)
    engine.module.eval()
    with engine.module.disable_adapter():
        c, r = pair_logps(engine.module, pairs, device, share_prompt)
    engine.module.train()
    return c, r


def evaluate(model, pairs: list[dict], ref: torch.Tensor, args: Args, rank: int, world: int, device, logger=None,
             tokenizer=None, step: int = 0) -> dict:  # fmt: skip
    """Held-out DPO loss and implicit-reward ranking. Ties (h = 0, e.g. before training) count as half right. With
    `logger`: the first `--logger.samples` pairs and their implicit-reward margins go to samples.jsonl at `step`."""
    logps = all_pair_logps(model, pairs, args.train.ref_pairs_per_forward, rank, world, device, args.train.share_prompt)
    t = args.train
    loss, rc, rr = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], t.beta, t.label_smoothing, t.ipo)
    if logger is not None:
        logger.log_samples(samples.pair_rows(tokenizer, pairs, rc, rr, step, args.logger.samples), step)
    return {
        "eval/loss": loss.item(),
        "eval/pref_accuracy": ((rc > rr).float() + 0.5 * (rc == rr).float()).mean().item(),
        "eval/margin": (rc - rr).mean().item(),
        "eval/chosen_reward": rc.mean().item(),
        "eval/rejected_reward": rr.mean().item(),
        "eval/logp_accuracy": (logps[:, 0] > logps[:, 1]).float().mean().item(),
    }


def main(args: Args) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    # PLUMBING: process group (world of one for `python algos/dpo.py`), tokenizer, pairs, policy, DeepSpeed engine.
    rank, world, device = ds_engine.init_distributed(args.ds.backend, args.ds.timeout_s)
    # Same seed on every rank for the data order (each rank slices the same global batch); per-rank offset for
    # everything stochastic inside the model (dropout), so ranks do not draw identical noise.
    random.seed(args.train.seed + rank)
    np.random.seed(args.train.seed + rank)
    torch.manual_seed(args.train.seed + rank)
    if args.train.beta <= 0 or not 0.0 <= args.train.label_smoothing < 0.5:
        raise ValueError(f"--train.beta must be > 0 and --train.label-smoothing in [0, 0.5), got "
                         f"{args.train.beta} and {args.train.label_smoothing}")  # fmt: skip
    if args.train.share_prompt and args.model.attn_implementation not in ("auto", "sdpa", "eager"):
        raise ValueError(f"--train.share-prompt needs a 4D attention mask (sdpa or eager), not --model.attn-"
                         f"implementation {args.model.attn_implementation}: add --train.no-share-prompt")  # fmt: skip
    # a sample longer than the model's context is skipped and counted, not trained past the position embeddings
    limits = {"max_position_embeddings of --model.name-or-path": models.max_positions(args.model.name_or_path)}
    args.data.max_len = data.resolve_max_len(args.data.max_len, limits)
    tokenizer = models.load_tokenizer(args.model.tokenizer or args.model.name_or_path)
    log = print if rank == 0 else (lambda *_: None)
    make = partial(data.preference_example, tokenizer=tokenizer, cfg=args.data, chosen_key=args.chosen_key,
                   rejected_key=args.rejected_key)  # fmt: skip
    if args.data.image_key:  # vision-language: the row's pictures join the prompt of both sides (core/vision.py)
        make = vision.with_image(make, args.data, tokenizer, vision.load_image_processor(args.model.name_or_path))
    sources = data.load_sources(args.data.path, args.data.split, args.data.max_samples)
    train_set = data.mix(data.build_examples(sources, make, args.data, log), args.data.probs, args.train.seed)
    eval_sources = data.load_sources(args.data.eval_path or args.data.path, args.data.eval_split, args.eval.max_samples)
    eval_set = [ex for g in data.build_examples(eval_sources, make, args.data, log) for ex in g]
    model = models.load_causal_lm(args.model).to(device)
    # PLUMBING: --train.sp-size N (each pair's tokens split over N ranks) or --ds.tensor-parallel-size N (each linear
    # layer split over N ranks): groups of N ranks share each pair, and the data is split over the groups (dp_rank,
    # dp_world; without either: rank, world). `copies`: the ranks that hold each pair
    sp = args.train.sp_size
    if sp > 1 and args.data.image_key:
        raise ValueError("--train.sp-size splits packed rows; pairs with pictures (--data.image-key) take the padded "
                         "forward")  # fmt: skip
    if sp > 1 and args.train.share_prompt:
        raise ValueError("--train.sp-size splits packed rows by position ids; prompt sharing needs a 4D mask: add "
                         "--train.no-share-prompt")  # fmt: skip
    dp_rank, dp_world = ds_engine.tp_data_split(args.ds, sp)
    if sp > 1:
        dp_rank, dp_world = sequence_parallel.setup(model, sp)
    copies = world // dp_world
    schedule = partial(lr_schedule, warmup=args.train.warmup_steps, total=args.train.max_steps,
                       floor=args.train.min_lr_ratio)  # per optimizer step
    engine = ds_engine.make_engine(model, args.ds, args.train.lr, schedule, weight_decay=args.train.weight_decay,
                                   betas=args.train.adam_betas)  # fmt: skip
    ref_model = None
    if args.train.live_ref and args.model.lora_rank == 0:  # DEVIATION(1): a frozen full replica per rank
        ref_model = models.load_causal_lm(replace(args.model, gradient_checkpointing=False)).to(device).eval()
        ref_model.requires_grad_(False)

    run_dir = Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed))
    ckpt_dir = Path(args.ckpt.dir or run_dir / "checkpoints")
    lock_run_dir(run_dir, enabled=rank == 0)  # PLUMBING: one run writes a run folder: a second one is refused here
    # PLUMBING: resume from the newest intact checkpoint (flags checked against config.json); (0, {}) if new
    start_step, client = checkpoint.resume({"model": engine}, ckpt_dir, run_dir, args)
    logger = RunLogger(args.logger, run_dir, args, args.train.max_steps, enabled=rank == 0, resume_step=start_step)
    logger.print(f"[dpo] {len(train_set)} train / {len(eval_set)} eval pairs, world size {world}, "
                 f"ZeRO-{engine.zero_optimization_stage()}, run dir {run_dir}")  # fmt: skip

    # 2. reference log-probs -------------------------------------------------------------------------------------
    # ALGO LOGIC: π_ref is the starting policy, so before the first step the policy's own log-probs ARE the
    # reference's (DEVIATION 1). A resumed run takes them from the checkpoint: the policy has moved since.
    perf: dict = {}
    chunk = args.train.ref_pairs_per_forward
    used = sorted({i for s in range(start_step, args.train.max_steps)  # every pair this run's batches will use
                   for i in data.batch_indices(len(train_set), args.train.batch_size, s, args.train.seed)})  # fmt: skip
    with timer(perf, "perf/ref_s"):
        if "eval_ref" in client:
            train_ref, eval_ref = client["train_ref"], client["eval_ref"]
            if train_ref is not None and torch.isnan(train_ref[used]).any():
                raise ValueError(f"{ckpt_dir}: its cached reference log-probs cover the batches of the original "
                                 f"--train.max-steps only; resume with that value (or train with --train.live-ref)")  # fmt: skip
        else:
            eval_ref = all_pair_logps(engine.module, eval_set, chunk, dp_rank, dp_world, device, args.train.share_prompt)
            train_ref = None
            if not args.train.live_ref:
                train_ref = torch.full((len(train_set), 2), float("nan"))  # NaN: a pair no batch uses
                train_ref[used] = all_pair_logps(engine.module, [train_set[i] for i in used], chunk, dp_rank, dp_world,
                                                 device, args.train.share_prompt).cpu()  # fmt: skip
    first_eval = {}  # --eval.every 0: no eval at all, the first one included
    if args.eval.every:
        first_eval = client.get("first_eval") or evaluate(engine.module, eval_set, eval_ref, args, dp_rank, dp_world,
                                                          device, logger, tokenizer, 0)  # fmt: skip
    if start_step == 0:  # a resumed run logged it when it started
        logger.log({**first_eval, **perf}, 0)
    tokens_seen, t_train, step = 0, 0.0, start_step - 1

    for step in range(start_step, args.train.max_steps):
        # 3. batch: the global batch is a pure function of (seed, step); each SP or TP group (each rank, without them)
        # takes every dp_world-th pair; sums over ranks count a pair once per rank of its group: / copies
        idx = data.batch_indices(len(train_set), args.train.batch_size, step, args.train.seed)[dp_rank::dp_world]
        groups = micro_batches(idx, train_set, args.train.max_tokens_per_micro)
        n_micro = int(ds_engine.all_reduce(len(groups), op="max"))  # ranks must run the same number of passes
        num_chosen = ds_engine.all_reduce(sum(sum(train_set[i]["chosen"]["loss_mask"]) for i in idx)) / copies

        # 4. policy update: forward (chosen + rejected packed) / backward over micro-batches, one optimizer step
        t0 = time.perf_counter()
        stats = torch.zeros(8, dtype=torch.float64)  # sums of: dpo, nll, r_c, r_r, correct, logp_c, logp_r, tokens
        for i in range(n_micro):
            g, weight = (groups[i], 1.0) if i < len(groups) else (groups[0], 0.0)  # weight 0: a pad pass (ZeRO-3)
            pairs = [train_set[j] for j in g]
            pc, pr = pair_logps(engine, pairs, device, args.train.share_prompt, sp=sp > 1)
            if train_ref is not None:
                ref_c, ref_r = train_ref[g, 0].to(device), train_ref[g, 1].to(device)
            else:
                ref_c, ref_r = reference_logps(engine, ref_model, pairs, device, args.train.share_prompt)
            dpo, rc, rr = dpo_loss(pc, pr, ref_c, ref_r, args.train.beta, args.train.label_smoothing, args.train.ipo)
            nll = -pc.sum() / num_chosen  # RPO term: token mean over all chosen tokens of the global batch
            # mean over the global batch; DeepSpeed averages gradients over its data-parallel ranks, so scale by their
            # number, engine.dp_world_size (the world, or the world over --ds.tensor-parallel-size; with sequence
            # parallelism each rank's backward gives the gradient of its own tokens' share: the same scale).
            loss = (dpo * len(g) / args.train.batch_size + args.train.nll_coef * nll) * engine.dp_world_size * weight
            ds_engine.check_finite(loss, step)  # PLUMBING: a NaN/inf loss or gradient stops the run before the step
            engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            engine.backward(loss)
            n_tok = sum(len(p["chosen"]["input_ids"]) + len(p["rejected"]["input_ids"]) for p in pairs)
            correct = ((rc > rr).sum() + 0.5 * (rc == rr).sum()).item()  # ties (policy == reference) count half
            stats += weight * torch.tensor([dpo.item() * len(g), nll.item(), rc.sum().item(), rr.sum().item(), correct,
                                            pc.sum().item(), pr.sum().item(), n_tok])  # fmt: skip
        grad_norm = ds_engine.optimizer_step(engine, step)
        t_train += time.perf_counter() - t0

        # 5. logging, eval, checkpoint
        s = [ds_engine.all_reduce(x) / copies for x in stats.tolist()]
        tokens_seen += s[7]
        b = args.train.batch_size
        metrics = {
            "loss/dpo": s[0] / b,
            "loss/nll": s[1],
            "train/chosen_reward": s[2] / b,
            "train/rejected_reward": s[3] / b,
            "train/margin": (s[2] - s[3]) / b,
            "train/reward_accuracy": s[4] / b,
            "train/chosen_logp": s[5] / b,
            "train/rejected_logp": s[6] / b,
            "train/lr": engine.lr_scheduler.get_last_lr()[0],
            "train/grad_norm": grad_norm,
            "train/tokens": s[7],
            "perf/step_s": t_train / (step + 1 - start_step),
            "perf/tokens_per_s": tokens_seen / max(t_train, 1e-9),
        }
        last = step == args.train.max_steps - 1
        if args.eval.every and ((step + 1) % args.eval.every == 0 or last):
            with timer(metrics, "perf/eval_s"):
                metrics.update(evaluate(engine.module, eval_set, eval_ref, args, dp_rank, dp_world, device, logger,
                                        tokenizer, step + 1))  # fmt: skip
        logger.log(metrics, step + 1, shown=("loss/dpo", "train/reward_accuracy", "eval/pref_accuracy"))
        halted = args.train.halt_after is not None and step + 1 - start_step >= args.train.halt_after and not last
        if halted or (args.ckpt.every and ((step + 1) % args.ckpt.every == 0 or last)):
            checkpoint.save({"model": engine}, ckpt_dir, step, {"step": step, "first_eval": first_eval,
                            "train_ref": train_ref, "eval_ref": eval_ref}, args.ckpt.keep_last)  # fmt: skip
        if halted:
            logger.print(f"[dpo] halted after {args.train.halt_after} steps; resume with --run-dir {run_dir}")
            logger.close({"steps": step + 1, "halted": True})
            return {"steps": step + 1, "halted": True, "run_dir": str(run_dir)}

    # 6. export and summary
    export_dir = Path(args.export_dir or run_dir / "hf")
    ds_engine.export_hf(engine, tokenizer, export_dir)
    summary = {
        "steps": step + 1,
        "train_loss_last": logger.latest("loss/dpo"),
        "eval_pref_accuracy_first": first_eval.get("eval/pref_accuracy"),  # None: --eval.every 0
        "eval_pref_accuracy_last": logger.latest("eval/pref_accuracy", None),
        "eval_logp_accuracy_first": first_eval.get("eval/logp_accuracy"),
        "eval_logp_accuracy_last": logger.latest("eval/logp_accuracy", None),
        "eval_margin_last": logger.latest("eval/margin", None),
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
