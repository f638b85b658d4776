"""GRPO throughput: algos/grpo.py against TRL's GRPOTrainer, same model, prompts, batch and reward, one run.

    .venv/bin/pip install --no-deps trl==1.16.0       # the peer (not a project dependency)
    .venv/bin/python tests/benchmarks/bench_grpo.py --steps 10              # --threads 1 when the cores are shared
    .venv/bin/python tests/benchmarks/bench_grpo.py --model 0.5b --steps 3 --warmup 1 --sides ours ours-hf trl
    .venv/bin/python tests/benchmarks/bench_grpo.py --device cuda --steps 20   # a GPU: grpo.py --vllm.engine hf vs TRL

`--model 0.5b` is the Qwen2-0.5B shape (24 layers, hidden 896, MLP 4864, 14 heads / 2 KV heads: 358 M parameters with
the embedded tokenizer's small vocabulary) with random weights, built once by tests/benchmarks/bench_real_size.py;
random weights change nothing here, since every sample is forced to 64 tokens. `--device cuda` runs both sides on
the GPU in bf16 (`--dtype` changes it): ours as `ours-hf`, grpo.py in one process with `--vllm.engine hf`
(transformers' `generate` on the trainer's GPU: vLLM is not on the lent machines), TRL with `model.generate` as
always. The `ours-hf` side runs on CPU too, which is how its code path is checked without a GPU.

Each step on both sides: 8 prompts of the embedded task `cleanrlhf/add2` x 4 samples (the group) x exactly 64 new
tokens at temperature 1.0 from the SFT warm start `cleanrlhf/tiny-sft`, rewards/arithmetic.py as the reward, then one
AdamW step (lr 3e-4, grad clip 1.0) on all 32 samples: no KL, no reference model, no zero-variance filtering, fp32, no
gradient checkpointing, eval off. Each side runs in its own subprocess with `--threads` torch threads and is timed
over the same steps after a few warm-up steps. s/step is the wall time between step ends (everything included).

64 tokens are forced because the warm start stops after ~4: grpo.py's engine calls get `ignore_eos=True` (eos may be
sampled, it does not stop), TRL gets `min_new_tokens=64` (eos is masked until then). The split: ours is grpo.py's
`perf/gen_s` (vLLM generation, decoding, reward), `perf/train_s` (old log-probs, loss, backward, optimizer) and
`perf/sync_s` (weights to vLLM); TRL's generation is its HF `model.generate` calls, training the rest of the step
(reward, loss, backward, optimizer), and it has no sync. Not aligned, as it does not change the work: the lr schedule
(ours cosine to 0.1 lr, TRL constant) and the order of the prompts. Before its first step grpo.py scores 8 eval
prompts once (untimed). Our side runs twice: as shipped (vLLM eager on CPU) and with `--vllm.enforce-eager False`
(vLLM compiles the model; the compile is start-up, not timed). algos/grpo_async.py runs the same two ways: its vLLM
engine is a Ray actor generating step t+1 while the trainer (one thread fewer: the engine has its core) trains on
step t, one update stale (`--train.max-lag 1`). Its `perf/gen_s` overlaps training; `wait` is the time the trainer
sat idle waiting for a rollout or for the engine to finish before the sync.

The "ceiling" line bounds what any generator could give: a step is never shorter than its training phase, so with
generation and sync free (or wholly hidden behind training) the speed-up is at most TRL's step over our training.
On the CPU the last lines bound the training phase itself: its model FLOPs per step (`train_flops`: forward and
backward of every linear and of the attention, on the real tokens) over this CPU's own torch.mm rate at the model's
matmul shapes on the same threads (`matmul_rate`), and each side's achieved FLOP/s as a fraction of that rate.
tests/benchmarks/bench_train_phase.py times the training phase alone, ours against a plain transformers step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS, GROUP, TOKENS, LR = 8, 4, 64, 3e-4
SIDES = ("ours", "ours-compiled", "ours-hf", "async", "async-compiled", "trl")
NAMES = {"ours": "grpo.py", "ours-compiled": "grpo.py, vLLM compiled", "ours-hf": "grpo.py --vllm.engine hf",
         "async": "grpo_async.py",
         "async-compiled": "grpo_async.py, vLLM compiled", "trl": "TRL GRPOTrainer"}  # fmt: skip


def model_path(spec: str, out: Path) -> str:
    """`--model`: an embedded name or a folder, or `0.5b` (the Qwen2-0.5B-shaped model, built once under `out`)."""
    if spec != "0.5b":
        return spec
    from bench_real_size import build_model  # tests/benchmarks/ is sys.path[0] when run as a script

    return str(build_model(out / "qwen2-0.5b-shape", layers=24))


def run_ours(steps: int, warmup: int, out: Path, compiled: bool = False, script: str = "grpo",
             model: str = "cleanrlhf/tiny-sft", dtype: str = "fp32", engine: str = "vllm") -> dict:  # fmt: skip
    sys.argv = [sys.argv[0]]
    import importlib

    import torch
    from bench_sft import clock_steps  # tests/benchmarks/ is sys.path[0] when run as a script

    from core import rollout

    grpo = importlib.import_module(f"algos.{script}")
    generate, ends = rollout.RolloutEngines.generate, clock_steps(grpo, "perf/gen_s")
    rollout.RolloutEngines.generate = lambda self, *a, **k: generate(self, *a, **{**k, "ignore_eos": True})
    shutil.rmtree(out / "ours", ignore_errors=True)  # metrics.jsonl appends; a stale run would mix into the timing
    args = grpo.Args()
    args.actor.model.name_or_path, args.actor.model.dtype = model, dtype
    args.vllm.engine, args.vllm.dtype = engine, {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    args.rollout.batch_size, args.rollout.n_samples, args.rollout.max_new_tokens = PROMPTS, GROUP, TOKENS
    args.rollout.temperature, args.actor.lr, args.algo.kl_coef, args.algo.filter_zero_variance = 1.0, LR, 0.0, False
    args.train.max_steps, args.train.minibatches = warmup + steps, 1
    args.eval.every, args.eval.max_samples = 0, 8
    args.logger.quiet, args.logger.tensorboard = True, False
    args.vllm.enforce_eager = not compiled  # compiled: vLLM's torch.compile of the model (start-up +15-40 s on CPU)
    args.run_dir = str(out / "ours")
    grpo.main(args)
    rows = [json.loads(line) for line in open(out / "ours" / "metrics.jsonl") if '"perf/gen_s"' in line][warmup:]
    res = {k: sum(r.get(f"perf/{k}", 0.0) for r in rows) / steps for k in ("gen_s", "train_s", "sync_s", "wait_s")}
    res["tokens"] = sum(r["rollout/response_len_mean"] for r in rows) / steps
    return {**res, "step_s": (ends[-1] - ends[warmup - 1]) / steps, "threads": torch.get_num_threads()}


def run_trl(steps: int, warmup: int, out: Path, model: str = "cleanrlhf/tiny-sft", dtype: str = "fp32",
            device: str = "cpu") -> dict:  # fmt: skip
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from core import embedded, models
    from rewards.arithmetic import reward_func

    path = embedded.resolve_model(model)
    tokenizer = models.load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=models.torch_dtype(dtype))
    rows = [json.loads(line) for line in open(Path(embedded.resolve_data("cleanrlhf/add2")) / "train.jsonl")]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    gens, ends, lens = [], [], []
    generate = model.generate  # TRL calls the unwrapped model's generate: this very object on one CPU process

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        result = generate(*a, **k)
        gens.append((t0, time.perf_counter()))
        return result

    model.generate = timed_generate

    def reward(prompts, completions, completion_ids, answer, **_):
        lens.append(sum(map(len, completion_ids)) / len(completion_ids))
        return reward_func([p + c for p, c in zip(prompts, completions)], prompts, answer)["rewards"].tolist()

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    cfg = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
        generation_batch_size=PROMPTS * GROUP, max_completion_length=TOKENS, generation_kwargs={"min_new_tokens": TOKENS},
        temperature=1.0, beta=0.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.95,
        max_grad_norm=1.0, max_steps=warmup + steps, use_cpu=device == "cpu", bf16=dtype == "bf16", report_to="none", logging_steps=10**6,
        save_strategy="no", gradient_checkpointing=False, dataloader_num_workers=0, seed=1,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tokenizer,
                          callbacks=[Clock()])  # fmt: skip
    trainer.train()
    step_s = (ends[-1] - ends[warmup - 1]) / steps
    gen_s = sum(t1 - t0 for t0, t1 in gens if t0 > ends[warmup - 1]) / steps
    return {"step_s": step_s, "gen_s": gen_s, "train_s": step_s - gen_s, "sync_s": 0.0, "tokens": lens[-1],
            "threads": torch.get_num_threads()}  # fmt: skip


def linear_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of every linear a token goes through in one decoder layer of a Qwen2/Llama-style config, then the LM
    head's (hidden, vocab) as the last entry."""
    h, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    return [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h), (h, config.vocab_size)]


