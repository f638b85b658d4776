# Course exercise, lesson 6: Reward models (Bradley-Terry) (docs/course/06_reward_model.md).
# A copy of algos/rm.py with the body of `reward_loss` left for you to write; the rest is the
# real code and runs as the file it copies. Check your function, then a short learning run with it:
#     python docs/course/check.py 6 <this file>
# Written by docs/course/make_exercises.py from the real file; edit your own copy, not this one.
"""Reward model (RM) training: a causal LM body with a scalar head, fit to pairwise preferences (Bradley-Terry).

Ouyang et al. 2022 ("Training language models to follow instructions", step 2), after Stiennon et al. 2020. The
reward r_φ(x, y) is a linear head on the last hidden state of the last token (the eos appended to prompt + response).
For a pair with chosen y_w and rejected y_l:

    sigmoid:  L = −log σ(r_φ(x, y_w) − r_φ(x, y_l) − m)        (m: optional per-pair margin, Llama 2, arXiv:2307.09288)
    logexp:   L = log(1 + exp(r_φ(x, y_l) − r_φ(x, y_w)))      (OpenRLHF's LogExpLoss: the same function when m = 0)

The trained model is saved as an `AutoModelForSequenceClassification` (num_labels=1) whose `config.json` also holds
`reward_mean` / `reward_std` (of the held-out rewards, chosen and rejected together) and `reward_add_special_tokens`,
so `rewards/server.py` can serve normalized scores of exactly the tokens seen in training.

Deviations from the paper:
1. Chosen and rejected sequences are packed padding-free into ONE forward pass, their common prefix (the prompt)
   computed once (`--train.share-prompt`); the scores are read at each sequence's last token (tests/test_rm.py
   checks them against the padded `core.models.sequence_scores`).
2. One pair per prompt and a global batch of pairs (the paper batches all K-choose-2 comparisons of a prompt).
3. The prompt and response are tokenized as one text (`core.data.reward_ids`), as the server sees them.
4. Vision-language pairs (`--data.image-key`, a Qwen2-VL-style model: `core.models.vl_scalar_class` puts the scalar
   head on its multimodal body): chosen and rejected both follow the prompt's pictures (core/vision.py) and take a
   padded forward, not 1.'s packed one (Qwen2-VL's multimodal RoPE positions are computed per padded row).

Debug (SFT warm start body, embedded pairs `cleanrlhf/add2-pref`, one CPU):
    python algos/rm.py --train.max-steps 40
Pictures (the random tiny vision-language model, embedded pairs `cleanrlhf/shapes-pref`):
    python algos/rm.py --model.name-or-path cleanrlhf/tiny-vl --data.path cleanrlhf/shapes-pref --data.image-key image
Several processes (ZeRO-3 over 2 ranks; see slurm/ for many hosts):
    torchrun --nproc_per_node 2 algos/rm.py --ds.zero-stage 3
Serve it:
    python -m rewards.server --model runs/rm__1__<time>/hf --normalize
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

from core import checkpoint, data, flags, models, packing, samples, vision
from core import engine as ds_engine
from core.config import CkptConfig, DataConfig, DSConfig, LoggerConfig, ModelConfig, check_args
from core.logger import RunLogger, lock_run_dir, run_name, timer


@dataclass
class TrainArgs:
    loss: Literal["sigmoid", "logexp"] = "sigmoid"
    """pairwise loss: `sigmoid` (−log σ(r_w − r_l − m)) or `logexp` (log(1 + exp(r_l − r_w)), no margin)."""
    lr: flags.PosFloat = 3e-4
    """peak learning rate (3e-4 suits the ~1 M embedded model, 6e-4 is unstable; use ~9e-6 for real models)."""
    batch_size: flags.PosInt = 128
    """global batch: preference pairs per optimizer step, summed over ranks."""
    max_tokens_per_micro: flags.PosInt = 4096
    """packing budget: chosen + rejected tokens per forward/backward on one rank."""
    max_steps: flags.PosInt = 150
    """optimizer steps."""
    warmup_steps: flags.NonNegInt = 10
    """linear learning-rate warmup steps, then cosine decay."""
    min_lr_ratio: flags.Fraction = 0.1
    """the cosine schedule ends at lr · min_lr_ratio."""
    weight_decay: flags.NonNegFloat = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (β1, β2); β2 0.95 left the embedded reward model at chance for longer."""
    share_prompt: bool = True
    """compute a pair's common prefix (its prompt) once, chosen and rejected branching off it in the same packed
    row (exact: each sees only the prompt and itself). Needs sdpa or eager attention; off packs them whole."""
    seed: flags.NonNegInt = 1
    """seed of the data order, of the head's initialisation and of every rank's RNG."""
    halt_after: flags.PosInt | None = None
    """stop this invocation after this many optimizer steps (the schedule still spans max-steps), saving a
    checkpoint: the next invocation on the same --run-dir resumes. For time-limited cluster jobs."""


