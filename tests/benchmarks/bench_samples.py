"""What keeping samples costs: a default `algos/grpo.py` step with `--logger.samples 8` (the default) against
`--logger.samples 0`, side by side in one run.

    .venv/bin/python tests/benchmarks/bench_samples.py --steps 20 --rounds 3

Both sides run grpo.py's defaults (64 prompts x 8 samples of the embedded task, the SFT warm start, two minibatches)
with eval off (`--eval.every 0`, so the eval answers kept at every eval are not part of it), each in its own
subprocess, alternating `--rounds` times so that a slow moment of the machine hits both. s/step is the wall time
between two metrics rows after `--warmup` steps (everything a step does). A whole step varies by a few percent from
run to run, more than what is measured, so the side with samples also times the sample work itself: `Trace.add` in
the update and `samples.log` after it (decoding the tokens, the rows, the file), reported as a share of its step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_side(n_samples: int, steps: int, warmup: int, out: Path) -> dict:
    sys.argv = [sys.argv[0]]
    import shutil

    from bench_sft import clock_steps  # tests/benchmarks/ is sys.path[0] when run as a script

    from algos import grpo
    from core import samples

    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    samples.Trace.add = timed(samples.Trace.add)
    samples.log = timed(samples.log)  # grpo.py calls it as `samples.log`: the module attribute, looked up each step
    ends = clock_steps(grpo, "perf/gen_s")
    run_dir = out / f"samples{n_samples}"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = grpo.Args()
    args.train.max_steps, args.eval.every = warmup + steps, 0
    args.logger.samples, args.logger.quiet, args.logger.tensorboard = n_samples, True, False
    args.run_dir = str(run_dir)
    grpo.main(args)
    step_s = (ends[-1] - ends[warmup - 1]) / steps
    return {"step_s": step_s, "samples_s": spent[0] / (warmup + steps)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="/tmp/cleanrlhf-bench-samples")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.side is not None:
        print("RESULT " + json.dumps(run_side(a.side, a.steps, a.warmup, out)), flush=True)
        return
    results: dict[int, list[dict]] = {8: [], 0: []}
    for r in range(a.rounds):
        for n in (8, 0):
            cmd = [sys.executable, __file__, "--side", str(n), "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--out", str(out)]  # fmt: skip
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                sys.exit(f"--logger.samples {n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            results[n].append(json.loads(line[0][7:]))
            print(f"round {r + 1}: --logger.samples {n}: {results[n][-1]['step_s']:.3f} s/step", flush=True)
    with_s = statistics.median(x["step_s"] for x in results[8])
    without = statistics.median(x["step_s"] for x in results[0])
    work = statistics.median(x["samples_s"] for x in results[8])
    print(f"\ngrpo.py defaults, {a.steps} steps after {a.warmup}, median of {a.rounds} rounds")
    print(f"  --logger.samples 8: {with_s:.3f} s/step   --logger.samples 0: {without:.3f} s/step   "
          f"ratio {with_s / without:.3f}")  # fmt: skip
    print(f"  the sample work itself (Trace.add + samples.log): {work * 1e3:.1f} ms/step = {work / with_s:.2%} of a step")


if __name__ == "__main__":
    main()
