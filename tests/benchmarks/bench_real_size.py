"""A Qwen2-0.5B-shaped model through algos/grpo.py end to end on the CPU: two ZeRO-3 trainer ranks (bf16), a vLLM
engine as a Ray actor, `--debug` (the engine's log-probs checked against the trainer's after every weight sync), a
halt after step 2 and an exact resume to step 3, then the HF export loaded into vLLM.

The model is randomly initialised from a config: 24 layers, hidden 896, MLP 4864, 14 heads (2 KV heads), tied
embeddings, the embedded tokenizer's 100-token vocabulary (358 M parameters; the 151,936-token vocabulary's cost is
measured by bench_head_memory.py). It learns nothing (its reward is 0; `--algo.no-filter-zero-variance` keeps every
sample in the update so the training passes run at full size). Reported: wall time per phase (the scripts' perf/gen_s,
perf/train_s, perf/sync_s per step), the weight sync's share of the step against the floor of moving its bytes (a
gloo broadcast of as many MB between two processes) and the engine's own cost of loading the same weights from memory
(vLLM's reload, and the repacking for its CPU GEMM kernels inside it), and the peak resident memory of each
process (sampled every 0.2 s over the whole run, every process started after the driver; Ray's own daemons left
out). Run:

    .venv/bin/python tests/benchmarks/bench_real_size.py                 # ~10 min on 2 CPU cores
    .venv/bin/python tests/benchmarks/bench_real_size.py --layers 2      # what tests/test_real_size.py runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build_model(out: Path, layers: int) -> Path:
    """The 0.5B-shaped model (bf16) and the embedded tokenizer in `out`, built once."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core import models

    if (out / "config.json").exists():
        return out
    tokenizer = models.load_tokenizer("cleanrlhf/tiny")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def role(cmdline: str) -> str | None:
    """What a process of the run is, from its command line; None for Ray's daemons and helpers."""
    if "ray::VLLMEngine" in cmdline:
        return "vLLM engine actor"
    if "ray::Worker" in cmdline:
        return "trainer rank"
    if "algos/grpo.py" in cmdline:
        return "driver"
    if "EngineCore" in cmdline or "VLLM::" in cmdline:
        return "vLLM engine core"
    return None


