#!/usr/bin/env bash
# Verify the GPU paths on a machine with NVIDIA GPUs, in one command from the repo root:
#
#   bash results/gpu/run.sh            # = all: environment, GPU tests, GPU benchmarks, RL runs with vLLM
#   bash results/gpu/run.sh tests      # tests/test_gpu.py (DeepSpeed over NCCL, packing, hybrid engine, CUDA IPC sync)
#   bash results/gpu/run.sh bench      # weight transports; SFT and DPO against TRL; packed RL step; LM-head memory;
#                                      #   SFT at ZeRO-3 without and with --ds.deepcompile
#   bash results/gpu/run.sh rl         # grpo.py on the GPU with vLLM, --debug after every sync; with 2+ GPUs also
#                                      #   --train.ranks 2 with the NCCL weight broadcast to a separate engine GPU;
#                                      #   without vLLM, 80 steps in one process with --vllm.engine hf
#   bash results/gpu/run.sh grpo       # bench_grpo.py --device cuda: one-process GRPO against TRL's GRPOTrainer
#
# Each part's output goes to $OUT (default results/gpu/out-<date>) as a .txt file, and a summary is printed at the end.
# Python: .venv/bin/python when the project's venv exists (the GPU install of README.md), else python3. On a machine
# without a registry the missing pure-Python packages may travel as wheels in .whl/ and the embedded artifacts as a
# copy of $CLEANRLHF_HOME in .gpu_home/ (how the committed files of 2026-11-22 were produced); both are optional.
# Without a CUDA GPU the script says so and exits with status 2.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-all}
OUT=${OUT:-results/gpu/out-$(date +%Y%m%d-%H%M)}
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
[ -d .gpu_home ] && export CLEANRLHF_HOME=$PWD/.gpu_home
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if ! command -v nvidia-smi >/dev/null || ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "results/gpu/run.sh: no CUDA GPU here (nvidia-smi missing or torch.cuda.is_available() is False); nothing run." >&2
    echo "On CPU, the test suite is: .venv/bin/python -m pytest -q tests" >&2
    exit 2
fi
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
HAS_VLLM=$($PY -c "import vllm" >/dev/null 2>&1 && echo 1 || echo 0)
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import sys, torch, transformers, deepspeed; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__,
'deepspeed', deepspeed.__version__)"
    echo "GPUs: $NGPU, vLLM: $([ "$HAS_VLLM" = 1 ] && $PY -c 'import vllm; print(vllm.__version__)' || echo 'not installed')"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} 2>&1 | tee "$OUT/env.txt"

declare -A STATUS
part() {  # part NAME TIMEOUT_S COMMAND...: run, tee into $OUT/NAME.txt, remember the exit status
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*" | tee "$OUT/$name.txt"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    STATUS[$name]=${PIPESTATUS[0]}
}

if [[ $MODE == tests || $MODE == all ]]; then
    part test_gpu 900 $PY -m pytest -v -rs -p no:cacheprovider --durations=0 tests/test_gpu.py
fi
if [[ $MODE == bench || $MODE == all ]]; then
    part bench_sync_gpu 300 $PY tests/benchmarks/bench_sync_gpu.py --out "$OUT/bench_sync_gpu.json"
    part bench_sft_gpu 600 bash -c "$PY tests/benchmarks/bench_sft.py --steps 40 &&
        $PY tests/benchmarks/bench_sft.py --steps 20 --workload mixed --model qwen2-0.5b-shaped --bf16"
    part bench_dpo_gpu 600 bash -c "$PY tests/benchmarks/bench_dpo.py &&
        $PY tests/benchmarks/bench_dpo.py --steps 10 --batch 8 64 --model qwen2-0.5b-shaped --bf16"
    part bench_rl_packing 600 $PY tests/benchmarks/bench_rl_packing.py --device cuda
    part bench_head_memory 600 bash -c "$PY tests/benchmarks/bench_head_memory.py --device cuda &&
        $PY tests/benchmarks/bench_head_memory.py --device cuda --model"
    # DeepCompile (--ds.deepcompile, CUDA only): the same SFT run at ZeRO-3 without and with it, the step time of each
    part sft_deepcompile 900 bash -c "$PY algos/sft.py --ds.zero-stage 3 --model.dtype bf16 --train.max-steps 60 \
        --eval.every 60 --run-dir $OUT/runs/sft_z3 && $PY algos/sft.py --ds.zero-stage 3 --model.dtype bf16 \
        --ds.deepcompile --train.max-steps 60 --eval.every 60 --run-dir $OUT/runs/sft_z3_deepcompile"
fi
if [[ $MODE == rl || $MODE == all ]]; then
    if [ "$HAS_VLLM" = 1 ]; then
        # the main job on one GPU: in-process vLLM engine, weights synced after every step and checked (--debug)
        part rl_grpo_1gpu 900 $PY algos/grpo.py --train.max-steps 20 --eval.every 10 --debug \
            --run-dir "$OUT/runs/grpo_1gpu"
        if [ "$NGPU" -ge 3 ]; then
            # two ZeRO-3 ranks on GPUs 0-1 and an engine on a GPU of its own: the NCCL weight broadcast between GPUs
            part rl_grpo_2ranks 900 $PY algos/grpo.py --train.ranks 2 --train.no-colocate --ds.zero-stage 3 \
                --vllm.num-engines 1 --train.max-steps 10 --eval.every 10 --debug --run-dir "$OUT/runs/grpo_2ranks"
        else
            echo "rl_grpo_2ranks: skipped, needs 3 GPUs (2 trainer ranks + 1 engine GPU)" | tee "$OUT/rl_grpo_2ranks.txt"
        fi
    else
        # one process, no vLLM: the policy's own copy generates with transformers on the trainer's GPU
        part rl_grpo_hf 900 $PY algos/grpo.py --vllm.engine hf --train.max-steps 80 --eval.every 20 \
            --run-dir "$OUT/runs/grpo_hf"
    fi
fi
if [[ $MODE == grpo || $MODE == all ]]; then
    # one-process GRPO (--vllm.engine hf) against TRL's GRPOTrainer on the GPU, bf16, the gen/train split of both
    part bench_grpo_gpu 900 bash -c "$PY tests/benchmarks/bench_grpo.py --device cuda --steps 10 --warmup 2 \
        --out $OUT/bench_grpo && $PY tests/benchmarks/bench_grpo.py --device cuda --model 0.5b --steps 5 \
        --warmup 1 --out $OUT/bench_grpo_05b"
fi

echo
echo "summary ($OUT):"
fail=0
for name in "${!STATUS[@]}"; do
    echo "  $name: $([ "${STATUS[$name]}" = 0 ] && echo ok || echo "FAILED (exit ${STATUS[$name]})")"
    [ "${STATUS[$name]}" = 0 ] || fail=1
done
exit $fail
