#!/usr/bin/env bash
# What ran on the lent GPU machine (one H200; its own python3 with torch + CUDA, no vLLM, no Ray, no registry), from
# the repo root, and whose output is committed beside this file. The packages the machine lacks travel as wheels in
# .whl/ (built or downloaded on the dev machine: deepspeed 0.19.8, tyro, datasets, trl, pydantic, ...) and the
# embedded artifacts as a copy of $CLEANRLHF_HOME in .gpu_home/ (so nothing is rebuilt there).
#
#   bash results/gpu/run.sh tests    # GPU tests (tests/test_gpu.py) and the weight-transport benchmark
#   bash results/gpu/run.sh bench    # SFT and DPO against TRL on the GPU (tests/benchmarks/bench_{sft,dpo}.py)
#   bash results/gpu/run.sh all      # both, in one call (what produced the committed files)
set -uo pipefail
OUT=${OUT:-/tmp/cleanrlhf-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site:$PWD CLEANRLHF_HOME=$PWD/.gpu_home PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys, torch, transformers, deepspeed; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__,
'deepspeed', deepspeed.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [[ "${1:-tests}" == tests || "${1:-}" == all ]]; then
    timeout 280 python3 -m pytest -v -rs -s -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 |
        tee "$OUT/test_gpu.txt"
    timeout 80 python3 tests/benchmarks/bench_sync_gpu.py --out "$OUT/bench_sync_gpu.json" 2>&1 |
        tee "$OUT/bench_sync_gpu.txt"
fi
if [[ "${1:-tests}" == bench || "${1:-}" == all ]]; then
    # the tiny model (fp32, as on CPU), then a Qwen2-0.5B-shaped one in bf16, where the GPU has work to do
    { timeout 120 python3 tests/benchmarks/bench_sft.py --steps 40
      timeout 150 python3 tests/benchmarks/bench_sft.py --steps 20 --workload mixed --model qwen2-0.5b-shaped --bf16
    } 2>&1 | tee "$OUT/bench_sft_gpu.txt"
    { timeout 100 python3 tests/benchmarks/bench_dpo.py
      timeout 150 python3 tests/benchmarks/bench_dpo.py --steps 10 --batch 8 64 --model qwen2-0.5b-shaped --bf16
    } 2>&1 | tee "$OUT/bench_dpo_gpu.txt"
fi
