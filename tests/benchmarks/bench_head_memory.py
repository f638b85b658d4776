"""Peak memory of the LM head + log-softmax of one micro-step, full logits vs `core.rl_math.head_logprobs` (chunked).

A Qwen2.5-0.5B-shaped head (hidden 896, vocabulary 151,936) on 4,096 tokens: the full path materialises the float32
(4,096 x 151,936) logits (2.5 GB) and keeps them (and the log-softmax) for backward; the chunked path holds one
chunk's logits at a time, forward and backward. Each mode runs in its own process on the CPU; the number reported is
the peak resident memory of the step (log-probs + entropy, backward into hidden and head weight) above the memory
the process held before it (inputs, gradients and a small warm-up step of the same mode), and `floor` is that of a
step with no logits at all, which still allocates the head's (V, H) weight gradient once. Run:

    .venv/bin/python tests/benchmarks/bench_head_memory.py            # prints one row per mode and a JSON line

`--model`: the same three modes as a whole micro-step of the RL scripts (`core.rl.forward_logp` and its backward) on a
randomly initialised Qwen2.5-0.5B-shaped model (hidden 896, MLP 4864, 14 heads, vocabulary 151,936, tied head; bf16,
`--layers` decoder layers, default 24): 8 sequences of 512 tokens packed, 32 prompt tokens each and the rest targets.
`full` forces the full-logits path (`models.chunked_head` returns None), `floor` replaces the head by a product with
the target rows only (no logits); the extra peak of `chunked` and `full` over `floor` is what the logits cost:

    .venv/bin/python tests/benchmarks/bench_head_memory.py --model

`--device cuda`: the same on a GPU, where the extra peak is the CUDA caching allocator's peak of allocated memory
(`torch.cuda.max_memory_allocated`) above what was allocated before the step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def status_gib(key: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident) of this process in GiB, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM over from the current resident memory (Linux: `5` into /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


class Peak:
    """Memory held now and the peak since `reset()`, in GiB: resident memory on the CPU, the CUDA allocator's
    allocated bytes on a GPU."""

    def __init__(self, device: str):
        import torch

        self.torch, self.cuda = torch, device.startswith("cuda")

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.memory_allocated() / 2**30
        return status_gib("VmRSS")

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak()

    def peak(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**30
        return status_gib("VmHWM")


def one_mode(mode: str, tokens: int, hidden: int, vocab: int, chunk: int, device: str = "cpu") -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from core import rl_math

    torch.manual_seed(0)
    h = (torch.randn(tokens, hidden) / hidden**0.5).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(device).requires_grad_()
    y = torch.randint(0, vocab, (tokens,)).to(device)
    mem = Peak(device)

    def step(n: int) -> None:
        if mode == "floor":  # no logits at all: what any path spends on the head's (V, H) weight gradient
            (h[:n] * w[y[:n]]).sum().backward()
            return
        if mode == "full":
            logits = h[:n] @ w.t()  # (n, V) float32, kept for backward
            logp = rl_math.logprobs_from_logits(logits, y[:n])
            ent = rl_math.entropy_from_logits(logits)
        else:
            logp, ent = rl_math.head_logprobs(h[:n], w, y[:n], chunk=chunk, entropy=True)
        (logp.sum() - 0.01 * ent.sum()).backward()

    step(8)  # warm-up: gradient buffers of h and w exist from here on
    before = mem.now()
    mem.reset()
    t0 = time.perf_counter()
    step(tokens)
    peak = mem.peak()
    seconds = time.perf_counter() - t0
    return {"mode": mode, "device": device, "tokens": tokens, "vocab": vocab, "chunk": chunk if mode == "chunked" else None,
            "extra_peak_gib": round(peak - before, 3), "seconds": round(seconds, 3),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "full_logits_gib": round(tokens * vocab * 4 / 2**30, 3)}  # fmt: skip


def one_model_mode(mode: str, layers: int, seqs: int, seq_len: int, device: str = "cpu") -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agents.executor import Episode
    from core import models, rl, rl_math

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).to(device)
    mem = Peak(device)
    if mode == "floor":  # the head's weight gradient without logits: h · W[y] per target
        rl_math.head_logprobs = lambda h, w, y, t, c, e: ((h * w[y]).sum(-1).float(), (h * w[y]).sum(-1).float())
    elif mode == "full":
        models.chunked_head = lambda model: None
    prompt = 32
    episodes = [Episode({}, list(range(3, 3 + prompt)), [(7 * i + k) % 151_900 + 3 for k in range(seq_len - prompt)],
                        [0.0] * (seq_len - prompt), [1] * (seq_len - prompt), False) for i in range(seqs)]  # fmt: skip
    batch = rl.sequences(episodes, 0, torch.device(device))

    def step(b: dict) -> None:
        logp, ent = rl.forward_logp(model, b, 1.0, entropy=True)
        (logp.sum() - 0.01 * ent.sum()).backward()

    step(rl.rows(batch, [0]))  # warm-up on one sequence: the parameters' gradient buffers exist from here on
    before = mem.now()
    mem.reset()
    t0 = time.perf_counter()
    step(batch)
    peak = mem.peak()
    seconds = time.perf_counter() - t0
    tokens = seqs * seq_len
    return {"mode": mode, "device": device, "tokens": tokens, "targets": int(batch["loss_mask"].sum()), "vocab": 151_936,
            "layers": layers, "chunk": 2**25 // 151_936 if mode == "chunked" else None,
            "extra_peak_gib": round(peak - before, 3), "seconds": round(seconds, 3),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "full_logits_gib": round(tokens * 151_936 * 4 / 2**30, 3)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--model", action="store_true", help="a whole micro-step of a 0.5B-shaped model (see above)")
    p.add_argument("--layers", type=int, default=24, help="--model: decoder layers")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--mode", choices=["floor", "full", "chunked"], help="run one mode in this process (used internally)"
    )
    a = p.parse_args()
    if a.mode:
        if a.model:
            row = one_model_mode(a.mode, a.layers, 8, a.tokens // 8, a.device)
        else:
            row = one_mode(a.mode, a.tokens, a.hidden, a.vocab, a.chunk, a.device)
        print(json.dumps(row))
        return
    rows = []
    for mode in ("floor", "full", "chunked"):
        cmd = [sys.executable, __file__, "--mode", mode, "--tokens", str(a.tokens), "--hidden", str(a.hidden),
               "--vocab", str(a.vocab), "--chunk", str(a.chunk), "--layers", str(a.layers), "--device", a.device] + (["--model"] if a.model
                                                                                               else [])  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    print(f"device {a.device}" + (f" ({rows[0].get('gpu')})" if rows[0].get("gpu") else ""))
    print(f"{'mode':<8} {'tokens':>6} {'vocab':>7} {'chunk':>5} {'extra peak GiB':>14} {'s':>6}")
    for r in rows:
        print(f"{r['mode']:<8} {r['tokens']:>6} {r['vocab']:>7} {r['chunk'] or '-':>5} {r['extra_peak_gib']:>14} "
              f"{r['seconds']:>6}")  # fmt: skip
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
