"""Supervised fine-tuning (SFT): maximum likelihood on demonstration responses.

Objective (Ouyang et al. 2022, "Training language models to follow instructions", step 1): for prompt x and
response y = (y_1 .. y_n),

    L(θ) = − Σ_{samples} Σ_t m_t · log π_θ(y_t | x, y_<t)  /  Σ_{samples} Σ_t m_t

where m_t = 1 on the tokens we learn from: the response (+ eos) by default, every assistant turn with
`--train.mode multiturn`, every token with `--train.mode pretrain`. The mean is over all target tokens of the
global batch (all micro-batches, all ranks), so packing and data parallelism do not change the loss.

Deviations from the paper:
1. Samples are packed padding-free into micro-batches of at most `--train.max-tokens-per-micro` tokens
   (transformers' position-id packing); the loss is identical to the padded one (tests/test_packing.py).
2. Optional early stop when greedy exact-match accuracy on the eval set reaches `--eval.stop-at-accuracy`:
   used to build the RL warm start `cleanrlhf/tiny-sft` at partial accuracy.
3. Mixture-of-experts models add c · aux, the router's load-balancing loss (Fedus et al. 2021,
   `models.router_aux_loss`) weighted by each micro-batch's share of the target tokens, c =
   `--train.router-aux-coef`, as transformers' MoE loss does.
4. Vision-language models (`--data.image-key`): the row's picture goes in front of the prompt and through the vision
   tower; such batches are right-padded micro-batches of `--train.micro-batch-size`, not packed, because the model
   computes its multimodal RoPE positions from a padded batch (core/vision.py).

Debug (tiny model, embedded task, one CPU):
    python algos/sft.py --train.max-steps 50
The recipe of the embedded RL warm start `cleanrlhf/tiny-sft` (a preset: its flags are the defaults, the others apply):
    python algos/sft.py --preset warm-start --export-dir my-warm-start
Several processes (ZeRO-3 over 2 ranks; one host or many with torchrun's rendezvous flags, see slurm/):
    torchrun --nproc_per_node 2 algos/sft.py --ds.zero-stage 3
A vision-language model on the embedded picture task (count the squares in a picture):
    python algos/sft.py --model.name-or-path cleanrlhf/tiny-vl --data.path cleanrlhf/shapes --data.image-key image
A real model and dataset:
    python algos/sft.py --model.name-or-path Qwen/Qwen2.5-0.5B --data.path my.jsonl --data.input-key question \\
        --data.output-key response --data.apply-chat-template --train.lr 1e-5 --eval.no-generate
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import tyro

from core import checkpoint, data, flags, models, packing, sequence_parallel, vision
from core import engine as ds_engine
from core.config import CkptConfig, DataConfig, DSConfig, LoggerConfig, ModelConfig, check_args
from core.logger import RunLogger, lock_run_dir, run_name, timer


@dataclass
class TrainArgs:
    lr: flags.PosFloat = 3e-3
    """peak learning rate (3e-3 suits the ~1 M embedded model; use ~1e-5 for real models)."""
    batch_size: flags.PosInt = 64
    """global batch: samples per optimizer step, summed over ranks."""
    max_tokens_per_micro: flags.PosInt = 4096
    """packing budget: tokens per forward/backward on one rank (gradient accumulation covers the rest)."""
    packing: bool = True
    """pack samples padding-free; `--train.no-packing` uses right-padded micro-batches of `micro-batch-size`."""
    pack_row_len: flags.PosInt | None = None
    """tokens per packed row (rows are filled longest-first and padded to the fullest one). Default: one row per
    micro-batch with flash-attention (varlen kernels), otherwise rows of twice the longest sample, because
    sdpa/eager attention over a packed row costs O(row length^2)."""
    micro_batch_size: flags.PosInt = 16
    """samples per micro-batch when packing is off."""
    max_steps: flags.PosInt = 300
    """optimizer steps."""
    warmup_steps: flags.NonNegInt = 10
    """linear learning-rate warmup steps, then cosine decay."""
    min_lr_ratio: flags.Fraction = 0.1
    """the cosine schedule ends at lr · min_lr_ratio."""
    weight_decay: flags.NonNegFloat = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2)."""
    router_aux_coef: float | None = None
    """mixture-of-experts models: weight of the router's load-balancing loss added to the loss (logged as
    `loss/router_aux`); None: the model config's `router_aux_loss_coef` (0.001 in Qwen's MoE configs), as
    transformers' own MoE loss. Dense models have no such loss."""
    sp_size: flags.PosInt = 1
    """sequence parallelism for long context (DeepSpeed-Ulysses): each packed row's tokens are split over this many
    consecutive ranks, which all-to-all their attention heads (core/sequence_parallel.py); must divide the number of
    ranks and of attention heads. The ranks of a group train on the same samples: data parallelism is over groups."""
    mode: Literal["single", "multiturn", "pretrain"] = "single"
    """`single`: loss on the response; `multiturn`: on every assistant turn of a chat; `pretrain`: on all tokens."""
    seed: flags.NonNegInt = 1
    """seed of the data order and of every rank's RNG."""
    halt_after: flags.PosInt | None = None
    """stop this invocation after this many optimizer steps (the schedule still spans max-steps), saving a
    checkpoint: the next invocation on the same --run-dir resumes. For time-limited cluster jobs."""


