"""One RL update step on a rollout of mixed response lengths: right-padded rows (`--train.no-packing`) against packed
padding-free micro-batches of rows, and packed micro-batches filled to a token budget (`--train.max-tokens-per-micro`).

The rollout: 32 episodes, prompts of 16-48 tokens, responses of 16-512 tokens (uniform), on a randomly initialised
Qwen2-shaped model (hidden 256, 4 layers, the embedded 100-token vocabulary), fp32, one process, DeepSpeed ZeRO-0 on
the CPU, the attention implementation the scripts pick. Each mode runs `algos.grpo.update` (one minibatch, one epoch:
one forward and backward of every sequence) from the same initial weights. Reported per mode: positions the model
computed (the forward inputs' elements) over real tokens, and the step's wall time (median of --reps after one
warm-up), all in one run. Run:

    .venv/bin/python tests/benchmarks/bench_rl_packing.py                  # a table and a JSON line
    .venv/bin/python tests/benchmarks/bench_rl_packing.py --device cuda    # the same on a GPU (NCCL, FusedAdam)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build_model(out: Path, hidden: int, layers: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core import models

    tokenizer = models.load_tokenizer("cleanrlhf/tiny")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def count_positions(counts: list, module, args, kwargs) -> None:
    """A forward pre-hook: the positions this forward computes (its input_ids' elements)."""
    counts.append(kwargs["input_ids"].numel())


def rollout(n: int, vocab: int, lo: int, hi: int, seed: int = 0):
    from agents.executor import Episode

    rng = random.Random(seed)
    episodes = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
        episodes.append(Episode({}, prompt, response, [-4.0] * len(response), [1] * len(response), False))
    return episodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--max-tokens-per-micro", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    opts = ap.parse_args()

    import torch

    from algos import grpo
    from core import engine as ds_engine
    from core import models, rl
    from core.config import DSConfig, ModelConfig

    torch.set_num_threads(1)
    cuda = opts.device.startswith("cuda")
    ds_engine.init_distributed("nccl" if cuda else "gloo")
    path = build_model(Path(tempfile.mkdtemp()) / "model", opts.hidden, opts.layers)
    tokenizer = models.load_tokenizer(path)
    episodes = rollout(opts.episodes, len(tokenizer), opts.min_len, opts.max_len)
    real = sum(len(e.prompt_ids) + len(e.token_ids) for e in episodes)
    run = SimpleNamespace(rank=0, world=1, device=torch.device(opts.device))
    modes = {
        "padded": (False, None),
        "packed": (True, None),
        "packed + token budget": (True, opts.max_tokens_per_micro),
    }
    rows = []
    for name, (packed, budget) in modes.items():
        torch.manual_seed(0)
        model = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32")).to(run.device)
        attn = model.config._attn_implementation
        engine = ds_engine.make_engine(model, DSConfig(), lr=1e-6)
        computed = []
        model.register_forward_pre_hook(partial(count_positions, computed), with_kwargs=True)
        args = grpo.Args()
        args.train.minibatches, args.train.epochs = 1, 1
        args.train.micro_batch_size, args.train.max_tokens_per_micro = opts.micro_batch_size, budget
        seqs = rl.sequences(episodes, tokenizer.pad_token_id, run.device, packed)
        adv = torch.linspace(-1.0, 1.0, len(episodes), device=run.device)
        times = []
        for rep in range(opts.reps + 1):
            computed.clear()
            t0 = time.perf_counter()
            stats = grpo.update(engine, None, seqs, adv, args, run, step=rep, kl_coef=0.0)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append({"mode": name, "micro_batches": len(computed), "computed_positions": sum(computed),
                     "real_tokens": real, "computed_per_real": sum(computed) / real,
                     "step_s": statistics.median(times[1:]), "loss": stats["loss/policy"], "attn": attn})  # fmt: skip
        print(f"{name:>22}: {len(computed):3d} micro-batches, computed/real {sum(computed) / real:.3f}, "
              f"step {rows[-1]['step_s']:.2f} s", flush=True)  # fmt: skip
    base = rows[0]["step_s"]
    print(
        f"\n{opts.episodes} episodes, responses {opts.min_len}-{opts.max_len} tokens, {real} real tokens; "
        f"Qwen2-shaped hidden {opts.hidden} x {opts.layers} layers, fp32, attention {rows[0]['attn']}, "
        + (torch.cuda.get_device_name() if cuda else "CPU, 1 thread")
    )
    print(f"{'mode':>22} | micro-batches | computed / real | step s | vs padded")
    for r in rows:
        print(f"{r['mode']:>22} | {r['micro_batches']:13d} | {r['computed_per_real']:15.3f} | {r['step_s']:6.2f} | "
              f"{base / r['step_s']:.2f}x")  # fmt: skip
    print(json.dumps({"bench": "rl_packing", "opts": vars(opts), "rows": rows}))


if __name__ == "__main__":
    main()
