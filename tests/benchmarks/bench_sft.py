"""SFT throughput: algos/sft.py against TRL's SFTTrainer, same model, data, batch and step count, one run.

    .venv/bin/pip install --no-deps trl==1.16.0       # the peer (not a project dependency)
    .venv/bin/python tests/benchmarks/bench_sft.py --steps 40                  # both workloads

Both sides train `cleanrlhf/tiny` (loss on the answer only) with batch 64, AdamW lr 3e-3, fp32, no gradient
checkpointing, one process, and are timed over the same optimizer steps after a few warm-up steps: the wall time
of whole iterations on both sides (batch building and logging included), from the end of the last warm-up step.
Two workloads from the same sample pool for both sides: `add2`, the embedded default (every sample is 11 tokens,
so padding costs nothing), and `mixed`, additions of 1 to 8 digits (8 to 29 tokens), where TRL pads each batch to
its longest sample and algos/sft.py packs. Each side runs in its own subprocess (same thread count) so neither
inherits the other's state. Tokens are the real (non-pad) tokens of the samples consumed, counted the same way for
both.

In eager runs each side also counts the token positions its model computes per step, padding included (`count_tokens`),
and the table gives the work ratio: TRL's model work over ours (a trained token counting 3, a forward-only one 1).
On a machine where the step is compute-bound that ratio is about the speed-up the step's design can give; the rest is
per-token speed and overhead.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pool(workload: str) -> list[dict]:
    """The sample pool both sides draw their batches from (rows with prompt / answer)."""
    from core import embedded

    if workload == "add2":
        return embedded.task_rows(2)[0]
    per_size = [embedded.task_rows(d)[0][:1000] for d in range(1, 9)]
    return [rows[i] for i in range(1000) for rows in per_size if i < len(rows)]  # interleaved sizes


def tokens_per_sample(rows: list[dict]) -> float:
    """Mean real tokens per sample (<s> + prompt + answer + </s>), the unit of tokens/s for both sides."""
    from core import models

    tokenizer = models.load_tokenizer("cleanrlhf/tiny")
    return sum(len(tokenizer(r["prompt"] + r["answer"])["input_ids"]) + 1 for r in rows) / len(rows)


def shaped_model(out: Path) -> str:
    """`--model qwen2-0.5b-shaped`: a randomly initialised Qwen2-0.5B-shaped model (24 layers, hidden 896, MLP 4864;
    358 M parameters with the embedded 100-token vocabulary), built once under `out`: the step times of a model whose
    compute matters, with the embedded data. Timing only; nothing is learned from it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core import models

    path = out / "qwen2-0.5b-shaped"
    if not (path / "config.json").exists():
        tokenizer = models.load_tokenizer("cleanrlhf/tiny")
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def model_path(name: str, out: Path) -> str:
    from core import embedded

    return shaped_model(out) if name == "qwen2-0.5b-shaped" else embedded.resolve_model(name)


def count_tokens(path: str) -> dict:
    """Count the token positions the model is run on, from now on in this process: `train` (grad enabled: forward +
    backward) and `forward` (no grad: reference, eval), padding and pad segments included, since the model computes
    them. Patches the forward of the model's decoder class (`Qwen2Model` under `Qwen2ForCausalLM`; TRL's fused
    LM-head loss calls the decoder directly), so every instance counts: TRL's frozen reference copy as well as the
    policy. Eager only (a compiled graph would trace the counter)."""
    import torch
    import transformers
    from transformers import AutoConfig

    arch = AutoConfig.from_pretrained(path).architectures[0]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Model"))
    counts, forward = {"train": 0, "forward": 0}, cls.forward

    @functools.wraps(forward)  # keep the signature: HF's Trainer picks the batch columns it passes from it
    def counted(self, *a, **k):
        x = k.get("input_ids", a[0] if a else None)
        x = k.get("inputs_embeds") if x is None else x
        if x is not None:
            counts["train" if torch.is_grad_enabled() else "forward"] += x.shape[0] * x.shape[1]
        return forward(self, *a, **k)

    cls.forward = counted
    return counts


def per_step(snaps: list[dict], warmup: int, steps: int) -> dict:
    """Mean tokens per timed step from `counts` snapshots taken at every step end (the window the clock times)."""
    return {k: (snaps[-1][k] - snaps[warmup - 1][k]) / steps for k in snaps[-1]}


def work_ratio(trl: dict, ours: dict) -> float:
    """TRL's model work per step over ours, in forward-equivalents of the linear layers: a trained token costs 3 (its
    backward computes two matmuls per forward one), a forward-only token 1. At equal speed per token this would be
    the speed-up; attention's share (small at these lengths) is left out."""
    work = lambda t: 3 * t["train"] + t["forward"]  # noqa: E731
    return work(trl) / work(ours)


def clock_steps(script, loss_key: str, counts: dict | None = None, snaps: list | None = None) -> list[float]:
    """Wall-clock time at the end of every training step of `script` (an imported algos module): its logger's call
    for the step's metrics row is the last thing an iteration does, so the gap between two calls is the whole
    iteration (batch building, forward, backward, optimizer, logging), the span TRL's `on_step_end` clock measures.
    The clock is on `core.logger.RunLogger` itself, which every script's logger is (the RL scripts create theirs in
    `core.rl.start`, so it is no name of theirs). With `counts` (from `count_tokens`), a copy of it is appended to
    `snaps` at the same moments."""
    from core.logger import RunLogger

    log, ends = RunLogger.log, []

    def timed_log(self, metrics, *a, **k):
        log(self, metrics, *a, **k)
        if loss_key in metrics:
            ends.append(time.perf_counter())
            if counts is not None:
                snaps.append(dict(counts))

    RunLogger.log = timed_log
    return ends


