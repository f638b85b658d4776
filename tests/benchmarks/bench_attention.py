"""Attention backends on this machine: torch's sdpa against eager attention, fp32 and bf16, forward + backward.

    .venv/bin/python tests/benchmarks/bench_attention.py

Why `--model.attn-implementation auto` picks eager for bf16 on CPU (`core.models.attn_implementation`). Two
measurements, each the median of `--repeats` timed calls after warm-up:
1. the attention op alone, shaped as the tiny model's (4 heads of 32) on packed rows of the SFT and DPO benchmarks,
   with the block-diagonal mask of packing, forward + backward: `F.scaled_dot_product_attention` against the
   eager formula (matmul, masked softmax, matmul);
2. a training step of the embedded tiny model (forward, backward, AdamW) loaded with each backend, on a packed
   batch of 64 samples of 13 tokens in rows of 26 (a little longer than `add2`'s 11-token samples).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def block_mask(rows: int, length: int, seg: int) -> torch.Tensor:
    """(rows, 1, L, L) bool: causal within each packed segment of `seg` tokens, nothing across segments."""
    pos = torch.arange(length)
    same = (pos[:, None] // seg) == (pos[None, :] // seg)
    return (same & (pos[:, None] >= pos[None, :]))[None, None].expand(rows, 1, length, length)


def attention_op(rows: int, length: int, seg: int, dtype: torch.dtype, backend: str, warmup: int, repeats: int):
    q, k, v = (torch.randn(rows, 4, length, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = block_mask(rows, length, seg)

    def eager():
        scores = (q @ k.transpose(-1, -2)) / 32**0.5
        return scores.masked_fill(~mask, torch.finfo(dtype).min).softmax(-1) @ v

    def step():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask) if backend == "sdpa" else eager()
        out.float().sum().backward()

    return median_ms(step, warmup, repeats)


def model_step(dtype: torch.dtype, backend: str, warmup: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    from core import embedded, packing

    model = AutoModelForCausalLM.from_pretrained(embedded.ensure_tiny_base(), dtype=dtype, attn_implementation=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    examples = [
        {"input_ids": torch.randint(4, 100, (13,), generator=gen).tolist(), "loss_mask": [0] * 6 + [1] * 7}
        for _ in range(64)
    ]
    batch = packing.collate_packed(examples, row_len=26)

    def step():
        logp = packing.token_logprobs(model, batch)
        (-(logp * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return median_ms(step, warmup, repeats)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {a.threads} threads")
    print("1. attention op, forward + backward, ms (median)")
    print(f"{'rows x length (segment)':28}{'dtype':>6}{'sdpa':>9}{'eager':>9}")
    for rows, length, seg in [(32, 26, 13), (32, 58, 29), (4, 256, 32)]:
        for name, dtype in dtypes.items():
            t = [attention_op(rows, length, seg, dtype, b, a.warmup, a.repeats) for b in ("sdpa", "eager")]
            print(f"{f'{rows} x {length} ({seg})':28}{name:>6}{t[0]:>9.2f}{t[1]:>9.2f}")
    print("2. tiny model training step on a packed batch of 64 x 13 tokens, ms (median)")
    print(f"{'dtype':>6}{'sdpa':>9}{'eager':>9}")
    for name, dtype in dtypes.items():
        t = [model_step(dtype, b, a.warmup, a.repeats) for b in ("sdpa", "eager")]
        print(f"{name:>6}{t[0]:>9.2f}{t[1]:>9.2f}")


if __name__ == "__main__":
    main()
