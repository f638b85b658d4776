"""A GRPO training phase alone, at the Qwen2-0.5B shape on the CPU: our path against a plain transformers step, and
both against the FLOP bound of this CPU's own matmul rate.

    .venv/bin/python tests/benchmarks/bench_train_phase.py               # ~10 min on 2 cores
    .venv/bin/python tests/benchmarks/bench_train_phase.py --model 0.5b --steps 2 --threads 2

Each side, in its own subprocess with `--threads` torch threads, takes the same optimizer step on the same 32 sequences
of 10 prompt + 64 response tokens (random ids, fp32, loss = −mean log-prob of the response tokens, grad clip 1.0,
AdamW), one untimed warm-up step then `--steps` timed ones:
- `plain`: what TRL's `Trainer` step does with this model: a padded forward, the full logits, log-softmax, backward,
  `clip_grad_norm_`, torch's fused AdamW.
- `packed`: the same model and optimizer through grpo.py's forward (`core.rl.forward_logp`) made to pack the rows
  (two samples to a row, the chunked log-prob head), as it does for a table with padding to drop.
- `ours`: grpo.py's training phase: the DeepSpeed engine (`core.engine.make_engine`, ZeRO-0 with one process),
  `core.rl.forward_logp` (this table has no padding: forwarded as it is, `core.rl.FULL_TABLE`), `core.rl.backward`,
  `core.engine.optimizer_step`.
The bound: the step's model FLOPs (bench_grpo.py's `train_flops`: forward + backward of every linear and the
attention) over torch.mm's rate on the model's own matmul shapes with the same threads (`matmul_rate`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
B, PROMPT, RESPONSE = 32, 10, 64
SIDES = ("plain", "packed", "ours")


def run_side(side: str, model_path: str, steps: int) -> list[float]:
    import torch

    from core import engine as ds_engine
    from core import models, rl
    from core.config import DSConfig, ModelConfig

    torch.manual_seed(0)
    length = PROMPT + RESPONSE
    ids = torch.randint(3, 100, (B, length))
    attn = torch.ones(B, length, dtype=torch.long)
    mask = torch.zeros(B, length, dtype=torch.bool)
    mask[:, PROMPT:] = True
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "packed": True}
    model = models.load_causal_lm(ModelConfig(name_or_path=model_path, dtype="fp32")).train()
    if side == "packed":
        rl.FULL_TABLE = -1.0  # pack even a table without padding
    if side == "ours":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ds_engine.free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")  # fmt: skip
        ds_engine.init_distributed("gloo", 600)
        engine = ds_engine.make_engine(model, DSConfig(), 1e-6)

        def step():
            logp, _ = rl.forward_logp(engine, batch, 1.0)
            rl.backward(engine, -(logp * mask).sum() / mask.sum(), 0, 1, True, True)
            ds_engine.optimizer_step(engine, 0, "actor")

    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

        def step():
            if side == "plain":
                logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
                loss = -(logp * mask[:, 1:]).sum() / mask.sum()
            else:
                logp, _ = rl.forward_logp(model, batch, 1.0)
                loss = -(logp * mask).sum() / mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="0.5b", help="a model folder, or 0.5b (the Qwen2-0.5B shape, built once)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="/tmp/cleanrlhf-bench-train-phase")
    p.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.side:
        import torch

        torch.set_num_threads(a.threads)
        (out / f"{a.side}.json").write_text(json.dumps(run_side(a.side, a.model, a.steps)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_grpo import matmul_rate, model_path, train_flops

    model = model_path(a.model, out)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "CUDA_VISIBLE_DEVICES": ""}
    res = {}
    for side in SIDES:
        cmd = [sys.executable, __file__, "--side", side, "--model", model, "--steps", str(a.steps), "--threads",
               str(a.threads), "--out", str(out)]  # fmt: skip
        with open(out / f"{side}.log", "w") as log:
            if subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"side {side} failed: see {out / f'{side}.log'}")
        res[side] = json.loads((out / f"{side}.json").read_text())
    tokens, length = B * (PROMPT + RESPONSE), PROMPT + RESPONSE
    flops, rate = train_flops(model, tokens, length), matmul_rate(model, tokens, a.threads)
    print(f"training phase, {a.model}: {B} sequences x {length} tokens, fp32, {a.threads} threads, {a.steps} timed steps")
    print(f"model FLOPs per step {flops / 1e12:.2f} T; torch.mm at the model's shapes {rate / 1e9:.1f} GFLOP/s: at "
          f"least {flops / rate:.1f} s per step")  # fmt: skip
    for side, times in res.items():
        best = min(times)
        print(f"{side:8} s/step {' '.join(f'{t:.2f}' for t in times)}   best {best:.2f}   {flops / best / 1e9:.1f} "
              f"GFLOP/s = {100 * flops / best / rate:.0f} % of the matmul rate   plain / this {min(res['plain']) / best:.2f}x")
    print(json.dumps({"bench": "train_phase", "flops": flops, "mm_flops_per_s": rate, **res}))


if __name__ == "__main__":
    main()