@dataclass
class EvalArgs:
    every: flags.NonNegInt = 50
    """evaluate every N steps (and at the start and the end); 0 disables every eval, the start and end included (the
    held-out reward statistics the export saves for `--normalize` are still measured once after training)."""
    max_samples: flags.PosInt = 500
    """held-out pairs used (also the sample for the saved reward mean / std)."""
    batch_size: flags.PosInt = 128
    """sequences per padded forward pass in the eval."""


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    chosen_key: str = "chosen"
    """field holding the preferred response (the prompt is `--data.input-key`)."""
    rejected_key: str = "rejected"
    """field holding the dispreferred response."""
    margin_key: str | None = None
    """optional field holding a per-pair margin m ≥ 0 (sigmoid loss only), e.g. Llama 2's preference strength."""
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
    """where the final HF model (AutoModelForSequenceClassification) is written; default `<run_dir>/hf`."""


# ALGO LOGIC: the objective. chosen, rejected, margin: (P,) rewards of the P pairs.
def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                kind: str = "sigmoid") -> torch.Tensor:  # fmt: skip
    """Bradley-Terry pairwise loss, mean over pairs. sigmoid: −log σ(r_c − r_r − m); logexp: log(1 + exp(r_r − r_c)),
    computed as softplus (no overflow), equal to sigmoid with m = 0."""
    # YOUR CODE HERE: the docstring above says what to return (lesson 6).
    raise NotImplementedError("lesson 6: write reward_loss")


# ALGO LOGIC: the learning-rate schedule, the multiplier of --train.lr at each optimizer step (CleanRL anneals by hand).
def lr_schedule(update: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over `warmup` optimizer steps, then cosine decay from 1 to `floor` at update `total`."""
    progress = min(1.0, (update - warmup) / max(1, total - warmup))  # of the decay, after the warm-up
    return (update + 1) / warmup if update < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def packed_scores(model, seqs: list[list[int]], device) -> torch.Tensor:
    """Rewards (S,) of S token sequences from ONE packed forward: the scalar head at each sample's last token.
    `model`: the engine of a `core.models.TokenValues` (or the wrapper itself)."""
    rows = 2 * max(len(s) for s in seqs)  # bounded rows: sdpa's block-diagonal mask costs O(row length^2)
    batch = packing.collate_packed([{"input_ids": s, "loss_mask": [0] * len(s)} for s in seqs], device, rows)
    values = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])  # (rows, L): models.TokenValues
    row = torch.tensor([r for r, _, _ in batch["segments"]], device=device)
    last = torch.tensor([start + n - 1 for _, start, n in batch["segments"]], device=device)
    return values[row, last]  # (S,)


def pair_scores(model, pairs: list[dict], device, share_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (P,) of the chosen and of the rejected sequences of P pairs, from one packed forward; `share_prompt`:
    each pair's common prefix is computed once (`core.packing.collate_prefix_shared`), else `packed_scores`.
    Pairs with pictures: one padded forward of chosen 1..P then rejected 1..P (DEVIATION 4)."""
    if pairs[0].get("pictures") is not None:
        seqs = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
        batch = picture_batch(seqs, [p["pictures"] for p in pairs] * 2, device)
        values = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       **vision.model_kwargs(batch))  # (2P, L): models.TokenValues  # fmt: skip
        r = models.at_last_token(values, batch["attention_mask"])
        return r[: len(pairs)], r[len(pairs) :]
    if not share_prompt:
        r = packed_scores(model, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], device)
        return r[: len(pairs)], r[len(pairs) :]
    row_len = 2 * max(len(p[k]) for p in pairs for k in ("chosen", "rejected"))
    groups = [[{"input_ids": p[k], "loss_mask": [0] * len(p[k])} for k in ("chosen", "rejected")] for p in pairs]
    batch = packing.collate_prefix_shared(groups, device, row_len)
    values = model(input_ids=batch["input_ids"], attention_mask=packing.prefix_shared_mask(model, batch),
                   position_ids=batch["position_ids"])  # (R, L): models.TokenValues  # fmt: skip
    r = values[batch["last"][:, 0], batch["last"][:, 1]]  # (2P,): chosen, rejected of pair 0, then pair 1, ...
    return r[0::2], r[1::2]


