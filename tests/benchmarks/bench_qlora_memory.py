"""Memory of a QLoRA policy (`--model.load-in-4bit --model.lora-rank 8`) against the same model in fp32 and bf16.

    .venv/bin/python tests/benchmarks/bench_qlora_memory.py                 # Qwen2-0.5B-shaped (358 M parameters)
    .venv/bin/python tests/benchmarks/bench_qlora_memory.py --model cleanrlhf/tiny

Each variant loads in a process of its own through `core.models.load_causal_lm` (what the scripts call) and reports
two numbers: the bytes of the model's parameters and buffers (transformers' `get_memory_footprint`), and the growth of
the process's resident memory from before the load to after it, once every weight has been read and the memory the
load freed has been handed back with glibc's `malloc_trim`, in two parts (`/proc/self/status`): anonymous (RssAnon,
what the process allocated) and file-backed (RssFile, pages of the weights file still mapped: an fp32 load keeps its
tensors in the memory-mapped safetensors file, which the kernel can drop and read again). The 4-bit variant keeps the embeddings, the LM head and the norms in
its compute dtype (fp32 here) and adds the rank-8 adapters; only the decoder's linears are NF4.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {"fp32": {"dtype": "fp32"}, "bf16": {"dtype": "bf16"},
            "4-bit + LoRA 8": {"dtype": "fp32", "load_in_4bit": True, "lora_rank": 8}}  # fmt: skip


def rss_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory of this process in MiB (`/proc/self/status` RssAnon, RssFile)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))


def measure(path: str, fields: dict) -> dict:
    """Load `path` with `fields` of ModelConfig in this process; the footprint and the resident memory's growth."""
    import gc

    import torch

    from core import models

    torch.set_num_threads(1)
    import bitsandbytes  # noqa: F401  (the libraries' own memory is not the model's: imported before the baseline)
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa: F401

    before = rss_mib()
    model = models.load_causal_lm(models.ModelConfig(name_or_path=path, **fields))
    with torch.no_grad():  # every weight paged in (an fp32 load may leave them memory-mapped from the file, untouched)
        for t in (*model.parameters(), *model.buffers()):
            t.float().sum() if t.is_floating_point() else t.sum()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the load freed (a 4-bit load quantizes from fp32 copies) goes back
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    footprint = model.get_memory_footprint() / 2**20
    (anon, file), (anon0, file0) = rss_mib(), before
    return {"footprint_mib": footprint, "anon_mib": anon - anon0, "file_mib": file - file0, "trainable": trainable}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2-0.5b-shaped", help="a model path or name, or qwen2-0.5b-shaped")
    p.add_argument("--out", default="runs/bench_qlora_memory", help="where the shaped model is built")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a variant, in a child process
    opts = p.parse_args()
    if opts.one:
        print(json.dumps(measure(opts.model, VARIANTS[opts.one])))
        return
    from bench_sft import model_path

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    path = model_path(opts.model, out)
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows = {}
    for name in VARIANTS:
        done = subprocess.run([sys.executable, __file__, "--model", path, "--one", name], capture_output=True,
                              text=True, env=env, check=True)  # fmt: skip
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    base = rows["fp32"]
    print(f"{opts.model}: memory of the loaded policy (one process per row)")
    print(f"{'variant':<16} {'footprint MiB':>14} {'x fp32':>7} {'anon RSS MiB':>13} {'file RSS MiB':>13} "
          f"{'trainable':>11}")  # fmt: skip
    for name, r in rows.items():
        print(f"{name:<16} {r['footprint_mib']:>14.1f} {r['footprint_mib'] / base['footprint_mib']:>7.3f} "
              f"{r['anon_mib']:>13.1f} {r['file_mib']:>13.1f} {r['trainable']:>11,}")  # fmt: skip
    (out / "result.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