class PeakMemory:
    """Peak RSS per process of a run (the driver `pid` and every process started after it), sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2):
        import psutil

        self.root, self.every_s, self.peak, self.roles = psutil.Process(pid), every_s, defaultdict(int), {}
        self.start = self.root.create_time()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import psutil

        while not self.stop.is_set():
            # Ray's actors are children of its raylet, not of the driver: every process started since the run began
            # (a benchmark machine runs nothing else)
            procs = [p for p in psutil.process_iter(["create_time"]) if p.info["create_time"] >= self.start - 1]
            for p in procs:
                try:
                    if self.roles.get(p.pid) is None:  # a Ray worker takes its actor's name once it becomes one
                        self.roles[p.pid] = role(" ".join(p.cmdline()))
                    if self.roles[p.pid]:
                        self.peak[p.pid] = max(self.peak[p.pid], p.memory_info().rss)
                except psutil.Error:
                    continue
            time.sleep(self.every_s)

    def result(self) -> dict[str, float]:
        """{role: largest peak GiB among its processes}."""
        self.stop.set()
        self.thread.join()
        out: dict[str, float] = {}
        for pid, rss in self.peak.items():
            r = self.roles[pid]
            out[r] = max(out.get(r, 0.0), rss / 2**30)
        return out


def grpo_command(model: Path, run_dir: Path, steps: int, halt_after: int | None) -> list[str]:
    cmd = [sys.executable, "algos/grpo.py", "--actor.model.name-or-path", str(model), "--actor.model.dtype", "bf16",
           "--actor.lr", "1e-6", "--train.ranks", "2", "--ds.zero-stage", "3", "--vllm.num-engines", "1",
           "--vllm.dtype", "bfloat16", "--vllm.kv-cache-gib", "1", "--ray.num-cpus", "4", "--debug",
           "--train.max-steps", str(steps), "--train.minibatches", "1", "--rollout.batch-size", "8",
           "--rollout.n-samples", "2", "--rollout.max-new-tokens", "16", "--algo.no-filter-zero-variance",
           "--eval.every", "0", "--eval.max-samples", "8", "--eval.k", "1", "--eval.best-metric", "None",
           "--ckpt.every", "0", "--logger.quiet", "--run-dir",  # the halt checkpoints: the one the resume needs
           str(run_dir)]  # fmt: skip
    return cmd + (["--train.halt-after", str(halt_after)] if halt_after else [])


def run(cmd: list[str], log: Path) -> tuple[float, dict]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        mem = PeakMemory(proc.pid)
        rc = proc.wait()
    peaks = mem.result()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({rc}); the log: {log}\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0, peaks


def load_export_in_vllm(path: Path) -> list[int]:
    """Greedy-generate 4 tokens from the exported folder with a vLLM engine built as the scripts build theirs
    (`core.rollout.create_engines`, in a fresh process)."""
    code = (
        "import json\n"
        "from core import rollout\n"
        f"cfg = rollout.VLLMConfig(in_process=True, dtype='bfloat16', kv_cache_gib=0.5, max_model_len=256)\n"
        f"engines = rollout.create_engines({str(path)!r}, cfg)\n"
        "out = engines.generate([[5, 6, 7]], max_new_tokens=4, temperature=0.0, ignore_eos=True)\n"
        "print('TOKENS', json.dumps(list(out[0][0].token_ids)))\n"
        "engines.shutdown()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"vLLM could not load the export {path}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def _engine_load(path: str) -> None:
    """(In a fresh process, `--engine-load PATH`.) Build a bf16 vLLM engine on `path` as the scripts do and time
    loading the checkpoint's own tensors into it from memory (`WorkerExtension.cleanrlhf_load_weights`: vLLM's
    `reload_weights`, what every sync ends with), best of 3, and the part of it that vLLM's CPU backend spends
    repacking each linear layer's weight for its GEMM kernel (`dispatch_cpu_unquantized_gemm` on the same shapes):
    work a CPU engine does whatever brings it the weights. Prints one JSON line."""
    import torch
    from safetensors.torch import load_file

    from core import rollout

    cfg = rollout.VLLMConfig(in_process=True, dtype="bfloat16", kv_cache_gib=0.25, max_model_len=256)
    engines = rollout.create_engines(path, cfg)
    named = list(load_file(str(Path(path) / "model.safetensors")).items())
    mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20

    def load(worker) -> float:
        t0 = time.perf_counter()
        worker.cleanrlhf_load_weights(named)
        return time.perf_counter() - t0

    def repack(worker) -> float:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        seconds = 0.0
        for module in worker.get_model().modules():
            n, k = getattr(module, "output_size_per_partition", None), getattr(module, "input_size_per_partition", None)
            if n is None or k is None or not hasattr(module, "cpu_linear"):
                continue
            stand_in = torch.nn.Module()
            stand_in.weight = torch.nn.Parameter(torch.randn(n, k).to(torch.bfloat16), requires_grad=False)
            t0 = time.perf_counter()
            dispatch_cpu_unquantized_gemm(stand_in, remove_weight=True)
            seconds += time.perf_counter() - t0
        return seconds

    llm = engines.engines[0].llm
    load_s = min(llm.collective_rpc(load)[0] for _ in range(3))
    repack_s = min(llm.collective_rpc(repack)[0] for _ in range(3))
    print("ENGINE_LOAD " + json.dumps({"mb": mb, "load_s": load_s, "repack_s": repack_s}))
    engines.shutdown()


def engine_load(path: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--engine-load", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE_LOAD ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the engine-load measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def _floor_rank(rank: int, port: int, mb: float, bucket_mb: float, out) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    bucket = torch.ones(int(bucket_mb * 2**20) // 2, dtype=torch.bfloat16)
    n = max(1, round(mb / bucket_mb))
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.broadcast(bucket, src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put((n * bucket_mb, min(times)))
    dist.destroy_process_group()


def gloo_floor(mb: float, bucket_mb: float = 256) -> float:
    """ms/MB of broadcasting `mb` MB in `bucket_mb` buckets between two processes over gloo (best of 3): what moving
    the weights' bytes costs on this machine, without the gather, the bucketing or the engine's load."""
    import torch.multiprocessing as mp

    from core.engine import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_floor_rank, args=(r, port, mb, bucket_mb, out)) for r in range(2)]
    for p in procs:
        p.start()
    moved, seconds = out.get(timeout=600)
    for p in procs:
        p.join()
    return 1000 * seconds / moved


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    ap.add_argument("--no-bounds", action="store_true", help="skip the physical bounds (a gloo broadcast of the same "
                    "bytes, the engine alone loading the weights): the run, its sync share and the export only")
    ap.add_argument("--engine-load", default=None, help=argparse.SUPPRESS)  # internal: `_engine_load` in a child
    opts = ap.parse_args(argv)
    if opts.engine_load:
        _engine_load(opts.engine_load)
        return {}
    out = Path(opts.out or tempfile.mkdtemp(prefix="real_size_"))
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out / f"qwen2-0.5b-shaped-{opts.layers}l", opts.layers)
    run_dir = out / "run"
    halted_s, peaks1 = run(grpo_command(model, run_dir, opts.steps, opts.steps - 1), out / "halted.log")
    resumed_s, peaks2 = run(grpo_command(model, run_dir, opts.steps, None), out / "resumed.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/gen_s" in r]
    keys = ("gen", "train", "sync", "transfer", "debug_check")
    phases = {k: sum(r.get(f"perf/{k}_s", 0.0) for r in steps) / len(steps) for k in keys}
    step_s = phases["gen"] + phases["train"] + phases["sync"]  # sync_s holds the transfer and the --debug check
    user_s = step_s - phases["debug_check"]  # the step a user runs: without the --debug check
    tokens = load_export_in_vllm(run_dir / "hf")
    import torch

    from core import models
    from core.config import ModelConfig

    floor = float("nan") if opts.no_bounds else gloo_floor(steps[-1]["sync/mb"])
    load = {"load_s": float("nan"), "repack_s": float("nan")} if opts.no_bounds else engine_load(model)
    n_params = sum(p.numel() for p in models.load_causal_lm(ModelConfig(name_or_path=str(model))).parameters())
    peaks = {k: max(peaks1.get(k, 0.0), peaks2.get(k, 0.0)) for k in {*peaks1, *peaks2}}
    result = {
        "layers": opts.layers, "params_m": round(n_params / 1e6, 1), "steps": [r["step"] for r in steps],
        "halted_run_s": round(halted_s, 1), "resumed_run_s": round(resumed_s, 1),
        "per_step_s": {k: round(v, 2) for k, v in phases.items()}, "step_s": round(step_s, 2),
        "sync_share": round(phases["transfer"] / step_s, 4), "step_without_debug_s": round(user_s, 2),
        "sync_share_without_debug": round(phases["transfer"] / user_s, 4),
        "sync_mb": steps[-1].get("sync/mb"), "sync_senders": steps[-1].get("sync/senders"),
        "transfer_ms_per_mb": round(1000 * phases["transfer"] / steps[-1]["sync/mb"], 3),
        "gloo_floor_ms_per_mb": round(floor, 3), "floor_share": round(floor * steps[-1]["sync/mb"] / 1000 / step_s, 4),
        "engine_load_s": round(load["load_s"], 3), "engine_repack_s": round(load["repack_s"], 3),
        "bound_share": round((floor * steps[-1]["sync/mb"] / 1000 + load["repack_s"]) / step_s, 4),
        "bound_share_without_debug": round((floor * steps[-1]["sync/mb"] / 1000 + load["repack_s"]) / user_s, 4),
        "peak_rss_gib": {k: round(v, 2) for k, v in sorted(peaks.items())},
        "export_generates": tokens, "torch_threads": torch.get_num_threads(),
    }  # fmt: skip
    print(f"Qwen2-0.5B-shaped, {opts.layers} layers, {result['params_m']} M parameters, bf16; 2 ZeRO-3 ranks + 1 "
          f"vLLM engine actor, --debug; steps logged {result['steps']}")  # fmt: skip
    print(f"runs: halted after step {opts.steps - 1} in {halted_s:.0f} s, resumed to step {opts.steps} in "
          f"{resumed_s:.0f} s (start-up included)")  # fmt: skip
    print(f"per step {step_s:.2f} s: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()) +
          f"; weight transfer {result['sync_mb']:.0f} MB from {result['sync_senders']:.0f} rank(s), {100 * result['sync_share']:.1f} % of the step, "
          f"{result['transfer_ms_per_mb']:.2f} ms/MB; a gloo broadcast of the same bytes: {floor:.2f} ms/MB, "
          f"{100 * result['floor_share']:.1f} % of the step")  # fmt: skip
    print(f"without the --debug check (the step a user runs): step {user_s:.2f} s, weight transfer "
          f"{100 * result['sync_share_without_debug']:.1f} % of it, bytes + repacking "
          f"{100 * result['bound_share_without_debug']:.1f} %")  # fmt: skip
    print(f"the engine alone loading the same weights from memory: {load['load_s']:.2f} s, of which {load['repack_s']:.2f} "
          f"s repacking them for vLLM's CPU GEMM kernels; bytes + repacking: {100 * result['bound_share']:.1f} % of "
          "the step")  # fmt: skip
    print("peak RSS: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in result["peak_rss_gib"].items()))
    print(f"export loaded in vLLM, greedy tokens {tokens}")
    print(json.dumps({"bench": "real_size", **result}))
    return result


if __name__ == "__main__":
    main()
