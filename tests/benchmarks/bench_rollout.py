"""Rollout throughput through core/rollout.py against raw vLLM, and weight-sync cost, on the same engine.

    .venv/bin/python tests/benchmarks/bench_rollout.py                      # tiny model, in-process engine
    .venv/bin/python tests/benchmarks/bench_rollout.py --model medium      # ~27 M Qwen2 (random, built in /tmp)
    .venv/bin/python tests/benchmarks/bench_rollout.py --ray               # the engine as a Ray actor

Generation: the same prompts (embedded 2-digit addition prompts) and sampling parameters, n samples of exactly
`--max-new-tokens` tokens each (ignore_eos, so both sides generate the same number of tokens), per-token log-probs
on. "raw" calls `LLM.generate` on the very engine that core wraps (in-process) or on a second in-process engine
(--ray), so the ratio is core's overhead: building requests, dispatch, converting outputs to `Sample`s (and, with
--ray, the actor hop). Sides alternate, one warm-up call each, `--repeats` calls each; the ratio uses the fastest
call of each side (best-of-N: on a shared machine the slow calls measure the neighbours), medians are printed too.
In-process, the process CPU time of each call is recorded as well (less sensitive to other jobs).

Weight sync: `engines.update_weights(model.named_parameters())` from an fp32 HF copy of the model, for several
bucket sizes; ms per MB of weights sent (reload + prefix-cache reset included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build_medium(dst: Path) -> str:
    """A random Qwen2 of ~27 M parameters with the embedded character tokenizer (hidden 512, 8 layers)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core import embedded

    if (dst / "config.json").exists():
        return str(dst)
    tokenizer = embedded.build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return str(dst)


def prompts(k: int) -> list[list[int]]:
    from core import embedded, models

    tokenizer = models.load_tokenizer("cleanrlhf/tiny")
    train, _ = embedded.task_rows(2)
    return [tokenizer(r["prompt"]).input_ids for r in train[:k]]


def time_it(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "medium"], default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in this process (2 cores, shared)")
    ap.add_argument("--ray", action="store_true", help="core's engine is a Ray actor; raw is in-process")
    ap.add_argument("--sync-backend", choices=["auto", "ray", "broadcast"], default="auto", help="with --ray")
    ap.add_argument("--out", type=str, default=None, help="write the numbers as JSON here")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from core import embedded, rollout, vllm_engine

    torch.set_num_threads(args.threads)
    path = (
        str(embedded.ensure_tiny_base())
        if args.model == "tiny"
        else build_medium(Path(tempfile.gettempdir()) / "cleanrlhf-bench-medium")
    )
    backend = args.sync_backend if args.ray else "auto"
    cfg = rollout.VLLMConfig(dtype=args.dtype, kv_cache_gib=1.0, in_process=not args.ray, timeout_s=1800,
                             sync_backend=backend)  # fmt: skip
    if args.ray:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=300 * 2**20, log_to_driver=False)
        raw_llm = vllm_engine.VLLMEngine(path, rollout.VLLMConfig(dtype=args.dtype, kv_cache_gib=1.0)).llm
    t0 = time.perf_counter()
    engines = rollout.create_engines(path, cfg, seed=0)
    start_s = time.perf_counter() - t0
    if not args.ray:
        raw_llm = engines.engines[0].llm

    ids = prompts(args.prompts)
    T, n = args.max_new_tokens, args.n
    tokens = len(ids) * n * T
    params = [
        SamplingParams(n=n, max_tokens=T, temperature=1.0, seed=i * n, logprobs=0, flat_logprobs=True,
                       detokenize=False, ignore_eos=True)
        for i in range(len(ids))
    ]  # fmt: skip

    def raw():
        outs = raw_llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == tokens

    def core():
        groups = engines.generate(ids, n=n, max_new_tokens=T, temperature=1.0, seed=0, ignore_eos=True)
        assert sum(len(s.token_ids) for g in groups for s in g) == tokens

    raw(), core()  # warm-up
    raw_s, core_s = [], []
    for _ in range(args.repeats):
        raw_s.append(time_it(raw))
        core_s.append(time_it(core))
    raw_tps, core_tps = tokens / min(w for w, _ in raw_s), tokens / min(w for w, _ in core_s)
    median_tps = {k: tokens / statistics.median(w for w, _ in v) for k, v in (("raw", raw_s), ("core", core_s))}
    cpu_tps = {k: tokens / min(c for _, c in v) for k, v in (("raw", raw_s), ("core", core_s))}

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    sync = {}
    for bucket_mb in (1, 16, 256):
        engines.cfg.sync_bucket_mb = bucket_mb
        engines.update_weights(model.named_parameters())  # warm-up
        runs = [engines.update_weights(model.named_parameters()) for _ in range(args.repeats)]
        ms = 1000 * statistics.median(r["perf/sync_s"] for r in runs)
        sync[bucket_mb] = {"ms": ms, "ms_per_mb": ms / mb, "buckets": runs[0]["sync/buckets"]}
    probe = [p + [5] * 20 for p in ids[:4]]
    check = rollout.check_weights(engines, model, probe)

    result = {
        "model": args.model, "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "weights_mb_fp32": mb,
        "engine": "ray actor" if args.ray else "in-process", "sync_backend": engines.backend, "dtype": args.dtype, "threads": args.threads,
        "start_s": start_s, "prompts": len(ids), "n": n, "max_new_tokens": T,
        "raw_tok_s": raw_tps, "core_tok_s": core_tps, "core_over_raw": core_tps / raw_tps,
        "median_tok_s": median_tps, "cpu_tok_s": cpu_tps, "raw_wall_cpu_s": raw_s, "core_wall_cpu_s": core_s, "sync": sync, "check_weights_max_abs_diff": check,
    }  # fmt: skip
    print(f"model {args.model} ({result['params_m']:.1f} M params, {mb:.1f} MB fp32), engine {result['engine']}, "
          f"{args.dtype}, {args.threads} thread(s), started in {start_s:.1f} s, sync via {engines.backend}")  # fmt: skip
    print(f"rollout {len(ids)} prompts x {n} x {T} tokens: raw vLLM {raw_tps:,.0f} tok/s, core {core_tps:,.0f} tok/s "
          f"({100 * core_tps / raw_tps:.1f} %); medians {median_tps['raw']:,.0f} / {median_tps['core']:,.0f}")  # fmt: skip
    if not args.ray:
        print(f"  per CPU-second of this process: raw {cpu_tps['raw']:,.0f}, core {cpu_tps['core']:,.0f} tok/s")
    for bucket_mb, s in sync.items():
        print(
            f"sync bucket {bucket_mb:>3} MB: {s['ms']:.1f} ms ({s['ms_per_mb']:.2f} ms/MB, {s['buckets']:.0f} buckets)"
        )
    print(f"check_weights after sync: max |engine - trainer| log-prob {check:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    engines.shutdown()


if __name__ == "__main__":  # vLLM spawns processes; nothing may run at import
    main()
