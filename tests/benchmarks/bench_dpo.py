"""DPO throughput: algos/dpo.py against TRL's DPOTrainer, same model, pairs, batch and step count, one run.

    .venv/bin/pip install --no-deps trl==1.16.0       # the peer (not a project dependency)
    .venv/bin/python tests/benchmarks/bench_dpo.py --steps 20 --batch 8 64

Both sides train the SFT warm start `cleanrlhf/tiny-sft` on the embedded pairs `cleanrlhf/add2-pref` (the same
pool, random order) with AdamW lr 5e-4, β 0.1, sigmoid loss, fp32, one process, and are timed over the same
optimizer steps after a few warm-up steps: the wall time of whole iterations on both sides (batch building and
logging included), from the end of the last warm-up step. Each side runs in its own subprocess with the same
thread count.

The reference model is handled the way each side does it by default: TRL runs a frozen reference copy on every
step; algos/dpo.py computes the reference log-probs of the pairs its batches will use once, before the first step.
The table shows our step time without that up-front pass (`s/step`) and with it spread over the timed steps
(`s/step incl. ref`), so neither side is flattered. In eager runs it also gives the token positions each side's
model computes per step and their work ratio (see bench_sft.py): the speed-up the two designs give at equal speed
per token, with and without our up-front reference pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LR, BETA = 5e-4, 0.1


def pool() -> list[dict]:
    from core import data

    path = data.resolve_data("cleanrlhf/add2-pref")
    return [json.loads(line) for line in open(Path(path) / "train.jsonl")][:4000]


def model_path(name: str, out: Path) -> str:
    from bench_sft import shaped_model  # tests/benchmarks/ is sys.path[0] when run as a script

    from core import embedded

    return shaped_model(out) if name == "qwen2-0.5b-shaped" else embedded.resolve_model(name)


def run_ours(steps: int, warmup: int, batch: int, out: Path, model: str, bf16: bool, compile_: bool = False) -> dict:
    sys.argv = [sys.argv[0]]
    from bench_sft import clock_steps, count_tokens, per_step

    import algos.dpo as dpo
    from algos.dpo import Args, main

    path = model_path(model, out)
    counts, snaps = (None if compile_ else count_tokens(path)), []
    ends = clock_steps(dpo, "loss/dpo", counts, snaps)

    data_file = out / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in pool()))
    shutil.rmtree(out / "ours", ignore_errors=True)  # metrics.jsonl appends; a stale run would mix into the timing
    args = Args()
    args.model.name_or_path, args.model.dtype = path, ("bf16" if bf16 else "fp32")
    args.data.path, args.data.eval_path, args.eval.max_samples = str(data_file), "cleanrlhf/add2-pref", 8
    args.train.max_steps, args.train.batch_size, args.train.lr, args.train.beta = warmup + steps, batch, LR, BETA
    args.train.warmup_steps = 0
    args.eval.every = 0
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(out / "ours")
    args.ds.compile = compile_
    summary = main(args)
    res = {"step_s": (ends[-1] - ends[warmup - 1]) / steps, "ref_s": summary["ref_s"]}
    if snaps:  # the up-front reference (and first eval) forwards, spread over all steps as ref_s is
        res["tokens"] = {**per_step(snaps, warmup, steps), "upfront": snaps[-1]["forward"] / (warmup + steps)}
    return res


def run_trl(steps: int, warmup: int, batch: int, out: Path, model: str, bf16: bool, compile_: bool = False) -> dict:
    import torch
    from bench_sft import count_tokens, per_step
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from core import models

    path = model_path(model, out)
    tokenizer = models.load_tokenizer(str(path))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # bf16: autocast over fp32 weights (TRL's way)
    ds = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in pool()])
    times: list[float] = []
    counts, snaps = (None if compile_ else count_tokens(path)), []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            times.append(time.perf_counter())
            if counts is not None:
                snaps.append(dict(counts))

    cfg = DPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=batch, max_steps=warmup + steps, learning_rate=LR,
        beta=BETA, lr_scheduler_type="constant", warmup_steps=0, use_cpu=not torch.cuda.is_available(), bf16=bf16,
        report_to="none",
        logging_steps=10**6, save_strategy="no", gradient_checkpointing=False, dataloader_num_workers=0, seed=1,
        torch_compile=compile_, max_length=64,
    )  # fmt: skip
    trainer = DPOTrainer(model=lm, args=cfg, train_dataset=ds, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    res = {"step_s": (times[-1] - times[warmup - 1]) / steps}
    return {**res, "tokens": per_step(snaps, warmup, steps)} if snaps else res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64], help="pairs per step (one row per value)")
    p.add_argument("--model", default="cleanrlhf/tiny-sft", help="a model path or name, or qwen2-0.5b-shaped")
    p.add_argument("--bf16", action="store_true", help="bf16 (ours: bf16 weights; TRL: autocast); default fp32")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile on both sides (ours: --ds.compile; TRL: "
        "torch_compile=True); use a larger --warmup, the first steps compile",
    )
    p.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/cleanrlhf-bench-dpo")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.side:
        res = (run_ours if a.side == "ours" else run_trl)(
            a.steps, a.warmup, a.batch[0], out, a.model, a.bf16, a.compile
        )
        (out / f"{a.side}.json").write_text(json.dumps(res))
        return
    from bench_sft import work_ratio

    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    import torch

    precision = ("bf16" if a.bf16 else "fp32") + (", torch.compile on both sides" if a.compile else "")
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {threads} threads"
    print(f"DPO, {a.model} on cleanrlhf/add2-pref, {a.steps} timed steps, {where}, {precision}")
    print(f"{'pairs':>5}  {'':16}{'s/step':>10}{'s/step incl. ref':>18}{'pairs/s':>10}")
    for batch in a.batch:
        for side in ("ours", "trl"):
            (out / f"{side}.json").unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--batch", str(batch), "--out", str(out), "--model", a.model,
                   *(["--bf16"] if a.bf16 else []), *(["--compile"] if a.compile else [])]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ours, trl = (json.loads((out / f"{side}.json").read_text()) for side in ("ours", "trl"))
        with_ref = ours["step_s"] + ours["ref_s"] / (a.steps + a.warmup)
        print(f"{batch:>5}  {'CleanRLHF':16}{ours['step_s']:>10.4f}{with_ref:>18.4f}{batch / ours['step_s']:>10.0f}")
        print(
            f"{batch:>5}  {'TRL DPOTrainer':16}{trl['step_s']:>10.4f}{trl['step_s']:>18.4f}{batch / trl['step_s']:>10.0f}"
        )
        print(f"{batch:>5}  speed-up {trl['step_s'] / ours['step_s']:.2f}x ({trl['step_s'] / with_ref:.2f}x incl. ref)")
        if "tokens" in ours and "tokens" in trl:
            t, u = trl["tokens"], ours["tokens"]
            print(f"{batch:>5}  tokens through the model per step (trained + forward-only): ours {u['train']:.0f} + "
                  f"{u['forward']:.0f} (+ {u['upfront']:.0f} up front), TRL {t['train']:.0f} + {t['forward']:.0f}; "
                  f"work ratio {work_ratio(t, u):.2f} "
                  f"({work_ratio(t, {**u, 'forward': u['forward'] + u['upfront']}):.2f} incl. ref)")  # fmt: skip


if __name__ == "__main__":
    main()