def micro_batches(idx: list[int], pairs: list[dict], max_tokens: int) -> list[list[int]]:
    """Split pair indices, in order, into groups of at most `max_tokens` chosen + rejected tokens."""
    groups, size = [[]], 0
    for i in idx:
        n = len(pairs[i]["chosen"]) + len(pairs[i]["rejected"])
        if groups[-1] and size + n > max_tokens:
            groups, size = groups + [[]], 0
        groups[-1].append(i)
        size += n
    return groups


def picture_batch(seqs: list[list[int]], pictures: list[dict], device) -> dict:
    """A right-padded batch (S, L) of token sequences with their pictures (`with_pictures`): `core.vision.collate`."""
    return vision.collate([{"input_ids": s, "loss_mask": [0] * len(s), **v} for s, v in zip(seqs, pictures)], 0, device)


@torch.no_grad()
def padded_scores(model, seqs: list[list[int]], pad_id: int, device, pictures: list[dict] | None = None) -> torch.Tensor:
    """Rewards (S,) of right-padded sequences (`core.models.sequence_scores`): what the eval and the server use.
    `pictures`: each sequence's pictures (`with_pictures`), given to the forward."""
    if pictures is not None:
        batch = picture_batch(seqs, pictures, device)
        return models.sequence_scores(model, batch["input_ids"], batch["attention_mask"], **vision.model_kwargs(batch))
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], device=device)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    with torch.compiler.set_stance("force_eager"):  # eval and serving: --ds.compile pays off in training only
        return models.sequence_scores(model, ids, attn)


def with_pictures(make, cfg: DataConfig, tokenizer, processor):
    """The pair maker `make` (`core.data.reward_pair_example`) for rows with pictures under `--data.image-key`: both
    sides follow the prompt's pictures (`core.vision.with_image`: each picture's `<|image_pad|>` expanded to its
    tokens), and the pair carries them once as `pictures` (`images`, `pixel_values`, `image_grid_thw`,
    `image_token_id`); `chosen` and `rejected` stay token lists."""
    sides = vision.with_image(lambda row: {**(ex := make(row)), "chosen": {"input_ids": ex["chosen"]},
                                           "rejected": {"input_ids": ex["rejected"]}}, cfg, tokenizer, processor)  # fmt: skip

    def make_pair(row: dict) -> dict:
        ex = sides(row)
        pictures = {k: v for k, v in ex["chosen"].items() if k != "input_ids"}
        return {**ex, "chosen": ex["chosen"]["input_ids"], "rejected": ex["rejected"]["input_ids"], "pictures": pictures}

    return make_pair


