"""Weight sync per step with a LoRA actor against full fine-tuning: bytes moved and seconds, one run side by side.

    .venv/bin/python tests/benchmarks/bench_lora_sync.py                  # embedded tiny model (1 M)
    .venv/bin/python tests/benchmarks/bench_lora_sync.py --model qwen     # random Qwen2 shape, 32 k vocab (~42 M)

Three sides on the same model, each with its own in-process vLLM engine (fp32) and a ZeRO-0 DeepSpeed actor:
  full     every parameter trained; every sync sends every weight (`--actor.model.lora-rank 0`);
  merged   LoRA rank r on every linear, `--vllm.lora-sync merged`: the first sync sends every weight with the adapters
           merged in, later syncs only the adapted linears (the base is frozen);
  adapter  LoRA rank r, `--vllm.lora-sync adapter`: every sync sends only the factors, loaded as a new vLLM adapter.
A step here is an update of the trainable parameters (a small random change: the sync's cost does not depend on the
values) followed by `core.placement.sync_weights`, exactly what the RL scripts call; `perf/sync_s` and `sync/mb` are
its own numbers (merging, writing and loading the adapter, reload and prefix-cache reset included). After every sync
`rollout.check_weights` asserts the engine's log-probs equal the trainer's (not timed). The first sync is reported
apart from the steady ones (median of `--steps`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBES = [[1, 5, 6, 14, 7, 8, 15, 5, 6, 9, 2], [1, 9, 9, 14, 9, 15, 1, 8, 8, 2]]


def build_qwen(dst: Path) -> str:
    """A random Qwen2 of ~42 M parameters shaped like a small real one: 32 k vocabulary (tied), hidden 512, 8 layers,
    intermediate 1408, with the embedded character tokenizer (whose ids are a prefix of the vocabulary)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core import embedded

    if (dst / "config.json").exists():
        return str(dst)
    tokenizer = embedded.build_tokenizer()
    config = Qwen2Config(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return str(dst)


def run_side(side: str, path: str, rank: int, steps: int) -> dict:
    """`steps` + 1 syncs of one side; returns its first and steady (median) sync seconds and MB."""
    import torch

    from core import engine as ds_engine
    from core import models, placement, rollout
    from core.config import DSConfig, ModelConfig

    lora = 0 if side == "full" else rank
    model = models.load_causal_lm(ModelConfig(name_or_path=path, dtype="fp32", lora_rank=lora))
    actor = ds_engine.make_engine(model, DSConfig(zero_stage=0), 1e-3)
    cfg = rollout.VLLMConfig(in_process=True, dtype="float32", kv_cache_gib=0.25, timeout_s=600,
                             lora_sync="adapter" if side == "adapter" else "merged")  # fmt: skip
    engines = rollout.create_engines(path, cfg, seed=0, max_lora_rank=lora if side == "adapter" else 0)
    trainable = [p for p in actor.module.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    syncs, worst = [], 0.0
    try:
        for _ in range(steps + 1):
            with torch.no_grad():  # an update of what this side trains
                for p in trainable:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            stats = placement.sync_weights(engines, actor, 0)
            syncs.append((stats["perf/sync_s"], stats["sync/mb"]))
            worst = max(worst, rollout.check_weights(engines, actor.module, PROBES))
    finally:
        engines.shutdown()
    steady = syncs[1:]
    return {
        "side": side,
        "trainable_params": sum(p.numel() for p in trainable),
        "first_sync_s": syncs[0][0],
        "first_sync_mb": syncs[0][1],
        "sync_s": statistics.median(s for s, _ in steady),
        "sync_mb": statistics.median(m for _, m in steady),
        "check_max_abs_diff": worst,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen"], default="tiny")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--steps", type=int, default=10, help="syncs after the first")
    ap.add_argument("--sides", nargs="+", default=["full", "merged", "adapter"])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from core import embedded
    from core import engine as ds_engine

    path = (embedded.resolve_model("cleanrlhf/tiny-sft") if a.model == "tiny"
            else build_qwen(Path(tempfile.gettempdir()) / "cleanrlhf-bench-lora-qwen"))  # fmt: skip
    if a.one:  # one side in this process (see below), its result as the last line
        ds_engine.init_distributed("gloo")
        print(json.dumps(run_side(a.one, path, a.rank, a.steps)))
        return {}
    t0 = time.perf_counter()
    rows = []
    for side in a.sides:  # a process per side: shutting an in-process vLLM engine down ends torch.distributed's group
        cmd = [sys.executable, __file__, "--model", a.model, "--rank", str(a.rank), "--steps", str(a.steps)]
        out = subprocess.run([*cmd, "--one", side], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"model {a.model} ({path}), LoRA rank {a.rank}, {a.steps} steady syncs per side, "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(f"{'side':8} {'trained':>10} {'first MB':>9} {'first s':>8} {'MB/step':>9} {'s/step':>8} {'check':>8}")
    for r in rows:
        print(f"{r['side']:8} {r['trainable_params']:>10,} {r['first_sync_mb']:>9.2f} {r['first_sync_s']:>8.3f} "
              f"{r['sync_mb']:>9.3f} {r['sync_s']:>8.4f} {r['check_max_abs_diff']:>8.1e}")  # fmt: skip
    result = {"model": a.model, "rank": a.rank, "steps": a.steps, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
