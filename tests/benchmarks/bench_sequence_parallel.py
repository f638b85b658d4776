"""Sequence parallelism (`--train.sp-size`): the activation memory and step time of one long sequence at SP=1 (one
process, the plain forward, transformers' sdpa) and at SP=2 (two gloo ranks, Ulysses attention), for a few lengths.

The model: a randomly initialised Qwen2 (hidden 256, 4 layers, 4 heads, MLP 1024, the embedded 100-token vocabulary),
fp32, CPU. One step: the SFT loss of one packed sequence (`packing.token_logprobs` or `sequence_parallel.token_logprobs`,
then `algos.sft.sft_loss`) and its backward. Reported per length: the bytes of the distinct storages autograd saved
for the backward (parameters and views of them excluded; per rank at SP=2, the larger rank), their ratio, and the step time (median of
--reps after a warm-up). SP=1 runs on rank 0 while rank 1 waits, one thread each: SP=2 uses both cores. Run:

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 \\
        tests/benchmarks/bench_sequence_parallel.py --lengths 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sequence_parallel_worker import random_samples, saved_bytes, tiny  # noqa: E402

from algos import sft  # noqa: E402
from core import embedded, packing  # noqa: E402
from core import sequence_parallel as sp  # noqa: E402


def step(model, batch: dict, use_sp: bool) -> tuple[int, float]:
    """(saved bytes, seconds) of one forward + backward."""
    model.zero_grad()
    t0 = time.perf_counter()
    logprobs = sp.token_logprobs if use_sp else packing.token_logprobs
    mask = batch["loss_mask"]
    loss, nbytes = saved_bytes(lambda: sft.sft_loss(logprobs(model, batch), mask, float(mask.sum())), model)
    loss.backward()
    return nbytes, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=2)
    cli = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    path = embedded.resolve_model("cleanrlhf/tiny")
    shape = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=max(cli.lengths))  # fmt: skip
    plain, split = tiny(path, seed=0, **shape), tiny(path, seed=0, **shape)
    sp.setup(split, 2)
    rows = []
    for n in cli.lengths:
        batch = packing.collate_packed(random_samples(100, 1, seed=n, lo=n, hi=n), "cpu")
        one = None
        if rank == 0:
            runs = [step(plain, batch, False) for _ in range(cli.reps + 1)][1:]
            one = (runs[0][0], statistics.median(t for _, t in runs))
        dist.barrier()
        runs = [step(split, batch, True) for _ in range(cli.reps + 1)][1:]
        peak = torch.tensor([float(max(b for b, _ in runs)), statistics.median(t for _, t in runs)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            rows.append({"tokens": n, "sp1_mib": one[0] / 2**20, "sp2_mib_per_rank": peak[0].item() / 2**20,
                         "ratio": peak[0].item() / one[0], "sp1_step_s": one[1], "sp2_step_s": peak[1].item()})  # fmt: skip
    if rank == 0:
        print("| tokens | saved activations SP=1 | SP=2, per rank | ratio | step SP=1 (1 core) | step SP=2 (2 ranks) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['sp1_mib']:.1f} MiB | {r['sp2_mib_per_rank']:.1f} MiB | {r['ratio']:.3f} | "
                  f"{r['sp1_step_s']:.2f} s | {r['sp2_step_s']:.2f} s |")  # fmt: skip
        print(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