@torch.no_grad()
def evaluate(model, pairs: list[dict], args: Args, pad_id: int, rank: int, world: int, device, logger=None,
             tokenizer=None, step: int = 0) -> dict:  # fmt: skip
    """Held-out pair accuracy, loss, margin and the reward mean / std (chosen and rejected together). Each
    data-parallel rank `rank` of `world` (the ranks of a TP group share one) scores an equal-sized slice (padded with
    repeats: ZeRO-3's collective forwards stay in step), summed over ranks.
    With `logger`: the first `--logger.samples` pairs and their scores go to samples.jsonl at `step`."""
    model.eval()
    n = len(pairs)
    per_rank = -(-n // world)
    scores = torch.zeros(n, 2, device=device, dtype=torch.float64)
    chunk = max(1, args.eval.batch_size // 2)
    for start in range(0, per_rank, chunk):
        idx = [rank * per_rank + i for i in range(start, min(start + chunk, per_rank))]
        seqs = [pairs[i % n]["chosen"] for i in idx] + [pairs[i % n]["rejected"] for i in idx]
        pictures = [pairs[i % n]["pictures"] for i in idx] * 2 if pairs[0].get("pictures") is not None else None
        r = padded_scores(model, seqs, pad_id, device, pictures).double()
        keep = torch.tensor([i < n for i in idx], device=device)
        rows = torch.tensor([i % n for i in idx], device=device)
        scores[rows[keep]] = torch.stack([r[: len(idx)], r[len(idx) :]], dim=1)[keep]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(scores)
        scores /= dist.get_world_size() // world  # the ranks that scored each slice
    model.train()
    rc, rr = scores[:, 0], scores[:, 1]
    if logger is not None:
        logger.log_samples(samples.pair_rows(tokenizer, pairs, rc, rr, step, args.logger.samples), step)
    margin = torch.tensor([p["margin"] for p in pairs], device=device, dtype=torch.float64)
    return {
        "eval/loss": reward_loss(rc, rr, margin if args.margin_key else None, args.train.loss).item(),
        "eval/accuracy": (rc > rr).double().mean().item(),
        "eval/margin": (rc - rr).mean().item(),
        "eval/chosen_reward": rc.mean().item(),
        "eval/rejected_reward": rr.mean().item(),
        "eval/reward_mean": scores.mean().item(),
        "eval/reward_std": scores.std().item(),
    }


def main(args: Args) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    models.check_4bit_training(args.model.load_in_4bit, args.model.lora_rank)  # QLoRA needs adapters
    # PLUMBING: process group (world of one for `python algos/rm.py`), tokenizer, pairs, model, DeepSpeed engine.
    rank, world, device = ds_engine.init_distributed(args.ds.backend, args.ds.timeout_s)
    # Same seed on every rank for the data order and the head's init (each rank must build the same model);
    # per-rank offset afterwards for everything stochastic inside the model (dropout).
    random.seed(args.train.seed)
    np.random.seed(args.train.seed)
    torch.manual_seed(args.train.seed)
    if args.margin_key and args.train.loss != "sigmoid":
        raise ValueError(f"--margin-key {args.margin_key!r} needs --train.loss sigmoid (logexp takes no margin)")
    if args.train.share_prompt and args.model.attn_implementation not in ("auto", "sdpa", "eager"):
        raise ValueError(f"--train.share-prompt needs a 4D attention mask (sdpa or eager), not --model.attn-"
                         f"implementation {args.model.attn_implementation}: add --train.no-share-prompt")  # fmt: skip
    # a sample longer than the model's context is skipped and counted, not trained past the position embeddings
    limits = {"max_position_embeddings of --model.name-or-path": models.max_positions(args.model.name_or_path)}
    args.data.max_len = data.resolve_max_len(args.data.max_len, limits)
    tokenizer = models.load_tokenizer(args.model.tokenizer or args.model.name_or_path)
    log = print if rank == 0 else (lambda *_: None)
    make = partial(data.reward_pair_example, tokenizer=tokenizer, cfg=args.data, chosen_key=args.chosen_key,
                   rejected_key=args.rejected_key, margin_key=args.margin_key)  # fmt: skip
    if args.data.image_key:  # vision-language: the row's pictures join the prompt of both sides (DEVIATION 4)
        make = with_pictures(make, args.data, tokenizer, vision.load_image_processor(args.model.name_or_path))
    sources = data.load_sources(args.data.path, args.data.split, args.data.max_samples)
    train_set = data.mix(data.build_examples(sources, make, args.data, log), args.data.probs, args.train.seed)
    eval_sources = data.load_sources(args.data.eval_path or args.data.path, args.data.eval_split, args.eval.max_samples)
    eval_set = [ex for g in data.build_examples(eval_sources, make, args.data, log) for ex in g]
    model = models.load_scalar_model(args.model.name_or_path, args.model.dtype, args.model.attn_implementation,
                                     load_in_4bit=args.model.load_in_4bit)  # fmt: skip
    model = model if args.model.load_in_4bit else model.to(device)  # 4-bit: loaded on its device
    if args.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.model.load_in_4bit:  # no parameter before the first adapter trains: checkpointed blocks need one
            model.enable_input_require_grads()
    if args.model.lora_rank > 0:  # LoRA adapters on the body's linears; the fresh score head trains whole
        model = models.add_lora(model, args.model, "SEQ_CLS", whole=("score",))  # (--model.lora-* as given)
    torch.manual_seed(args.train.seed + rank)
    # PLUMBING: --ds.tensor-parallel-size N (each linear layer split over N ranks): groups of N ranks share each pair,
    # and the data is split over the groups (dp_rank, dp_world; without it: rank, world). `copies`: the ranks that
    # hold each pair
    dp_rank, dp_world = ds_engine.tp_data_split(args.ds)
    copies = world // dp_world
    schedule = partial(lr_schedule, warmup=args.train.warmup_steps, total=args.train.max_steps,
                       floor=args.train.min_lr_ratio)  # per optimizer step
    engine = ds_engine.make_engine(models.TokenValues(model), args.ds, args.train.lr, schedule,
                                   weight_decay=args.train.weight_decay, betas=args.train.adam_betas)  # fmt: skip
    pad_id = tokenizer.pad_token_id

    run_dir = Path(args.run_dir or Path(args.logger.run_root) / run_name(args.exp_name, args.train.seed))
    ckpt_dir = Path(args.ckpt.dir or run_dir / "checkpoints")
    lock_run_dir(run_dir, enabled=rank == 0)  # PLUMBING: one run writes a run folder: a second one is refused here
    # PLUMBING: resume from the newest intact checkpoint (flags checked against config.json); (0, {}) if new
    start_step, client = checkpoint.resume({"model": engine}, ckpt_dir, run_dir, args)
    logger = RunLogger(args.logger, run_dir, args, args.train.max_steps, enabled=rank == 0, resume_step=start_step)
    logger.print(f"[rm] {len(train_set)} train / {len(eval_set)} eval pairs, world size {world}, "
                 f"ZeRO-{engine.zero_optimization_stage()}, run dir {run_dir}")  # fmt: skip
    first_eval = {}  # --eval.every 0: no eval at all, the first one included
    if args.eval.every:
        first_eval = client.get("first_eval") or evaluate(model, eval_set, args, pad_id, dp_rank, dp_world, device,
                                                          logger, tokenizer, 0)  # fmt: skip
        if start_step == 0:  # a resumed run logged it when it started
            logger.log(first_eval, 0)
    tokens_seen, t_train, step = 0.0, 0.0, start_step - 1

    for step in range(start_step, args.train.max_steps):
        # 2. batch: the global batch is a pure function of (seed, step); each TP group (each rank, without it) takes
        # every dp_world-th pair; sums over ranks count a pair once per rank of its group: / copies
        idx = data.batch_indices(len(train_set), args.train.batch_size, step, args.train.seed)[dp_rank::dp_world]
        groups = micro_batches(idx, train_set, args.train.max_tokens_per_micro)
        n_micro = int(ds_engine.all_reduce(len(groups), op="max"))  # ranks must run the same number of passes

        # 3. forward (chosen + rejected packed) / backward over micro-batches, one optimizer step
        t0 = time.perf_counter()
        stats = torch.zeros(5, dtype=torch.float64)  # sums of: loss, r_c, r_r, correct, tokens
        for i in range(n_micro):
            g, weight = (groups[i], 1.0) if i < len(groups) else (groups[0], 0.0)  # weight 0: a pad pass (ZeRO-3)
            pairs = [train_set[j] for j in g]
            rc, rr = pair_scores(engine, pairs, device, args.train.share_prompt)
            margin = torch.tensor([p["margin"] for p in pairs], device=device) if args.margin_key else None
            rm_loss = reward_loss(rc, rr, margin, args.train.loss)
            ds_engine.check_finite(rm_loss, step)  # PLUMBING: a NaN/inf loss or gradient stops the run before the step
            # mean over the global batch; DeepSpeed averages gradients over its data-parallel ranks
            # (engine.dp_world_size: the world, or the world over --ds.tensor-parallel-size), so scale by their number.
            engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            engine.backward(rm_loss * len(g) / args.train.batch_size * engine.dp_world_size * weight)
            n_tok = sum(len(p["chosen"]) + len(p["rejected"]) for p in pairs)
            stats += weight * torch.tensor([rm_loss.item() * len(g), rc.sum().item(), rr.sum().item(),
                                            (rc > rr).sum().item(), n_tok])  # fmt: skip
        grad_norm = ds_engine.optimizer_step(engine, step)
        t_train += time.perf_counter() - t0

        # 4. logging, eval, checkpoint
        s = [ds_engine.all_reduce(x) / copies for x in stats.tolist()]
        tokens_seen += s[4]
        b = args.train.batch_size
        metrics = {
            "loss/rm": s[0] / b,
            "train/accuracy": s[3] / b,
            "train/chosen_reward": s[1] / b,
            "train/rejected_reward": s[2] / b,
            "train/margin": (s[1] - s[2]) / b,
            "train/lr": engine.lr_scheduler.get_last_lr()[0],
            "train/grad_norm": grad_norm,
            "train/tokens": s[4],
            "perf/step_s": t_train / (step + 1 - start_step),
            "perf/tokens_per_s": tokens_seen / max(t_train, 1e-9),
        }
        last = step == args.train.max_steps - 1
        if args.eval.every and ((step + 1) % args.eval.every == 0 or last):
            with timer(metrics, "perf/eval_s"):
                metrics.update(evaluate(model, eval_set, args, pad_id, dp_rank, dp_world, device, logger, tokenizer,
                                        step + 1))  # fmt: skip
        logger.log(metrics, step + 1, shown=("loss/rm", "train/accuracy", "eval/accuracy"))
        halted = args.train.halt_after is not None and step + 1 - start_step >= args.train.halt_after and not last
        if halted or (args.ckpt.every and ((step + 1) % args.ckpt.every == 0 or last)):
            checkpoint.save({"model": engine}, ckpt_dir, step, {"step": step, "first_eval": first_eval},
                            args.ckpt.keep_last)  # fmt: skip
        if halted:
            logger.print(f"[rm] halted after {args.train.halt_after} steps; resume with --run-dir {run_dir}")
            logger.close({"steps": step + 1, "halted": True})
            return {"steps": step + 1, "halted": True, "run_dir": str(run_dir)}

    # 5. normalization statistics, export and summary
    # The held-out reward mean / std go into config.json: the server's `--normalize` serves (r − mean) / std.
    final = evaluate(model, eval_set, args, pad_id, dp_rank, dp_world, device)
    config = model.config
    config.reward_mean, config.reward_std = final["eval/reward_mean"], final["eval/reward_std"]
    config.reward_add_special_tokens = not args.data.apply_chat_template
    export_dir = Path(args.export_dir or run_dir / "hf")
    ds_engine.export_hf(engine, tokenizer, export_dir)
    summary = {
        "steps": step + 1,
        "train_loss_last": logger.latest("loss/rm"),
        "eval_accuracy_first": first_eval.get("eval/accuracy"),  # None: --eval.every 0
        "eval_accuracy_last": final["eval/accuracy"] if args.eval.every else None,
        "eval_margin_last": final["eval/margin"] if args.eval.every else None,
        "reward_mean": final["eval/reward_mean"],
        "reward_std": final["eval/reward_std"],
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