def run_ours(
    steps: int, warmup: int, batch: int, out: Path, workload: str, model: str, bf16: bool, compile_: bool = False
) -> dict:
    sys.argv = [sys.argv[0]]
    import algos.sft as sft
    from algos.sft import Args, main

    path = model_path(model, out)
    counts, snaps = (None if compile_ else count_tokens(path)), []
    ends = clock_steps(sft, "loss/sft", counts, snaps)

    data_file = out / f"{workload}.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in pool(workload)))
    shutil.rmtree(out / "ours", ignore_errors=True)  # metrics.jsonl appends; a stale run would mix into the timing
    args = Args()
    args.model.name_or_path, args.model.dtype = path, ("bf16" if bf16 else "fp32")
    args.data.path, args.data.eval_path, args.eval.max_samples, args.eval.generate = (
        str(data_file),
        "cleanrlhf/add2",
        64,
        False,
    )
    args.train.max_steps, args.train.batch_size, args.train.lr, args.train.warmup_steps = warmup + steps, batch, 3e-3, 0
    args.eval.every = 0
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(out / "ours")
    args.ds.compile = compile_
    main(args)
    rows = [json.loads(line) for line in open(out / "ours" / "metrics.jsonl") if '"loss/sft"' in line]
    compute = [r["perf/train_s"] for r in rows[warmup:]]  # forward + backward + optimizer step only
    res = {"step_s": (ends[-1] - ends[warmup - 1]) / steps, "compute_s": sum(compute) / len(compute)}
    return {**res, "tokens": per_step(snaps, warmup, steps)} if snaps else res


def run_trl(
    steps: int, warmup: int, batch: int, out: Path, workload: str, model: str, bf16: bool, compile_: bool = False
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from core import models

    path = model_path(model, out)
    tokenizer = models.load_tokenizer(str(path))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # bf16: autocast over fp32 weights (TRL's way)
    rows = pool(workload)
    ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["answer"]} for r in rows])
    times: list[float] = []
    counts, snaps = (None if compile_ else count_tokens(path)), []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            times.append(time.perf_counter())
            if counts is not None:
                snaps.append(dict(counts))

    cfg = SFTConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=batch, max_steps=warmup + steps, learning_rate=3e-3,
        lr_scheduler_type="constant", warmup_steps=0, use_cpu=not torch.cuda.is_available(), bf16=bf16, report_to="none",
        logging_steps=10**6,
        save_strategy="no", gradient_checkpointing=False, completion_only_loss=True, packing=False,
        dataloader_num_workers=0, seed=1, torch_compile=compile_, max_length=64,
    )  # fmt: skip
    trainer = SFTTrainer(model=lm, args=cfg, train_dataset=ds, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    res = {"step_s": (times[-1] - times[warmup - 1]) / steps}
    return {**res, "tokens": per_step(snaps, warmup, steps)} if snaps else res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workload", choices=["add2", "mixed", "both"], default="both")
    p.add_argument("--model", default="cleanrlhf/tiny", help="a model path or name, or qwen2-0.5b-shaped")
    p.add_argument("--bf16", action="store_true", help="bf16 (ours: bf16 weights; TRL: autocast); default fp32")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile on both sides (ours: --ds.compile; TRL: "
        "torch_compile=True); use a larger --warmup, the first steps compile",
    )
    p.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/cleanrlhf-bench-sft")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.side:
        t0 = time.perf_counter()
        res = (run_ours if a.side == "ours" else run_trl)(
            a.steps, a.warmup, a.batch, out, a.workload, a.model, a.bf16, a.compile
        )
        res["wall_s"] = time.perf_counter() - t0
        (out / f"{a.side}.json").write_text(json.dumps(res))
        return
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    import torch

    precision = ("bf16" if a.bf16 else "fp32") + (", torch.compile on both sides" if a.compile else "")
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {threads} threads"
    print(f"SFT, {a.model}, batch {a.batch}, {a.steps} timed steps, {where}, {precision}")
    print(f"{'workload':10}{'':16}{'s/step':>10}{'tokens/s':>12}")
    for workload in ["add2", "mixed"] if a.workload == "both" else [a.workload]:
        for side in ("ours", "trl"):
            (out / f"{side}.json").unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--batch", str(a.batch), "--out", str(out), "--workload", workload, "--model", a.model,
                   *(["--bf16"] if a.bf16 else []), *(["--compile"] if a.compile else [])]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        res = {side: json.loads((out / f"{side}.json").read_text()) for side in ("ours", "trl")}
        ours, trl = res["ours"]["step_s"], res["trl"]["step_s"]
        per_sample = tokens_per_sample(pool(workload))
        for name, step_s in (("CleanRLHF", ours), ("TRL SFTTrainer", trl)):
            print(f"{workload:10}{name:16}{step_s:>10.4f}{a.batch * per_sample / step_s:>12.0f}")
        print(
            f"{workload:10}speed-up {trl / ours:.2f}x (our forward + backward + optimizer alone: "
            f"{res['ours']['compute_s']:.4f} s/step)"
        )
        if "tokens" in res["ours"] and "tokens" in res["trl"]:
            t_ours, t_trl = res["ours"]["tokens"], res["trl"]["tokens"]
            print(f"{workload:10}tokens through the model per step (trained + forward-only): ours "
                  f"{t_ours['train']:.0f} + {t_ours['forward']:.0f}, TRL {t_trl['train']:.0f} + {t_trl['forward']:.0f}; "
                  f"work ratio {work_ratio(t_trl, t_ours):.2f} (the speed-up at equal speed per token)")  # fmt: skip


if __name__ == "__main__":
    main()
