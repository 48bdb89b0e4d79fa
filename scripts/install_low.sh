#!/usr/bin/env bash
# A second environment at the low end of the supported range: the lowest supported transformers release
# (kvkit.compat.TRANSFORMERS_LOWEST; tests/core/test_versions.py checks the pin below matches it) with kvkit and its
# test tools. CI runs the fast core tests there after the main suite (.ci/run).
# usage: bash scripts/install_low.sh    (creates ./.venv-low; reuses it when present)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-low/bin/python ] || "$PY" -m venv .venv-low
. .venv-low/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU wheel of torch. Any looser torch spec would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]" "transformers==5.16.0"
python -c "import kvkit, torch, transformers; print('kvkit', kvkit.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