@dataclass
class EvalArgs:
    every: flags.NonNegInt = 50
    """evaluate every N steps (and at the start and the end); 0 disables every eval, the start and end included."""
    max_samples: flags.PosInt = 500
    """eval examples used."""
    generate: bool = True
    """also measure greedy exact-match accuracy of the generated response against `--data.output-key`."""
    max_new_tokens: flags.PosInt = 16
    """generation length for the accuracy eval."""
    batch_size: flags.PosInt = 128
    """eval examples per forward pass on one rank."""
    stop_at_accuracy: flags.Fraction | None = None
    """stop training once eval accuracy reaches this value (how the partial-accuracy warm start is made)."""


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """run name prefix; defaults to this file's name, so a copied script names its own runs."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
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


# ALGO LOGIC: the objective. `logp` and `mask` are (1, N) packed or (B, T) padded.
def sft_loss(logp: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """Negative log-likelihood summed over target tokens and divided by the *global* target count `num_tokens`
    (all micro-batches, all ranks), so the micro-batch losses add up to one exact token mean."""
    return -(logp * mask).sum() / num_tokens


# ALGO LOGIC: the learning-rate schedule, the multiplier of --train.lr at each optimizer step (CleanRL anneals by hand).
def lr_schedule(update: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over `warmup` optimizer steps, then cosine decay from 1 to `floor` at update `total`."""
    progress = min(1.0, (update - warmup) / max(1, total - warmup))  # of the decay, after the warm-up
    return (update + 1) / warmup if update < warmup else floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def sft_example_with_label(row: dict, tokenizer, cfg: DataConfig, mode: str) -> dict:
    """`data.sft_example` plus the reference response text, for the exact-match eval."""
    label = row.get(cfg.output_key) if mode == "single" else None
    return {**data.sft_example(row, tokenizer, cfg, mode), "label": str(label or "")}


def micro_batches(examples: list[dict], args: Args, pad_id: int, device) -> list[dict]:
    """Packed (default) or padded micro-batches of one rank's share of the batch; with pictures always padded,
    DEVIATION(4)."""
    step = args.train.micro_batch_size
    if args.data.image_key:
        return [vision.collate(examples[i : i + step], pad_id, device) for i in range(0, len(examples), step)]
    if args.train.packing:
        row_len = args.train.pack_row_len
        if row_len is None and not models.packs_in_one_row(args.model.attn_implementation):
            row_len = 2 * max(len(ex["input_ids"]) for ex in examples)
        groups = packing.pack(examples, args.train.max_tokens_per_micro)
        return [packing.collate_packed(g, device, row_len) for g in groups]
    return [packing.collate_padded(examples[i : i + step], pad_id, device) for i in range(0, len(examples), step)]