def train_flops(model: str, tokens: float, seq_len: float) -> float:
    """Model FLOPs of one training pass (forward + backward = 3 forwards) over `tokens` tokens in sequences of about
    `seq_len`: 2·in·out per token per linear, the causal attention's QKᵀ and AV (2 · 2 · hidden · seq_len / 2 per
    token and layer). Counted on the real tokens only, so padding (TRL's) is not counted as work."""
    from transformers import AutoConfig

    from core import embedded

    config = AutoConfig.from_pretrained(embedded.resolve_model(model))
    *layer, head = linear_shapes(config)
    per_token = config.num_hidden_layers * (sum(2 * i * o for i, o in layer) + 2 * config.hidden_size * seq_len)
    return 3 * tokens * (per_token + 2 * head[0] * head[1])


def matmul_rate(model: str, tokens: int, threads: int, dtype: str = "fp32", reps: int = 3) -> float:
    """This CPU's measured FLOP/s on the model's own matmul shapes: one layer's linears forward, (tokens, in) @ (in,
    out) each, with `threads` torch threads, best of `reps`. The bound a training phase's FLOP/s is read against."""
    import torch
    from transformers import AutoConfig

    from core import embedded

    torch.set_num_threads(threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    *layer, _ = linear_shapes(AutoConfig.from_pretrained(embedded.resolve_model(model)))
    xs = {i: torch.randn(tokens, i, dtype=dt) for i in {i for i, _ in layer}}
    ws = [torch.randn(i, o, dtype=dt) for i, o in layer]
    flops = sum(2 * tokens * w.shape[0] * w.shape[1] for w in ws)
    best = float("inf")
    for _ in range(reps + 1):  # the first pass warms the allocator and the kernels up
        t0 = time.perf_counter()
        for w in ws:
            torch.mm(xs[w.shape[0]], w)
        best = min(best, time.perf_counter() - t0)
    return flops / best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads on each side")
    p.add_argument("--model", default="cleanrlhf/tiny-sft", help="embedded name, folder, or 0.5b (the Qwen2-0.5B shape)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: both sides on the GPU")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=None,
                   help="which sides to run (default: all on cpu; ours-hf and trl on cuda)")  # fmt: skip
    p.add_argument("--out", default="/tmp/cleanrlhf-bench-grpo")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    if a.side:
        import torch

        if a.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: this machine has no CUDA device")
        torch.set_num_threads(a.threads)
        if a.side == "trl":
            res = run_trl(a.steps, max(1, a.warmup), out, a.model, dtype, a.device)
        else:
            script = "grpo_async" if a.side.startswith("async") else "grpo"
            res = run_ours(a.steps, max(1, a.warmup), out, compiled=a.side.endswith("compiled"), script=script,
                           model=a.model, dtype=dtype, engine="hf" if a.side == "ours-hf" else "vllm")  # fmt: skip
        (out / f"{a.side}.json").write_text(json.dumps(res))
        return
    model = model_path(a.model, out)  # built once here, before the sides
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU measurement on a GPU machine stays on the CPU
    wanted = a.sides or (["ours-hf", "trl"] if a.device == "cuda" else [s for s in SIDES if s != "ours-hf"])
    sides = [s for s in SIDES if s in wanted]
    for side in sides:
        (out / f"{side}.json").unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--threads", str(a.threads), "--out", str(out), "--model", model, "--device", a.device,
               "--dtype", dtype]  # fmt: skip
        with open(out / f"{side}.log", "w") as log:
            if subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"side {side} failed: see {out / f'{side}.log'}")
    res = {side: json.loads((out / f"{side}.json").read_text()) for side in sides}
    print(f"GRPO, {a.model} on cleanrlhf/add2, {PROMPTS} prompts x {GROUP} samples x {TOKENS} tokens per step, "
          f"{a.steps} timed steps, {dtype} on {a.device}, torch threads: "
          + ", ".join(f"{s} {r['threads']}" for s, r in res.items()))  # fmt: skip
    print(f"{'':30}{'s/step':>9}{'gen s':>9}{'train s':>9}{'sync s':>9}{'wait s':>9}{'tokens':>8}{'tokens/s':>10}")
    for side, r in res.items():
        sync = f"{r['sync_s']:>9.4f}" if side != "trl" else f"{'n/a':>9}"
        wait = f"{r['wait_s']:>9.4f}" if side.startswith("async") else f"{'':>9}"
        print(f"{NAMES[side]:30}{r['step_s']:>9.4f}{r['gen_s']:>9.4f}{r['train_s']:>9.4f}{sync}{wait}{r['tokens']:>8.1f}"
              f"{PROMPTS * GROUP * r['tokens'] / r['step_s']:>10.0f}")  # fmt: skip
    if "trl" in res:
        trl = res["trl"]["step_s"]
        print("speed-up over TRL: " + ", ".join(f"{s} {trl / r['step_s']:.2f}x" for s, r in res.items() if s != "trl"))
        # A step is never shorter than its training phase, even with generation and sync free or fully overlapped
        print("ceiling with free generation and sync (TRL's step over our training alone): "
              + ", ".join(f"{s} {trl / r['train_s']:.2f}x" for s, r in res.items() if s != "trl"))  # fmt: skip
        print("training phase vs TRL's: " + ", ".join(f"{s} {res['trl']['train_s'] / r['train_s']:.2f}x"
                                                      for s, r in res.items() if s != "trl"))  # fmt: skip
    # The training phase's bound: its model FLOPs over this CPU's own matmul rate at the model's shapes
    if a.device == "cpu":
        from transformers import AutoTokenizer

        from core import embedded

        tokenizer = AutoTokenizer.from_pretrained(embedded.resolve_model(model))
        rows = [json.loads(line) for line in open(Path(embedded.resolve_data("cleanrlhf/add2")) / "train.jsonl")]
        prompt = sum(len(tokenizer(r["prompt"])["input_ids"]) for r in rows[:512]) / len(rows[:512])
        seq, n = prompt + TOKENS, PROMPTS * GROUP
        flops = train_flops(model, n * seq, seq)
        rate = matmul_rate(model, int(n * seq), a.threads, dtype)
        print(f"training FLOPs per step {flops / 1e12:.2f} T ({n} sequences of ~{seq:.0f} tokens, forward + backward); "
              f"torch.mm at the model's shapes on {a.threads} threads: {rate / 1e9:.1f} GFLOP/s, so the training phase "
              f"takes at least {flops / rate:.2f} s")  # fmt: skip
        print("training phase FLOP/s, fraction of the matmul rate: " + ", ".join(
            f"{NAMES[s]} {flops / r['train_s'] / 1e9:.1f} GFLOP/s ({100 * flops / r['train_s'] / rate:.0f} %)"
            for s, r in res.items()))  # fmt: skip


if __name__ == "__main__":
    main()
