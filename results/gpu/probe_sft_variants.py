"""Where does algos/sft.py's step time go on the GPU? The Qwen2-0.5B-shaped model of tests/benchmarks/bench_sft.py on
the `mixed` workload, bf16, batch 64, 12 steps, under engine variants; prints the mean step time of steps 4-12.

    python results/gpu/probe_sft_variants.py          # on the GPU machine, after results/gpu/run.sh set PYTHONPATH
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "benchmarks")]


def run(name: str, out: Path, **over) -> float:
    import bench_sft

    from algos.sft import Args, main

    data_file = out / "mixed.jsonl"
    if not data_file.exists():
        data_file.write_text("".join(json.dumps(r) + "\n" for r in bench_sft.pool("mixed")))
    args = Args()
    args.model.name_or_path, args.model.dtype = bench_sft.shaped_model(out), "bf16"
    args.data.path, args.data.eval_path, args.eval.max_samples, args.eval.generate = (str(data_file),
                                                                                      "cleanrlhf/add2", 8, False)  # fmt: skip
    args.train.max_steps, args.train.batch_size, args.train.lr, args.train.warmup_steps = 12, 64, 3e-4, 0
    args.eval.every = 0
    args.logger.quiet, args.logger.tensorboard = True, False
    args.run_dir = str(out / name)
    for k, v in over.items():
        section, field = k.split("__")
        setattr(getattr(args, section), field, v)
    main(args)
    rows = [json.loads(line) for line in open(out / name / "metrics.jsonl") if '"loss/sft"' in line]
    step_s = sum(r["perf/train_s"] for r in rows[3:]) / len(rows[3:])
    print(f"{name:28s} {step_s:.4f} s/step", flush=True)
    return step_s


if __name__ == "__main__":
    out = Path("/tmp/probe-sft")
    out.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    run("zero2_packed (default)", out)
    run("zero0_packed", out, ds__zero_stage=0)
    run("zero2_padded", out, train__packing=False, train__micro_batch_size=64)
    run("zero0_padded", out, ds__zero_stage=0, train__packing=False, train__micro_batch_size=64)
    run("zero2_packed_one_row", out, train__pack_row_len=4096)
    torch.cuda.synchronize()
    print(f"total {time.perf_counter() - t0:.0f} s")