@torch.no_grad()
def evaluate(engine, tokenizer, examples: list[dict], args: Args, rank: int, world: int, device):
    """Token-mean eval loss and (optionally) greedy exact-match accuracy; every data-parallel rank (`rank` of `world`:
    an SP or TP group's ranks share theirs) takes an equal slice (padded with repeats that carry zero weight) so
    ZeRO-3's, AutoTP's and AutoEP's collective forwards stay in step."""
    model = engine.module
    model.eval()
    n = len(examples)
    per_rank = -(-n // world)
    idx = [(rank * per_rank + i) for i in range(per_rank)]
    weight = [1.0 if i < n else 0.0 for i in idx]
    idx = [i % n for i in idx]
    nll = tokens = correct = 0.0
    for start in range(0, per_rank, args.eval.batch_size):
        chunk = idx[start : start + args.eval.batch_size]
        w = torch.tensor(weight[start : start + args.eval.batch_size], device=device)[:, None]
        rows = [examples[i] for i in chunk]
        batch = (vision.collate(rows, tokenizer.pad_token_id, device) if args.data.image_key
                 else packing.collate_padded(rows, tokenizer.pad_token_id, device))  # fmt: skip
        with torch.compiler.set_stance("force_eager"):  # padded eval batches: --ds.compile pays off in training
            logp = packing.token_logprobs(model, batch)
        nll -= (logp * batch["loss_mask"] * w).sum().item()
        tokens += (batch["loss_mask"] * w).sum().item()
    metrics = {"eval/loss": ds_engine.all_reduce(nll) / max(ds_engine.all_reduce(tokens), 1.0)}
    if args.eval.generate:
        prompts = [examples[i]["input_ids"][: examples[i]["loss_mask"].index(1)] for i in idx]
        if args.data.image_key:  # the prompts with their pictures
            rows = [{**examples[i], "prompt_ids": p} for p, i in zip(prompts, idx)]
            outs = vision.greedy_generate(model, tokenizer, rows, "prompt_ids", args.eval.max_new_tokens)
        else:
            outs = models.greedy_generate(model, tokenizer, prompts, args.eval.max_new_tokens,
                                          synced_gpus=ds_engine.forwards_in_step(engine))  # fmt: skip
        for i, out, w in zip(idx, outs, weight):
            correct += w * float(
                tokenizer.decode(out, skip_special_tokens=True).strip() == examples[i]["label"].strip()
            )
        copies = ds_engine.all_reduce(1) / world  # ranks that evaluated each slice
        metrics["eval/accuracy"] = ds_engine.all_reduce(correct) / n / copies
    model.train()
    return metrics


def main(args: Args) -> dict:
    # 1. setup ------------------------------------------------------------------------------------------------
    check_args(args)  # PLUMBING: generic flag rules (sizes > 0, finite floats, ...) before anything is loaded
    # PLUMBING: process group (world of one for `python algos/sft.py`), tokenizer, data, model, DeepSpeed engine.
    rank, world, device = ds_engine.init_distributed(args.ds.backend, args.ds.timeout_s)
    # Same seed on every rank for the data order (each rank slices the same global batch); per-rank offset for
    # everything stochastic inside the model (dropout), so ranks do not draw identical noise.
    random.seed(args.train.seed + rank)
    np.random.seed(args.train.seed + rank)
    torch.manual_seed(args.train.seed + rank)
    if args.data.output_key is None and args.train.mode == "single":
        raise ValueError("--data.output-key is required in --train.mode single")
    # a sample longer than the model's context is skipped and counted, not trained past the position embeddings
    limits = {"max_position_embeddings of --model.name-or-path": models.max_positions(args.model.name_or_path)}
    args.data.max_len = data.resolve_max_len(args.data.max_len, limits)
    tokenizer = models.load_tokenizer(args.model.tokenizer or args.model.name_or_path)
    log = print if rank == 0 else (lambda *_: None)
    make = partial(sft_example_with_label, tokenizer=tokenizer, cfg=args.data, mode=args.train.mode)
    if args.data.image_key:  # vision-language: each row's picture joins its prompt (core/vision.py)
        make = vision.with_image(make, args.data, tokenizer, vision.load_image_processor(args.model.name_or_path))
    train_groups = data.build_examples(data.load_sources(args.data.path, args.data.split, args.data.max_samples), make,
                                       args.data, log)  # fmt: skip
    train_set = data.mix(train_groups, args.data.probs, args.train.seed)
    eval_sources = data.load_sources(args.data.eval_path or args.data.path, args.data.eval_split, args.eval.max_samples)
    eval_set = [ex for g in data.build_examples(eval_sources, make, args.data, log) for ex in g]
    model = models.load_causal_lm(args.model).to(device)
    # PLUMBING: --train.sp-size N (each sample's tokens split over N ranks) or --ds.tensor-parallel-size N (each
    # linear layer split over N ranks): groups of N ranks share each sample, and the data is split over the groups
    # (dp_rank, dp_world; without either: rank, world). `copies`: the ranks that hold each sample
    sp = args.train.sp_size
    if sp > 1 and (not args.train.packing or models.is_moe(model) or args.data.image_key):
        raise ValueError("--train.sp-size needs --train.packing, a dense model (the router's aux loss of a "
                         "mixture-of-experts model is not split over ranks) and no pictures (--data.image-key: "
                         "padded batches)")  # fmt: skip
    dp_rank, dp_world = ds_engine.tp_data_split(args.ds, sp)
    if sp > 1:
        dp_rank, dp_world = sequence_parallel.setup(model, sp)
    copies = world // dp_world
    router_aux_coef = args.train.router_aux_coef
    if router_aux_coef is None:
        router_aux_coef = getattr(model.config, "router_aux_loss_coef", 0.0)
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
    logger.print(f"[sft] {len(train_set)} train / {len(eval_set)} eval examples, world size {world}, "
                 f"ZeRO-{engine.zero_optimization_stage()}, run dir {run_dir}")  # fmt: skip
    first_eval = {}  # --eval.every 0: no eval at all, the first one included
    if args.eval.every:
        first_eval = client.get("first_eval") or evaluate(engine, tokenizer, eval_set, args, dp_rank, dp_world, device)
        if start_step == 0:  # a resumed run logged it when it started
            logger.log(first_eval, 0)
    perf: dict = {}
    tokens_seen, t_train, step = 0, 0.0, start_step - 1

    for step in range(start_step, args.train.max_steps):
        # 2. batch: the global batch is a pure function of (seed, step); each SP or TP group (each rank, without
        # them) takes every dp_world-th sample
        idx = data.batch_indices(len(train_set), args.train.batch_size, step, args.train.seed)[dp_rank::dp_world]
        mbs = micro_batches([train_set[i] for i in idx], args, tokenizer.pad_token_id, device)
        # sums over ranks count each sample once per rank of its SP or TP group: divide by copies
        num_tokens = ds_engine.all_reduce(sum(mb["loss_mask"].sum().item() for mb in mbs)) / copies
        n_micro = int(ds_engine.all_reduce(len(mbs), op="max"))  # ranks must run the same number of passes

        # 3. forward / backward over micro-batches, one optimizer step
        t0 = time.perf_counter()
        total_loss = total_aux = 0.0
        for i in range(n_micro):
            mb = mbs[i] if i < len(mbs) else {**mbs[0], "loss_mask": torch.zeros_like(mbs[0]["loss_mask"])}
            logp = (sequence_parallel.token_logprobs if sp > 1 else packing.token_logprobs)(engine, mb)  # (R, L)
            nll = sft_loss(logp, mb["loss_mask"], num_tokens)
            loss = nll
            aux = models.router_aux_loss(engine)  # MoE: the router's load-balancing loss of this forward, else None
            if aux is not None:  # DEVIATION(3): + c · aux, a token-weighted mean over micro-batches and ranks
                share = mb["loss_mask"].sum() / num_tokens
                loss = nll + router_aux_coef * aux * share
                total_aux += (aux * share).item()
            # DeepSpeed averages gradients over its data-parallel ranks (engine.dp_world_size: the world, or the world
            # over --ds.tensor-parallel-size); scale by their number so the sum is the global mean (with sequence
            # parallelism each rank's backward gives the gradient of its own tokens' share: the same scale).
            ds_engine.check_finite(loss, step)  # PLUMBING: a NaN/inf loss or gradient stops the run before the step
            engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            engine.backward(loss * engine.dp_world_size)
            total_loss += nll.item()
            tokens_seen += int(mb["input_ids"].numel()) if i < len(mbs) else 0
        grad_norm = ds_engine.optimizer_step(engine, step)
        t_step = time.perf_counter() - t0
        t_train += t_step

        # 4. logging, eval, checkpoint
        metrics = {
            "loss/sft": ds_engine.all_reduce(total_loss) / copies,
            **({"loss/router_aux": ds_engine.all_reduce(total_aux)} if models.is_moe(engine.module) else {}),
            "train/lr": engine.lr_scheduler.get_last_lr()[0],
            "train/grad_norm": grad_norm,
            "train/tokens": num_tokens,
            "perf/train_s": t_step,
            "perf/tokens_per_s": ds_engine.all_reduce(tokens_seen) / copies / max(t_train, 1e-9),
        }
        last = step == args.train.max_steps - 1
        if args.eval.every and ((step + 1) % args.eval.every == 0 or last):
            with timer(perf, "perf/eval_s"):
                metrics.update(evaluate(engine, tokenizer, eval_set, args, dp_rank, dp_world, device))
        logger.log(metrics, step + 1, shown=("loss/sft", "eval/loss", "eval/accuracy"))  # step = updates done
        reached = (
            args.eval.stop_at_accuracy is not None and metrics.get("eval/accuracy", -1) >= args.eval.stop_at_accuracy
        )
        halted = args.train.halt_after is not None and step + 1 - start_step >= args.train.halt_after and not last
        if halted or (args.ckpt.every and ((step + 1) % args.ckpt.every == 0 or last or reached)):
            checkpoint.save({"model": engine}, ckpt_dir, step, {"step": step, "first_eval": first_eval},
                            args.ckpt.keep_last)  # fmt: skip
        if reached:
            logger.print(f"[sft] eval accuracy {metrics['eval/accuracy']:.3f} >= {args.eval.stop_at_accuracy}: stop")
            break
        if halted:
            logger.print(f"[sft] halted after {args.train.halt_after} steps; resume with --run-dir {run_dir}")
            logger.close({"steps": step + 1, "halted": True})
            return {"steps": step + 1, "halted": True, "run_dir": str(run_dir)}

    # 5. export and summary
    export_dir = Path(args.export_dir or run_dir / "hf")
    ds_engine.export_hf(engine, tokenizer, export_dir)
    summary = {
        "steps": step + 1,
        "train_loss_last": logger.latest("loss/sft"),
        "eval_loss_first": first_eval.get("eval/loss"),  # None: --eval.every 0
        "eval_loss_last": logger.latest("eval/loss", None),
        **(
            {"eval_accuracy_first": first_eval.get("eval/accuracy"),
             "eval_accuracy_last": logger.latest("eval/accuracy", None)}
            if args.eval.generate
            else {}
        ),  # fmt: skip
        "tokens_per_s": logger.latest("perf/tokens_per_s"),
        "export_dir": str(export_dir),
    }
    logger.close(summary)
    return summary


def warm_start() -> Args:
    """The RL warm start `cleanrlhf/tiny-sft` (core/embedded.py builds it with `--preset warm-start`): the random
    `cleanrlhf/tiny` trained on `cleanrlhf/add2` until greedy exact match reaches 45 % (DEVIATION(2)), so RL has
    room to improve it."""
    args = Args()
    args.model.name_or_path, args.data.path = "cleanrlhf/tiny", "cleanrlhf/add2"
    args.train.lr, args.train.adam_betas, args.train.batch_size = 1e-3, (0.9, 0.98), 64
    args.train.max_steps, args.train.warmup_steps = 3000, 0
    args.eval.every, args.eval.generate, args.eval.stop_at_accuracy, args.eval.max_samples = 20, True, 0.45, 500
    args.ckpt.every, args.logger.quiet = 0, True
    return args


def hint_warm_start() -> Args:
    """The self-distillation student `cleanrlhf/tiny-sft-hint` (core/embedded.py builds it with `--preset
    hint-warm-start`): `cleanrlhf/tiny-sft` trained on `cleanrlhf/add2-hint`, whose prompts show the answer, until it
    copies it (greedy exact match 90 %), so that it can be its own teacher in algos/opsd.py."""
    args = warm_start()
    args.model.name_or_path, args.data.path = "cleanrlhf/tiny-sft", "cleanrlhf/add2-hint"
    args.eval.stop_at_accuracy = 0.9
    return args


PRESETS = {"warm-start": warm_start, "hint-warm-start": hint_warm_start}


def cli(argv: list[str] | None = None) -> Args:
    """The command line: `tyro.cli(Args)`, where a leading `--preset NAME` (one of `PRESETS`) replaces the defaults
    and the flags after it change the preset."""
    argv = list(sys.argv[1:] if argv is None else argv)
    default = None
    if argv[:1] == ["--preset"]:
        if len(argv) < 2 or argv[1] not in PRESETS:
            raise SystemExit(f"--preset takes one of: {', '.join(PRESETS)}")
        default, argv = PRESETS[argv[1]](), argv[2:]
    presets = ", ".join(f"{name} ({' '.join(fn.__doc__.split(':')[0].split())})" for name, fn in PRESETS.items())
    return tyro.cli(Args, args=argv, default=default, description=f"Supervised fine-tuning. `--preset NAME` as the "
                    f"first flag starts from a named recipe, and the flags after it change it: {presets}.")  # fmt: skip


if __name__ == "__main__":
    from core.noise import quiet_libraries

    quiet_libraries()  # PLUMBING: library messages to <run>/run.log (--logger.verbose: on the console)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(cli())
