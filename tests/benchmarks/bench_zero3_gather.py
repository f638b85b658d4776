"""What the weight sync's ZeRO-3 gather costs: every parameter of a Qwen2-0.5B-shaped bf16 model gathered from 2 CPU
ranks (gloo) and copied out, one parameter at a time (one all-gather each, how the sync gathered before) against one
decoder layer at a time (`core.weights.full_named_parameters`: one coalesced all-gather per layer), in one run.

Both ranks walk the same order, as in `core.placement.sync_weights`; rank 0 reports the median of `--reps` walks
after a warm-up, in seconds and ms per MB, and checks that both ways give identical tensors. Nothing is sent to an
engine: this is the gather alone (bench_real_size.py measures the whole transfer inside a GRPO step). Run:

    .venv/bin/python tests/benchmarks/bench_zero3_gather.py              # 24 layers (~1.5 min on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def per_parameter(engine):
    """The earlier sync's gather: one `GatheredParameters` (one all-gather) per parameter."""
    import deepspeed

    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            yield name, p.detach().clone()


def _rank(rank: int, port: int, layers: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core import engine as ds_engine
    from core import weights
    from core.config import DSConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    torch.set_num_threads(1)
    ds_engine.init_distributed("gloo")
    config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    engine = ds_engine.make_engine(model, DSConfig(zero_stage=3), lr=1e-6)
    ways = {"per parameter": per_parameter, "per decoder layer": weights.full_named_parameters}
    times: dict[str, list[float]] = {k: [] for k in ways}
    first: dict[str, list] = {}
    for rep in range(reps + 1):
        for name, walk in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            tensors = list(walk(engine))
            dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
            else:
                first[name] = tensors
    a, *others = first.values()
    same = all([n for n, _ in a] == [n for n, _ in b] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
               for b in others)  # fmt: skip
    mb = sum(t.numel() * t.element_size() for _, t in a) / 2**20
    if rank == 0:
        out.put({"layers": layers, "mb": round(mb, 1), "identical": same,
                 "seconds": {k: round(statistics.median(v), 3) for k, v in times.items()},
                 "collectives": {"per parameter": len(a), "per decoder layer": len(weights.gather_groups(
                     list(engine.module.named_parameters())))}})  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    opts = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from core.engine import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, opts.layers, opts.reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
    mb = result["mb"]
    print(f"Qwen2-0.5B-shaped, {opts.layers} layers, bf16, {mb:.0f} MB, 2 ZeRO-3 ranks over gloo; identical tensors: "
          f"{result['identical']}")  # fmt: skip
    for way, s in result["seconds"].items():
        print(f"  {way:>18}: {result['collectives'][way]:4d} all-gathers, {s:.3f} s, {1000 * s / mb:.2f} ms/MB")
    print(json.dumps({"bench": "zero3_gather", **result}))
    return result


if __name__ == "__main__":
    main()
